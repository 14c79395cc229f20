"""Batch rows into tensors: padded with attention_mask, or packed with position_ids and no mask."""

from __future__ import annotations

from llmtune.train.data.formats import IGNORE

REAL_TOKENS = "num_real_tokens"  # popped by the trainer before the forward pass


class Collator:
    """Packed rows (they carry position_ids) batch without a mask; other rows pad with attention_mask."""

    def __init__(self, pad_token_id: int, pad_to: int | None = None, multiple_of: int = 1, mask: bool = True):
        self.pad_token_id = pad_token_id
        self.pad_to = pad_to
        # context parallelism: rows split into 2 x cp chunks (load-balanced ring attention), and no padding mask:
        # padding sits at the end, so under causal attention no real token sees it (its labels are ignored)
        self.multiple_of = multiple_of
        self.mask = mask

    def __call__(self, rows: list[dict]) -> dict:
        import torch

        packed = "position_ids" in rows[0]
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
                extra.append(row["position_ids"] + list(range(pad)))
            else:
                extra.append([1] * len(row["input_ids"]) + [0] * pad)
        batch = {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels)}
        if packed or self.mask:
            batch["position_ids" if packed else "attention_mask"] = torch.tensor(extra)
        batch[REAL_TOKENS] = torch.tensor(sum(len(r["input_ids"]) for r in rows))
        return batch
