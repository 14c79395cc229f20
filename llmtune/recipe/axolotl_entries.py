"""Keys public Axolotl recipes write where Axolotl ignored them, or set itself: a custom format's keys beside a named
type, a recipe key repeated in a dataset entry, an entry with data_files and no path, and the top-level values that
say what llmtune does anyway. Each is a note, or one line saying where the key goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.recipe.data import CustomFormat, DatasetSpec
from llmtune.recipe.schema import Recipe

WANDB_LOG_MODEL = ("false", "checkpoint", "end")
# (field_system is also a chat_template entry key; beside the other types it belongs in a type: mapping)
FORMAT_KEYS = frozenset(CustomFormat.model_fields) - frozenset(DatasetSpec.model_fields) | {"field_system"}
PREFERENCE_KEYS = frozenset("field_prompt field_completion field_system_chosen chosen rejected field_label "
                            "prompt_key chosen_key rejected_key".split())  # fmt: skip


def shown(value: Any) -> str:
    """A value as a one-line message quotes it (cut at 60 characters)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def path_from_data_files(where: str, spec: dict, notes) -> None:
    """An entry with data_files and no path (v0.4.0's documented form for rl: data): `datasets`' builder for the
    files, as Axolotl's loader called load_dataset(ds_type, data_files=...)."""
    files = [spec["data_files"]] if isinstance(spec["data_files"], str) else spec["data_files"]
    suffixes = {Path(str(f)).suffix.lower().lstrip(".") for f in files if isinstance(f, str)}
    by_suffix = {"jsonl": "json", "json": "json", "csv": "csv", "parquet": "parquet", "arrow": "arrow", "txt": "text"}
    builder = spec.get("ds_type") or (by_suffix.get(suffixes.pop()) if len(suffixes) == 1 else None)
    if builder:
        spec["path"] = builder
        notes.add(f"{where}: no path, read as path: {builder} with its data_files (as Axolotl loaded them)")


def format_key(where: str, key: str, value: Any, kind: str, notes, path: Path) -> None:
    """A key of a custom format's type: mapping written beside a named type (type: alpaca): Axolotl reads it only
    inside the mapping and ignored it here. At its default it changes nothing; another value, which the author meant
    to take effect, is refused with where it goes."""
    default = CustomFormat.model_fields[key].default
    if value in (default, None, ""):
        notes.unused(f"{where}.{key}", f"beside type: {kind} (a named format) it is the default, and Axolotl reads "
                     "it only inside a type: mapping")  # fmt: skip
        return
    raise UserError(f"{path}: {where}.{key}: {shown(value)} beside type: {kind} has no effect (Axolotl reads {key} "
                    f"only inside a custom format's type: mapping, and ignored it here)",
                    f"to use it, write the format as a mapping: type: {{{key}: {shown(value)}, ...}} (see docs/axolotl.md); "
                    "else remove it")  # fmt: skip


def top_level_key_in_entry(where: str, key: str, value: Any, data: dict, notes, path: Path) -> None:
    """A recipe key written in one dataset entry (train_on_inputs, sequence_len, ...): read for the whole recipe
    only, in Axolotl as here. The same value as the recipe's (or its default) is a note; another is refused."""
    field = Recipe.model_fields[key]
    recipe_value = data.get(key, field.get_default(call_default_factory=True))
    if value == recipe_value:
        notes.unused(f"{where}.{key}", f"a recipe key, set for the whole recipe (here {value!r} as there)")
        return
    raise UserError(f"{path}: {where}.{key}: {shown(value)}: {key} is a recipe key, read for the whole recipe "
                    f"only (Axolotl ignores it in a dataset entry too; the recipe's is {recipe_value!r})",
                    f"set {key} at the top level of the recipe, or remove it here")  # fmt: skip


# Dataset-entry keys only type: chat_template reads (bradley_terry.chat_template: drop_system_message too)
CHAT_TEMPLATE_KEYS = ("roles_to_train", "train_on_eos", "train_on_eot", "message_field_training",
                      "message_field_training_detail", "split_thinking", "field_thinking", "template_thinking_key",
                      "field_tools")  # fmt: skip


def chat_only_keys(where: str, spec: dict, notes) -> None:
    """A chat_template key set to something other than its default beside another type: a note that it has no effect
    there (Axolotl's other formats didn't read it either), rather than silence."""
    kind = spec.get("type")
    if not isinstance(kind, str) or "chat_template" in kind:
        return
    for key in CHAT_TEMPLATE_KEYS:
        if key in spec and spec[key] not in (None, DatasetSpec.model_fields[key].default):
            notes.unused(f"{where}.{key}", f"only type: chat_template reads it; Axolotl's type: {kind} didn't either")


HAND_WRITTEN = {"chatml": "ChatML", "llama3": "Llama-3"}  # preference type families Axolotl writes by hand


def hand_written_template(where: str, spec: dict, data: dict, notes) -> None:
    """Axolotl's chatml.* / llama3.* preference types write ChatML / Llama-3 strings by hand, whatever the model;
    llmtune renders them with the model's chat template: a note, since a model with another template trains on other
    prompt strings than under Axolotl."""
    kind = spec.get("type")
    family = kind.split(".")[0] if isinstance(kind, str) and data.get("rl") else None
    if family in HAND_WRITTEN:
        notes.add(f"{where}.type: {kind}: rendered with the model's chat template (the recipe's chat_template, else "
                  f"the tokenizer's), {HAND_WRITTEN[family]} only where there is none; Axolotl writes "
                  f"{HAND_WRITTEN[family]} by hand whatever the model")  # fmt: skip
