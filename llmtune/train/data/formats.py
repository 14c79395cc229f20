"""Turn one raw row into token ids and labels, per dataset `type`.

Prompt tokens get label -100 unless train_on_inputs; the answer (and its end-of-turn token) is
trained. A row that doesn't fit its format raises RowError; the caller adds the file and line.
"""

from __future__ import annotations

from collections.abc import Callable

from llmtune.errors import UserError
from llmtune.train.data.base import (  # noqa: F401  (re-exported: formats.IGNORE etc. are imported elsewhere)
    IGNORE,
    Example,
    FormatContext,
    RowError,
    _eos,
    _field,
    _ids,
    _prompt_answer,
)
from llmtune.train.data.instruct import INSTRUCT_FORMATS, custom
from llmtune.train.data.model_formats import MODEL_FORMATS
from llmtune.train.data.parts import check_thinking, detailed_spans, joined_parts, split_thinking, training_detail
from llmtune.train.data.sharegpt import SHAREGPT_FORMATS
from llmtune.train.data.tool_fields import json_text, parsed_calls, tools_of
from llmtune.train.data.turns import turns_by_prefix, turns_in_full

ALPACA_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
# Axolotl's Jeopardy prompt, word for word ("tbe" included): a model trained on it is prompted with this text
ROLE_ALIASES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant", "ai": "assistant"}


def alpaca(row: dict, ctx: FormatContext) -> list[Example]:
    instruction = _field(row, "instruction")
    extra = _field(row, "input", required=False)
    # Axolotl's test is the input's truth value: " " still takes the with-input prompt
    prompt = (ALPACA_WITH_INPUT if extra else ALPACA_NO_INPUT).format(instruction=instruction, input=extra)
    return _prompt_answer(ctx, prompt, _field(row, "output"))


def jeopardy(row: dict, ctx: FormatContext) -> list[Example]:
    """Axolotl's `type: jeopardy`: the clue is the instruction, its category the input, "what is <answer>" trained.
    The prompt is Alpaca's: Axolotl's JeopardyPrompter declares a Jeopardy preamble that nothing reads (every
    release), and its rows must have a category (a KeyError there)."""
    question, category = _field(row, "question"), _field(row, "category")
    prompt = (ALPACA_WITH_INPUT if category else ALPACA_NO_INPUT).format(instruction=question, input=category)
    return _prompt_answer(ctx, prompt, "what is " + _field(row, "answer"))


def completion(row: dict, ctx: FormatContext) -> list[Example]:
    text = _field(row, ctx.spec.field or "text")
    ids = _ids(ctx.tokenizer, text, special=True) + _eos(ctx.tokenizer)
    # Long documents become several rows rather than being cut: every token is training signal.
    size = ctx.sequence_len
    return [(ids[i : i + size], ids[i : i + size]) for i in range(0, len(ids), size) if len(ids[i : i + size]) > 1]


def input_output(row: dict, ctx: FormatContext) -> list[Example]:
    segments = _field(row, "segments", list)
    ids, labels = [], []
    for index, segment in enumerate(segments):
        if not isinstance(segment, dict) or not isinstance(segment.get("text"), str):
            raise RowError(f"segments[{index}] must be an object with a 'text' string and a 'label' flag")
        if not isinstance(segment.get("label"), bool):  # Axolotl reads segment["label"]: a KeyError without one
            said = "has no 'label'" if "label" not in segment else f"has label {segment['label']!r}"
            raise RowError(f"segments[{index}] {said}: write true (it trains) or false (it is masked)")
        piece = _ids(ctx.tokenizer, segment["text"])
        ids += piece
        labels += piece if (segment["label"] or ctx.train_on_inputs) else [IGNORE] * len(piece)
    return [(ids, labels)]


def pretokenized(row: dict, ctx: FormatContext) -> list[Example]:
    ids = _field(row, "input_ids", list)
    labels = row.get("labels")
    labels = list(ids) if labels is None else list(labels)
    if len(labels) != len(ids):
        raise RowError(f"labels has {len(labels)} entries but input_ids has {len(ids)}")
    mask = row.get("attention_mask")
    if mask is not None:
        labels = [label if keep else IGNORE for label, keep in zip(labels, mask, strict=False)]
    if not all(isinstance(i, int) for i in ids):
        raise RowError("input_ids must be a list of integers")
    size = len(ctx.tokenizer)  # an id outside it indexes past the embeddings (a device-side assert on a GPU)
    for key, values in (("input_ids", ids), ("labels", labels)):
        wrong = next(((n, v) for n, v in enumerate(values) if not isinstance(v, int)
                      or not (0 <= v < size or (key == "labels" and v == IGNORE))), None)  # fmt: skip
        if wrong:
            raise RowError(f"{key}[{wrong[0]}] is {wrong[1]!r}, not one of this tokenizer's {size} ids",
                           "tokenize the rows with the recipe's tokenizer (labels may also be -100)")  # fmt: skip
    return [([int(i) for i in ids], [int(x) for x in labels])]


OWN_KEYS = ("training", "has_thinking", "training_detail", "thinking_detail")  # what llmtune puts on a message


def role_aliases(spec) -> dict[str, str]:
    """Source role names (a row's `from: gpt`) -> the role the template reads, with the dataset's own `roles:`."""
    aliases = dict(ROLE_ALIASES)
    for role, names in (spec.roles or {}).items():
        aliases.update({name: role for name in names})
    return aliases


def trained_roles(spec) -> set[str]:
    """The roles whose turns train: roles_to_train as written, through the role map (Axolotl, from v0.6.0, maps
    each entry as it maps a row's roles, so `[gpt]` and `[assistant]` both train the gpt turns)."""
    aliases = role_aliases(spec)
    return {aliases.get(role, role) for role in spec.roles_to_train}


def _messages(row: dict, spec) -> list[dict]:
    """The row's conversation as the chat template reads it: each message's role and content, every other key it
    carries (tool_calls, name, tool_call_id, reasoning_content, ...: Axolotl passes them to the template), the keys
    message_property_mappings renames, and the row's system field first where the conversation has no system
    message."""
    raw = _field(row, spec.field_messages, list) if not isinstance(row.get(spec.field_messages), str) else \
        json_text(row[spec.field_messages], f"'{spec.field_messages}'", list)  # fmt: skip
    mappings = spec.message_property_mappings
    role_key, content_key = mappings["role"], mappings["content"]
    renamed = {source: key for key, source in mappings.items() if key not in ("role", "content")}
    thinking_key = spec.field_thinking or "reasoning_content"  # Axolotl's default from v0.12.0
    thinking_from = next((source for source, key in renamed.items() if key == thinking_key), thinking_key)
    aliases = role_aliases(spec)
    messages = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict) or role_key not in message or content_key not in message:
            raise _unmapped(f"{spec.field_messages}[{index}]", message, role_key, content_key, aliases)
        content, where = message[content_key], f"{spec.field_messages}[{index}]"
        detail = None
        if isinstance(content, list):  # [{"type": "text", "text": ...}], each part perhaps with its train flag
            content, detail = joined_parts(content, f"{where}.{content_key}")
        if content is None and message.get("tool_calls"):  # an assistant turn that only calls tools
            content = ""
        if not isinstance(content, str):
            raise RowError(f"{where}.{content_key} must be text")
        written = message.get(spec.message_field_training_detail) if spec.message_field_training_detail else None
        if detail is None and written is not None:
            detail = training_detail(written, content, f"{where}.{spec.message_field_training_detail}")
        role = aliases.get(message[role_key], message[role_key])
        thinking = message.get(thinking_from)
        if spec.split_thinking and role == "assistant" and (split := split_thinking(content)):
            if detail is not None:
                raise RowError(f"{where} has a training detail and a thinking block split_thinking moves out of its "
                               "content: the detail's offsets would point into moved text",
                               "train the thinking as reasoning_content with its own parts, or drop split_thinking")  # fmt: skip
            thinking, content = split
        thinking_detail = None
        if isinstance(thinking, list):
            thinking, thinking_detail = joined_parts(thinking, f"{where}.{thinking_from}")
        if role == "system" and spec.drop_system_message:
            continue
        entry = {"role": role, "content": content}
        for key, value in message.items():  # None: a key other rows have (a parquet or datasets column)
            name = renamed.get(key, key)
            if value is not None and key not in (role_key, content_key, spec.message_field_training, thinking_from,
                                                 spec.message_field_training_detail) \
                    and name not in entry and name not in OWN_KEYS:  # fmt: skip
                entry[name] = parsed_calls(value, f"{where}.{key}") if name == "tool_calls" else value
        training = message.get(spec.message_field_training) if spec.message_field_training else None
        if training is not None:  # Axolotl's truth value: 0/1 as well as false/true
            entry["training"] = bool(training)
        if detail is not None:
            entry["training_detail"] = detail
        if isinstance(thinking, str) and thinking:
            entry[spec.template_thinking_key or thinking_key] = thinking
            entry["has_thinking"] = True
            if thinking_detail is not None:
                entry["thinking_detail"] = (thinking, thinking_detail)
        messages.append(entry)
    if not messages:
        raise RowError(f"'{spec.field_messages}' is empty")
    system = row.get(spec.field_system)
    if isinstance(system, str) and system and messages[0]["role"] != "system" and not spec.drop_system_message:
        messages.insert(0, {"role": "system", "content": system})
    return messages


ROLE_KEYS, CONTENT_KEYS = ("from", "role", "speaker", "author"), ("value", "content", "text", "message")


def _unmapped(where: str, message, role_key: str, content_key: str, aliases: dict) -> RowError:
    """A message without the mapped role and content keys: what it has, and the mapping that would read it."""
    if not isinstance(message, dict):
        return RowError(f"{where} should be a message with '{role_key}' and '{content_key}', not "
                        f"{type(message).__name__}")  # fmt: skip
    keys = ", ".join(map(str, message)) or "nothing"
    role = next((key for key in ROLE_KEYS if key in message), "<role key>")
    content = next((key for key in CONTENT_KEYS if key in message), "<content key>")
    hint = f"set message_property_mappings: {{role: {role}, content: {content}}}"
    value = message.get(role)
    if isinstance(value, str) and value in aliases:
        hint += f" ({value} is read as {aliases[value]})"
    elif isinstance(value, str) and value not in ("system", "user", "assistant", "tool"):
        hint += f", and roles: {{user: [...], assistant: [...]}} to say what '{value}' is"
    return RowError(f"{where} needs '{role_key}' and '{content_key}' (it has: {keys})", hint)


def _turn_ends(ids: list[int], offsets, content_end: int, end: int, markers) -> tuple[int, int] | None:
    """The character span of the first marker token after a message's content, within its turn."""
    for (a, b), token in zip(offsets, ids, strict=True):
        if a >= content_end and b <= end and token in markers:
            return a, b
    return None


def _chosen(ends: list[tuple[int, int, bool]], mode: str) -> list[tuple[int, int]]:
    """Which end-of-turn tokens get labels: each trained turn's, the last trained one, all, or none."""
    picked = [(a, b) for a, b, trained in ends if mode == "all" or (mode in ("turn", "last") and trained)]
    return picked[-1:] if mode == "last" else picked


def _turn_markers(tokenizer, eot_ids) -> set[int]:
    """What ends a turn: the recipe's eot_tokens, else any special token (<|im_end|>, <|eot_id|>, <|end|> are
    added special tokens, not always in the special map)."""
    if eot_ids:
        return set(eot_ids)
    return set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}


PROBE_ANSWER = "The answer is four."


def untrained_turn_end(template: str, tokenizer, eot_ids=frozenset()) -> tuple[str, str] | None:
    """(what the template puts after an answer, why it never gets a label) when no token there ends the turn for
    this tokenizer (a terminator split into pieces, or a token that isn't special), else None. Axolotl warns the
    same way: the model then never learns to end its answers."""
    from llmtune.train.data.templates import render

    messages = [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": PROBE_ANSWER}]
    try:
        full = render(template, messages, tokenizer)
    except Exception:  # a template that wants other roles: the rows will say so
        return None
    content_end = full.rfind(PROBE_ANSWER) + len(PROBE_ANSWER)
    if content_end < len(PROBE_ANSWER):
        return None
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    if _turn_ends(ids, offsets, content_end, len(full), _turn_markers(tokenizer, eot_ids)):
        return None
    terminator = full[content_end:].strip()
    if not terminator:
        return "", "the template puts nothing after an answer"
    pieces = tokenizer.encode(terminator, add_special_tokens=False)
    if eot_ids:
        why = "is not one of eot_tokens"
    elif len(pieces) > 1:
        why = f"is {len(pieces)} tokens to this tokenizer, not one special token"
    else:
        why = "is a token of this tokenizer but not a special one"
    return terminator, why


def _check_tools(messages: list[dict], tools: list | None, ctx: FormatContext) -> None:
    """A row with tool calls or tool definitions that the chat template would drop (a plain-chat template renders an
    assistant's call as an empty reply, and trains on it) is refused."""
    from llmtune.train.data.templates import tool_rendering

    calling = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("tool_calls")), None)
    if calling is None and not tools:
        return
    renders_calls, renders_tools = tool_rendering(ctx.template, ctx.tokenizer)
    if calling is not None and not renders_calls:
        what = f"message {calling} (assistant) has tool_calls"
    elif tools and not renders_tools:
        what = f"the row has tool definitions ('{ctx.spec.field_tools}')"
    else:
        return
    used = f"chat_template {ctx.template_name}" if ctx.template_name else "the chat template"
    raise RowError(f"{what}, which {used} does not render: it would be dropped and the turn trained without it",
                   "use chat_template: tokenizer_default with a tokenizer whose template renders tools, or "
                   "chat_template: jinja with a chat_template_jinja that renders tool_calls and tools")  # fmt: skip


def chat_template(row: dict, ctx: FormatContext) -> list[Example]:
    from llmtune.train.data.templates import render

    spec, tokenizer, template = ctx.spec, ctx.tokenizer, ctx.template
    messages, tools = _messages(row, spec), tools_of(row, spec)
    _check_tools(messages, tools, ctx)
    if any(message.get("has_thinking") for message in messages):
        check_thinking(ctx)
    try:
        full = render(template, messages, tokenizer, tools=tools)
    except UserError as err:  # this row's conversation: its file and line go with the message
        raise RowError(f"{err.message} ({err.hint})") from None
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    train_roles = trained_roles(spec)
    # Without eot_tokens, a turn ends at the first special token after it, governed by train_on_eos. With
    # eot_tokens (Axolotl's meaning), those end turns and follow train_on_eot, and the eos token follows
    # train_on_eos on its own.
    markers = _turn_markers(tokenizer, ctx.eot_ids)
    eos = {tokenizer.eos_token_id} - set(ctx.eot_ids) if ctx.eot_ids else set()
    trained_chars: list[tuple[int, int]] = []
    masked_chars: list[tuple[int, int]] = []  # a training detail's untrained ranges: no token touching them trains
    eot_chars: list[tuple[int, int, bool]] = []  # end-of-turn token span, and whether its turn is trained
    eos_chars: list[tuple[int, int, bool]] = []
    turns = turns_by_prefix(template, messages, tokenizer, full, tools)
    if turns is None:  # the template renders earlier turns differently once later ones follow (Qwen3's thinking)
        turns = turns_in_full(template, messages, tokenizer, full, tools, (ids, offsets, markers))
    for message, (start, found, content_end, end) in zip(messages, turns, strict=True):
        # train_on_inputs makes every turn trainable (Axolotl's should_train); a message's own `training` wins, then
        # its training detail (a message with one trains where it says, whatever its role)
        details = [message.get("training_detail"), (message.get("thinking_detail") or ("", None))[1]]
        default = ctx.train_on_inputs or message["role"] in train_roles
        trained = message.get("training", default if details == [None, None] else any(details))
        content = message["content"].strip()  # templates often trim the content
        calls = message["role"] == "assistant" and bool(message.get("tool_calls"))
        if calls:  # the tool calls train with the answer: the turn after its header, up to its last end marker
            last = [
                a for (a, b), token in zip(offsets, ids, strict=True) if start <= a and b <= end and token in markers
            ]
            content_end = last[-1] if last else end
            found = -1
        trained = trained and bool(content or message.get("has_thinking") or calls)  # an empty answer teaches nothing
        if trained and details != [None, None]:
            trained_chars += detailed_spans(message, full, (start, found, content_end), masked_chars)
        elif trained:
            # reasoning rendered before the answer trains with it
            begin = start if message.get("has_thinking") or found < 0 else found
            trained_chars.append((begin, content_end))
        turn_end = _turn_ends(ids, offsets, content_end, end, markers)
        if turn_end:
            eot_chars.append((*turn_end, trained))
        eos_end = _turn_ends(ids, offsets, content_end, end, eos) if eos else None
        if eos_end:
            eos_chars.append((*eos_end, trained))
    eot_mode = (spec.train_on_eot or spec.train_on_eos) if ctx.eot_ids else spec.train_on_eos
    spans = trained_chars + _chosen(eot_chars, eot_mode) + _chosen(eos_chars, spec.train_on_eos)
    labels = []
    for (a, b), token in zip(offsets, ids, strict=True):
        # a token overlapping a trained span trains: byte-level BPE fuses the space a template puts before the
        # content with its first word (" Paris" after "[/INST]"), as Axolotl's find_turn labels it
        keep = any((a < e and b > s) if b > a else s <= a < e for s, e in spans)
        keep = keep and not any(a < e and b > s for s, e in masked_chars)
        labels.append(token if keep else IGNORE)
    return [(list(ids), labels)]


FORMATS: dict[str, Callable[[dict, FormatContext], list[Example]]] = {
    "alpaca": alpaca,
    "chat_template": chat_template,
    "completion": completion,
    "input_output": input_output,
    "jeopardy": jeopardy,
    "pretokenized": pretokenized,
}


def format_for(spec) -> Callable[[dict, FormatContext], list[Example]]:
    """The converter for a dataset entry's type: today's formats, Axolotl's older ones, or a user-defined mapping.

    A `name:style` type (alpaca:chat) is one of the prompted formats in that prompt style."""
    if spec.type is None:
        return pretokenized
    if not isinstance(spec.type, str):
        return custom
    name, _, style = spec.type.partition(":")
    if name in FORMATS and not style:
        return FORMATS[name]
    return INSTRUCT_FORMATS.get(name) or MODEL_FORMATS.get(name) or SHAREGPT_FORMATS[name]
