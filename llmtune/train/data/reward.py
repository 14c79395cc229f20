"""Reward-model training: its two data formats, the pair batches and the Bradley-Terry loss.

reward_model (bradley_terry.chat_template): one score per sequence from a sequence-classification head, trained so
the chosen reply scores above the rejected one: loss = -log sigmoid(r_chosen - r_rejected), averaged over pairs.
A pair is stored as one row, so the cache, the eval split, shuffling and sharding across ranks treat it like any
other: the chosen conversation's ids, then the rejected one's; every label is -100 but each side's last token:
CHOSEN ends the chosen side, REJECTED the rejected side. The collator cuts rows back into one batch of 2B
sequences, the B chosen first, with labels 1 (chosen) and 0 (rejected).

process_reward_model (stepwise_supervised): a token-classification head labels each reasoning step. The row is
[BOS] prompt step_1 sep step_2 sep ...; the last token of each step's separator carries the step's label (0/1),
every other token -100. The model's own token-classification cross-entropy trains it; the batches are ordinary.
"""

from __future__ import annotations

from llmtune.train.data.formats import IGNORE, Example, FormatContext, RowError, _field, _messages

CHOSEN, REJECTED = 1, 0


def _side(row: dict, ctx: FormatContext, side: str) -> list[dict]:
    """One side's whole conversation: a list of messages, or Axolotl's strings (system, input, chosen/rejected)."""
    value = row.get(side)
    if isinstance(value, list):  # a whole conversation per side, with an optional shared prompt before it
        prompt = row.get("prompt")
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        messages = _messages({"m": [*(prompt or []), *value]}, ctx.spec.model_copy(update={"field_messages": "m"}))
    else:
        reply = _field(row, side)
        question = row.get("input") if row.get("input") is not None else row.get("prompt")
        if not isinstance(question, str):
            raise RowError(f"missing field 'input' (the prompt) (row has: {', '.join(map(str, row))})")
        system = row.get("system")
        messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system
                    and not ctx.spec.drop_system_message else [])  # fmt: skip
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
    if messages[-1]["role"] != "assistant":
        raise RowError(f"'{side}' must end with the assistant's reply")
    return messages


def bradley_terry(row: dict, ctx: FormatContext) -> list[Example]:
    """A preference pair as one stored row (see the module's docstring)."""
    from llmtune.train.data.templates import render

    ids: list[int] = []
    labels: list[int] = []
    for side, mark in (("chosen", CHOSEN), ("rejected", REJECTED)):
        text = render(ctx.template, _side(row, ctx, side), ctx.tokenizer)
        side_ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not side_ids:
            raise RowError(f"'{side}' renders to no tokens")
        ids += side_ids
        labels += [IGNORE] * (len(side_ids) - 1) + [mark]
    return [(ids, labels)]


def split_pair(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """The chosen and the rejected ids of a stored pair."""
    end = labels.index(CHOSEN) + 1
    return ids[:end], ids[end:]


def fit_pair(ids: list[int], labels: list[int], limit: int, truncate: bool) -> tuple[list, list] | None:
    """A pair whose sides fit sequence_len: unchanged, each side cut to `limit` (truncate), or None (drop)."""
    chosen, rejected = split_pair(ids, labels)
    if max(len(chosen), len(rejected)) <= limit:
        return ids, labels
    if not truncate:
        return None
    chosen, rejected = chosen[:limit], rejected[:limit]
    marks = [IGNORE] * (len(chosen) - 1) + [CHOSEN] + [IGNORE] * (len(rejected) - 1) + [REJECTED]
    return chosen + rejected, marks


def stepwise_supervised(row: dict, ctx: FormatContext) -> list[Example]:
    spec, tokenizer = ctx.spec, ctx.tokenizer
    prompt = _field(row, "prompt")
    steps, verdicts = _field(row, "completions", list), _field(row, "labels", list)
    if len(steps) != len(verdicts) or not steps:
        raise RowError(f"'completions' has {len(steps)} steps and 'labels' {len(verdicts)}; one label per step")
    if not all(isinstance(s, str) for s in steps) or not all(isinstance(v, (bool, int)) for v in verdicts):
        raise RowError("'completions' must be strings and 'labels' true/false")
    if any(int(v) < 0 or int(v) >= ctx.num_labels for v in verdicts):
        raise RowError(f"'labels' must lie in 0..{ctx.num_labels - 1} (the head's num_labels), not {verdicts}")
    separator = tokenizer(spec.step_separator, add_special_tokens=False)["input_ids"]
    completion: list[int] = []
    marks: list[int] = []
    for index, (step, verdict) in enumerate(zip(steps, verdicts, strict=True)):
        piece = tokenizer(step, add_special_tokens=False)["input_ids"] + separator
        if not piece:
            continue
        last = index == len(steps) - 1
        mark = int(verdict) if (last or not spec.train_on_last_step_only) else IGNORE
        completion += piece
        marks += [IGNORE] * (len(piece) - 1) + [mark]
    if spec.max_completion_length:
        completion, marks = completion[: spec.max_completion_length], marks[: spec.max_completion_length]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    head = bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return [(head + completion, [IGNORE] * len(head) + marks)]


REWARD_FORMATS = {"bradley_terry.chat_template": bradley_terry, "stepwise_supervised": stepwise_supervised}


def converter(spec):
    """The function that turns one raw row of this dataset into examples: a reward format, or formats.py's."""
    from llmtune.train.data.formats import format_for

    return REWARD_FORMATS.get(spec.type) if isinstance(spec.type, str) and spec.type in REWARD_FORMATS else (
        format_for(spec))  # fmt: skip


class PairCollator:
    """Stored pairs -> one batch of 2B sequences (the B chosen first), right-padded, labels 1/0 per sequence."""

    def __init__(self, pad_token_id: int, pad_to: int | None = None):
        self.pad_token_id, self.pad_to = pad_token_id, pad_to

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        pairs = [split_pair(row["input_ids"], row["labels"]) for row in rows]
        sequences = [chosen for chosen, _ in pairs] + [rejected for _, rejected in pairs]
        width = max(max(len(s) for s in sequences), self.pad_to or 0)
        ids = [s + [self.pad_token_id] * (width - len(s)) for s in sequences]
        mask = [[1] * len(s) + [0] * (width - len(s)) for s in sequences]
        return {
            "input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask),
            "labels": torch.tensor([CHOSEN] * len(rows) + [REJECTED] * len(rows)),
            "num_real_tokens": torch.tensor(sum(len(s) for s in sequences)),  # collate.REAL_TOKENS
        }  # fmt: skip


def pairwise_loss(center_rewards_coefficient: float | None):
    """The Trainer's compute_loss_func for reward_model: Bradley-Terry over the pairs of a batch.

    The Trainer counts the non-ignored labels of the whole accumulated batch on every rank (num_items_in_batch):
    two per pair. Dividing the summed pair losses by the pairs counted makes gradient accumulation and data
    parallelism average over pairs, as one big batch would."""

    def loss(outputs, labels, num_items_in_batch=None):
        import torch.nn.functional as F

        rewards = outputs.logits.squeeze(-1).float()
        chosen, rejected = rewards[labels == CHOSEN], rewards[labels == REJECTED]
        total = -F.logsigmoid(chosen - rejected).sum()
        if center_rewards_coefficient:
            total = total + center_rewards_coefficient * ((chosen + rejected) ** 2).sum()
        pairs = num_items_in_batch / 2 if num_items_in_batch is not None else chosen.numel()
        return total / pairs

    return loss


def pair_margins(logits, labels):
    """r_chosen - r_rejected of each pair of a batch (eval returns these: one value per pair, so the Trainer's
    gathering, which trims the last batch to the dataset's length in pairs, keeps whole pairs)."""
    rewards = logits.squeeze(-1).float()
    return rewards[labels == CHOSEN] - rewards[labels == REJECTED]


def reward_metrics(prediction):
    """Eval metrics: reward_model: accuracy (chosen scored above rejected) and the mean margin, from the margins of
    every pair; process_reward_model: accuracy of the step labels."""
    import numpy as np

    logits, labels = prediction.predictions, prediction.label_ids
    if labels.ndim == 1:  # one margin per pair
        margin = np.asarray(logits).reshape(-1)
        return {"accuracy": float((margin > 0).mean()), "margin": float(margin.mean())}
    kept = labels != IGNORE
    return {"accuracy": float((np.argmax(logits, axis=-1)[kept] == labels[kept]).mean())}
