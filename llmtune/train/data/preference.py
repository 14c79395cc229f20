"""Preference rows for TRL's trainers: Axolotl's `rl:` dataset types, each turning one raw row into strings.

dpo, ipo, orpo and simpo take {"prompt", "chosen", "rejected"}; kto takes {"prompt", "completion", "label"}.
The prompt is the conversation rendered with the chat template up to and including the assistant's generation
prompt; a reply is what the template renders after it (the reply and its end-of-turn token), so a reply never
repeats the prompt and TRL, which masks the prompt, trains only the reply.

Axolotl's chatml.* and llama3.* types write ChatML and Llama-3 strings by hand. Here both use the model's chat
template (the one the model was trained with, or the recipe's chat_template), falling back to the named template of
the type's family only when there is none; chatml.intel and llama3.intel differ in nothing else.

A converter raises RowError naming the field; `convert_rows` adds where the row is (file and line) and the type.
Torch-free: the tokenizer only renders text here.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from llmtune.errors import UserError, did_you_mean
from llmtune.train.data.base import RowError
from llmtune.train.data.preference_fields import (
    PROMPT_KEYS,
    PreferenceRowError,
    _conversation,
    _conversational,
    _label,
    _optional_text,
    _prompt_and_replies,
    _reply_message,
    _split,
    _system,
    _text,
)

# user_defined.default: its keys, defaults and the placeholders each format may use
PAIR_USER_KEYS = {"field_prompt": "prompt", "field_system": "system", "field_chosen": "chosen",
                  "field_rejected": "rejected", "prompt_format": "{prompt}", "chosen_format": "{chosen}",
                  "rejected_format": "{rejected}"}  # fmt: skip
KTO_USER_KEYS = {"field_prompt": "prompt", "field_system": "system", "field_completion": "completion",
                 "field_label": "label", "prompt_format": "{prompt}", "completion_format": "{completion}"}  # fmt: skip
PLACEHOLDERS = {"prompt_format": ("prompt", "system"), "chosen_format": ("chosen",),
                "rejected_format": ("rejected",), "completion_format": ("completion",)}  # fmt: skip


@dataclass(frozen=True)
class PreferenceContext:
    tokenizer: object
    template: str | None  # the resolved chat template; None: the tokenizer's own, else the type family's
    options: Mapping[str, Any] = field(default_factory=dict)  # the dataset's keys (field_chosen, roles, formats...)


Converter = Callable[[dict, PreferenceContext], dict]


# --- reading fields -------------------------------------------------------------------------------------------


# --- rendering --------------------------------------------------------------------------------------------------


def _template(ctx: PreferenceContext, family: str | None) -> str:
    from llmtune.train.data.templates import ALL_TEMPLATES, resolve_chat_template

    if ctx.template:
        return ctx.template
    own = getattr(ctx.tokenizer, "chat_template", None)
    if own or family is None:
        return resolve_chat_template(None, None, ctx.tokenizer)  # the tokenizer's own (raises if it has none)
    return ALL_TEMPLATES[family]


def _prompt(ctx: PreferenceContext, family: str | None, messages: list[dict]) -> tuple[str, str]:
    from llmtune.train.data.templates import render

    template = _template(ctx, family)
    return template, render(template, messages, ctx.tokenizer, add_generation_prompt=True)


def _reply(ctx: PreferenceContext, template: str, messages: list[dict], prompt: str, reply: str) -> str:
    """What the template renders after the prompt for the assistant's reply, end-of-turn token included."""
    from llmtune.train.data.templates import render

    full = render(template, [*messages, {"role": "assistant", "content": reply}], ctx.tokenizer)
    if full.startswith(prompt):
        return full[len(prompt) :].rstrip()
    # A template that renders the earlier turns differently once a reply follows (one that drops past reasoning,
    # say): take the reply from its content on, as Axolotl's chat_template types do.
    start = full.rfind(reply.strip())
    if not reply.strip() or start < 0:
        raise PreferenceRowError("the chat template renders the prompt differently once the reply is added",
                                 "use a prefix-stable chat_template (chatml, llama3, ...)")  # fmt: skip
    return full[start:].rstrip()


def _pair(ctx, family, messages: list[dict], chosen: str, rejected: str) -> dict:
    template, prompt = _prompt(ctx, family, messages)
    return {"prompt": prompt, "chosen": _reply(ctx, template, messages, prompt, chosen),
            "rejected": _reply(ctx, template, messages, prompt, rejected)}  # fmt: skip


def _kto(ctx, family, messages: list[dict], completion: str, label: bool) -> dict:
    template, prompt = _prompt(ctx, family, messages)
    return {"prompt": prompt, "completion": _reply(ctx, template, messages, prompt, completion), "label": label}


# --- DPO / IPO / ORPO / SimPO types -----------------------------------------------------------------------------


def _single_turn(prompt_field: str, row: dict, ctx: PreferenceContext, family: str) -> dict:
    """system (optional) and one user message, the replies as text (chatml.intel / icr / prompt_pairs)."""
    messages = [*_system(row), {"role": "user", "content": _text(row, prompt_field)}]
    return _pair(ctx, family, messages, _text(row, "chosen"), _text(row, "rejected"))


def default(row: dict, ctx: PreferenceContext, family: str) -> dict:
    """chatml / chatml.argilla: the prompt from prompt, input, question or instruction; chosen or chosen_response."""
    name = next((key for key in PROMPT_KEYS if row.get(key) is not None), None)
    if name is None:
        raise PreferenceRowError(f"missing the prompt: none of {', '.join(PROMPT_KEYS)} (row has: "
                                 f"{', '.join(map(str, row))})",
                                 "pick the type whose fields match the data")  # fmt: skip
    chosen = "chosen" if row.get("chosen") is not None else "chosen_response"
    rejected = "rejected" if row.get("rejected") is not None else "rejected_response"
    messages = [*_system(row), {"role": "user", "content": _text(row, name)}]
    return _pair(ctx, family, messages, _text(row, chosen), _text(row, rejected))


def ultra(row: dict, ctx: PreferenceContext, family: str) -> dict:
    """chatml.ultra: system (optional), prompt, and chosen/rejected as [user, assistant] conversations."""
    messages = [*_system(row), {"role": "user", "content": _text(row, "prompt")}]
    chosen, rejected = (_reply_message(row, side, {}) for side in ("chosen", "rejected"))
    return _pair(ctx, family, messages, chosen["content"], rejected["content"])


def _shared_history(row: dict, ctx: PreferenceContext) -> tuple[list[dict], str, str]:
    """chosen and rejected as whole conversations: the turns they share, and each one's last reply."""
    options = ctx.options
    sides = []
    for key, default_name in (("field_chosen", "chosen"), ("field_rejected", "rejected")):
        name = options.get(key) or default_name
        sides.append((name, *_split(_conversation(row, name, options, key), name)))
    (chosen_name, history, chosen), (rejected_name, other, rejected) = sides
    if other != history:
        raise PreferenceRowError(f"fields '{chosen_name}' and '{rejected_name}' differ before their last message",
                                 "both should hold the same conversation up to the reply")  # fmt: skip
    return history, chosen, rejected


def argilla_chat(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """chatml.argilla_chat / chat_template.argilla_chat: chosen and rejected are whole conversations sharing every
    turn but the last; the shared turns are the prompt."""
    history, chosen, rejected = _shared_history(row, ctx)
    return _pair(ctx, family, history, chosen, rejected)


def orpo_argilla(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """chat_template.argilla (Axolotl's ORPO type): argilla_chat plus an optional system and an optional prompt that
    stands for the user's message of a single-turn row."""
    history, chosen, rejected = _shared_history(row, ctx)
    prompt = _optional_text(row, "prompt")
    if prompt and len(history) == 1:
        history = [{"role": "user", "content": prompt}]
    return _pair(ctx, family, [*_system(row), *history], chosen, rejected)


def chat_template(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """chat_template.default: field_messages (a list of messages, or text from the user), field_chosen and
    field_rejected (text, a message, or a list whose last message is the reply)."""
    options = ctx.options
    name = options.get("field_messages") or "messages"
    value = row.get(name)
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    else:
        messages = _conversation(row, name, options, "field_messages")
    chosen = _reply_message(row, options.get("field_chosen") or "chosen", options, "field_chosen")
    rejected = _reply_message(row, options.get("field_rejected") or "rejected", options, "field_rejected")
    return _pair(ctx, family, messages, chosen["content"], rejected["content"])


def _format(key: str, template: str, **values: str) -> str:
    try:
        return template.format(**values)
    except (KeyError, IndexError, ValueError) as err:  # context_for checks formats; this covers a bypass
        raise UserError(f"{key} '{template}' can't be filled ({err!r})", "use only its placeholders") from None


def _user_prompt(row: dict, ctx: PreferenceContext, defaults: dict) -> tuple[dict, str]:
    """user_defined's keys (the recipe's over the defaults) and the prompt written into its prompt_format."""
    keys = {**defaults, **{k: v for k, v in ctx.options.items() if k in defaults and v}}
    prompt = _text(row, keys["field_prompt"], "type.field_prompt")
    return keys, _format("prompt_format", keys["prompt_format"], prompt=prompt,
                         system=_optional_text(row, keys["field_system"]))  # fmt: skip


def user_defined(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """user_defined.default: the row's fields written into the recipe's formats; no chat template."""
    keys, prompt = _user_prompt(row, ctx, PAIR_USER_KEYS)
    return {"prompt": prompt,
            "chosen": _format("chosen_format", keys["chosen_format"],
                              chosen=_text(row, keys["field_chosen"], "type.field_chosen")),
            "rejected": _format("rejected_format", keys["rejected_format"],
                                rejected=_text(row, keys["field_rejected"], "type.field_rejected"))}  # fmt: skip


def passthrough(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """No type (or passthrough): the row already holds the prompt and replies as text, or in TRL's conversational
    shape (message lists; without a prompt, chosen and rejected as whole conversations), which renders as
    chat_template.default's rows do."""
    if not _conversational(row, ("prompt", "chosen", "rejected")):
        return {name: _text(row, name) for name in ("prompt", "chosen", "rejected")}
    messages, (chosen, rejected) = _prompt_and_replies(row, ("chosen", "rejected"), ctx.options)
    return _pair(ctx, family, messages, chosen, rejected)


# --- KTO types --------------------------------------------------------------------------------------------------


def _kto_single(prompt_field: str, row: dict, ctx: PreferenceContext, family: str) -> dict:
    """kto chatml.ultra / intel / argilla / prompt_pairs: system (optional), the prompt, completion and label."""
    messages = [*_system(row), {"role": "user", "content": _text(row, prompt_field)}]
    return _kto(ctx, family, messages, _text(row, "completion"), _label(row, "label"))


def kto_argilla_chat(row: dict, ctx: PreferenceContext, family: str) -> dict:
    """kto chatml.argilla_chat: completion is the conversation [user, assistant]."""
    history, completion = _split(_conversation(row, "completion", ctx.options), "completion")
    return _kto(ctx, family, history, completion, _label(row, "label"))


def kto_user_defined(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """kto user_defined.default: as the pair one, with field_completion, field_label and completion_format."""
    keys, prompt = _user_prompt(row, ctx, KTO_USER_KEYS)
    return {"prompt": prompt,
            "completion": _format("completion_format", keys["completion_format"],
                                  completion=_text(row, keys["field_completion"], "type.field_completion")),
            "label": _label(row, keys["field_label"], "type.field_label")}  # fmt: skip


def kto_passthrough(row: dict, ctx: PreferenceContext, family: str | None) -> dict:
    """No type: prompt, completion and label, as text or as TRL's conversational rows (message lists)."""
    if not _conversational(row, ("prompt", "completion")):
        return {"prompt": _text(row, "prompt"), "completion": _text(row, "completion"), "label": _label(row, "label")}
    messages, (completion,) = _prompt_and_replies(row, ("completion",), ctx.options)
    return _kto(ctx, family, messages, completion, _label(row, "label"))


# --- the registries -----------------------------------------------------------------------------------------------


def _families(types: dict[str, Callable]) -> dict[str, Converter]:
    return {f"{family}.{name}": partial(function, family=family)
            for family in ("chatml", "llama3") for name, function in types.items()}  # fmt: skip


PAIR_TYPES: dict[str, Converter] = {
    **_families({
        "default": default, "argilla": default,  # Axolotl renamed argilla to default (2025) and kept its fields
        "argilla_chat": argilla_chat, "icr": partial(_single_turn, "input"), "intel": partial(_single_turn, "question"),
        "prompt_pairs": partial(_single_turn, "prompt"), "ultra": ultra,
    }),
    "chat_template.default": partial(chat_template, family=None),
    "chat_template.argilla_chat": partial(argilla_chat, family=None),
    "chat_template.argilla": partial(orpo_argilla, family=None),
    "user_defined.default": partial(user_defined, family=None),
    "passthrough": partial(passthrough, family=None),
}  # fmt: skip
KTO_TYPES: dict[str, Converter] = {
    **_families({
        "argilla": partial(_kto_single, "instruction"), "argilla_chat": kto_argilla_chat,
        "intel": partial(_kto_single, "question"), "prompt_pairs": partial(_kto_single, "prompt"),
        "ultra": partial(_kto_single, "prompt"),
    }),
    "user_defined.default": partial(kto_user_defined, family=None),
    "passthrough": partial(kto_passthrough, family=None),
}  # fmt: skip
REGISTRY = {"dpo": PAIR_TYPES, "ipo": PAIR_TYPES, "orpo": PAIR_TYPES, "simpo": PAIR_TYPES, "kto": KTO_TYPES}
# Axolotl loads `chatml` as chatml.default and a bare module name as its .default
ALIASES = {"chatml": "chatml.default", "llama3": "llama3.default", "chat_template": "chat_template.default",
           "user_defined": "user_defined.default", "passthrough.default": "passthrough"}  # fmt: skip


def type_name(kind: str | Mapping | None) -> str:
    """The registry name of a dataset's `type`: a mapping is user_defined.default, none is passthrough."""
    if kind is None:
        return "passthrough"
    if isinstance(kind, Mapping):
        return "user_defined.default"
    return ALIASES.get(kind, kind)


def converter_for(rl: str, kind: str | Mapping | None, label: str = "datasets[0]") -> Converter:
    """The converter for `rl` (dpo, ipo, orpo, simpo, kto) and a dataset's type; UserError naming the known ones."""
    if rl not in REGISTRY:
        raise UserError(f"rl: {rl} has no preference data types", f"use one of {', '.join(REGISTRY)}")
    types = REGISTRY[rl]
    name = type_name(kind)
    if name not in types:
        guess = did_you_mean(name, types)
        raise UserError(f"{label}.type '{name}' is not a preference type for rl: {rl}; known: {', '.join(types)}",
                        f"did you mean '{guess}'?" if guess else "write one of the types above")  # fmt: skip
    return types[name]


def context_for(rl: str, kind, tokenizer, template: str | None, options: Mapping | None = None,
                label: str = "datasets[0]") -> PreferenceContext:  # fmt: skip
    """The context a dataset's rows convert in; a user_defined mapping's keys join `options` and are checked."""
    merged = dict(options or {})
    if isinstance(kind, Mapping):
        known = KTO_USER_KEYS if rl == "kto" else PAIR_USER_KEYS
        for key, value in kind.items():
            if key not in known:
                guess = did_you_mean(key, known)
                raise UserError(f"{label}.type.{key} is not a user_defined key for rl: {rl}",
                                f"did you mean '{guess}'?" if guess else f"use {', '.join(known)}")  # fmt: skip
            if key in PLACEHOLDERS and value:
                _check_format(f"{label}.type.{key}", value, PLACEHOLDERS[key])
        merged.update(kind)
    return PreferenceContext(tokenizer, template, merged)


def _check_format(key: str, text: str, allowed: tuple[str, ...]) -> None:
    try:
        used = [name for _, name, _, _ in string.Formatter().parse(text) if name is not None]
    except ValueError as err:
        raise UserError(f"{key} is not a valid format ({err})", "write {{ and }} for literal braces") from None
    for name in used:
        if name not in allowed:
            raise UserError(f"{key} uses {{{name}}}; it can use " + ", ".join(f"{{{a}}}" for a in allowed),
                            "write {{ and }} for literal braces")  # fmt: skip


def convert_rows(rows: Iterable[tuple[dict, str]], convert: Converter, ctx: PreferenceContext, label: str,
                 kind: str | Mapping | None) -> Iterator[dict]:  # fmt: skip
    """Each (row, where) from sources.read_rows as TRL's strings; a malformed row is a one-line UserError."""
    for row, where in rows:
        try:
            yield convert(row, ctx)
        except RowError as err:
            hint = getattr(err, "hint", None) or "fix the row, or set the dataset's type/fields to match the data"
            raise UserError(f"{where}: {err} ({label}.type is {type_name(kind)})", hint) from None
        except UserError as err:  # the chat template failed on this row's conversation
            raise UserError(f"{where}: {err.message} ({label}.type is {type_name(kind)})", err.hint) from None
