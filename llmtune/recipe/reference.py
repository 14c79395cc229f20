"""Generate docs/recipe-reference.md from the schema: `python -m llmtune.recipe.reference`."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from llmtune.recipe.adapter import AdapterKeys
from llmtune.recipe.axolotl_keys import (
    ANY,
    AXOLOTL_DATASET_KEYS,
    AXOLOTL_FSDP_KEYS,
    AXOLOTL_ONLY_KEYS,
    BNB_CONFIG_KWARGS,
    INTENDED,
    PLUGINS,
    RENAMED,
    RENAMED_DATASET_KEYS,
    TRANSLATED,
)
from llmtune.recipe.data import CustomFormat, DataKeys, DatasetSpec
from llmtune.recipe.distributed import DistributedKeys, FsdpConfig
from llmtune.recipe.mixing import MixingKeys
from llmtune.recipe.model import ModelKeys
from llmtune.recipe.preference import PreferenceFormat, PreferenceKeys
from llmtune.recipe.qat import Qat
from llmtune.recipe.training import TrainingKeys

SECTIONS = [
    ("Model and tokenizer", ModelKeys),
    ("Adapters and quantization", AdapterKeys),
    ("`qat` (quantization-aware training, torchao)", Qat),
    ("Data", DataKeys),
    ("Merging, sharding and batching the rows", MixingKeys),
    ("Each entry of `datasets` / `test_datasets`", DatasetSpec),
    ("Custom format (`type:` as a mapping)", CustomFormat),
    ("Training", TrainingKeys),
    ("Distributed", DistributedKeys),
    ("Preference training (`rl:`, through TRL)", PreferenceKeys),
    ("Preference format (`type:` as a mapping with `rl:`: user_defined.default)", PreferenceFormat),
    ("`fsdp_config` (keys may also carry the `fsdp_` prefix)", FsdpConfig),
]


def _type_name(annotation) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("NoneType", "None").replace("llmtune.recipe.", "")
    for module in ("data.", "distributed.", "adapter.", "qat.", "preference."):
        text = text.replace(module, "")
    return text.replace("|", "\\|")


def _own_fields(model: type[BaseModel]) -> dict:
    parents = [b for b in model.__mro__[1:] if isinstance(b, type) and issubclass(b, BaseModel)]
    inherited = set().union(*(getattr(b, "model_fields", {}) for b in parents))
    return {k: v for k, v in model.model_fields.items() if k not in inherited}


def render() -> str:
    lines = [
        "# Recipe reference",
        "",
        "Generated from the schema by `python -m llmtune.recipe.reference`; do not edit by hand.",
        "Key names follow Axolotl. Unknown keys are errors (with a did-you-mean);",
        "`key:` with no value means the default.",
        "",
    ]
    for title, model in SECTIONS:
        lines += [f"## {title}", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
        for name, info in _own_fields(model).items():
            default = "required" if info.default is PydanticUndefined else repr(info.default)
            hint = typing.get_type_hints(model).get(name, info.annotation)
            lines.append(
                f"| `{name}` | {_type_name(hint)} | {default} | {(info.description or '').replace('|', '/')} |"
            )
        lines.append("")
    lines += _axolotl_sections()
    return "\n".join(lines) + "\n"


def _key_table(title: str, table: dict) -> list[str]:
    lines = [f"### {title}", "", "| key | accepted | otherwise |", "| --- | --- | --- |"]
    for key, entry in sorted(table.items()):
        if entry.accepted is ANY:
            lines.append(f"| `{key}` | any value, no effect: {entry.reason} | - |")
        else:
            shown = ", ".join(["empty/false", *map(repr, entry.accepted)])
            hint = f" ({entry.hint})" if entry.hint else ""
            lines.append(f"| `{key}` | {shown} | error: {entry.reason} is not supported{hint} |")
    return [*lines, ""]


def _axolotl_sections() -> list[str]:
    """Axolotl's keys that llmtune's schema doesn't define: older names, no effect, or refused by capability."""
    lines = [
        "## Axolotl keys",
        "",
        "Every key Axolotl defines is read: honoured (the tables above), read under its newer name, accepted with "
        "no effect (reported once), or refused by the capability it asks for.",
        "",
        "### Older names",
        "",
        "| Axolotl key | read as |",
        "| --- | --- |",
    ]
    lines += [f"| `{old}` | `{new}` |" for old, new in sorted({**RENAMED, **RENAMED_DATASET_KEYS}.items())]
    lines += [f"| `{old}` | {how} |" for old, how in sorted(TRANSLATED.items())]
    lines += [f"| `bnb_config_kwargs.{name}` | {f'`{key}`' if key else 'no effect (from the precision)'} |"
              for name, key in BNB_CONFIG_KWARGS.items()]  # fmt: skip
    lines += ["", "### Keys Axolotl drops, honoured", "",
              "Not Axolotl keys (Axolotl drops them without a word), but recipes carry them and their intent is plain.",
              "", "| key | read as |", "| --- | --- |"]  # fmt: skip
    lines += [f"| `{key}` | `{new}`{' (divided by learning_rate)' if new == 'cosine_min_lr_ratio' else ''} |"
              for key, new in INTENDED.items()]  # fmt: skip
    lines += ["", "### Plugins", "", "| plugin class | effect |", "| --- | --- |"]
    for name, entry in PLUGINS.items():
        effect = "honoured (see the liger_* and cut_cross_entropy keys)" if entry is None else (
            f"no effect: {entry.reason}" if entry.accepted is ANY else f"error: {entry.reason} is not supported")  # fmt: skip
        lines.append(f"| `{name}` | {effect} |")
    lines.append("")
    lines += _key_table("Top-level keys", AXOLOTL_ONLY_KEYS)
    lines += _key_table("Keys of a `datasets` entry", AXOLOTL_DATASET_KEYS)
    lines += _key_table("Keys of `fsdp_config`", AXOLOTL_FSDP_KEYS)
    return lines


if __name__ == "__main__":
    print(render(), end="")
