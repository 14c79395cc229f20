"""Read an Axolotl recipe as written: its older spellings renamed, keys with no effect reported once, keys that ask
for a capability llmtune lacks refused by that capability, and unknown keys refused with a did-you-mean.

Runs on the raw mapping before the schema; the tables are in axolotl_keys.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.recipe.axolotl_entries import (
    FORMAT_KEYS,
    PREFERENCE_KEYS,
    WANDB_LOG_MODEL,
    chat_only_keys,
    format_key,
    hand_written_template,
    path_from_data_files,
    shown,
    top_level_key_in_entry,
)
from llmtune.recipe.axolotl_history import DEPRECATED, KEYS, RELEASES
from llmtune.recipe.axolotl_keys import (
    ANY,
    AXOLOTL_DATASET_KEYS,
    AXOLOTL_FSDP_KEYS,
    AXOLOTL_ONLY_KEYS,
    BNB_CONFIG_KWARGS,
    BNB_DEFAULTS,
    CLOUD_KEYS,
    INERT,
    INTENDED,
    RENAMED,
    RENAMED_DATASET_KEYS,
    SUCCESSORS,
    TRANSLATED,
    AxolotlKey,
    attention_alias,
    is_inert,
    plugin_entry,
)
from llmtune.recipe.base import key_guess, unknown_key_message
from llmtune.recipe.data import DatasetSpec
from llmtune.recipe.distributed import FsdpConfig
from llmtune.recipe.model import SPECIAL_TOKEN_NAMES
from llmtune.recipe.preference import ONLINE_METHODS, RL_METHODS, RL_NOT_YET
from llmtune.recipe.schema import Recipe
from llmtune.recipe.training import OFFLOADED_CHECKPOINTING

REFERENCE_HINT = "see docs/recipe-reference.md for every key"
OLDER_NAME = "Axolotl's older name"
DATASET_GROUPS = ("datasets", "test_datasets", "pretraining_dataset")


class Notes:
    """Notes said once each; keys without effect are grouped by their reason."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.no_effect: dict[str, list[str]] = {}

    def add(self, line: str) -> None:
        if line not in self.lines:
            self.lines.append(line)

    def unused(self, key: str, reason: str) -> None:
        self.no_effect.setdefault(reason, []).append(key)

    def result(self) -> list[str]:
        """One line per key left empty or default; keys that ask for something, grouped by why it has no effect."""
        lines = [f"{key}: accepted, has no effect in llmtune" for key in self.no_effect.pop("", [])]
        lines += [f"{', '.join(keys)}: accepted, has no effect in llmtune ({reason})"
                  for reason, keys in self.no_effect.items()]  # fmt: skip
        return lines + self.lines


def history(key: str) -> str:
    """For a key Axolotl has dropped, deprecated or renamed: 'a key of Axolotl <releases>[; today's spelling: ...]',
    from the history table; '' for the keys of today's Axolotl."""
    span = KEYS.get(key)
    if span is None:
        return ""
    first, last = span[0], span[1]
    today = SUCCESSORS.get(key) or RENAMED.get(key)
    spelling = f"; today's spelling: {today}" if today else ""
    if last != RELEASES[-1]:
        releases = f"{first} only" if first == last else f"{first} to {last}"
        return f"a key of Axolotl {releases}" + (spelling or f", dropped after {last}")
    if key in DEPRECATED:
        return f"a key of Axolotl since {first}, deprecated since {DEPRECATED[key]}{spelling}"
    return f"a key of Axolotl since {first}{spelling}" if today else ""


def _screen_key(where: str, key: str, value: Any, entry: AxolotlKey, notes: Notes, path: Path) -> None:
    """Accept (with a note) or refuse one Axolotl-only key."""
    old = "" if where else history(key)
    if not is_inert(entry, value):
        then = f"; {key} is {old}" if old else ""
        raise UserError(f"{path}: {entry.reason} is not supported ({where}{key}: {shown(value)}){then}",
                        entry.hint or None)  # fmt: skip
    asked = entry.accepted is ANY and not is_inert(AxolotlKey((), ""), value)
    # a key left empty is only listed; one given a value is told where it comes from
    notes.unused(where + key + (f" ({old})" if old and asked else ""), entry.reason if asked else "")


def _cloud_config(raw: dict, path: Path) -> None:
    if "base_model" not in raw and any(key in raw for key in CLOUD_KEYS):
        raise UserError(f"{path} is an Axolotl cloud launch config (provider, gpu, secrets, ...), not a training "
                        "recipe: launching on Modal or Baseten is not supported",
                        "run llmtune on the machines themselves with a training recipe")  # fmt: skip


def _rl_with_generation(raw: dict, path: Path) -> None:
    """`rl:` naming a method that generates (GRPO, GDPO, EBFT) is the refusal, before the keys that come with it
    (vllm, ebft, trl's generation settings, reward dataset types) are each refused on their own."""
    method = raw.get("rl")
    if isinstance(method, str) and method.lower() in RL_NOT_YET:
        raise UserError(f"{path}: rl: {method} ({RL_NOT_YET[method.lower()]}) is not supported yet: llmtune trains "
                        f"{', '.join((*RL_METHODS, *ONLINE_METHODS))} through TRL",
                        "EBFT is Axolotl's own method; GRPO (rl: grpo) is the closest llmtune trains")  # fmt: skip


def _top_level(raw: dict, path: Path, notes: Notes) -> dict:
    data: dict[str, Any] = {}
    unknown: list[str] = []
    known = [*Recipe.model_fields, *AXOLOTL_ONLY_KEYS, *RENAMED, "bnb_config_kwargs"]
    for key, value in raw.items():
        if not isinstance(key, str):
            raise UserError(f"{path}: key {key!r} is not a string", "recipe keys are names like base_model")
        if key == "bnb_config_kwargs":
            _bnb_kwargs(value, raw, data, path, notes)
        elif key in RENAMED:
            new = RENAMED[key]
            if new in raw and raw[new] != value:
                raise UserError(f"{path}: {key} (Axolotl's older name of {new}) and {new} disagree; keep {new}")
            if value is not None:
                data.setdefault(new, value)
                notes.add(f"{key}: read as {new} ({history(key) or OLDER_NAME})")
        elif key == "wandb_log_model" and isinstance(value, str) and value.lower() not in WANDB_LOG_MODEL:
            data[key] = "false"  # Axolotl passed it on as WANDB_LOG_MODEL, which transformers read as off
            notes.add(f"wandb_log_model: {value!r} is none of false, checkpoint, end: no model is uploaded, as "
                      "transformers did with it under Axolotl")  # fmt: skip
        elif key in Recipe.model_fields:
            data[key] = value
        elif key in AXOLOTL_ONLY_KEYS:
            _screen_key("", key, value, AXOLOTL_ONLY_KEYS[key], notes, path)
        elif key in INTENDED:
            _intended(key, value, raw, data, path, notes)
        elif key in TRANSLATED:
            continue  # rewritten below, once every key it interacts with is in
        elif key in KEYS:  # a release defined it but no table here says what to do: never "unknown"
            raise UserError(f"{path}: {key} is not supported by llmtune ({history(key) or 'a key of Axolotl'})",
                            REFERENCE_HINT)  # fmt: skip
        else:
            unknown.append(key)
    if len(unknown) == 1:
        raise UserError(f"{path}: {unknown_key_message(unknown[0], known)}", REFERENCE_HINT)
    if unknown:  # every one named in the one line, each with its did-you-mean
        named = [f"'{key}'" + (f" (did you mean '{guess}'?)" if (guess := key_guess(key, known)) else "")
                 for key in unknown]  # fmt: skip
        raise UserError(f"{path}: {len(unknown)} unknown keys: {', '.join(named)}", REFERENCE_HINT)
    for key in TRANSLATED:
        if key in raw:
            _translated(key, raw[key], data, path, notes)
    return data


def _translated(key: str, value: Any, data: dict, path: Path, notes: Notes) -> None:
    """Keys of Axolotl's earlier releases rewritten into today's form (TRANSLATED), said once with their release."""
    old = history(key)
    if value is None or value is False:
        notes.unused(key, "")
        return
    if key == "max_packed_sequence_len":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{path}: max_packed_sequence_len: {shown(value)} must be a whole number of tokens",
                            "e.g. max_packed_sequence_len: 2048")  # fmt: skip
        sequence_len = data.get("sequence_len")
        # Axolotl packed to the smaller of the two (its data.py: min(max_packed_sequence_len, sequence_len))
        length = min(value, sequence_len) if isinstance(sequence_len, int) else value
        data["sample_packing"], data["sequence_len"] = True, length
        notes.add(f"max_packed_sequence_len: {value}: read as sample_packing: true at sequence_len: {length} ({old})")
    elif key == "rope_scaling":
        if not isinstance(value, dict):
            raise UserError(f"{path}: rope_scaling: {shown(value)} must be a mapping, e.g. {{type: linear, factor: 2}}")
        overrides = data.get("overrides_of_model_config")
        overrides = dict(overrides) if isinstance(overrides, dict) else {}
        if overrides.get("rope_scaling") not in (None, value):
            raise UserError(f"{path}: rope_scaling and overrides_of_model_config.rope_scaling disagree; keep one")
        data["overrides_of_model_config"] = {**overrides, "rope_scaling": value}
        notes.add(f"rope_scaling: read as overrides_of_model_config: {{rope_scaling: {value}}} ({old})")
    elif key == "xformers_attention":
        if value is not True:
            raise UserError(f"{path}: xformers_attention: {shown(value)} must be true or false")
        clash = "flash_attention: true" if data.get("flash_attention") else None
        if data.get("attn_implementation") not in (None, "sdpa", "xformers"):
            clash = f"attn_implementation: {data['attn_implementation']}"
        if clash:
            raise UserError(f"{path}: xformers_attention: true and {clash} ask for different attention; keep one")
        data["attn_implementation"] = "sdpa"
        notes.add("xformers_attention: true: read as attn_implementation: sdpa (torch's fused attention, with its "
                  f"memory-efficient kernel: the same maths as xformers'; {old})")  # fmt: skip


def _intended(key: str, value: Any, raw: dict, data: dict, path: Path, notes: Notes) -> None:
    """A key Axolotl drops silently but whose intent is plain (INTENDED), honoured as llmtune's key with a note."""
    new = INTENDED[key]
    if value is None:
        return
    if new == "cosine_min_lr_ratio":  # an absolute floor -> a fraction of the peak
        scheduler = raw.get("lr_scheduler") or Recipe.model_fields["lr_scheduler"].default
        if scheduler not in ("cosine", "cosine_with_min_lr"):
            raise UserError(f"{path}: {key} floors a cosine schedule, and lr_scheduler is {scheduler}",
                            "remove it, or use lr_scheduler: cosine")  # fmt: skip
        peak = raw.get("learning_rate") or Recipe.model_fields["learning_rate"].default
        try:
            floor, peak = float(value), float(peak)
        except (TypeError, ValueError):
            raise UserError(
                f"{path}: {key}: {shown(value)} is not a number", "an absolute learning rate, e.g. 1e-6"
            ) from None
        if not 0 <= floor <= peak:
            raise UserError(f"{path}: {key}: {floor:g} must lie between 0 and learning_rate {peak:g}")
        value = round(floor / peak, 6)
    if raw.get(new) is not None and raw[new] != value:
        raise UserError(f"{path}: {key} (read as {new}: {value}) and {new}: {raw[new]} disagree; keep {new}")
    data.setdefault(new, value)
    notes.add(f"{key}: read as {new}: {value} (Axolotl drops this key without a word; llmtune honours it)")


def _bnb_kwargs(value: Any, raw: dict, data: dict, path: Path, notes: Notes) -> None:
    """Axolotl's bitsandbytes arguments: the two llmtune has keys for are read as those keys."""
    if not value:
        return
    if not isinstance(value, dict):
        raise UserError(f"{path}: bnb_config_kwargs must be a mapping of BitsAndBytesConfig arguments")
    for name, setting in value.items():
        if name in BNB_DEFAULTS and setting == BNB_DEFAULTS[name]:
            notes.unused(f"bnb_config_kwargs.{name}", "BitsAndBytesConfig's default")
            continue
        if name not in BNB_CONFIG_KWARGS:
            raise UserError(f"{path}: the bitsandbytes option {name} is not supported (bnb_config_kwargs.{name})",
                            "llmtune sets bnb_4bit_quant_type and bnb_4bit_use_double_quant")  # fmt: skip
        key = BNB_CONFIG_KWARGS[name]
        if key is None:
            notes.unused(f"bnb_config_kwargs.{name}", "set from the run's precision")
            continue
        if key in raw and raw[key] != setting:
            raise UserError(f"{path}: bnb_config_kwargs.{name} and {key} disagree; keep {key}")
        data[key] = setting
        notes.add(f"bnb_config_kwargs.{name}: read as {key}")


def _plugins(data: dict, path: Path, notes: Notes) -> None:
    plugins = data.get("plugins")
    if not isinstance(plugins, list):
        return
    kept = []
    for name in plugins:
        entry = plugin_entry(name)
        if entry is None or entry is False:
            kept.append(name)  # honoured (Liger, Cut Cross Entropy), or not Axolotl's: kernels.py says which
        elif entry.accepted is ANY:
            notes.unused(f"plugins: {name.rsplit('.', 1)[-1]}", entry.reason)
        else:
            raise UserError(f"{path}: plugins: plugin '{name}' is not supported; llmtune has no plugin system "
                            f"({entry.reason} is not supported)", "remove it from plugins")  # fmt: skip
    data["plugins"] = kept


def _datasets(data: dict, path: Path, notes: Notes) -> None:
    for group in DATASET_GROUPS:
        entries = data.get(group)
        entries = [entries] if isinstance(entries, dict) else entries
        if not isinstance(entries, list):
            continue
        screened = []
        for index, entry in enumerate(entries):
            if not isinstance(entry, dict):
                screened.append(entry)
                continue
            spec: dict[str, Any] = {}
            for key, value in entry.items():
                if key in RENAMED_DATASET_KEYS:
                    new = RENAMED_DATASET_KEYS[key]
                    if entry.get(new) not in (None, value):
                        raise UserError(f"{path}: {group}[{index}].{key} and .{new} disagree; keep {new}")
                    spec[new] = value
                elif (key in FORMAT_KEYS and isinstance(entry.get("type"), str)
                      and not (key == "field_system" and entry["type"].startswith("chat_template"))):  # fmt: skip
                    format_key(f"{group}[{index}]", key, value, entry["type"], notes, path)
                elif key in PREFERENCE_KEYS and not data.get("rl"):
                    notes.unused(f"{group}[{index}].{key}", "a preference data key, beside a dataset without rl: "
                                 "Axolotl ignores it there too")  # fmt: skip
                elif key in AXOLOTL_DATASET_KEYS and key not in DatasetSpec.model_fields:
                    _screen_key(f"{group}[{index}].", key, value, AXOLOTL_DATASET_KEYS[key], notes, path)
                elif key in Recipe.model_fields and key not in DatasetSpec.model_fields:
                    top_level_key_in_entry(f"{group}[{index}]", key, value, data, notes, path)
                else:
                    spec[key] = value
            if "path" not in spec and spec.get("data_files"):
                path_from_data_files(f"{group}[{index}]", spec, notes)
            chat_only_keys(f"{group}[{index}]", spec, notes)
            hand_written_template(f"{group}[{index}]", spec, data, notes)
            screened.append(spec)
        data[group] = screened


def _fsdp_config(data: dict, path: Path, notes: Notes) -> None:
    config = data.get("fsdp_config")
    if not isinstance(config, dict):
        return
    kept = {}
    for key, value in config.items():
        bare = key.removeprefix("fsdp_") if isinstance(key, str) else key
        if bare in AXOLOTL_FSDP_KEYS and bare not in FsdpConfig.model_fields:
            _screen_key("fsdp_config.", key, value, AXOLOTL_FSDP_KEYS[bare], notes, path)
        else:
            kept[key] = value
    data["fsdp_config"] = kept


def _values(data: dict, notes: Notes) -> None:
    """Axolotl values llmtune spells otherwise, rewritten with a note."""
    attention = attention_alias(data.get("attn_implementation"))
    if attention:
        notes.add(f"attn_implementation: {data['attn_implementation']} runs as {attention} (the same attention maths)")
        data["attn_implementation"] = attention
    if data.get("tokenizer_type") not in INERT:  # a schema key (kept in the resolved recipe) that nothing reads
        notes.unused("tokenizer_type", "the tokenizer loads with AutoTokenizer: the class its own files name")
    checkpointing = data.get("gradient_checkpointing")
    if checkpointing in OFFLOADED_CHECKPOINTING:
        moved = "activation_offloading: true" + (" (to CPU memory: llmtune has no disk offload)"
                                                 if checkpointing == "offload_disk" else "")  # fmt: skip
        notes.add(f"gradient_checkpointing: {checkpointing}: read as gradient_checkpointing: true with {moved}, "
                  "as Axolotl reads it today")  # fmt: skip
    elif data.get("activation_offloading") == "disk":
        notes.add("activation_offloading: disk: offloads to CPU memory (llmtune has no disk offload)")
    if data.get("bf16") == "full":
        notes.add("bf16: full (Axolotl v0.3.0-v0.4.0: bf16 with bf16_full_eval): read as bf16: true; evaluation runs "
                  "under the same bf16 autocast as training")  # fmt: skip
    tokens = data.get("tokens")
    if isinstance(tokens, dict) and all(name in SPECIAL_TOKEN_NAMES for name in tokens):
        # Axolotl's early releases gave special tokens under `tokens`
        data["special_tokens"] = {**tokens, **(data.get("special_tokens") or {})}
        data["tokens"] = None
        notes.add("tokens: a mapping of special tokens (Axolotl's older form), read as special_tokens")
    steps = data.get("warmup_steps")
    if isinstance(steps, float) and 0 < steps < 1:
        notes.add(f"warmup_steps: {steps} is below 1, read as warmup_ratio (as transformers reads it)")
    if isinstance(data.get("pretraining_dataset"), str):
        notes.add("pretraining_dataset: a name (Axolotl v0.3.0-v0.4.0's form), read as [{path: that name}]")
    if data.get("pretraining_dataset"):
        notes.add("pretraining_dataset: read as plain-text completion data and packed (sample_packing: true); "
                  "hub sources are streamed up to what max_steps needs")  # fmt: skip


def action(key: str, kind: str = "top") -> str:
    """What llmtune does with an Axolotl key today (top-level, or of a dataset entry), in the history table's words:
    'llmtune' (its own key), 'alias of K', 'translated: how', 'no effect', 'refused: capability', or 'unknown'."""
    if kind == "dataset":
        if key in DatasetSpec.model_fields:
            return "llmtune"
        if key in RENAMED_DATASET_KEYS:
            return f"alias of {RENAMED_DATASET_KEYS[key]}"
        entry = AXOLOTL_DATASET_KEYS.get(key)
    else:
        if key in Recipe.model_fields:
            return "llmtune"
        if key in RENAMED:
            return f"alias of {RENAMED[key]}"
        if key in TRANSLATED:
            return f"translated: {TRANSLATED[key]}"
        if key in INTENDED:
            return f"translated to {INTENDED[key]}"
        if key == "bnb_config_kwargs":
            return "translated: its entries read as bnb_4bit_quant_type / bnb_4bit_use_double_quant"
        entry = AXOLOTL_ONLY_KEYS.get(key)
    if entry is None:
        return "unknown"
    return "no effect" if entry.accepted is ANY else f"refused: {entry.reason}"


def screen(raw: dict, path: Path) -> tuple[dict, list[str]]:
    """The mapping the schema validates, and the notes to show once. Raises UserError for refused keys."""
    _cloud_config(raw, path)
    _rl_with_generation(raw, path)
    notes = Notes()
    data = _top_level(raw, path, notes)
    _plugins(data, path, notes)
    _datasets(data, path, notes)
    _fsdp_config(data, path, notes)
    _values(data, notes)
    return data, notes.result()
