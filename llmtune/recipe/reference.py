"""Generate docs/recipe-reference.md from the schema: `python -m llmtune.recipe.reference`."""

from __future__ import annotations

import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from llmtune.recipe.adapter import AdapterKeys
from llmtune.recipe.axolotl_keys import ANY, AXOLOTL_ONLY_KEYS
from llmtune.recipe.data import CustomFormat, DataKeys, DatasetSpec
from llmtune.recipe.distributed import DistributedKeys, FsdpConfig
from llmtune.recipe.model import ModelKeys
from llmtune.recipe.training import TrainingKeys

SECTIONS = [
    ("Model and tokenizer", ModelKeys),
    ("Adapters and quantization", AdapterKeys),
    ("Data", DataKeys),
    ("Each entry of `datasets` / `test_datasets`", DatasetSpec),
    ("Custom format (`type:` as a mapping)", CustomFormat),
    ("Training", TrainingKeys),
    ("Distributed", DistributedKeys),
    ("`fsdp_config` (keys may also carry the `fsdp_` prefix)", FsdpConfig),
]


def _type_name(annotation) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    text = text.replace("typing.", "").replace("NoneType", "None").replace("llmtune.recipe.", "")
    for module in ("data.", "distributed."):
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
    lines += [
        "## Axolotl keys llmtune accepts but does not use",
        "",
        "Accepted when empty, false or the listed default (reported once as having no effect); any other value is "
        "an error naming the key.",
        "",
        "| key | also accepted | otherwise |",
        "| --- | --- | --- |",
    ]
    for key, (accepted, hint) in sorted(AXOLOTL_ONLY_KEYS.items()):
        shown = "any value" if accepted is ANY else ", ".join(map(repr, accepted)) or "-"
        lines.append(f"| `{key}` | {shown} | {hint or '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
