"""Read a recipe file: safe YAML, Axolotl-only keys, schema errors as one line naming the key."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import ValidationError

from llmtune.errors import UserError
from llmtune.recipe.axolotl import screen
from llmtune.recipe.axolotl_keys import INTENDED, RENAMED
from llmtune.recipe.online import user_functions
from llmtune.recipe.paths import check_local_paths
from llmtune.recipe.preference import ONLINE_METHODS
from llmtune.recipe.schema import Recipe

REFERENCE_HINT = "see docs/recipe-reference.md for every key"


@dataclass
class LoadedRecipe:
    recipe: Recipe
    path: Path
    notes: list[str] = field(default_factory=list)  # keys accepted with no effect, and similar


def load_recipe(path: str | Path, check_files: bool = True) -> LoadedRecipe:
    """Load, validate and normalise a recipe file; raise UserError on any mistake in it."""
    path = Path(path)
    duplicates: list[str] = []
    raw = read_yaml_mapping(path, duplicates)
    loaded = recipe_from_mapping(raw, path, check_files=check_files)
    loaded.notes[:0] = duplicates
    return loaded


class _RecordingLoader(yaml.SafeLoader):
    """yaml.safe_load as it is (the last of a key written twice wins, as under Axolotl), recording each such key."""

    duplicates: tuple[str, ...] = ()

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        self.duplicates = duplicate_keys(node)
        return self.construct_document(node)


def duplicate_keys(node) -> list[str]:
    """One warning per key written more than once in one mapping, naming its path and lines, in the file's order."""
    found: list[tuple[int, str]] = []
    _walk(node, "", set(), found)
    return [text for _, text in sorted(found)]


def _walk(node, where: str, seen: set, found: list) -> None:
    if id(node) in seen:  # an alias: its anchor's node, already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, f"{where}[{index}]", seen, found)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[tuple, list[int]] = {}
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                lines.setdefault((key.tag, key.value), []).append(key.start_mark.line + 1)
                _walk(value, f"{where}.{key.value}" if where else str(key.value), seen, found)
        for (_, name), at in lines.items():
            if len(at) > 1:
                name = f"{where}.{name}" if where else name
                times = "twice" if len(at) == 2 else f"{len(at)} times"
                listed = ", ".join(map(str, at[:-1])) + f" and {at[-1]}"
                found.append((at[0], f"WARNING {name} appears {times} (lines {listed}): the last one, line {at[-1]}, "
                              "is used"))  # fmt: skip


def read_yaml_mapping(path: Path, duplicates: list[str] | None = None) -> dict:
    """The recipe file's mapping; keys written twice are warned of in `duplicates`, when given."""
    if not path.exists():
        raise UserError(f"recipe file not found: {path}", "check the path")
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a recipe file", "pass the .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})", "save it as UTF-8") from None
    try:
        loader = _RecordingLoader(text)
        try:
            data = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as err:
        raise UserError(_yaml_error_line(path, err), "fix the YAML syntax at that line") from None
    except RecursionError:
        raise UserError(f"{path}: the YAML is nested too deeply", "a recipe is a flat mapping of keys") from None
    if data is None:
        raise UserError(f"recipe {path} is empty", "a recipe needs at least base_model and datasets")
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise UserError(f"recipe {path} must be a mapping of keys at the top level, not a {kind}", REFERENCE_HINT)
    if duplicates is not None:
        duplicates += loader.duplicates
    return data


def _yaml_error_line(path: Path, err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if isinstance(err, yaml.constructor.ConstructorError) and "tag" in str(problem):
        problem = f"{problem.strip()} (only plain YAML is read: tags like !!python/... are refused)"
    return f"{path}{where}: YAML error: {str(problem).strip()}"


def recipe_from_mapping(raw: dict, path: Path, check_files: bool = True) -> LoadedRecipe:
    data, notes = screen(raw, path)  # Axolotl's keys: renamed, accepted with a note, or refused by capability
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as err:
        raise UserError(f"{path}: {schema_errors(err, raw)}", REFERENCE_HINT) from None
    except RecursionError:
        raise UserError(f"{path}: a value is nested too deeply", REFERENCE_HINT) from None
    if check_files:
        check_local_paths(recipe, path)
        if recipe.rl in ONLINE_METHODS:  # the user's reward functions and transforms: imported, named if missing
            # (a rehearsal's copy of a recipe says where the original, and its Python files, are)
            user_functions(recipe, Path(os.environ.get("LLMTUNE_RECIPE_DIR") or Path(path).resolve().parent))
    if recipe.trust_remote_code:
        notes.append(f"WARNING trust_remote_code: true: Python code shipped with {recipe.base_model} will run on "
                     "every rank; use it only for models whose code you trust")  # fmt: skip
    if recipe.lora_model_dir:  # PEFT loads the adapter as it was saved: the recipe's shape keys have no say
        notes += _adapter_base_note(recipe)
        shape = [key for key in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_linear",
                                 "lora_modules_to_save") if key in data]  # fmt: skip
        if shape:
            notes.append(f"lora_model_dir: the adapter trains on as it was saved (its adapter_config.json: rank, "
                         f"alpha, dropout, target modules); {', '.join(shape)} in the recipe have no effect")  # fmt: skip
    for index, spec in enumerate(recipe.datasets):
        if spec.trust_remote_code:
            notes.append(
                f"WARNING datasets[{index}].trust_remote_code: true: the loading script of {spec.path} will run"
            )
    return LoadedRecipe(recipe=recipe, path=path, notes=notes)


def _as_written(line: str, raw: dict) -> str:
    """A schema error about a key the recipe spelt the Axolotl way names it as written too."""
    for old, new in {**RENAMED, **INTENDED}.items():
        if old in raw and new not in raw and line.startswith((f"{new}:", f"{new}.", f"{new}[")):
            return f"{new} (written as {old}){line[len(new) :]}"
    return line


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def key_path(loc: tuple) -> str:
    """('datasets', 1, 'type') -> 'datasets[1].type', leaving out pydantic's union-member tags."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.split("[")[0].lower() in _TYPE_TAGS or part[:1].isupper() or part.startswith("function-"):
            continue
        else:
            text += f".{part}" if text else part
    return text


def _where_written(loc: tuple) -> str:
    """The key a schema error belongs to: its location up to the first union-member tag, so that the errors of one
    value's union members (one per member pydantic tried) count as one problem."""
    kept: list = []
    for part in loc:
        if not isinstance(part, int) and not key_path((part,)):
            break
        kept.append(part)
    return key_path(tuple(kept))


def _one_error(error: dict) -> str:
    message = error["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
    where = key_path(error["loc"])
    if error["type"] == "missing":
        return f"{where}: required key is missing"
    if error["type"] not in ("value_error", "assertion_error") and "input" in error:
        shown = repr(error["input"])
        message += f" (got {shown[:60] + '...' if len(shown) > 60 else shown})"
    return f"{where}: {message}" if where else message


def _sections() -> dict[str, type]:
    from llmtune.recipe.base import Section

    found, todo = {}, [Section]
    while todo:
        for sub in todo.pop().__subclasses__():
            found[sub.__name__] = sub
            todo.append(sub)
    return found


def _meant(error: dict) -> tuple:
    """Among the errors of one value's union members, the member the user meant: the deepest location, then a
    member that got the right kind of value (a mapping for a mapping) over one that wanted another kind, then the
    member that knows the most of the mapping's keys (field_chosen and a typo: the preference format)."""
    depth = len([p for p in error["loc"] if key_path((p,))])
    kind = not error["type"].endswith("_type")
    value, member = error.get("input"), _sections().get(str(error["loc"][-1]) if error["loc"] else "")
    known = len(set(value) & set(member.model_fields)) if isinstance(value, dict) and member else 0
    return depth, kind, known


def schema_errors(err: ValidationError, raw: dict, shown: int = 5) -> str:
    """Every key the recipe got wrong, in one line: per key the error of the union member the user meant (the
    deepest location), in the recipe's order; past `shown` keys, a count."""
    order = {key: index for index, key in enumerate(raw)}
    for old, new in {**RENAMED, **INTENDED}.items():
        if old in order:
            order.setdefault(new, order[old])
    errors = sorted(err.errors(include_url=False), key=lambda e: order.get(e["loc"][0] if e["loc"] else "", len(order)))
    groups: dict[str, list[dict]] = {}
    for error in errors:
        groups.setdefault(_where_written(error["loc"]), []).append(error)
    lines = [_as_written(_one_error(max(errors, key=_meant)), raw) for errors in groups.values()]
    more = len(lines) - shown
    return "; ".join(lines[:shown]) + (f" (and {more} more key{'s' if more > 1 else ''})" if more > 0 else "")


# keys one machine of a launch may hold differently from the others: its own disk's output_dir, and what its
# launcher's flags set (--rdzv-timeout, --max-restarts, --rdzv-endpoint, --profile)
PER_MACHINE_KEYS = frozenset({"output_dir", "rdzv_timeout", "max_restarts", "rdzv_endpoint", "profiler_steps"})


def recipe_fingerprint(recipe, exclude: set[str] | frozenset[str] | None = None) -> str:
    """Identifies a recipe's resolved values: a finished run with the same fingerprint has nothing left to do, and the
    machines of one launch must all run the same one (there without output_dir: machines with their own disks)."""
    import hashlib
    import json

    values = recipe.model_dump(mode="json", exclude=set(exclude or ()))
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]


def _adapter_base_note(recipe) -> list[str]:
    """lora_model_dir's adapter names the base it was trained on; another base_model gets a note (its deltas were
    learned on other weights; a stage's merged folder or a moved copy of the same base is said as such)."""
    from llmtune.recipe.paths import adapter_trained_on

    named = adapter_trained_on(recipe.lora_model_dir, recipe.base_model)
    if named is None:
        return []
    return [
        f"lora_model_dir: the adapter was trained on {named}, and base_model is {recipe.base_model}: it trains "
        "on from there on these weights (right for a copy of the same model; otherwise its deltas were learned "
        "on other weights)"
    ]
