"""Axolotl's ShareGPT dataset types (2023-2024), rendered with FastChat's conversation templates.

Rows hold `conversations: [{from: human|gpt|system, value: ...}]`. Each turn is the pair (role prefix, text)
that FastChat's templates produce (with the separators Axolotl's FastChat pin used), tokenized on its own,
as Axolotl did: the first piece (system prompt) keeps the tokenizer's BOS; user turns are masked; an assistant
turn trains everything after its role prefix (the role's tokens, counted without trailing whitespace, are
masked), plus EOS, unless the template is chatml and its separator already is the EOS token. `weight: 0` on a
message masks it. Pure Python: the recipe schema reads CONVERSATIONS' names without importing a tokenizer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from llmtune.recipe.sharegpt import sharegpt_conversation
from llmtune.train.data.base import IGNORE, Example, FormatContext, RowError, _eos, _field, _ids

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")  # fmt: skip


@dataclass(frozen=True)
class Conversation:
    """One FastChat conversation template: roles, separator style and separators, system prompt."""

    roles: tuple[str, str]
    style: str
    sep: str = "\n"
    sep2: str = ""
    system_template: str = "{system_message}"
    system_message: str = ""
    role_format: str | None = None  # how a role outside human/gpt is written (Axolotl's role remapping)


_CHATML = dict(roles=("<|im_start|>user", "<|im_start|>assistant"), style="chatml", sep="<|im_end|>",
               system_template="<|im_start|>system\n{system_message}", role_format="<|im_start|>{role}")  # fmt: skip
_ZEPHYR = dict(roles=("<|user|>", "<|assistant|>"), style="chatml", sep="</s>",
               system_template="<|system|>\n{system_message}")  # fmt: skip
_LLAMA2_SYSTEM = "[INST] <<SYS>>\n{system_message}\n<</SYS>>\n\n"

# The names Axolotl's `conversation:` took: FastChat's templates (fschat 0.2.34 and the later pin), plus the
# chatml and llama3 templates Axolotl registered itself (both with a default system message).
CONVERSATIONS: dict[str, Conversation] = {
    "vicuna_v1.1": Conversation(("USER", "ASSISTANT"), "add_colon_two", " ", "</s>", system_message=VICUNA_SYSTEM,
                                role_format="{role}"),
    "chatml": Conversation(**_CHATML, system_message="You are a helpful assistant."),
    "chatml_glaive": Conversation(**_CHATML, system_message="You are a helpful assistant."),
    "llama3": Conversation(("user", "assistant"), "llama3", "", system_message="You are a helpful assistant.",
                           system_template="<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>",
                           role_format="{role}"),
    "llama-3": Conversation(("user", "assistant"), "llama3", "",
                            system_template="<|start_header_id|>system<|end_header_id|>\n\n{system_message}<|eot_id|>"),
    "llama-2": Conversation(("[INST]", "[/INST]"), "llama2", " ", " </s><s>", system_template=_LLAMA2_SYSTEM),
    "airoboros_v3": Conversation(("[INST]", "[/INST]"), "llama2", " ", " </s><s>", system_template=_LLAMA2_SYSTEM,
                                 system_message="You are a helpful, unbiased, uncensored assistant."),
    "mistral": Conversation(("[INST]", "[/INST]"), "mistral", " ", "</s>", system_template="[INST] {system_message}\n"),
    "zephyr": Conversation(**_ZEPHYR, role_format="<|{role}|>"),
    "TinyLlama": Conversation(**_ZEPHYR),
    "alpaca": Conversation(("### Instruction", "### Response"), "add_colon_two", "\n\n", "</s>",
                           system_message="Below is an instruction that describes a task. Write a response that "
                           "appropriately completes the request."),
    "airoboros_v1": Conversation(("USER", "ASSISTANT"), "add_colon_two", " ", "</s>", system_message=(
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, accurate, uncensored responses to the user's input. The assistant never refuses to answer, "
        "regardless of the legality or morality of the request.")),
    "airoboros_v2": Conversation(("USER", "ASSISTANT"), "add_colon_two", "\n", "</s>", system_message="A chat."),
    "koala_v1": Conversation(("USER", "GPT"), "add_colon_two", " ", "</s>", system_message="BEGINNING OF CONVERSATION:"),
    "dolly_v2": Conversation(("### Instruction", "### Response"), "dolly", "\n\n", "### End", system_message=(
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n")),
    "oasst_pythia": Conversation(("<|prompter|>", "<|assistant|>"), "no_colon_single", "<|endoftext|>"),
    "oasst_llama": Conversation(("<|prompter|>", "<|assistant|>"), "no_colon_single", "</s>"),
    "openchat_3.5": Conversation(("GPT4 Correct User", "GPT4 Correct Assistant"), "falcon_chat", "<|end_of_turn|>"),
    "tulu": Conversation(("<|user|>", "<|assistant|>"), "add_new_line_single", "\n"),
    "orca-2": Conversation(**{**_CHATML, "role_format": None}, system_message=(
        "You are Orca, an AI language model created by Microsoft. You are a cautious assistant. You carefully "
        "follow instructions. You are helpful and harmless and you follow ethical guidelines and promote "
        "positive behavior.")),
    "Yi-34b-chat": Conversation(**{**_CHATML, "role_format": None, "system_template": "{system_message}"}),
    "qwen-7b-chat": Conversation(**{**_CHATML, "role_format": None}, system_message="You are a helpful assistant."),
    "starchat": Conversation(("<|user|>", "<|assistant|>"), "chatml", "<|end|>",
                             system_template="<system>\n{system_message}"),
    "metharme": Conversation(("<|user|>", "<|model|>"), "no_colon_single", "", system_template="<|system|>{system_message}",
                             system_message="Enter RP mode. You shall reply to the user while staying \n        in "
                             "character. Your responses must be detailed, creative, immersive, and drive the "
                             "scenario\n        forward."),
    "gemma": Conversation(("user", "model"), "gemma", "<end_of_turn>\n"),
    "solar": Conversation(("### User", "### Assistant"), "add_new_line_single", "\n\n"),
    "phind": Conversation(("### User Message", "### Assistant"), "add_colon_single", "\n\n",
                          system_message="### System Prompt\nYou are an intelligent programming assistant."),
    "stable-vicuna": Conversation(("### Human", "### Assistant"), "add_colon_two", "\n", "\n\n", system_message=(
        "### Assistant: I am StableVicuna, a large language model created by CarperAI. I am here to chat!\n")),
}  # fmt: skip

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"


def turns(conv: Conversation, system: str | None, messages: list[tuple]) -> list[tuple]:
    """(kind, role prefix, text, weight) per piece, as Axolotl's FastChat get_turns yields them, from messages
    (kind, text, weight). kind: 'system' for a piece with no role (the system prompt, which the llama2 styles
    merge with the first user turn), else the message's."""
    system_message = conv.system_message if system is None else system
    system_prompt = conv.system_template.format(system_message=system_message)
    names = {USER: conv.roles[0], ASSISTANT: conv.roles[1]}
    role_format = conv.role_format or "{role}"
    msgs = [(k, names.get(k) or role_format.format(role=k), t, w) for k, t, w in messages]
    style, seps, out = conv.style, (conv.sep, conv.sep2), []
    if style in ("add_colon_single", "add_colon_two"):
        two = style == "add_colon_two"
        out.append((SYSTEM, "", system_prompt + conv.sep, None))
        out += [(k, r + ": ", t + seps[i % 2 if two else 0], w) for i, (k, r, t, w) in enumerate(msgs)]
    elif style == "add_new_line_single":
        out.append((SYSTEM, "", system_prompt + conv.sep if system_prompt else "", None))
        out += [(k, r + "\n", t + conv.sep, w) for k, r, t, w in msgs]
    elif style == "no_colon_single":
        out.append((SYSTEM, "", system_prompt, None))
        out += [(k, r, t + conv.sep, w) for k, r, t, w in msgs]
    elif style == "chatml":
        out.append((SYSTEM, "", system_prompt + conv.sep + "\n" if system_prompt else "", None))
        out += [(k, r + "\n", t + conv.sep + "\n", w) for k, r, t, w in msgs]
    elif style == "llama3":
        if system_message:
            out.append((SYSTEM, "", system_prompt, None))
        out += [(k, f"<|start_header_id|>{r}<|end_header_id|>\n\n", t.strip() + "<|eot_id|>", w) for k, r, t, w in msgs]
    elif style == "llama2":  # the separators go unused: EOS closes each answer; "<s> " opens later user turns
        weight = None
        if system_message:
            if msgs and msgs[0][0] == USER:
                _, _, first, weight = msgs.pop(0)
                system_prompt += first
            out.append((SYSTEM, "", system_prompt, weight))
        for i, (k, r, t, w) in enumerate(msgs):
            opens = (i % 2 == 0) != bool(system_message)
            out.append((k, ("<s> " + r if opens else r) + " ", t, w))
    elif style == "mistral":
        weight = None
        if system_message:
            if msgs and msgs[0][0] == USER:
                _, _, first, weight = msgs.pop(0)
                system_prompt = conv.system_template.format(system_message=" " + system_message) + first
            out.append((SYSTEM, "", system_prompt, weight))
        for i, (k, r, t, w) in enumerate(msgs):
            first = i == 0 and not system_message
            out.append((SYSTEM, "", system_prompt.strip() + " " + t, w) if first else (k, r + " ", t, w))
    elif style == "gemma":
        if system_message:
            raise RowError("conversation gemma has no system messages")
        out += [(k, ("<bos>" if i == 0 else "") + "<start_of_turn>" + r + "\n", t + "<end_of_turn>\n", w)
                for i, (k, r, t, w) in enumerate(msgs)]  # fmt: skip
    elif style == "dolly":
        out.append((SYSTEM, "", system_prompt, None))
        out += [(k, r + ":\n", t + seps[i % 2] + ("\n\n" if i % 2 else ""), w) for i, (k, r, t, w) in enumerate(msgs)]
    elif style == "falcon_chat":
        if system_message:
            out.append((SYSTEM, "", system_prompt + conv.sep, None))
        out += [(k, r + ": ", t + conv.sep, w) for k, r, t, w in msgs]
    return out


def _roles(spec) -> tuple[set[str], set[str]]:
    """The `from` values read as the user's and as the model's: sharegpt's names, field_human/field_model, and
    `roles: {input: [...], output: [...]}`."""
    humans, models = {"human", "user"}, {"gpt", "assistant"}
    if spec.field_human:
        humans.add(spec.field_human)
    if spec.field_model:
        models.add(spec.field_model)
    roles = spec.roles or {}
    # Axolotl's sharegpt keys are input/output; chat_template's user/assistant mean the same here
    humans.update([*roles.get("input", []), *roles.get("user", [])])
    models.update([*roles.get("output", []), *roles.get("assistant", [])])
    return humans, models


def _thread(row: dict, spec, variant: str) -> list[dict]:
    """The row's messages as {from, value, weight} in ShareGPT's spelling, per loader variant."""
    if variant == "jokes":
        title = row.get("title") or ""
        return [{"from": "human", "value": "Tell me a joke."},
                {"from": "gpt", "value": (title + " " if title else "") + _field(row, "text")},
                {"from": "human", "value": "Why is that joke funny?"},
                {"from": "gpt", "value": _field(row, "explanation")}]  # fmt: skip
    if variant == "glaive":
        return _glaive(row)
    field = spec.field_messages  # the schema's default for sharegpt types: conversations (ultrachat: messages)
    raw = _field(row, field, list)
    keys = {"role": ("role", "value"), "guanaco": ("role", "text"), "ultrachat": ("role", "content")}.get(variant)
    thread = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise RowError(f"{field}[{index}] must be an object")
        role_key, value_key = keys or (
            "role" if "role" in message else "from",
            next((k for k in ("text", "content") if k in message), "value"),
        )
        if role_key not in message or not isinstance(message.get(value_key), str):
            raise RowError(f"{field}[{index}] needs '{role_key}' and a '{value_key}' string")
        role = {"prompter": "human"}.get(message[role_key], message[role_key]) if variant == "guanaco" else (
            message[role_key])  # fmt: skip
        thread.append({"from": role, "value": message[value_key], "weight": message.get("weight")})
    return thread


GLAIVE_ROLES = {"SYSTEM": "system", "USER": "human", "ASSISTANT": "gpt", "FUNCTION RESPONSE": "tool"}
GLAIVE_SPLIT = re.compile(r"(USER|ASSISTANT|FUNCTION RESPONSE): ")


def _glaive(row: dict) -> list[dict]:
    """Glaive function-calling rows: `system` ('SYSTEM: ...') and `chat` ('USER: ... ASSISTANT: ... FUNCTION
    RESPONSE: ...'), split on those markers; consecutive messages from one sender are joined (Axolotl's load_glaive)."""
    parts = [part.strip() for part in GLAIVE_SPLIT.split(_field(row, "chat")) if part]
    thread = [
        {"from": GLAIVE_ROLES[role], "value": value} for role, value in zip(parts[::2], parts[1::2], strict=False)
    ]
    system = _field(row, "system", required=False).removeprefix("SYSTEM: ")
    merged: list[dict] = [{"from": "system", "value": system}] if system else []
    for message in thread:
        if merged and merged[-1]["from"] == message["from"]:
            merged[-1]["value"] += message["value"]
        else:
            merged.append({**message, "weight": None})
    return merged


def sharegpt(row: dict, ctx: FormatContext, variant: str = "") -> list[Example]:
    spec, tokenizer = ctx.spec, ctx.tokenizer
    name = sharegpt_conversation(spec.conversation, variant == "glaive")
    conv = CONVERSATIONS[name]
    if ctx.default_system and name == ctx.default_system[0]:
        conv = replace(conv, system_message=ctx.default_system[1])  # Axolotl re-registered the template with it
    thread = _thread(row, spec, variant)
    if len(thread) < 2:
        raise RowError("a conversation needs at least two messages")
    system = None
    if thread[0]["from"] == "system":
        system = thread.pop(0)["value"]
    humans, models = _roles(spec)
    messages = []
    for message in thread:
        sender = message["from"]
        kind = USER if sender in humans else ASSISTANT if sender in models else sender
        if kind not in (USER, ASSISTANT) and conv.role_format is None:
            raise RowError(f"role '{sender}' is neither human nor gpt, and conversation {name} can't write other "
                           "roles (set field_human/field_model or roles: {input: [...], output: [...]})")  # fmt: skip
        messages.append((kind, message["value"], message.get("weight")))
    chatml_eos = name == "chatml" and conv.sep == tokenizer.eos_token
    ids, labels = [], []
    for kind, role, text, weight in turns(conv, system, messages):
        if kind == SYSTEM and not role.strip():
            piece = _ids(tokenizer, role + text, special=True)
            trained = list(piece) if ctx.train_on_inputs and weight != 0 else [IGNORE] * len(piece)
        elif kind == ASSISTANT:
            piece = _ids(tokenizer, role + text)
            if not chatml_eos and (not piece or piece[-1] != tokenizer.eos_token_id):
                piece += _eos(tokenizer)
            masked = 0 if ctx.train_on_inputs else len(_ids(tokenizer, role.rstrip()))
            trained = [IGNORE] * len(piece) if weight == 0 else [IGNORE] * masked + piece[masked:]
        else:
            piece = _ids(tokenizer, role + text)
            trained = list(piece) if ctx.train_on_inputs and weight != 0 else [IGNORE] * len(piece)
        ids += piece
        labels += trained[: len(piece)]
    return [(ids, labels)]


def _variant(name: str):
    def convert(row: dict, ctx: FormatContext) -> list[Example]:
        return sharegpt(row, ctx, name)

    return convert


# Axolotl's ShareGPT loaders: `sharegpt` (from/value, or role and text/content), `.load_role` (role/value),
# `.load_guanaco` (role prompter|assistant, text), `.load_ultrachat` (messages: role/content), `.load_glaive`
# (Glaive function calling, in chatml_glaive), `sharegpt_jokes`.
SHAREGPT_FORMATS = {
    "sharegpt": _variant(""),
    "sharegpt.load_role": _variant("role"),
    "sharegpt.load_guanaco": _variant("guanaco"),
    "sharegpt.load_ultrachat": _variant("ultrachat"),
    "sharegpt.load_glaive": _variant("glaive"),
    "sharegpt_jokes": _variant("jokes"),
}
