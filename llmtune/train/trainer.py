"""The HF Trainer with what llmtune adds: real-token counting, atomic checkpoints, a stop on a non-finite loss."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

from transformers import Trainer

from llmtune.errors import UserError
from llmtune.train import checkpoints, collectives
from llmtune.train.async_checkpoint import AsyncCheckpointing
from llmtune.train.callbacks import NONFINITE_HINT, NonFiniteLoss, _test_kill
from llmtune.train.data.collate import REAL_TOKENS, ROW_BYTES, ROW_LENGTHS


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


def _disk_full(err: BaseException, folder: Path) -> bool:
    """ENOSPC, or (torch.save reports a full disk as a bare iostream error) almost no space left."""
    if getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err):
        return True
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


def _weights_finite(model) -> bool:
    import torch

    from llmtune.train.memory import local_tensor

    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad:  # frozen weights don't change (and 4-bit ones are packed bytes)
                continue
            local = local_tensor(param)
            if local is not None and local.numel() and local.is_floating_point() and not torch.isfinite(local).all():
                return False
    return True


class LlmtuneTrainer(AsyncCheckpointing, Trainer):
    tokens_seen = 0
    padded_seen = 0
    rows_seen = 0
    plan: dict | None = None
    rank_reports: list[dict] | None = None
    batch_hash = None  # hashlib object while StepStats records batch hashes

    def training_step(self, model, inputs, num_items_in_batch=None):
        ids, mask, rows, real, lengths = self._batch_view(inputs)
        if self.rank_reports is None and self.plan is not None:
            from llmtune.train.ranks import check_first_batch

            self.rank_reports = check_first_batch(ids, self.plan, self.accelerator.num_processes, self.train_dataset)
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
            return os.path.join(self.args.output_dir, checkpoints.STAGING)
        return super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """Write into a staging folder, then (all ranks done) mark it complete and rename it into place. With
        async_checkpoint the states are written in the background and the checkpoint is published later, when every
        rank's write has finished (llmtune/train/async_checkpoint.py)."""
        began = time.perf_counter()
        waited = self.wait_for_previous_write() if self.async_saver is not None else 0.0
        self._check_finite()  # a NaN/inf model is never checkpointed
        step = self.state.global_step
        staging_root = Path(self.args.output_dir) / checkpoints.STAGING
        staged, final = staging_root / f"checkpoint-{step}", Path(self.args.output_dir) / f"checkpoint-{step}"
        from llmtune.train import manifest  # which machine holds which file; machines with their own disk

        machines = self.plan["cluster"]["num_machines"] if self.plan else 1
        if machines > 1 and manifest.own_disk():
            manifest.save_weights_here(self.accelerator.unwrap_model(self.model, keep_torch_compile=False))
        self._staging = True
        try:
            super()._save_checkpoint(model, trial)
            if self._tensor_parallel_resumable():  # the Trainer saved no optimizer (save_only_model): llmtune does
                if self.async_saver is not None:
                    self.start_async_write(staged, trainable_only=True)
                    self._save_rng_state(str(staged))
                else:
                    self._save_tensor_parallel_state(str(staged))
        except (OSError, RuntimeError) as err:
            if not _disk_full(err, Path(self.args.output_dir)):
                raise
            shutil.rmtree(staged, ignore_errors=True)  # give the space back; the last complete checkpoint stays
            last = checkpoints.last_complete(Path(self.args.output_dir))
            kept = f"{last.name} is intact and resume will start from it" if last else "there is no earlier checkpoint"
            raise UserError(
                f"disk full while writing checkpoint-{step} in {self.args.output_dir}; {kept}",
                "free some space (or lower save_total_limit) and run the same command again",
            ) from None
        finally:
            self._staging = False
        _test_kill("LLMTUNE_TEST_KILL_IN_SAVE", step)
        self.checkpoint_times = self.checkpoint_times if self.checkpoint_times is not None else []
        record = {"step": step, "async": self.async_saver is not None, "waited_seconds": round(waited, 4)}
        self.checkpoint_times.append(record)
        # what the marker says of this allocation and of the rows trained up to this step (a collective)
        info = {"step": step, "world_size": self.accelerator.num_processes, **self._allocation()}
        if self.async_saver is not None:  # published once every rank's background write has finished
            self._deferred = (staged, final, {**info, "format": "dcp-async"})
            record["stall_seconds"] = round(time.perf_counter() - began - waited, 4)
            return
        self._publish(staged, final, info)
        record["stall_seconds"] = record["write_seconds"] = round(time.perf_counter() - began - waited, 4)

    def _publish(self, staged: Path, final: Path, info: dict) -> None:
        """Every rank's files are written: the marker, the rename into place, rotation. Called by every rank."""
        from llmtune.train import manifest

        staging_root = staged.parent
        machines = self.plan["cluster"]["num_machines"] if self.plan else 1
        self.accelerator.wait_for_everyone()
        # Rank 0 publishes first; then, on machines with their own disk (not shared storage), each machine's first
        # rank publishes its copy. Publishing at once from every machine raced on shared storage: one machine's
        # "replace the same step saved again" moved away the checkpoint another had just put in place.
        if machines > 1:
            if manifest.own_disk() and self.accelerator.is_local_main_process:
                manifest.complete_deepspeed_copy(staged)
            info[manifest.KEY] = manifest.gather(staged, self.accelerator.is_local_main_process)
        if self.accelerator.is_main_process and staged.exists():
            checkpoints.publish(staged, final, info)
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
        if self.accelerator.is_local_main_process and not self.accelerator.is_main_process and staged.exists():
            try:
                checkpoints.publish(staged, final, info)
            except FileNotFoundError:
                pass  # shared storage after all (a stale exists() on NFS): rank 0 already moved it
        if self.accelerator.is_local_main_process:
            try:
                staging_root.rmdir()
            except OSError:
                pass
        best = self.state.best_model_checkpoint
        if best and str(staging_root) in best:
            self.state.best_model_checkpoint = str(final)
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            checkpoints.rotate(Path(self.args.output_dir), self.args.save_total_limit,
                               Path(self.state.best_model_checkpoint) if self.state.best_model_checkpoint else None)  # fmt: skip

    recipe = None  # the run's recipe (set by the worker), for what TrainingArguments can't say

    def _allocation(self) -> dict:
        """What a resume on another allocation needs to know of this one (llmtune/plan/resume.py reads it)."""
        if not self.plan:
            return {}
        world = self.accelerator.num_processes
        data_parallel = self.plan["data_parallel_size"] * world // self.plan["world_size"]  # an elastic world too
        micro, accumulation = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        (rows,) = collectives.sum_values([float(self.rows_seen)])  # every rank saves, so every rank sums
        return {"strategy": self.plan["strategy"], "data_parallel_size": data_parallel,
                "global_batch_size": micro * accumulation * data_parallel, "mesh": self.plan.get("mesh"),
                # the rows trained up to here, the resumed checkpoint's included (unknown when its marker is older)
                **({"rows_seen": self.rows_before + int(rows)} if self.rows_before is not None else {}),
                "rows_per_epoch": len(self.train_dataset)}  # fmt: skip

    rows_before: int | None = 0  # rows the checkpoint this run resumed had trained (None: its marker didn't say)
    saved_world: int | None = None  # the world size of the checkpoint this run resumed

    def _load_rng_state(self, checkpoint) -> None:
        """Each rank's RNG state is restored only at the world size that saved them: elsewhere the Trainer would
        restore some ranks' and not others'. The data order does not depend on it (the sampler is seeded by
        epoch); dropout and other draws then continue from the seed."""
        if self.saved_world is None or self.saved_world == self.accelerator.num_processes:
            return super()._load_rng_state(checkpoint)
        if self.accelerator.is_main_process:
            from llmtune.train.progress import log

            log(f"random state not restored: {Path(checkpoint).name} was saved by {self.saved_world} process(es) "
                f"(the data order is; dropout draws continue from the seed)")  # fmt: skip
        return None

    # Tensor parallel: transformers can't checkpoint the optimizer of a model it sharded at load (the Trainer runs
    # with save_only_model, which still writes the whole weights for users). For resume llmtune saves the model's
    # and the optimizer's DTensor states with torch's distributed checkpoint (each rank its shards, under the names
    # the live model has, whatever transformers converted at load), the scheduler and the RNG state. Async
    # checkpoints (any strategy but ZeRO, FSDP1 and pipelines) hold the same states, written in the background.

    def _tensor_parallel_resumable(self) -> bool:
        return bool(self.plan and self.plan["strategy"] == "tp" and self.recipe and not self.recipe.save_only_model)

    def _save_tensor_parallel_state(self, folder: str) -> None:
        import torch

        from llmtune.train import dcp_checkpoint

        dcp_checkpoint.save(self.model, self.optimizer, Path(folder) / dcp_checkpoint.TP_STATE)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(folder, "scheduler.pt"))
        self._save_rng_state(folder)

    def _dcp_folder(self, checkpoint):
        """The checkpoint's DCP states (a tensor-parallel or an async checkpoint), or None."""
        from llmtune.train import dcp_checkpoint

        folder = dcp_checkpoint.folder_of(checkpoint)
        if folder is None or (folder.name == dcp_checkpoint.TP_STATE and not self._tensor_parallel_resumable()):
            return None
        return folder

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        folder = self._dcp_folder(resume_from_checkpoint)
        if folder is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        from llmtune.train import dcp_checkpoint

        dcp_checkpoint.load_model(self.model, folder, trainable_only=folder.name == dcp_checkpoint.STATE)
        return None

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        folder = self._dcp_folder(checkpoint)
        if folder is None:
            from llmtune.train.fsdp_resume import load_optimizer_and_scheduler

            self._repair_universal_load(checkpoint)
            if load_optimizer_and_scheduler(self, checkpoint):  # FSDP1 sharded: accelerate's loader drops the state
                return None
            return super()._load_optimizer_and_scheduler(checkpoint)
        import torch

        from llmtune.train import dcp_checkpoint

        dcp_checkpoint.load_optimizer(self.model, self.optimizer, folder,
                                      trainable_only=folder.name == dcp_checkpoint.STATE)  # fmt: skip
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
        return None

    def _repair_universal_load(self, checkpoint) -> None:
        """ZeRO-3 after DeepSpeed loaded a universal checkpoint (another data-parallel size): llmtune/train/universal.py."""
        if not (checkpoint and self.is_deepspeed_enabled and self.plan and self.plan["strategy"] == "zero3"):
            return
        if not (self.plan.get("deepspeed_config") or {}).get("checkpoint", {}).get("load_universal"):
            return
        from llmtune.train.universal import converted_folder, repair_zero3_load

        repair_zero3_load(self.optimizer.optimizer, converted_folder(Path(checkpoint)))

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.recipe is not None and self.recipe.optimizer == "muon":
            from llmtune.train.muon import make_muon

            model = model or self.model
            self.optimizer = make_muon(model, self.args, set(self.get_decay_parameter_names(model)))
            return self.optimizer
        return super().create_optimizer(model)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        from llmtune.train.schedule import make_scheduler, own_schedule

        if self.lr_scheduler is None and self.recipe is not None and own_schedule(self.recipe):
            warmup = self.args.get_warmup_steps(num_training_steps)
            self.lr_scheduler = make_scheduler(self.recipe, optimizer or self.optimizer, warmup, num_training_steps)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs.pop(REAL_TOKENS, None)
        inputs.pop(ROW_BYTES, None)
        inputs.pop(
            ROW_LENGTHS, None
        )  # the Trainer weighs each eval batch's loss by the loader's batch size, flat or not
        if self.recipe is not None and self.recipe.reward_model:  # one margin per pair, not one score per sequence
            import torch

            from llmtune.train.data.reward import pair_margins

            labels = inputs["labels"]
            with torch.no_grad():
                loss, outputs = self.compute_loss(model, dict(inputs), return_outputs=True)
            if prediction_loss_only:
                return loss.detach(), None, None
            margins = pair_margins(outputs.logits.detach(), labels)
            return loss.detach(), margins, torch.ones_like(margins)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
