"""Tokenized examples held as flat arrays; a row becomes Python lists only when it is read.

The cache stores each group as three arrays (token ids, labels, row offsets). Loading them is a
memory map, so a cache hit costs milliseconds whatever the dataset's size, and ranks on one
machine share the pages. Shuffling, splitting and packing reorder row numbers, not tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llmtune.train.data.formats import IGNORE


class TokenRows(Sequence):
    """Examples {'input_ids', 'labels'} backed by flat arrays, viewed through an index of row numbers."""

    def __init__(self, ids: np.ndarray, labels: np.ndarray, offsets: np.ndarray, index: np.ndarray | None = None):
        self.ids, self.labels, self.offsets = ids, labels, offsets
        self.index = np.arange(len(offsets) - 1) if index is None else index

    @classmethod
    def from_examples(cls, examples: list[dict]) -> TokenRows:
        offsets = np.zeros(len(examples) + 1, dtype=np.int64)
        np.cumsum([len(e["input_ids"]) for e in examples], out=offsets[1:])
        total = int(offsets[-1])
        ids, labels = (np.fromiter((t for e in examples for t in e[key]), dtype=np.int32, count=total)
                       for key in ("input_ids", "labels"))  # fmt: skip
        return cls(ids, labels, offsets)

    @classmethod
    def load(cls, folder: Path) -> TokenRows:
        return cls(*(np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("input_ids", "labels", "offsets")))

    def save(self, folder: Path) -> None:
        rows = self if len(self.index) == len(self.offsets) - 1 and _is_identity(self.index) else _compact(self)
        folder.mkdir(parents=True)
        for name, array in (("input_ids", rows.ids), ("labels", rows.labels), ("offsets", rows.offsets)):
            np.save(folder / f"{name}.npy", np.asarray(array))

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, position):
        if isinstance(position, slice):
            return TokenRows(self.ids, self.labels, self.offsets, self.index[position])
        row = self.index[position]
        start, end = self.offsets[row], self.offsets[row + 1]
        return {"input_ids": self.ids[start:end].tolist(), "labels": self.labels[start:end].tolist()}

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Sequence)
            and len(self) == len(other)
            and all(a == b for a, b in zip(self, other, strict=True))
        )

    __hash__ = None  # mutable-style equality: not hashable

    def reorder(self, order: list[int]) -> TokenRows:
        return TokenRows(self.ids, self.labels, self.offsets, self.index[np.asarray(order, dtype=np.int64)])

    def lengths(self) -> np.ndarray:
        return (self.offsets[1:] - self.offsets[:-1])[self.index]

    def total_tokens(self) -> int:
        return int(self.lengths().sum())


def _is_identity(index: np.ndarray) -> bool:
    return bool(np.array_equal(index, np.arange(len(index))))


def _compact(rows: TokenRows) -> TokenRows:
    return TokenRows.from_examples(list(rows))


def lengths_of(examples: Sequence) -> list[int]:
    if isinstance(examples, TokenRows):
        return examples.lengths().tolist()
    return [len(e["input_ids"]) for e in examples]


class PackedRows(Sequence):
    """Bins of example numbers, concatenated when read: input_ids, labels and per-example position_ids.

    The first label of every example after the first is IGNORE, so nothing is predicted across a boundary.
    """

    def __init__(self, examples: Sequence, bins: list[list[int]]):
        self.examples, self.bins = examples, bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, position):
        if isinstance(position, slice):
            return PackedRows(self.examples, self.bins[position])
        if isinstance(self.examples, TokenRows):
            return self._from_arrays(self.bins[position])
        ids, labels, positions = [], [], []
        for number, index in enumerate(self.bins[position]):
            example = self.examples[index]
            ids += example["input_ids"]
            labels += (example["labels"][:1] if number == 0 else [IGNORE]) + example["labels"][1:]
            positions += range(len(example["input_ids"]))
        return {"input_ids": ids, "labels": labels, "position_ids": positions}

    def _from_arrays(self, group: list[int]) -> dict:
        rows = self.examples
        numbers = rows.index[group]
        starts, ends = rows.offsets[numbers], rows.offsets[numbers + 1]
        spans = [slice(a, b) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        labels = np.concatenate([rows.labels[span] for span in spans])
        boundaries = np.cumsum(ends - starts)[:-1]
        labels[boundaries] = IGNORE
        positions = np.concatenate([np.arange(span.stop - span.start) for span in spans])
        ids = np.concatenate([rows.ids[span] for span in spans])
        return {"input_ids": ids.tolist(), "labels": labels.tolist(), "position_ids": positions.tolist()}

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, Sequence)
            and len(self) == len(other)
            and all(a == b for a, b in zip(self, other, strict=True))
        )

    __hash__ = None


def even_rows(rows: list, args, plan: dict, tokenizer, own_loss: bool = False) -> list:
    """The eval rows, with label-free one-token rows added to fill the ranks' last batches: accelerate would repeat
    real rows to even them out, counting them twice in the eval loss. `own_loss`: a reward model's pairs (and
    their own metrics) are left as they are."""
    if own_loss:
        return rows
    # every rank's share, whichever ranks split the eval rows (under Ulysses all of them do, though training splits
    # only among data-parallel groups): a multiple of the world's is a multiple of any of them
    per_step = (plan.get("world_size") or 1) * args.per_device_eval_batch_size
    missing = -len(rows) % per_step if (plan.get("world_size") or 1) > 1 else 0
    if not missing:
        return rows
    filler = {"input_ids": [tokenizer.pad_token_id or 0], "labels": [-100]}
    return list(rows) + [dict(filler) for _ in range(missing)]
