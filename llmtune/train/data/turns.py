"""Where each turn of a conversation lies in its chat-template rendering: the spans the chat_template format
(formats.py) labels. Turn by turn where the template renders earlier turns the same once later ones follow; in the
whole conversation where it doesn't (Qwen3's thinking), as Axolotl finds its turns."""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.train.data.base import RowError


def turns_by_prefix(template: str, messages: list[dict], tokenizer, full: str, tools) -> list | None:
    """Each message's (start, content start or -1, content end, end) in `full`, from the conversation rendered turn
    by turn; None where a turn renders differently once later turns follow."""
    from llmtune.train.data.templates import render

    turns, earlier = [], ""  # `earlier`: the turns before this one, rendered (the previous turn's `upto`)
    for index, message in enumerate(messages):
        upto = render(template, messages[: index + 1], tokenizer, tools=tools)
        if not full.startswith(upto):
            return None
        end, start = len(upto), len(earlier)
        if message["role"] == "assistant" and index:
            # Skip the assistant header exactly as the model will see it at inference time (as much of it as the
            # turn has: Qwen3's opens an empty thinking block, which a turn with reasoning fills)
            head, opened = _opening(full, _assistant_header(template, messages[:index], tokenizer, tools, earlier),
                                    start)  # fmt: skip
            start = opened + len(head) if opened >= 0 else start
        content = message["content"].strip()
        found = _content_start(template, messages, index, tokenizer, full, content, start, end, tools)
        turns.append((start, found, found + len(content) if found >= 0 else end, end))
        earlier = upto
    return turns


def turns_in_full(template: str, messages: list[dict], tokenizer, full: str, tools, tokens) -> list:
    """Each message's (start, content start or -1, content end, end) in `full` when the template renders an earlier
    turn differently once later turns follow (Qwen3 drops the reasoning of answers before the last question, writes
    an empty thinking block only after it, and splits `<think>` out of a content). Axolotl finds its turns in the
    full rendering too. A content is where the whole conversation, that content replaced by a stand-in, has the
    stand-in; where the template rewrites the turn around it (the last answer's thinking block), the turn starts
    after the assistant header. Either way the content runs to the turn's end token, as the template rendered it."""
    from llmtune.train.data.templates import render

    ids, offsets, markers = tokens
    ends = [(a, b) for (a, b), token in zip(offsets, ids, strict=True) if token in markers and b > a]
    turns, previous = [], 0
    for index, message in enumerate(messages):
        probe = [*messages[:index], {**message, "content": SENTINEL}, *messages[index + 1 :]]
        try:
            rendered = render(template, probe, tokenizer, tools=tools)
        except UserError:
            rendered = ""
        at = rendered.find(SENTINEL)
        rewritten = at < 0 or not full.startswith(rendered[:at]) or at < previous
        if rewritten or message.get("has_thinking") or message.get("tool_calls"):
            head, opened = ("", -1) if message["role"] != "assistant" else _opening(
                full, _assistant_header(template, messages[:index], tokenizer, tools), previous)  # fmt: skip
            if opened < 0 and rewritten:
                raise RowError(f"message {index} ({message['role']}) is not where this chat template renders it in "
                               "the whole conversation, so its labels can't be placed")  # fmt: skip
            start = opened + len(head) if opened >= 0 else at
            at = at if not rewritten and not message.get("has_thinking") else start
        else:
            start = at
        marker = next(((a, b) for a, b in ends if a >= at), (len(full), len(full)))
        # the content as rendered, up to the turn's end token, where the template changed it or wrote reasoning
        whole = rewritten or message.get("has_thinking") or not full.startswith(message["content"].strip(), at)
        content_end = marker[0] if whole else at + len(message["content"].strip())
        turns.append((start, -1 if whole else at, content_end, marker[1]))
        previous = marker[1]
    return turns


def _opening(full: str, head: str, after: int) -> tuple[str, int]:
    """The longest start of the assistant header, cut at a line end, that `full` has after `after`, and where it is
    (Qwen3's generation prompt opens an empty thinking block that a turn with reasoning fills)."""
    cuts = [i + 1 for i, char in enumerate(head) if char == "\n"] + [len(head)]
    for cut in sorted(set(cuts), reverse=True):
        at = full.find(head[:cut], after) if head[:cut] else -1
        if at >= 0:
            return head[:cut], at
    return "", -1


def _assistant_header(template: str, earlier: list[dict], tokenizer, tools, base: str | None = None) -> str:
    """What the template writes to open an assistant turn after `earlier` (its generation prompt), or ''. `base`:
    `earlier` rendered already, where the caller has it."""
    from llmtune.train.data.templates import render

    try:
        base = render(template, earlier, tokenizer, tools=tools) if base is None else base
        prompt = render(template, earlier, tokenizer, add_generation_prompt=True, tools=tools)
    except UserError:
        return ""
    return prompt[len(base) :] if prompt.startswith(base) else ""


SENTINEL = "\u2063llmtune\u2063"  # text no template produces (invisible separators around a word)


def _content_start(template: str, messages: list[dict], index: int, tokenizer, full: str, content: str, start: int,
                   end: int, tools=None) -> int:  # fmt: skip
    """Where message `index`'s content starts in `full`, or -1. An assistant turn's search starts after its header;
    any other turn's header can hold the content's text ("user" in "<|im_start|>user"): there the turn is rendered
    with a stand-in content, whose position is the content's (Axolotl compares with a dummy render the same way)."""
    from llmtune.train.data.templates import render

    if not content:
        return -1
    if messages[index]["role"] != "assistant" or not index:
        probe = [*messages[:index], {**messages[index], "content": SENTINEL}]
        try:
            rendered = render(template, probe, tokenizer, tools=tools)
        except UserError:
            rendered = ""
        at = rendered.find(SENTINEL)
        if at >= 0 and full.startswith(rendered[:at]) and full.startswith(content, at):
            return at
    return full.find(content, start, end)
