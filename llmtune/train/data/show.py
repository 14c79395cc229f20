"""What the model is trained on: tokenized examples shown as their spans of trained and masked tokens
(`llmtune preprocess --debug`, as Axolotl's `preprocess --debug` shows labels), from the same cache a run reads."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from itertools import islice

from llmtune.train.data.formats import IGNORE

GREEN, RED, RESET = "\033[32m", "\033[31m", "\033[0m"


def spans(ids: Sequence[int], labels: Sequence[int]) -> list[tuple[bool, list[int]]]:
    """Runs of consecutive tokens that are all trained (label set) or all masked, in order."""
    found: list[tuple[bool, list[int]]] = []
    for token, label in zip(ids, labels, strict=True):
        trained = label != IGNORE
        if found and found[-1][0] == trained:
            found[-1][1].append(int(token))
        else:
            found.append((trained, [int(token)]))
    return found


def show_examples(rows, tokenizer, count: int, text_only: bool = False, color: bool = False,
                  group: str = "train", classes: Mapping[int, str] | None = None) -> Iterator[str]:  # fmt: skip
    """Lines showing the first `count` examples: a header (tokens, trained), then each span marked + (trained) or
    - (masked), its token count unless text_only, and its text as a JSON string (newlines and spaces visible).

    `classes`: a reward model's or process reward model's labels are classes read at a position, not tokens to
    predict: each such position says its class instead."""
    for position in range(min(count, len(rows))):
        row = rows[position]
        runs = spans(row["input_ids"], row["labels"])
        trained = sum(len(tokens) for on, tokens in runs if on)
        what = "scored positions" if classes is not None else "trained"
        yield f"{group} example {position + 1} of {len(rows)}: {len(row['input_ids'])} tokens, {trained} {what}"
        labels = iter(label for label in row["labels"] if label != IGNORE)
        for on, tokens in runs:
            text = json.dumps(tokenizer.decode(tokens, skip_special_tokens=False), ensure_ascii=False)
            sign = "+" if on else "-"
            line = f"  {sign} {text}" if text_only else f"  {sign} {len(tokens):>4} {text}"
            if on and classes is not None:
                marks = [classes.get(int(label), f"label {label}") for label in islice(labels, len(tokens))]
                line += f"  <- {', '.join(marks)}"
            yield f"{GREEN if on else RED}{line}{RESET}" if color else line


def label_classes(recipe) -> Mapping[int, str] | None:
    """What a reward model's labels mean where they are set (None: labels are the tokens to predict)."""
    if recipe.reward_model:
        return {1: "score of the chosen reply", 0: "score of the rejected reply"}
    if recipe.process_reward_model:
        return {value: f"step label {value}" for value in range(recipe.num_labels or 2)}
    return None
