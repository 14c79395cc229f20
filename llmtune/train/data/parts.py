"""A message's text beyond one plain string, as Axolotl's chat_template reads it: content parts with per-part
training flags, a message's training detail, and split_thinking.

- Content parts (`[{"type": "text", "text": ...}]`, the text under `text`, `content` or `value`) are joined; a part's
  `train` (or `weight` 0/1) makes the message's training detail, one range per part.
- A training detail (`message_field_training_detail`) is a list of `{begin_offset, end_offset, train}` over the
  message's content, end inclusive (Axolotl's form). The message trains where a range says train and nowhere else
  in that text; formats.chat_template places the ranges in the rendered conversation, and a token that straddles a
  trained and a masked range is masked (as Axolotl documents: split parts before a space, not after).
- split_thinking moves a `<think>...</think>` block (and its two other spellings) out of an assistant's content into
  the reasoning field, and keeps only what `<|begin_of_solution|>...<|end_of_solution|>` wraps where the rest has it.
"""

from __future__ import annotations

from llmtune.train.data.base import RowError

Detail = tuple[int, int, bool]  # characters [begin, end) of the text, and whether they train

THINKING_PAIRS = (("<think>", "</think>"), ("<reasoning>", "</reasoning>"), ("<|begin_of_thought|>",
                  "<|end_of_thought|>"))  # fmt: skip
SOLUTION_PAIR = ("<|begin_of_solution|>", "<|end_of_solution|>")
DETAIL_KEYS = ("begin_offset", "end_offset", "train")


def joined_parts(parts: list, where: str) -> tuple[str, list[Detail] | None]:
    """Content parts as one text, and their training detail where any part carries `train` or `weight` (None
    otherwise: the message trains as a whole). A part without a flag trains, as in Axolotl."""
    texts: list[str] = []
    details: list[Detail] = []
    flagged, offset = False, 0
    for index, part in enumerate(parts):
        if not isinstance(part, dict):
            continue
        text = part.get("text") or part.get("content") or part.get("value") or ""
        if not isinstance(text, str):
            raise RowError(f"{where}[{index}]: a content part's text must be text, not {type(text).__name__}")
        flag, weight = part.get("train"), part.get("weight")
        if flag is not None or weight is not None:
            flagged = True
        train = bool(flag) if flag is not None else weight not in (0, 0.0)
        if text:
            details.append((offset, offset + len(text), train))
            texts.append(text)
            offset += len(text)
    return "".join(texts), details if flagged else None


def training_detail(value, text: str, where: str) -> list[Detail]:
    """A message's training detail field: its ranges over `text`, end offsets made exclusive and kept inside it."""
    if not isinstance(value, list):
        raise RowError(f"{where} must be a list of {{begin_offset, end_offset, train}}, not {type(value).__name__}")
    details = []
    for index, entry in enumerate(value):
        if not isinstance(entry, dict) or any(key not in entry for key in DETAIL_KEYS):
            raise RowError(f"{where}[{index}] must have begin_offset, end_offset and train (it has: "
                           f"{', '.join(map(str, entry)) if isinstance(entry, dict) else type(entry).__name__})")  # fmt: skip
        begin, end = entry["begin_offset"], entry["end_offset"]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (begin, end)):
            raise RowError(f"{where}[{index}]: begin_offset and end_offset must be character offsets (0 or more)")
        details.append((min(begin, len(text)), min(end + 1, len(text)), bool(entry["train"])))
    return details


def split_thinking(content: str) -> tuple[str, str] | None:
    """(reasoning, answer) of an assistant content holding a thinking block, else None."""
    for opening, closing in THINKING_PAIRS:
        begin, end = content.find(opening), content.find(closing)
        if begin < 0 or end < 0:
            continue
        thinking = content[begin + len(opening) : end].strip()
        rest = content[end + len(closing) :].lstrip()
        first, last = rest.find(SOLUTION_PAIR[0]), rest.find(SOLUTION_PAIR[1])
        if first >= 0 and last >= 0:
            rest = rest[first + len(SOLUTION_PAIR[0]) : last].strip()
        return thinking, rest
    return None


def placed(details: list[Detail], text: str, at: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The detail's trained and masked ranges as characters of the rendering, where `text` stripped begins at `at`
    (templates trim a content; what the trim removed is in no range)."""
    lead = len(text) - len(text.lstrip())
    size = len(text.strip())
    trained, masked = [], []
    for begin, end, train in details:
        begin, end = max(begin - lead, 0), min(end - lead, size)
        if end > begin:
            (trained if train else masked).append((at + begin, at + end))
    return trained, masked


def detailed_spans(message: dict, full: str, turn: tuple[int, int, int], masked: list) -> list[tuple[int, int]]:
    """The trained characters of a message with a training detail (its content's, its reasoning's, or both); a
    field without one trains whole, the reasoning with the template's text around it. Masked ranges go to
    `masked`."""
    start, found, content_end = turn
    if found < 0:
        raise RowError(f"a {message['role']} message with a training detail is not where this chat template renders "
                       "its content, so the detail's ranges can't be placed")  # fmt: skip
    content, trained = message["content"], []
    if message.get("training_detail") is not None:
        kept, dropped = placed(message["training_detail"], content, found)
        trained += kept
        masked += dropped
    else:
        trained.append((found, content_end))
    if not message.get("has_thinking"):
        return trained
    if message.get("thinking_detail") is None:
        return [*trained, (start, found)]
    thinking, detail = message["thinking_detail"]
    at = full.find(thinking.strip(), start, found)
    if at < 0:  # the template didn't render it (warned once per template): nothing of it to train
        return trained
    kept, dropped = placed(detail, thinking, at)
    masked += dropped
    return trained + kept


_WARNED_THINKING: set[tuple] = set()


def check_thinking(ctx) -> None:
    """Rows with reasoning under a chat template that doesn't render it train on their answers alone, as under
    Axolotl: said once per dataset and template, on rank 0, instead of silently."""
    import os
    import sys

    from llmtune.train.data.templates import renders_thinking

    key = ctx.spec.template_thinking_key or ctx.spec.field_thinking or "reasoning_content"
    seen = (ctx.spec.path, ctx.template, key)
    if seen in _WARNED_THINKING or renders_thinking(ctx.template, ctx.tokenizer, key):
        return
    _WARNED_THINKING.add(seen)
    if os.environ.get("RANK", "0") == "0":
        used = f"chat_template {ctx.template_name}" if ctx.template_name else "the tokenizer's chat template"
        print(f"[llmtune] warning: {ctx.spec.path}: rows carry reasoning ('{key}') that {used} does not render: "
              "those turns train on their answers alone (a template that writes it: chat_template: qwen3, a "
              "reasoning model's tokenizer_default, or chat_template: jinja)", file=sys.stderr, flush=True)  # fmt: skip
