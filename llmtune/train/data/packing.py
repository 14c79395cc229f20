"""Sample packing: several examples per `sequence_len` row, with no attention between them.

Each example keeps its own position ids (restarting at 0); transformers reads the restarts and
builds a block-diagonal mask when no attention_mask is given (and no KV cache exists, so the
worker trains with use_cache=False). The first label of every example after the first is -100,
so no token is predicted from the previous example's last token.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from llmtune.train.data.rows import PackedRows, lengths_of


def pack_indices(lengths: list[int], capacity: int, seed: int) -> list[list[int]]:
    """Best-fit-decreasing bins of example indices (each bin's total <= capacity), shuffled by seed.

    O(n log n): open bins are kept sorted by free space, and each example goes to the tightest one.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin number), sorted
    for index in order:
        size = lengths[index]
        slot = bisect.bisect_left(free, (size, -1))
        if slot < len(free):
            room, number = free.pop(slot)
            bins[number].append(index)
        else:
            room, number = capacity, len(bins)
            bins.append([index])
        if room - size > 0:
            bisect.insort(free, (room - size, number))
    random.Random(seed).shuffle(bins)
    return bins


def pack_examples(examples: Sequence, capacity: int, seed: int) -> tuple[PackedRows, float]:
    """Packed rows (input_ids, labels, position_ids; built when read) and the packing efficiency (real tokens / slots)."""
    lengths = lengths_of(examples)
    rows = PackedRows(examples, pack_indices(lengths, capacity, seed))
    efficiency = sum(lengths) / (len(rows) * capacity) if len(rows) else 0.0
    return rows, efficiency
