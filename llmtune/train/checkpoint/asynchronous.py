"""`async_checkpoint: true` in the Trainer: a checkpoint's model and optimizer states go to DCP's background writer
(llmtune/train/checkpoint/dcp.py) instead of the Trainer's synchronous save, and the checkpoint is published (marker
written, renamed into place, old ones rotated) only once every rank's write has finished.

The Trainer's own `_save_checkpoint` still runs and writes the small files (trainer state, scheduler, RNG states);
`save_model` is skipped for checkpoints (no full-weights gather: the states are in DCP's shards), and
`_save_optimizer_and_scheduler` hands the states to the writer. `Publisher` checks after every step whether the write
is done everywhere, and at the end of training waits for it.
"""

from __future__ import annotations

import time
from pathlib import Path

from transformers import TrainerCallback

from llmtune.train.checkpoint import dcp as dcp_checkpoint
from llmtune.train.checkpoint.manager import CheckpointManager


class AsyncCheckpointing:
    """Mixed into llmtune's trainer before transformers' Trainer; the checkpoint manager holds the writer and the
    checkpoint being written."""

    _checkpoints: CheckpointManager | None = None

    @property
    def checkpoints(self) -> CheckpointManager:
        """The run's checkpoint manager (the worker gives it; a trainer built without one makes its own)."""
        if self._checkpoints is None:
            self._checkpoints = CheckpointManager(self.args.output_dir, getattr(self, "plan", None),
                                                  getattr(self, "recipe", None))  # fmt: skip
        return self._checkpoints

    @checkpoints.setter
    def checkpoints(self, manager: CheckpointManager) -> None:
        self._checkpoints = manager

    @property
    def async_saver(self) -> dcp_checkpoint.AsyncSaver | None:
        return self.checkpoints.saver

    def enable_async_checkpoints(self, on_cuda: bool) -> None:
        self.checkpoints.saver = dcp_checkpoint.AsyncSaver(on_cuda)
        self.add_callback(Publisher(self))

    def save_model(self, output_dir=None, _internal_call: bool = False):
        if self.async_saver is not None and _internal_call and getattr(self, "_staging", False):
            return None  # a checkpoint's weights travel with the optimizer's states in DCP's shards
        return super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.async_saver is None or not getattr(self, "_staging", False):
            return super()._save_optimizer_and_scheduler(output_dir)
        self.start_async_write(Path(output_dir), trainable_only=True)
        return None

    def start_async_write(self, folder: Path, trainable_only: bool) -> None:
        """Stage this rank's model and optimizer states and hand them to the writer; the scheduler written here."""
        import torch

        folder.mkdir(parents=True, exist_ok=True)
        state = dcp_checkpoint.states(self.model, self.optimizer, trainable_only=trainable_only)
        self.async_saver.start(state, folder / dcp_checkpoint.STATE)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), folder / "scheduler.pt")

    def wait_for_previous_write(self) -> float:
        """Before the next checkpoint: the previous one's write finished and published (the wait logged)."""
        deferred = self.checkpoints.deferred
        if deferred is None:
            return 0.0
        waited = self.async_saver.wait()
        if waited > 0.05 and self.accelerator.is_main_process:
            from llmtune.train.runtime.progress import log

            log(f"checkpoint-{self.state.global_step}: waited {waited:.1f} s for checkpoint-{deferred[2]['step']}'s "
                "write to finish (saves never overlap)")  # fmt: skip
        self.publish_written(force=True)
        return waited

    def publish_written(self, force: bool = False) -> None:
        """Publish the deferred checkpoint if every rank has written it (`force`: every rank waited already)."""
        best = self.checkpoints.publish_deferred(force, self.state.best_model_checkpoint)
        self.state.best_model_checkpoint = best


class Publisher(TrainerCallback):
    """After every step: publish a checkpoint whose write finished on every rank. At the end: wait for the last."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.publish_written()

    def on_train_end(self, args, state, control, **kwargs):
        if self.trainer.checkpoints.deferred is not None:
            began = time.perf_counter()
            self.trainer.async_saver.wait()
            self.trainer.publish_written(force=True)
            if self.trainer.accelerator.is_main_process:
                from llmtune.train.runtime.progress import log

                log(f"the last checkpoint's write finished {time.perf_counter() - began:.1f} s after training")
        self.trainer.async_saver.close()
