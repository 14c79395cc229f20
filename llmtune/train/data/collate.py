"""Batch rows into tensors: padding-free (the rows concatenated, FlatCollator), or padded rows with an attention
mask, or packed rows with position_ids and no mask (Collator)."""

from __future__ import annotations

from llmtune.train.data.formats import IGNORE

# Popped by the trainer before the forward pass. Plain Python values, so reading them costs no device sync.
REAL_TOKENS = "num_real_tokens"  # tokens that are not padding
ROW_LENGTHS = "row_lengths"  # the micro-batch's rows, as lengths (padding-free batches: where each row lies)
ROW_BYTES = "row_bytes"  # benchmarks only (LLMTUNE_BATCH_HASHES=1): each row's token ids, hashed by the trainer
# Ulysses: (fingerprint, width) of the whole batch, which DeepSpeed's data adapter copies to every rank that holds a
# chunk of it (the rank check compares batches, not chunks)
WHOLE_BATCH = "whole_batch"


def fingerprint(input_ids) -> str:
    """A short hash of a batch's token ids (the rank check compares the ranks' batches by it)."""
    import hashlib

    return hashlib.sha256(input_ids.cpu().numpy().tobytes()).hexdigest()[:16]


def row_bytes(rows: list[dict]) -> bytes | None:
    """The rows' token ids as int64 bytes, each followed by b"|", when benchmarks compare batches (on the host: the
    hash never reads the GPU); None otherwise."""
    import os

    if os.environ.get("LLMTUNE_BATCH_HASHES") != "1":
        return None
    import numpy as np

    return b"".join(np.asarray(r["input_ids"], dtype=np.int64).tobytes() + b"|" for r in rows)


class Collator:
    """Packed rows (they carry position_ids) batch without a mask; other rows pad with attention_mask."""

    def __init__(self, pad_token_id: int, pad_to: int | None = None, multiple_of: int = 1, mask: bool = True,
                 positions: bool = False):  # fmt: skip
        self.pad_token_id = pad_token_id
        self.pad_to = pad_to
        # context parallelism: rows split into 2 x cp chunks (load-balanced ring attention) or cp chunks (Ulysses),
        # and no padding mask: padding sits at the end, so under causal attention no real token sees it (its labels
        # are ignored)
        self.multiple_of = multiple_of
        self.mask = mask
        # Ulysses: every row carries position_ids (DeepSpeed's data adapter requires them; the attention reads each
        # row's examples and padding from them), unpacked rows as one example
        self.positions = positions

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        packed = "position_ids" in rows[0] or self.positions
        width = max(len(r["input_ids"]) for r in rows)
        if self.pad_to:
            width = max(width, self.pad_to)
        width = -(-width // self.multiple_of) * self.multiple_of
        ids, labels, extra = [], [], []
        for row in rows:
            pad = width - len(row["input_ids"])
            ids.append(row["input_ids"] + [self.pad_token_id] * pad)
            labels.append(row["labels"] + [IGNORE] * pad)
            if packed:
                # Padding becomes its own "example" (positions restart), so real tokens never attend to it.
                extra.append(list(row.get("position_ids") or range(len(row["input_ids"]))) + list(range(pad)))
            else:
                extra.append([1] * len(row["input_ids"]) + [0] * pad)
        batch = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if self.positions:
            batch[WHOLE_BATCH] = (fingerprint(batch["input_ids"]), width)
        if packed or self.mask:
            batch["position_ids" if packed else "attention_mask"] = torch.tensor(extra)
        batch[REAL_TOKENS] = sum(len(r["input_ids"]) for r in rows)
        if (hashed := row_bytes(rows)) is not None:
            batch[ROW_BYTES] = hashed
        return batch


class FlatCollator:
    """A padding-free micro-batch: its rows concatenated into one sequence of shape (1, tokens).

    Positions restart at every row, and at every example of a packed row (its own position_ids). The boundaries
    go to the attention kernel as cu_seq_lens (int32) with the longest segment as a Python int, all computed here
    on the host. The first label of every row is ignored: in a padded batch no token predicts it, and here the
    previous row's last token would. `pad_to_rows`: pad to rows x sequence_len tokens (fixed shapes for
    torch.compile) with one extra segment of pad tokens that no real token attends to.
    """

    def __init__(self, pad_token_id: int, sequence_len: int | None = None):
        self.pad_token_id = pad_token_id
        self.sequence_len = sequence_len  # pad_to_sequence_len: the per-row length padded to

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        ids, labels, positions, lengths = [], [], [], []
        for row in rows:
            n = len(row["input_ids"])
            ids += row["input_ids"]
            labels += [IGNORE] + list(row["labels"][1:])
            positions += list(row["position_ids"]) if "position_ids" in row else list(range(n))
            lengths.append(n)
        real = len(ids)
        pad = self.sequence_len * len(rows) - real if self.sequence_len else 0
        if pad > 0:
            ids += [self.pad_token_id] * pad
            labels += [IGNORE] * pad
            positions += list(range(pad))
        starts = [i for i, p in enumerate(positions) if i == 0 or p != positions[i - 1] + 1]
        bounds = [*starts, len(positions)]
        longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        cu_seq_lens = torch.tensor(bounds, dtype=torch.int32)
        batch = {
            "input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]),
            "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest, "max_length_k": longest,
            REAL_TOKENS: real, ROW_LENGTHS: lengths,
        }  # fmt: skip
        if (hashed := row_bytes(rows)) is not None:
            batch[ROW_BYTES] = hashed
        return batch
