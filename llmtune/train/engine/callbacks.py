"""The callbacks llmtune adds to the Trainer: progress lines, per-step statistics, a stop on request or on a
non-finite loss, Axolotl's loss watchdog, and the test hooks that kill or pause a rank at a known step."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from transformers import Trainer, TrainerCallback

from llmtune.errors import UserError
from llmtune.train.checkpoint import folders as checkpoints
from llmtune.train.runtime import collectives
from llmtune.train.runtime.hooks import test_kill as _test_kill

NONFINITE_HINT = ("lower learning_rate or add warmup, look for broken rows in the data, and prefer bf16 over fp16 "
                  "(fp16 overflows); the last complete checkpoint is untouched")  # fmt: skip


class NonFiniteLoss(UserError):
    pass


class StopOnNonFiniteLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            raise NonFiniteLoss(f"training loss became {loss} at step {state.global_step}", NONFINITE_HINT)


class StepStats(TrainerCallback):
    """Per optimizer step on this rank: wall seconds, real and padded tokens; and when the first step ended.

    A step's seconds run from the end of the step before (the start of training for the first), so fetching and
    collating its batch are counted, as a user's clock counts them. With LLMTUNE_BATCH_HASHES=1 (benchmarks) each
    step also records a hash of its input_ids, to prove two runs trained on the same batches.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.seconds: list[float] = []
        self.real: list[int] = []
        self.padded: list[int] = []
        self.hashes: list[str] = []
        self.first_step_end_unix: float | None = None
        self._last_end = 0.0
        self._tokens = (0, 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_end = time.perf_counter()
        if os.environ.get("LLMTUNE_BATCH_HASHES") == "1":
            import hashlib

            self.trainer.batch_hash = hashlib.sha256()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(round(now - self._last_end, 6))
        self._last_end = now
        self.real.append(self.trainer.tokens_seen - self._tokens[0])
        self.padded.append(self.trainer.padded_seen - self._tokens[1])
        self._tokens = (self.trainer.tokens_seen, self.trainer.padded_seen)
        if self.trainer.batch_hash is not None:
            import hashlib

            self.hashes.append(self.trainer.batch_hash.hexdigest()[:16])
            self.trainer.batch_hash = hashlib.sha256()
        self.first_step_end_unix = self.first_step_end_unix or time.time()

    WARMUP_STEPS = 2  # the first steps compile kernels, fill the allocator's cache and (DeepSpeed) build buffers

    def steady(self) -> tuple[int, float]:
        """Real tokens and seconds of this rank's steps after the warm-up (none if the run was that short)."""
        return sum(self.real[self.WARMUP_STEPS :]), sum(self.seconds[self.WARMUP_STEPS :])


class ProgressLines(TrainerCallback):
    """Rank 0's progress at each logging step, in place of the Trainer's dict lines and bar: step/total, loss and
    learning rate as numbers, tokens/s (rank 0's real tokens x the data-parallel degree) and the ETA; eval results
    as one line. The launcher turns the step lines into a live bar on a terminal."""

    def __init__(self, trainer: Trainer, data_parallel_size: int) -> None:
        self.trainer, self.data_parallel_size = trainer, data_parallel_size
        self._start = (0.0, 0, 0)  # (clock, step, tokens) when this run's training began (a resume starts mid-way)

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = (time.perf_counter(), state.global_step, self.trainer.tokens_seen)

    def on_log(self, args, state, control, logs=None, **kwargs):
        from llmtune.train.runtime.progress import log, step_line

        logs = logs or {}
        if not state.is_world_process_zero:
            return
        if "loss" in logs:
            began, first_step, first_tokens = self._start
            elapsed, done = time.perf_counter() - began, state.global_step - first_step
            speed = (self.trainer.tokens_seen - first_tokens) * self.data_parallel_size / elapsed if elapsed else None
            eta = elapsed / done * (state.max_steps - state.global_step) if done else None
            log(step_line(state.global_step, state.max_steps, logs["loss"], logs.get("learning_rate", 0.0),
                          logs.get("grad_norm"), speed, eta).removeprefix("[llmtune] "))  # fmt: skip
        evals = {k: v for k, v in logs.items() if k.startswith("eval_") and isinstance(v, (int, float))}
        if "eval_loss" in evals:
            shown = "  ".join(f"{k.removeprefix('eval_')} {v:.4f}" for k, v in evals.items()
                              if not k.endswith(("_runtime", "_per_second", "_tokens")))  # fmt: skip
            log(f"eval at step {state.global_step}: {shown}")


class StopOnRequest(TrainerCallback):
    """Save a checkpoint at the end of the current step and stop, when asked: `kill -USR1` to `llmtune train`, or
    the sbatch script on Slurm's warning before the time limit, leaves <config_dir>/stop-requested. Each machine's
    first rank looks for it after every step; one all-reduce of a host flag (over gloo, never waiting for the GPU)
    makes every rank stop after the same step."""

    def __init__(self, config_dir: str) -> None:
        self.config_dir = config_dir
        self.stopped_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        asked = collectives.any_rank_on_host(checkpoints.stop_requested(self.config_dir))
        if asked and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step


class TestKillAfterSave(TrainerCallback):
    """Tests only: LLMTUNE_TEST_EXIT_AFTER_STEP=k kills one rank right after checkpoint k is complete."""

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(float(os.environ.get("LLMTUNE_TEST_STEP_SLEEP", 0)))  # slow steps: time to signal a run mid-way

    def on_save(self, args, state, control, **kwargs):
        _test_kill("LLMTUNE_TEST_EXIT_AFTER_STEP", state.global_step)
        # LLMTUNE_TEST_PAUSE_AFTER_STEP=k: this rank says so in LLMTUNE_TEST_PAUSE_FILE and stops moving, so a
        # test can kill its whole machine at a known point (a node lost mid-run)
        if os.environ.get("LLMTUNE_TEST_PAUSE_AFTER_STEP") == str(state.global_step):
            Path(os.environ["LLMTUNE_TEST_PAUSE_FILE"]).touch()
            time.sleep(3600)


class LossWatchdog(TrainerCallback):
    """loss_watchdog_threshold / loss_watchdog_patience, as Axolotl reads them: each logged training loss above the
    threshold is one more strike (one at or below it clears them); at `patience` strikes in a row training stops
    after that step, and the run ends as any stopped run does (final model saved). A no-op without a threshold.

    The logged loss is the same on every rank (the Trainer reduces it), so every rank stops after the same step."""

    def __init__(self, threshold: float | None, patience: int = 3) -> None:
        self.threshold, self.patience = threshold, patience or 3
        self.strikes = 0
        self.stopped_at: int | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if self.threshold is None or loss is None:
            return control
        self.strikes = self.strikes + 1 if loss > self.threshold else 0
        if self.strikes >= self.patience and self.stopped_at is None:
            from llmtune.train.runtime.progress import log

            log(f"loss_watchdog: loss {loss:.4f} above {self.threshold} for {self.strikes} logged steps in a row; "
                f"stopping after step {state.global_step}")  # fmt: skip
            self.stopped_at = state.global_step
            control.should_training_stop = True
        return control


class HostSyncWatch(TrainerCallback):
    """Tests only (LLMTUNE_TEST_SYNC_DEBUG=1, on CUDA): torch's sync debug mode over whole steps after the warm-up,
    from one step's beginning to the next's (the step, its callbacks and the next batch's loading), so a GPU test can
    prove no host sync happens inside a step. `syncs`: where each synchronizing call was made, and how often."""

    def __init__(self, first_step: int = 3) -> None:
        self.first_step = first_step
        self.syncs: dict[str, int] = {}
        self.steps_watched = 0
        self._catcher = None

    def _close(self) -> None:
        import torch

        if self._catcher is None:
            return
        torch.cuda.set_sync_debug_mode(0)
        for warning in self._records:
            if "synchroniz" in str(warning.message):
                where = f"{warning.filename}:{warning.lineno}"
                self.syncs[where] = self.syncs.get(where, 0) + 1
        self._catcher.__exit__(None, None, None)
        self._catcher = None
        self.steps_watched += 1

    def on_step_begin(self, args, state, control, **kwargs):
        import warnings

        import torch

        self._close()
        if not torch.cuda.is_available() or state.global_step + 1 < self.first_step:
            return
        self._catcher = warnings.catch_warnings(record=True)
        self._records = self._catcher.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, args, state, control, **kwargs):
        import torch

        if self._catcher is not None:  # the last step's window is cut at the end of training, unwatched
            torch.cuda.set_sync_debug_mode(0)
            self._catcher.__exit__(None, None, None)
            self._catcher = None


class UlyssesResume(TrainerCallback):
    """A resume under DeepSpeed's Ulysses, whose data adapter the Trainer can't fast-forward: accelerate's
    skip_first_batches rebuilds a plain DataLoader from the loader it is given, and the adapter has no dataset
    (AttributeError at the first resumed step, measured). The worker turns the Trainer's skip off (ignore_data_skip)
    and this does it instead, before the first step: the adapter's loader is set to the checkpoint's epoch (its
    shuffle), the micro-batches that epoch already trained are drawn and dropped (read and split, not computed),
    and the RNG state is restored as the Trainer does after its own skip."""

    def __init__(self, trainer, checkpoint: str):
        self.trainer, self.checkpoint = trainer, checkpoint

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        if not state.global_step or train_dataloader is None:
            return
        accumulation = args.gradient_accumulation_steps
        length = len(train_dataloader)  # micro-batches per epoch: the adapter yields each batch's chunks in turn
        per_epoch = max(length // accumulation + int(length % accumulation > 0), 1)
        epoch, done = divmod(state.global_step, per_epoch)
        train_dataloader.dl.set_epoch(epoch)
        train_dataloader.iter = iter(train_dataloader.dl)  # the adapter opened epoch 0's iterator when it was built
        for _ in range(done * accumulation):
            next(train_dataloader)
        self.trainer._load_rng_state(self.checkpoint)


def early_stopping(recipe, has_eval: bool) -> list:
    """transformers' EarlyStoppingCallback for early_stopping_patience (with eval data; the plan notes it has no
    effect without), saying on rank 0 when it stops the run."""
    if not (recipe.early_stopping_patience and has_eval):
        return []
    from transformers import EarlyStoppingCallback

    class EarlyStop(EarlyStoppingCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            super().on_evaluate(args, state, control, metrics=metrics, **kwargs)
            # said when this callback ends the run: the Trainer also sets should_training_stop at the last step
            stopped = self.early_stopping_patience_counter >= self.early_stopping_patience
            if stopped and state.global_step < state.max_steps and state.is_world_process_zero:
                from llmtune.train.runtime.progress import log

                metric = (args.metric_for_best_model or "eval_loss").replace("_", " ")
                times = f"{self.early_stopping_patience} evaluation{'s' if self.early_stopping_patience > 1 else ''}"
                best = "" if state.best_metric is None else \
                    f" (best {state.best_metric:.4f} at step {state.best_global_step})"  # fmt: skip
                log(f"early stopping at step {state.global_step} of {state.max_steps}: {metric} has not improved "
                    f"for {times}{best}; the best checkpoint's weights are saved")  # fmt: skip

    return [EarlyStop(early_stopping_patience=recipe.early_stopping_patience)]


def final_evaluation(trainer) -> dict:
    """The eval metrics of the saved weights: those logged at the step they are from when an evaluation ran there
    (the same weights and data; evaluating again would cost the time and print the line twice), else a new one.
    With load_best_model_at_end the saved weights are the best checkpoint's: its step's logged evaluation, with
    best_step added when that is not the last step."""
    import re

    step = trainer.state.global_step
    best = trainer.state.best_model_checkpoint if trainer.args.load_best_model_at_end else None
    if trainer.args.load_best_model_at_end:
        found = re.search(r"checkpoint-(\d+)$", str(best or "").rstrip("/"))
        step = int(found.group(1)) if found else None
    for entry in reversed(trainer.state.log_history):
        if "eval_loss" in entry and step is not None and entry.get("step") == step:
            metrics = {k: v for k, v in entry.items() if k.startswith("eval_") or k == "epoch"}
            if step != trainer.state.global_step:
                metrics["best_step"] = step
            return metrics
    return trainer.evaluate()
