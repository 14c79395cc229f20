"""The HF Trainer with what llmtune adds: real-token counting, and a stop on a non-finite loss."""

from __future__ import annotations

import math

from transformers import Trainer, TrainerCallback

from llmtune.train.data.collate import REAL_TOKENS


class NonFiniteLoss(RuntimeError):
    pass


class Rows:
    """A list of example dicts as a map-style dataset."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class StopOnNonFiniteLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteLoss(f"training loss became {loss} at step {state.global_step}")


class LlmtuneTrainer(Trainer):
    tokens_seen = 0
    rows_seen = 0
    plan: dict | None = None
    rank_reports: list[dict] | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.rank_reports is None and self.plan is not None:
            from llmtune.train.ranks import check_first_batch

            self.rank_reports = check_first_batch(
                inputs["input_ids"], self.plan, self.accelerator.num_processes, len(self.train_dataset)
            )
        self.tokens_seen += int(inputs.pop(REAL_TOKENS, 0))
        self.rows_seen += int(inputs["input_ids"].shape[0])
        return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(REAL_TOKENS, None)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
