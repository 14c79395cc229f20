"""Which of Axolotl's preference dataset types a first row is, and whether a type reads it (`llmtune config`).

Pure: a row (a dict) in, a type name and the dataset keys it needs out. Pairs (dpo, ipo, orpo, simpo) and KTO's
labelled completions are told apart, so data of the wrong kind for a method is refused before a recipe is written.
"""

from __future__ import annotations

import json
from pathlib import Path

ONE_OF = ("prompt", "input", "question", "instruction")  # chatml.default's prompt, in the order it looks
# The fields each type reads (a tuple: any one of them), family (chatml./llama3.) stripped; passthrough's rows are
# already strings. user_defined's come from its mapping.
PAIR_FIELDS = {
    "default": (ONE_OF, ("chosen", "chosen_response"), ("rejected", "rejected_response")),
    "argilla": (ONE_OF, ("chosen", "chosen_response"), ("rejected", "rejected_response")),
    "argilla_chat": ("chosen", "rejected"), "icr": ("input", "chosen", "rejected"),
    "intel": ("question", "chosen", "rejected"), "prompt_pairs": ("prompt", "chosen", "rejected"),
    "ultra": ("prompt", "chosen", "rejected"), "chat_template.default": ("messages", "chosen", "rejected"),
    "chat_template.argilla_chat": ("chosen", "rejected"), "chat_template.argilla": ("chosen", "rejected"),
    "passthrough": ("prompt", "chosen", "rejected"),
}  # fmt: skip
KTO_FIELDS = {"argilla": ("instruction", "completion", "label"), "argilla_chat": ("completion", "label"),
              "intel": ("question", "completion", "label"), "prompt_pairs": ("prompt", "completion", "label"),
              "ultra": ("prompt", "completion", "label"), "passthrough": ("prompt", "completion", "label")}  # fmt: skip
TEMPLATE_MARKS = ("<|im_start|>", "<|start_header_id|>", "[INST]", "<start_of_turn>")  # a prompt already rendered


def first_row(path: Path) -> dict | None:
    """The first row of a local JSON/JSONL file, or None (not a file, not JSON, not an object)."""
    if not path.is_file() or path.suffix not in (".json", ".jsonl"):
        return None
    try:
        with path.open(encoding="utf-8") as handle:
            first = handle.readline().strip()
            if first.startswith("["):
                handle.seek(0)
                rows = json.load(handle)
                row = rows[0] if rows else None
            else:
                row = json.loads(first) if first else None
    except (OSError, ValueError, IndexError, KeyError, TypeError):
        return None
    return row if isinstance(row, dict) else None


def has(row: dict, fields: tuple) -> bool:
    return all(any(row.get(name) is not None for name in (f if isinstance(f, tuple) else (f,))) for f in fields)


def _is_list(value) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def guess_type(row: dict, kind: str) -> tuple[str, dict] | None:
    """The type (and dataset keys) whose fields a first row has, for pairs or KTO; None when none fits."""
    if kind == "kto":
        if has(row, ("completion", "label")) and _is_list(row["completion"]):
            return "chatml.argilla_chat", {}
        for name, prompt in (("ultra", "prompt"), ("intel", "question"), ("argilla", "instruction")):
            if has(row, (prompt, "completion", "label")):
                return f"chatml.{name}", {}
        return None
    if not has(row, ("chosen", "rejected")) and not has(row, ("chosen_response", "rejected_response")):
        return None
    for name in ("messages", "conversation", "conversations"):
        if _is_list(row.get(name)) and has(row, ("chosen", "rejected")):
            extra: dict = {} if name == "messages" else {"field_messages": name}
            if "from" in row[name][0]:  # ShareGPT turns
                extra["message_property_mappings"] = {"role": "from", "content": "value"}
                extra["roles"] = {"user": ["human"], "assistant": ["gpt"], "system": ["system"]}
            return "chat_template.default", extra
    if has(row, ("question", "chosen", "rejected")):
        return "chatml.intel", {}
    if has(row, ("input", "chosen", "rejected")):
        return "chatml.icr", {}
    if has(row, ("prompt", "chosen", "rejected")):
        if _is_list(row["chosen"]):
            return "chatml.ultra", {}
        rendered = any(mark in str(row["prompt"]) for mark in TEMPLATE_MARKS)
        return ("passthrough" if rendered else "chatml.prompt_pairs"), {}
    if has(row, PAIR_FIELDS["default"]):
        return "chatml.default", {}
    if _is_list(row.get("chosen")) and _is_list(row.get("rejected")):
        return "chat_template.argilla_chat", {}
    return None


def type_fields(kind: str, name) -> tuple:
    if not isinstance(name, str):  # user_defined's mapping
        return tuple(v for k, v in name.items() if k.startswith("field_") and k != "field_system")
    table = KTO_FIELDS if kind == "kto" else PAIR_FIELDS
    return table.get(name) or table.get(name.split(".", 1)[-1], ())


def fields_text(fields: tuple) -> str:
    return ", ".join("/".join(f) if isinstance(f, tuple) else f for f in fields)


def row_problem(row: dict, kind: str, name, extra: dict) -> str | None:
    fields = type_fields(kind, name)
    if name == "chat_template.default" and extra.get("field_messages"):
        fields = (extra["field_messages"], *fields[1:])
    if has(row, fields):
        return None
    return f"its first row has {', '.join(map(str, row)) or 'no fields'}, but that type reads {fields_text(fields)}"


def kind_problem(value: str, rl: str) -> str | None:
    """Rows that are the other kind of preference data (KTO's labelled completions for a pair method, or pairs for
    KTO) can't train with this method: said before a recipe is written."""
    row = first_row(Path(value).expanduser())
    kind = "kto" if rl == "kto" else "pairs"
    other = "pairs" if kind == "kto" else "kto"
    if row is None or guess_type(row, kind) or not guess_type(row, other):
        return None
    what = ("KTO data (single completions labelled good or bad)" if other == "kto"
            else "pairs (chosen and rejected)")  # fmt: skip
    fix = "--rl kto" if other == "kto" else "--rl dpo (ipo, orpo, simpo)"
    return f"its first row ({', '.join(map(str, row))}) is {what}, which rl: {rl} can't read; use {fix}"
