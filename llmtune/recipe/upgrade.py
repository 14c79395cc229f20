"""`llmtune validate --upgrade`: a recipe rewritten in today's vocabulary, written beside the original.

Driven by what the loader already knows: the tables of axolotl_keys.py say which keys are older spellings
(RENAMED, RENAMED_DATASET_KEYS), rewritten forms (TRANSLATED, INTENDED) or without effect (AXOLOTL_ONLY_KEYS),
and the loader's own reading of the recipe (axolotl.screen) gives the value each old key becomes. The rewrite
works on lines, not on a re-dumped mapping, so the user's key order, comments and layout stay; every line it
changes carries a comment with what it was and why. Keys that ask for a capability llmtune lacks stop it before
anything is written. Before writing, the new text is loaded again and must give the same Recipe as the original.

Keys without effect that today's Axolotl still defines (strict, debug-style switches, tracking) are kept as they
are: they are today's vocabulary, and validate reports them once. Those only earlier releases defined are
commented out, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmtune.errors import UserError
from llmtune.recipe.axolotl import DATASET_GROUPS, history, screen
from llmtune.recipe.axolotl_history import DEPRECATED, KEYS, RELEASES
from llmtune.recipe.axolotl_keys import (
    AXOLOTL_DATASET_KEYS,
    AXOLOTL_ONLY_KEYS,
    BNB_CONFIG_KWARGS,
    INTENDED,
    RENAMED,
    RENAMED_DATASET_KEYS,
    TRANSLATED,
    is_inert,
)
from llmtune.recipe.data import DatasetSpec
from llmtune.recipe.loader import load_recipe, read_yaml_mapping, recipe_from_mapping
from llmtune.recipe.model import SPECIAL_TOKEN_NAMES
from llmtune.recipe.schema import Recipe
from llmtune.recipe.training import OFFLOADED_CHECKPOINTING

REMOVE = object()  # an older form that today is said by leaving the key out


def _false_word(value: Any) -> bool:
    return value is False or isinstance(value, str) and value.strip().lower() in ("false", "no")


# Older value forms of today's keys: key -> (does the written value use one?, why). The value written instead is the
# one the schema reads it as, so a form that llmtune comes to honour as written stops being rewritten.
OLD_FORMS = {
    "gradient_checkpointing": (
        lambda value: value in OFFLOADED_CHECKPOINTING,
        "today's Axolotl and llmtune say the offload with activation_offloading",
    ),
    "bf16": (
        lambda value: value == "full",
        "Axolotl v0.3.0-v0.4.0's bf16 with bf16_full_eval; evaluation runs under the same bf16 autocast",
    ),
    **dict.fromkeys(("wandb_watch", "wandb_log_model"), (lambda value: value is False, 'today\'s value is "false"')),
    # `false` once meant "none" (distributed.py reads it so)
    **dict.fromkeys(
        ("deepspeed", "fsdp", "fsdp_config", "offload_nvme_path"),
        (_false_word, "false meant none; leaving the key out says the same"),
    ),
}


# Keys an older form also set, written on the lines after it when the recipe doesn't set them itself
COMPANIONS = {
    "gradient_checkpointing": lambda value: ("activation_offloading",) if value in OFFLOADED_CHECKPOINTING else (),
}


@dataclass
class Upgrade:
    """What --upgrade did: the file it wrote (None when nothing needed changing) and one line per change."""

    source: Path
    target: Path
    written: Path | None = None
    changes: list[str] = field(default_factory=list)


@dataclass
class _Entry:
    key: str
    first: int  # line of the key
    end: int  # one past the last line of its value (trailing comments and blank lines left out)
    column: int


def upgraded_path(path: Path) -> Path:
    """recipe.yaml -> recipe.upgraded.yaml, in the same folder."""
    return path.with_name(f"{path.stem}.upgraded{path.suffix or '.yaml'}")


def upgrade_recipe(path: str | Path, force: bool = False) -> Upgrade:
    """Write `<recipe>.upgraded.yaml` beside `path` in today's vocabulary; never touches `path` itself.

    Raises UserError (nothing written) for keys asking for a missing capability, for a recipe that doesn't
    validate, and for an existing target without `force`."""
    path = Path(path)
    raw = read_yaml_mapping(path)
    _refuse_capabilities(raw, path)
    original = load_recipe(path).recipe  # any other mistake in the recipe is reported as validate reports it
    data, _ = screen(raw, path)
    lines = path.read_text(encoding="utf-8").splitlines()
    result = Upgrade(path, upgraded_path(path))
    shadowed: list[tuple[_Entry, int]] = []
    entries = _entries(lines, path, shadowed)
    _drop_shadowed(lines, shadowed, result.changes)
    lines = _rename_dataset_keys(lines, result.changes)  # in place, one line each: the entries' lines stay put
    new_lines = _rewrite(lines, raw, original.model_dump(mode="json"), data, entries, result.changes)
    if not result.changes:
        return result
    result.changes.sort(key=lambda line: int(line.split(":")[0].removeprefix("line ")))
    if result.target.exists() and not force:
        raise UserError(f"{result.target} already exists; nothing written",
                        "remove it, or add --force to overwrite it")  # fmt: skip
    text = "\n".join(new_lines) + "\n"
    _same_reading(text, original, path, result.target)
    try:
        result.target.write_text(text, encoding="utf-8")
    except OSError as err:  # a read-only folder, a folder in the file's place
        reason = "it is a folder" if result.target.is_dir() else (err.strerror or str(err)).lower()
        raise UserError(f"can't write {result.target} ({reason})",
                        "copy the recipe to a folder you can write to, then upgrade that copy") from None  # fmt: skip
    result.written = result.target
    return result


def _same_reading(text: str, original: Recipe, path: Path, target: Path) -> None:
    """The safety net: the new text, loaded as the loader loads it, must give the same Recipe as the original."""
    bug = "this is a bug in llmtune's upgrade: please report it with the recipe"
    try:
        again = recipe_from_mapping(yaml.safe_load(text), target).recipe
    except (yaml.YAMLError, UserError) as err:
        raise UserError(f"{path}: the upgraded recipe would not load ({str(err).splitlines()[0]}); nothing written",
                        bug) from None  # fmt: skip
    before, after = original.model_dump(mode="json"), again.model_dump(mode="json")
    if after != before:
        changed = ", ".join(key for key in after if before.get(key) != after[key])
        raise UserError(f"{path}: the upgraded recipe would read differently ({changed}); nothing written", bug)


def _refuse_capabilities(raw: dict, path: Path) -> None:
    """All keys (top level and datasets) whose value asks for a capability llmtune lacks, named in one line."""
    refused = [f"{key} ({entry.reason})" for key, value in raw.items()
               if (entry := AXOLOTL_ONLY_KEYS.get(key)) and not is_inert(entry, value)]  # fmt: skip
    for group in DATASET_GROUPS:
        entries = raw.get(group)
        for index, spec in enumerate([entries] if isinstance(entries, dict) else entries or []):
            for key, value in spec.items() if isinstance(spec, dict) else ():
                entry = AXOLOTL_DATASET_KEYS.get(key)
                if entry and key not in DatasetSpec.model_fields and not is_inert(entry, value):
                    refused.append(f"{group}[{index}].{key} ({entry.reason})")
    if refused:
        raise UserError(f"{path}: can't upgrade, these keys ask for what llmtune doesn't support: "
                        f"{'; '.join(refused)}; nothing written",
                        "remove them (llmtune validate explains each one)")  # fmt: skip


def _entries(lines: list[str], path: Path, shadowed: list | None = None) -> dict[str, _Entry]:
    """Each top-level key with the lines it spans, from YAML's own node positions."""
    root = yaml.compose("\n".join(lines), Loader=yaml.SafeLoader)
    entries: dict[str, _Entry] = {}
    taken: set[int] = set()
    for key_node, value_node in root.value:
        first = key_node.start_mark.line
        end = value_node.end_mark.line + (value_node.end_mark.column > 0)
        while end > first + 1 and (not lines[end - 1].strip() or lines[end - 1].lstrip().startswith("#")):
            end -= 1
        if root.flow_style or taken & set(range(first, end)):
            raise UserError(f"{path}: --upgrade rewrites one key per line; this recipe puts several on one line",
                            "write the recipe as a block mapping (one key per line)")  # fmt: skip
        taken.update(range(first, end))
        if key_node.value in entries and shadowed is not None:  # written twice: the loader reads the last one
            shadowed.append((entries[key_node.value], first))
        entries[key_node.value] = _Entry(key_node.value, first, end, key_node.start_mark.column)
    return entries


def _drop_shadowed(lines: list[str], shadowed: list[tuple[_Entry, int]], changes: list[str]) -> None:
    """A key written twice: the earlier entries commented out in place (line for line, so that every entry's
    position stays), the one the loader reads kept."""
    for entry, used in shadowed:
        for index in range(entry.first, entry.end):
            lines[index] = f"# {lines[index]}"
        lines[entry.first] += f"  # removed: written again at line {used + 1}, which is the one read"
        changes.append(f"line {entry.first + 1}: {entry.key} removed (written again at line {used + 1})")


def _flow(value: Any) -> str:
    """One value as a one-line YAML scalar or flow collection."""
    if value is None:
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 20, allow_unicode=True)
    return text.removesuffix("\n...\n").strip()


def _line(column: int, key: str, value: Any, comment: str) -> str:
    shown = _flow(value)
    return f"{' ' * column}{key}:{' ' + shown if shown else ''}  # {comment}"


def _was(key: str, value: Any = REMOVE) -> str:
    """'was KEY[: VALUE] (a key of Axolotl ...)', today's spelling left out: the line itself is that."""
    when = history(key).split("; today's spelling")[0].split(", dropped after")[0]
    shown = "" if value is REMOVE or value is None else f": {_flow(value)}"
    return f"was {key}{shown}" + (f" ({when})" if when else "")


def _value_form(key: str, value: Any, read: dict) -> tuple[Any, str] | None:
    """Today's form of an older value of one of today's keys (REMOVE: none), and why; None when it is today's.
    `read` is the original Recipe as the schema read it."""
    rule = OLD_FORMS.get(key)
    if rule is None or not rule[0](value) or key not in read or read[key] == value:
        return None
    return (REMOVE if read[key] is None else read[key]), rule[1]


def _outputs(key: str, value: Any, read: dict, data: dict) -> tuple[dict[str, Any], str] | None:
    """The keys (and values, as the loader reads them) an older key becomes, and why; None when it stays."""
    if key in TRANSLATED:
        if value is None or value is False:  # no effect: kept while today's Axolotl still has the key
            return ({}, f"no effect in llmtune; {history(key)}") if _gone(key) else None
        targets = {"max_packed_sequence_len": ("sample_packing", "sequence_len"), "xformers_attention":
                   ("attn_implementation",), "rope_scaling": ("overrides_of_model_config",)}[key]  # fmt: skip
        return {name: data[name] for name in targets}, TRANSLATED[key]
    if key in INTENDED:
        new = INTENDED[key]
        why = f"Axolotl drops {key} without a word; llmtune honours it as {new}"
        return ({new: data[new]} if value is not None else {}), why + (
            " (the floor as a fraction of learning_rate)" if new == "cosine_min_lr_ratio" else ""
        )
    if key == "bnb_config_kwargs" and isinstance(value, dict) and any(BNB_CONFIG_KWARGS.get(n) for n in value):
        names = [BNB_CONFIG_KWARGS[n] for n in value if BNB_CONFIG_KWARGS.get(n)]
        return {name: data[name] for name in names}, "llmtune's own keys; the dtypes follow the run's precision"
    if key == "tokens" and isinstance(value, dict) and value and all(n in SPECIAL_TOKEN_NAMES for n in value):
        return {"special_tokens": data["special_tokens"]}, "special tokens, given under tokens by early releases"
    if key == "warmup_steps" and read.get("warmup_steps") is None and read.get("warmup_ratio") == value is not None:
        return {"warmup_ratio": value}, "below 1 it was a fraction of all steps, as transformers reads it"
    if key in AXOLOTL_ONLY_KEYS and _gone(key):  # accepted (refused values stopped the upgrade before)
        return {}, f"no effect in llmtune; {history(key)}"
    return None


def _gone(key: str) -> bool:
    """Not today's vocabulary: a key today's Axolotl no longer defines, or deprecates."""
    span = KEYS.get(key)
    return span is not None and (span[1] != RELEASES[-1] or key in DEPRECATED)


def _rewrite(
    lines: list[str], raw: dict, read: dict, data: dict, entries: dict[str, _Entry], changes: list[str]
) -> list[str]:
    """Top-level keys: renamed in place, translated into the lines of their new keys, or commented out."""
    replace: dict[str, list[str]] = {}  # key -> the lines that stand for its entry
    # which entry will carry each of today's keys: its own, or an older spelling renamed in place
    carrier = {key: key for key in entries if key not in RENAMED}
    for key, entry in entries.items():
        if key in RENAMED and RENAMED[key] not in raw:
            carrier[RENAMED[key]] = key
            replace[key] = _renamed(lines, entry, RENAMED[key], f"{_was(key)}; llmtune's name for it")
            changes.append(f"line {entry.first + 1}: {key} -> {RENAMED[key]}")
        elif key in RENAMED:  # both spellings: the loader already made sure they agree
            replace[key] = _commented(lines, entry, f"removed: {RENAMED[key]} says the same")
            changes.append(f"line {entry.first + 1}: {key} removed ({RENAMED[key]} is set)")
    for key, entry in entries.items():
        value = raw.get(key)
        if key in RENAMED:
            continue
        form = None if key in TRANSLATED or key in INTENDED else _value_form(key, value, read)
        if form and form[0] is not REMOVE:
            replace[key] = [_line(entry.column, key, form[0], f"{_was(key, value)}; {form[1]}")]
            changes.append(f"line {entry.first + 1}: {key}: {_flow(value)} -> {_flow(form[0])}")
            for name in COMPANIONS.get(key, lambda _: ())(value):
                if name not in raw:
                    replace[key].append(_line(entry.column, name, read[name], f"{_was(key, value)}; its offload"))
                    changes.append(f"line {entry.first + 1}: {name}: {_flow(read[name])} added")
            continue
        outputs = _outputs(key, value, read, data)
        if form and outputs is None:
            outputs = {}, form[1]
        if outputs is None:
            continue
        targets, why = outputs
        new_lines = []
        for name, new_value in targets.items():
            held = carrier.get(name)
            if held is None:  # a key the recipe doesn't have: written where the old key was
                new_lines.append(_line(entry.column, name, new_value, f"{_was(key, value)}; {why}"))
                carrier[name] = key
            elif held != key and raw[held] != new_value:  # the recipe has it: that line changes
                target = entries[held]
                replace[held] = [_line(target.column, name, new_value,
                                       f"was {held}: {_flow(raw[held])}; set by {key}: {_flow(value)}")]  # fmt: skip
                changes.append(f"line {target.first + 1}: {held}: {_flow(raw[held])} -> {name}: {_flow(new_value)}")
        if new_lines:
            replace[key] = new_lines
            changes.append(f"line {entry.first + 1}: {key} -> {', '.join(n for n in targets if carrier[n] == key)}")
        else:
            why = f"now said by {', '.join(targets)}" if targets else why
            replace[key] = _commented(lines, entry, f"removed: {why}")
            changes.append(f"line {entry.first + 1}: {key} removed ({why})")
    out: list[str] = []
    starts = {entries[key].first: key for key in replace}
    index = 0
    while index < len(lines):
        key = starts.get(index)
        if key is None:
            out.append(lines[index])
            index += 1
        else:
            out.extend(replace[key])
            index = entries[key].end
    return out


def _renamed(lines: list[str], entry: _Entry, new: str, comment: str) -> list[str]:
    """The entry with its key spelt anew and its value as written; the comment beside a one-line entry, above
    a longer one (a comment inside a quoted value would become part of it)."""
    text = lines[entry.first]
    start = entry.column + text[entry.column :].index(entry.key)
    head = f"{text[:start]}{new}{text[start + len(entry.key) :]}"
    rest = lines[entry.first + 1 : entry.end]
    return [f"{head}  # {comment}"] if not rest else [f"{' ' * entry.column}# {comment}", head, *rest]


def _commented(lines: list[str], entry: _Entry, why: str) -> list[str]:
    kept = [f"# {text}" for text in lines[entry.first : entry.end]]
    kept[0] += f"  # {why}"
    return kept


def _rename_dataset_keys(lines: list[str], changes: list[str]) -> list[str]:
    """Older spellings inside dataset entries (RENAMED_DATASET_KEYS), renamed where they stand."""
    root = yaml.compose("\n".join(lines), Loader=yaml.SafeLoader)
    lines = list(lines)
    for key_node, value_node in root.value:
        if key_node.value not in DATASET_GROUPS:
            continue
        specs = [value_node] if isinstance(value_node, yaml.MappingNode) else getattr(value_node, "value", [])
        for index, spec in enumerate(specs):
            if not isinstance(spec, yaml.MappingNode):
                continue
            names = {k.value for k, _ in spec.value}
            for name_node, _ in spec.value:
                old = name_node.value
                if old not in RENAMED_DATASET_KEYS:
                    continue
                new, mark = RENAMED_DATASET_KEYS[old], name_node.start_mark
                text = lines[mark.line]
                if new in names:  # both spellings (the loader made sure they agree): left as written
                    continue
                end = mark.column + len(old)
                lines[mark.line] = f"{text[: mark.column]}{new}{text[end:]}  # was {old} (Axolotl's older name)"
                changes.append(f"line {mark.line + 1}: {key_node.value}[{index}].{old} -> {new}")
    return lines
