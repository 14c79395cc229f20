"""The HF Trainer with what llmtune adds: real-token counting, atomic checkpoints, a stop on a non-finite loss."""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers import Trainer

from llmtune.plan.relayout import engine_layout, optimizer_of
from llmtune.plan.resume_checks import marker_keys
from llmtune.train.checkpoint.asynchronous import AsyncCheckpointing
from llmtune.train.checkpoint.folders import STAGING
from llmtune.train.data.collate import REAL_TOKENS, ROW_BYTES, ROW_LENGTHS, WHOLE_BATCH
from llmtune.train.engine.callbacks import NONFINITE_HINT, NonFiniteLoss
from llmtune.train.engine.evaluation import TokenEvaluation
from llmtune.train.runtime import collectives


def row_tokens(input_ids, mask, lengths) -> list:
    """Each row of a micro-batch as its real token ids (CPU tensors): padded rows under their attention mask,
    packed rows whole, a padding-free batch cut at its rows' lengths. The same rows give the same list whatever
    the layout."""
    if lengths is not None:
        return list(input_ids.cpu().reshape(-1)[: sum(lengths)].split(lengths))
    return [ids[mask[i].cpu().bool()] if mask is not None else ids for i, ids in enumerate(input_ids.cpu())]


def _log_rows(rows: list, step: int) -> None:
    """Tests only (LLMTUNE_TEST_ROW_LOG=<folder>): each rank appends the step it trains and a hash of each row of its
    micro-batch (its real tokens), so a test can prove no row was trained twice or skipped."""
    import hashlib

    rows = [hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] for ids in rows]
    folder = Path(os.environ["LLMTUNE_TEST_ROW_LOG"])
    with open(folder / f"rank{os.environ.get('RANK', 0)}.jsonl", "a") as log:
        log.write(json.dumps({"step": step, "rows": rows}) + "\n")


class Rows:
    """A list of example dicts as a map-style dataset."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        stall = os.environ.get("LLMTUNE_TEST_STALL_IN_LOADER")  # tests only: "rank:fetch:seconds"
        if stall:
            rank, fetch, seconds = stall.split(":")
            self.fetched = getattr(self, "fetched", 0) + 1
            if int(os.environ.get("RANK", 0)) == int(rank) and self.fetched == int(fetch):
                import sys
                import time

                print(f"test hook: rank {rank} stalls in its data loader for {seconds} s", file=sys.stderr, flush=True)
                time.sleep(float(seconds))
        return self.rows[index]


def _weights_finite(model) -> bool:
    import torch

    from llmtune.train.runtime.memory import local_tensor

    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:  # frozen weights don't change (and 4-bit ones are packed bytes)
                continue
            local = local_tensor(param)
            if local is not None and local.numel() and local.is_floating_point() and not torch.isfinite(local).all():
                return False
    return True


def ulysses_loss(model, inputs: dict, trained_tokens, averaged_over: int, data_parallel: int,
                 return_outputs: bool = False):  # fmt: skip
    """The loss of a micro-batch whose rows DeepSpeed's Ulysses split across the ranks of a sequence-parallel group.

    `trained_tokens`: the trained tokens of the whole step (every micro-batch of the accumulation, every rank's
    chunk, every data-parallel group; LlmtuneTrainer.get_batch_samples counts them). `averaged_over`: what DeepSpeed
    divides the ranks' summed gradients by (ZeRO-1/2: the data-parallel groups; ZeRO-3's reduce-scatter: every
    rank, no sequence-parallel correction). Each rank's forward gives the mean loss over its chunk; its gradient is
    its chunk's token-loss sum over the step's tokens, times `averaged_over`, so the step's gradient is one process's
    token mean over the same rows. The value is the group's sum over the step's tokens times the data-parallel
    groups: averaged over the ranks as the Trainer logs it, the step's loss.

    transformers' own Ulysses loss gathers the losses with a differentiable all-gather, whose backward sums the
    group's copies: under ZeRO-1/2 gradients context_parallel_size times too large (measured in the CPU rehearsal:
    at 2 ranks the reported grad_norm doubles, and with SGD the losses part from one process's at step 2; AdamW
    mostly hides it), and it weighs the micro-batches of an accumulation alike, whatever their tokens."""
    import torch
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    labels = inputs["shift_labels"]  # the adapter's labels, shifted before the rows were split
    outputs = model(**{**inputs, "labels": labels})
    trained = (labels != -100).sum()
    local = torch.where(trained > 0, outputs.loss * trained, outputs.loss.new_zeros(()))  # (a chunk of padding: NaN)
    group = collectives.all_reduce(local.detach().clone(), group=parallel_state_sp.get_sequence_parallel_group())
    tokens = trained_tokens.clamp(min=1)
    gradient = local * averaged_over / tokens
    loss = gradient + (group * data_parallel / tokens - gradient.detach())
    return (loss, outputs) if return_outputs else loss


class LlmtuneTrainer(AsyncCheckpointing, TokenEvaluation, Trainer):
    tokens_seen = 0
    padded_seen = 0
    rows_seen = 0
    plan: dict | None = None
    rank_reports: list[dict] | None = None
    batch_hash = None  # hashlib object while StepStats records batch hashes

    def _get_learning_rate(self):
        """The learning rate of the step just taken. Under DeepSpeed, accelerate's backward runs the engine's step,
        which steps the scheduler before the Trainer reads the rate: it logged the next step's (one step ahead of
        DDP's and FSDP's for the same schedule)."""
        step_lr = getattr(self, "_step_lr", None)
        return step_lr if self.is_deepspeed_enabled and step_lr is not None else super()._get_learning_rate()

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids, mask, rows, real, lengths = self._batch_view(inputs)
        whole = inputs.pop(WHOLE_BATCH, None) if isinstance(inputs, dict) else None
        if whole is not None:  # Ulysses: DeepSpeed's adapter slices each row's chunk and copies it to the CPU, a
            # no-op in the CPU rehearsal that leaves the slice strided (transformers' loss views it flat)
            inputs.update({k: v.contiguous() for k, v in inputs.items() if hasattr(v, "is_contiguous")})
        if self.rank_reports is None and self.plan is not None:
            from llmtune.train.runtime.ranks import check_first_batch

            self.rank_reports = check_first_batch(ids, self.plan, self.accelerator.num_processes, self.train_dataset,
                                                  whole)  # fmt: skip
        self.tokens_seen += real
        self.rows_seen += rows
        self.padded_seen += int(ids.numel())
        # the rows' tokens, whatever the layout, read on the host (GRPO's inputs are its rows, a list)
        hashed = inputs.pop(ROW_BYTES, None) if isinstance(inputs, dict) else None
        if self.batch_hash is not None:
            if hashed is None and mask is None and lengths is None and isinstance(inputs, list):
                hashed = ids.numpy().tobytes()  # GRPO: the prompts' fingerprint
            if hashed is None:  # a collator that doesn't hash (reward pairs): the batch, one device copy
                hashed = b"".join(row.numpy().tobytes() + b"|" for row in row_tokens(ids, mask, lengths))
            self.batch_hash.update(hashed)
        if "LLMTUNE_TEST_ROW_LOG" in os.environ:
            _log_rows(row_tokens(ids, mask, lengths), self.state.global_step + 1)
        if self.is_deepspeed_enabled:  # the rate this step trains at: DeepSpeed steps its scheduler in backward
            self._step_lr = super()._get_learning_rate()
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._nonfinite_guard(loss)
        return loss

    def _batch_view(self, inputs) -> tuple:
        """(token ids to fingerprint, attention mask, rows, real tokens, row lengths of a padding-free batch) of a
        micro-batch; the collator's counts are Python numbers (no device sync)."""
        pairs = self.recipe is not None and self.recipe.reward_model  # a pair is two sequences of the batch
        ids = inputs["input_ids"]
        lengths = inputs.pop(ROW_LENGTHS, None)
        rows = len(lengths) if lengths is not None else int(ids.shape[0]) // (2 if pairs else 1)
        return ids, inputs.get("attention_mask"), rows, int(inputs.pop(REAL_TOKENS, 0)), lengths

    def _nonfinite_guard(self, loss) -> None:
        """Remember (without a device sync) whether any loss since the last check was NaN/inf."""
        import torch

        bad = ~torch.isfinite(loss.detach()).all()
        self._bad_loss = bad if getattr(self, "_bad_loss", None) is None else (self._bad_loss | bad)

    def _check_finite(self) -> None:
        """Before any save: the losses since the last check and this rank's weights (its shard) are finite, on
        every rank. A NaN loss shows one step after the update that broke the weights, so both are checked."""
        bad = getattr(self, "_bad_loss", None)
        loss_bad, weights_bad = collectives.sum_values([float(bool(bad)) if bad is not None else 0.0,
                                                        float(not _weights_finite(self.model))])  # fmt: skip
        self._bad_loss = None
        if loss_bad or weights_bad:
            what = "training loss" if loss_bad else "the weights"
            raise NonFiniteLoss(f"{what} became NaN or inf by step {self.state.global_step}; stopped before saving",
                                NONFINITE_HINT)  # fmt: skip

    _staging: bool = False

    def _get_output_dir(self, trial):
        if self._staging:
            return os.path.join(self.args.output_dir, STAGING)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """Through the checkpoint manager: written into a staging folder, then (all ranks done) marked complete and
        renamed into place. With async_checkpoint the states are written in the background and the checkpoint is
        published later, when every rank's write has finished (llmtune/train/checkpoint/asynchronous.py)."""
        waited = self.wait_for_previous_write() if self.async_saver is not None else 0.0
        self._check_finite()  # a NaN/inf model is never checkpointed
        step = self.state.global_step

        def write(staged: Path) -> None:
            self._staging = True
            try:
                super(LlmtuneTrainer, self)._save_checkpoint(model, trial)
                if self.checkpoints.tensor_parallel_resumable:  # the Trainer saved no optimizer (save_only_model)
                    if self.async_saver is not None:
                        self.start_async_write(staged, trainable_only=True)
                        self._save_rng_state(str(staged))
                    else:
                        self.checkpoints.write_dcp(self, staged)
            finally:
                self._staging = False

        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        # what the marker says of this allocation and of the rows trained up to this step (a collective)
        marker = lambda: {"step": step, "world_size": self.accelerator.num_processes, **self._allocation()}  # noqa: E731
        self.state.best_model_checkpoint = self.checkpoints.save(
            step, write, marker, model=unwrapped, later=self.async_saver is not None,
            best=lambda: self.state.best_model_checkpoint, waited=waited,  # as the Trainer's save left it
        )  # fmt: skip

    @property
    def checkpoint_times(self) -> list[dict]:
        return self.checkpoints.times

    recipe = None  # the run's recipe (set by the worker), for what TrainingArguments can't say

    def _allocation(self) -> dict:
        """What a resume on another allocation needs to know of this one (llmtune/plan/resume.py reads it)."""
        if not self.plan:
            return {}
        world = self.accelerator.num_processes
        data_parallel = self.plan["data_parallel_size"] * world // self.plan["world_size"]  # an elastic world too
        micro, accumulation = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        from llmtune.plan.mesh import ranks_per_batch

        # every rank saves, so every rank sums; a tensor- or context-parallel group's ranks each count its rows
        group = ranks_per_batch(self.plan.get("mesh"))
        rows, tokens = collectives.sum_values([self.rows_seen / group, self.tokens_seen / group])
        return {"strategy": self.plan["strategy"], "data_parallel_size": data_parallel,
                "global_batch_size": micro * accumulation * data_parallel, "mesh": self.plan.get("mesh"),
                # the rows trained up to here, the resumed checkpoint's included (unknown when its marker is older)
                **({"rows_seen": self.rows_before + round(rows)} if self.rows_before is not None else {}),
                **({"tokens_seen": self.tokens_before + round(tokens)} if self.tokens_before is not None else {}),
                "rows_per_epoch": len(self.train_dataset), "started_from": self.started_from,
                "engine_layout": engine_layout(self.plan.get("deepspeed_config"),
                                               (self.plan.get("accelerate_config") or {}).get("fsdp_config")),
                **({"optimizer": optimizer_of(self.recipe.optimizer, self.plan.get("deepspeed_config"))}
                   if self.recipe is not None else {}),
                # what a later resume checks the recipe against (llmtune/plan/resume_checks.py)
                **(marker_keys(self.recipe) if self.recipe is not None else {})}  # fmt: skip

    rows_before: int | None = 0  # rows the checkpoint this run resumed had trained (None: its marker didn't say)
    tokens_before: int | None = 0  # the same in tokens (padding excluded)
    started_from: str | None = None  # the checkpoint this run (and the runs it resumes) started from
    saved_world: int | None = None  # the world size of the checkpoint this run resumed

    def _load_rng_state(self, checkpoint) -> None:
        """Each rank's RNG state is restored only at the world size that saved them: elsewhere the Trainer would
        restore some ranks' and not others'. The data order does not depend on it (the sampler is seeded by
        epoch); dropout and other draws then continue from the seed."""
        if self.saved_world is None or self.saved_world == self.accelerator.num_processes:
            return super()._load_rng_state(checkpoint)
        if self.accelerator.is_main_process:
            from llmtune.train.runtime.progress import log

            log(f"random state not restored: {Path(checkpoint).name} was saved by {self.saved_world} process(es) "
                f"(the data order is; dropout draws continue from the seed)")  # fmt: skip
        return None

    # Tensor parallel: transformers can't checkpoint the optimizer of a model it sharded at load (the Trainer runs
    # with save_only_model, which still writes the whole weights for users). For resume llmtune saves the model's
    # and the optimizer's DTensor states with torch's distributed checkpoint (each rank its shards, under the names
    # the live model has, whatever transformers converted at load), the scheduler and the RNG state. Async
    # checkpoints (any strategy but ZeRO, FSDP1 and pipelines) hold the same states, written in the background.

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        try:
            if not self.checkpoints.load_model(self, resume_from_checkpoint):
                return super()._load_from_checkpoint(resume_from_checkpoint, model)
        except RuntimeError as err:  # torch's "size mismatch for ...": weights of another model
            if "size mismatch" not in str(err):
                raise
            from llmtune.errors import UserError

            detail = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line.lower()), "")
            raise UserError(f"{Path(resume_from_checkpoint).name} holds weights of another model than base_model "
                            f"({detail[:160]})", "resume it with the base_model it was trained on, or start over "
                            "in another output_dir") from None  # fmt: skip
        return None

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if not self.checkpoints.load_optimizer(self, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
        self._rates_at_the_schedules_step()

    def _rates_at_the_schedules_step(self) -> None:
        """Every group at the rate the restored schedule gives at its step. The optimizer's state holds the rate of
        the schedule that saved it: after max_steps (or num_epochs) was raised, the first resumed step ran at the old
        schedule's last rate (0 at its end). Where the schedule is the saved one, the same rate (the same product)."""
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate's wrapper, or not
        lambdas = getattr(scheduler, "lr_lambdas", None)
        groups = getattr(getattr(scheduler, "optimizer", None), "param_groups", None)
        if not lambdas or not groups or len(groups) != len(lambdas):
            return
        rates = [base * rate(scheduler.last_epoch) for rate, base in zip(lambdas, scheduler.base_lrs, strict=True)]
        for group, rate in zip(groups, rates, strict=True):
            group["lr"] = rate
        scheduler._last_lr = rates  # what get_last_lr reports (the logged rate of the step)

    def _ulysses(self) -> int:
        """DeepSpeed's Ulysses group size (1: not running it)."""
        config = getattr(self.accelerator, "parallelism_config", None)
        return config.sp_size if config is not None and config.sp_backend == "deepspeed" and config.sp_enabled else 1

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Under Ulysses, the step's trained tokens over every rank (DeepSpeed's adapter turns labels into
        shift_labels, which the Trainer doesn't count)."""
        samples, items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if self._ulysses() > 1 and samples and "shift_labels" in samples[0]:
            import torch

            local = sum(int((batch["shift_labels"] != -100).sum()) for batch in samples)
            items = self.accelerator.gather(torch.tensor([local], device=device)).sum()
        return samples, items

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        size = self._ulysses()
        if size > 1 and model.training:
            self.loss_is_scaled_for_ga = True  # over the step's tokens already (ulysses_loss)
            world = self.accelerator.num_processes
            averaged_over = world if (self.plan or {}).get("strategy") == "zero3" else world // size
            return ulysses_loss(model, inputs, num_items_in_batch, averaged_over, world // size, return_outputs)
        if self._token_eval is not None and not model.training:  # an evaluation: this batch's own mean, which
            num_items_in_batch = None  # evaluation_loop weighs by its tokens (not the ranks' summed count)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.recipe is not None:
            from llmtune.train.objectives.optimizers import own_optimizer

            self.optimizer = own_optimizer(self, model or self.model)
        return super().create_optimizer(model)

    scheduler_from_step = 0  # a weights-only checkpoint's step (save_only_model): its schedule goes on from there

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        from llmtune.train.objectives.schedule import make_scheduler, own_schedule

        if self.lr_scheduler is None and self.recipe is not None and own_schedule(self.recipe):
            warmup = self.args.get_warmup_steps(num_training_steps)
            self.lr_scheduler = make_scheduler(self.recipe, optimizer or self.optimizer, warmup, num_training_steps)
            self._created_lr_scheduler = True
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        steps, self.scheduler_from_step = self.scheduler_from_step, 0
        if steps:  # no scheduler.pt to load: stepped to where the checkpoint was
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch: a scheduler step before any optimizer step
                for _ in range(steps):
                    scheduler.step()
        return scheduler
