"""The one checkpoint manager: every strategy saves, publishes, resumes, loads (at its own world size or another) and
saves asynchronously through it, and the run's final files go out through it too.

A checkpoint is `<output_dir>/checkpoint-N` with one marker (plan/checkpoint_layout.py): the step, the world size,
the strategy, the data-parallel size and global batch, the rows trained, its format and, on machines with their own
disks, which machine holds which file. Every format is written the same way: into a staging folder, then (every
rank done) marked and renamed into place in one step, so a killed save leaves nothing resume would pick. The formats:

    trainer     the HF Trainer's own files: DDP, FSDP1/2 (full or sharded), ZeRO-1/2/3 through DeepSpeed's engine;
                resharded for another data-parallel size by DeepSpeed's universal checkpoint (universal.py) or
                torch's distributed checkpoint (fsdp1.py)
    dcp         tensor parallel: the model's and the optimizer's DTensor states through torch's distributed
                checkpoint (dcp.py), beside the Trainer's weights-only files
    dcp-async   async_checkpoint: the same states copied to host memory and written in the background
                (asynchronous.py); published only once every rank's write has finished
    pipeline    the pipeline loop's per-stage weights, optimizer and scheduler (stages.py)
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from llmtune.errors import UserError
from llmtune.train.checkpoint import dcp, folders, manifest
from llmtune.train.runtime import collectives
from llmtune.train.runtime.hooks import test_kill
from llmtune.train.runtime.progress import log


def _disk_full(err: BaseException, folder: Path) -> bool:
    """ENOSPC, or (torch.save reports a full disk as a bare iostream error) almost no space left."""
    if getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err):
        return True
    try:
        return shutil.disk_usage(folder).free < 64 * 2**20
    except OSError:
        return False


def _files(folder: Path) -> dict[str, int]:
    """The files directly in a folder, with their modification times (what a final save writes or rewrites)."""
    try:
        return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file()}
    except OSError:
        return {}


def _after_failed_save(output_dir: Path, steps: int | None, recipe) -> str:
    """What gets the final model after its save failed, true to the checkpoints on disk: a checkpoint at the last
    step holds it already (a rerun would find no step left); an earlier one is resumed; none: it trains again."""
    last = folders.last_complete(output_dir)
    if last is not None and folders.step_of(last) == steps:
        return f"free space, then llmtune merge {last}: it writes the final model from that checkpoint"
    if last is not None and recipe is not None and not recipe.auto_resume_from_checkpoints:
        return f"free space, then train with resume_from_checkpoint: {last}"
    if last is not None:
        return f"free space, then run the same command: it resumes from {last.name}"
    return "free space, then run the same command: no checkpoint was saved, so it trains from the start"


def _local_main() -> bool:
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


class CheckpointManager:
    def __init__(self, output_dir: str | Path, plan: dict | None = None, recipe=None) -> None:
        self.output_dir = Path(output_dir)
        self.staging = self.output_dir / folders.STAGING
        self.plan, self.recipe = plan or {}, recipe
        self.machines = self.plan["cluster"]["num_machines"] if self.plan else 1
        self.limit = recipe.save_total_limit if recipe is not None else None
        self.times: list[dict] = []  # per checkpoint: step, stall, write, wait (metrics.json's `checkpoints`)
        self.deferred: tuple | None = None  # (staged, final, marker) of a checkpoint still being written
        self.saver: dcp.AsyncSaver | None = None  # async_checkpoint: the background writer

    @property
    def strategy(self) -> str:
        return self.plan.get("strategy", "single")

    # --- where a run starts --------------------------------------------------------------------------------------

    def resume_point(self, log) -> str | None:
        """What a killed save left half-written is cleared; then resume_from_checkpoint, else (auto-resume) the
        newest complete checkpoint. None for a tensor-parallel run that saves weights only (nothing to resume)."""
        if _local_main():
            folders.clear_staging(self.output_dir)
        collectives.barrier()
        if self.weights_only or self.recipe is None:
            return None
        return folders.resume_point(self.recipe, log)

    def prepare_resume(self, checkpoint: str | Path, log, model=None) -> dict:
        """The checkpoint's marker (what the run that saved it was); for a checkpoint DeepSpeed loads through its
        universal checkpoint (another data-parallel size or ZeRO layout, or a DDP checkpoint resumed under ZeRO: the
        plan said so), its conversion by the first rank before the engine starts. `model`: the model as loaded,
        which names a DDP checkpoint's optimizer state."""
        info = folders.read_marker(checkpoint) or {}
        if (self.plan.get("deepspeed_config") or {}).get("checkpoint", {}).get("load_universal"):
            if collectives.rank() == 0:
                from llmtune.train.checkpoint.universal import convert, fit_layout, from_replicated

                ds = self.plan["deepspeed_config"]
                owner = "DeepSpeed's" if "optimizer" in ds else "the Trainer's"
                replicated = not str(info.get("strategy", "zero")).startswith("zero")  # DDP's or one process's
                before = (info.get("engine_layout") or {}).get("optimizer", "the Trainer's" if replicated else owner)
                decays = None
                if before != owner:  # regrouped: DeepSpeed's optimizer steps one group, the Trainer's two
                    decays = [ds["optimizer"]["params"].get("weight_decay", 0.0)] if "optimizer" in ds else \
                        [self.recipe.weight_decay or 0.0, 0.0]  # fmt: skip
                if replicated:
                    folder = from_replicated(Path(checkpoint), model, int(info.get("step", 0)),
                                             int(info.get("data_parallel_size") or 1), log)  # fmt: skip
                else:
                    folder = convert(Path(checkpoint), log)
                fit_layout(Path(checkpoint), folder, self._zero_stage(), "optimizer" in ds, decays)
            collectives.barrier()
        return info

    # --- saving --------------------------------------------------------------------------------------------------

    def save(self, step: int, write: Callable[[Path], None], marker: Callable[[], dict], *, model=None,
             later: bool = False, best: Callable[[], str | None] | None = None,
             waited: float = 0.0) -> str | None:  # fmt: skip
        """Every rank: `write(staged)` writes this rank's files of checkpoint-`step` into the staging folder; then the
        checkpoint is published (`marker()`, a collective, gives its marker), or, `later`, once every rank's
        background write has finished (publish_deferred). `model`: the unwrapped model, whose weights each machine
        with its own disk keeps a copy of. `best` reads the best checkpoint's path once `write` has run (the
        Trainer's own save names the best, in staging when it is this one). Returns that path, moved out of staging
        if it was."""
        began = time.perf_counter()
        staged, final = self.staging / f"checkpoint-{step}", self.output_dir / f"checkpoint-{step}"
        if self.machines > 1 and manifest.own_disk() and model is not None:
            manifest.save_weights_here(model)
        try:
            write(staged)
        except (OSError, RuntimeError) as err:
            if not _disk_full(err, self.output_dir):
                raise
            shutil.rmtree(staged, ignore_errors=True)  # give the space back; the last complete checkpoint stays
            last = folders.last_complete(self.output_dir)
            kept = f"{last.name} is intact and resume will start from it" if last else "there is no earlier checkpoint"
            raise UserError(f"disk full while writing checkpoint-{step} in {self.output_dir}; {kept}",
                            "free some space (or lower save_total_limit) and run the same command again") from None  # fmt: skip
        test_kill("LLMTUNE_TEST_KILL_IN_SAVE", step)
        best = best() if best is not None else None
        record = {"step": step, "async": later, "waited_seconds": round(waited, 4)}
        self.times.append(record)
        info = marker()
        if later:
            self.deferred = (staged, final, info)
            record["stall_seconds"] = round(time.perf_counter() - began, 4)
            return best
        best = self.publish(staged, final, info, best)
        record["stall_seconds"] = record["write_seconds"] = round(time.perf_counter() - began, 4)
        return best

    def publish(self, staged: Path, final: Path, info: dict, best: str | None = None) -> str | None:
        """Every rank's files are written: the marker, the rename into place, rotation. Called by every rank.

        Rank 0 publishes first; then, on machines with their own disk (not shared storage), each machine's first
        rank publishes its copy. Publishing at once from every machine raced on shared storage: one machine's
        "replace the same step saved again" moved away the checkpoint another had just put in place."""
        main = collectives.rank() == 0
        collectives.barrier()
        if self.machines > 1:
            if manifest.own_disk() and _local_main():
                manifest.complete_deepspeed_copy(staged)
            info[manifest.KEY] = manifest.gather(staged, _local_main())
        info.setdefault("format", self.format)
        if self.recipe is not None and self.recipe.sample_packing and not self.recipe.rl and "rows_seen" in info:
            from llmtune.train.checkpoint.final import PACKED

            info.setdefault("rows_are", PACKED)  # rows_seen and rows_per_epoch count them, not examples
        if main and self.machines == 1 and staged.exists():  # what a resume checks is still there (several
            info.setdefault("files", manifest.files_in(staged))  # machines: the manifest above, per machine)
        if main and staged.exists():
            folders.publish(staged, final, info)
        if collectives.world_size() > 1:
            collectives.barrier()
        if _local_main() and not main and staged.exists():
            try:
                folders.publish(staged, final, info)
            except FileNotFoundError:
                pass  # shared storage after all (a stale exists() on NFS): rank 0 already moved it
        if _local_main():
            try:
                staged.parent.rmdir()
            except OSError:
                pass
        if best and str(staged.parent) in best:
            best = str(final)
        collectives.barrier()
        if main or (self.machines > 1 and manifest.own_disk() and _local_main()):  # each machine's own copies
            folders.rotate(self.output_dir, self.limit, Path(best) if best else None)
        return best

    def publish_deferred(self, force: bool = False, best: str | None = None) -> str | None:
        """Publish the checkpoint being written in the background, if every rank has written it (`force`: every rank
        waited already)."""
        if self.deferred is None or not (force or self.saver.finished_everywhere()):
            return best
        self.saver.wait()  # this rank's write: done; raises what the writer raised
        staged, final, info = self.deferred
        self.deferred = None
        record = next((r for r in self.times if r["step"] == info["step"]), None)
        if record is not None:
            record["write_seconds"] = round(self.saver.write_seconds() or 0.0, 4)
        self.saver.clear()
        return self.publish(staged, final, info, best)

    @property
    def format(self) -> str:
        """What this run's checkpoints hold (the marker's `format`)."""
        if self.strategy == "pipeline":
            return "pipeline"
        if self.saver is not None:
            return "dcp-async"
        return "dcp" if self.tensor_parallel_resumable else "trainer"

    def write_dcp(self, trainer, staged: Path) -> None:
        """The dcp format (tensor parallel, synchronous): the model's and the optimizer's DTensor states through
        torch's distributed checkpoint (each rank its shards, under the names the live model has, whatever
        transformers converted at load), the scheduler and this rank's RNG state, beside the Trainer's
        weights-only files."""
        import torch

        dcp.save(trainer.model, trainer.optimizer, staged / dcp.TP_STATE)
        if trainer.args.should_save:
            torch.save(trainer.lr_scheduler.state_dict(), staged / "scheduler.pt")
        trainer._save_rng_state(str(staged))

    # --- loading, by what the checkpoint holds -------------------------------------------------------------------

    @property
    def weights_only(self) -> bool:
        """A tensor-parallel run with save_only_model: its checkpoints are weight snapshots, never resumed."""
        return self.strategy == "tp" and bool(self.recipe is not None and self.recipe.save_only_model)

    @property
    def tensor_parallel_resumable(self) -> bool:
        return self.strategy == "tp" and self.recipe is not None and not self.recipe.save_only_model

    def dcp_folder(self, checkpoint) -> Path | None:
        """The checkpoint's DCP states (a tensor-parallel or an async checkpoint), or None (the Trainer's files)."""
        folder = dcp.folder_of(checkpoint)
        if folder is None or (folder.name == dcp.TP_STATE and not self.tensor_parallel_resumable):
            return None
        return folder

    def load_model(self, trainer, checkpoint) -> bool:
        """The model's states from a DCP checkpoint (True); False: the Trainer's own files, its loader's to read."""
        folder = self.dcp_folder(checkpoint)
        if folder is None:
            return False
        dcp.load_model(trainer.model, folder, trainable_only=folder.name == dcp.STATE)
        return True

    def load_optimizer(self, trainer, checkpoint) -> bool:
        """The optimizer's and scheduler's states (True), or False where the Trainer's own loader reads them (after
        the repair a ZeRO-3 universal load needs)."""
        import torch

        folder = self.dcp_folder(checkpoint)
        if folder is None:
            from llmtune.train.checkpoint.fsdp1 import load_optimizer_and_scheduler

            self._repair_universal_load(trainer, checkpoint)
            return load_optimizer_and_scheduler(trainer, checkpoint)  # FSDP1 sharded: accelerate's loader drops it
        dcp.load_optimizer(trainer.model, trainer.optimizer, folder, trainable_only=folder.name == dcp.STATE)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
        return True

    def _zero_stage(self) -> int:
        return int((self.plan["deepspeed_config"].get("zero_optimization") or {}).get("stage", 0))

    def _repair_universal_load(self, trainer, checkpoint) -> None:
        """After DeepSpeed loaded a universal checkpoint (another data-parallel size, ZeRO layout or strategy): each
        optimizer state's step, and ZeRO-3's groups (universal.py)."""
        if not (checkpoint and trainer.is_deepspeed_enabled):
            return
        if not (self.plan.get("deepspeed_config") or {}).get("checkpoint", {}).get("load_universal"):
            return
        from llmtune.train.checkpoint.universal import converted_folder, repair_universal_load

        repair_universal_load(trainer.optimizer.optimizer, converted_folder(Path(checkpoint)), self._zero_stage())

    def load_stages(self, checkpoint: str | Path, grid, params: dict, optimizer, scheduler) -> tuple[int, list]:
        """A pipeline checkpoint into this stage: the step to continue from and the loss history so far."""
        from llmtune.train.checkpoint import stages

        return stages.load(Path(checkpoint), grid, params, optimizer, scheduler)

    # --- the run's final files -----------------------------------------------------------------------------------

    def save_final(self, write_model: Callable[[Path], None], tokenizer, metrics: dict, gguf_origin: str | None,
                   main: bool) -> None:  # fmt: skip
        """The trained model (`write_model`, called on every rank: a sharded model's save is a collective), and, by
        the first rank, the tokenizer and the run's files (metrics.json, model card, resolved recipe); then a note for
        each output of the post commands the new model leaves stale (training continued in the same output_dir)."""
        from llmtune.train.checkpoint.final import packed_rows, write_run_files
        from llmtune.train.runtime.report import resumed_figures

        before = _files(self.output_dir)
        stale = stale_outputs(self.output_dir) if main else []  # what `llmtune merge` and `eval` made of an older model
        metrics.update(**resumed_figures(metrics), **packed_rows(metrics))
        try:
            write_model(self.output_dir)
            if main:
                tokenizer.save_pretrained(str(self.output_dir))
                write_run_files(self.output_dir, self.recipe, self.plan, metrics, gguf_origin)
        except Exception as err:  # safetensors reports a full disk as its own error, torch as a RuntimeError
            full = _disk_full(err, self.output_dir)
            if not full and getattr(err, "errno", None) not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT):
                raise
            if main:  # the final save's files, half-written: a folder that looks like a model must be one
                for name, stamp in _files(self.output_dir).items():
                    if before.get(name) != stamp:
                        (self.output_dir / name).unlink(missing_ok=True)
            raise UserError(f"{'the disk filled' if full else 'the disk refused writes'} while saving the final model "
                            f"in {self.output_dir} ({getattr(err, 'strerror', None) or str(err).splitlines()[0][:120]}):"
                            " that save's files were removed, the checkpoints kept",
                            _after_failed_save(self.output_dir, metrics.get("steps"), self.recipe)) from None  # fmt: skip
        for line in stale:
            log(f"note: {line}")


def stale_outputs(run: Path) -> list[str]:
    """What the post commands wrote from the run's final model before this save replaced it (training continued in
    the same output_dir): each with the command that rewrites it. The files stay: they are the user's to replace.
    A checkpoint's own outputs (merged-checkpoint-N, eval-checkpoint-N.json) and the base model's eval still hold."""
    found = []
    if (run / "merged").is_dir():
        found.append(f"{run / 'merged'} holds the model merged before this training continued, not the one just "
                     f"saved: llmtune merge {run} --force rewrites it")  # fmt: skip
    if (run / "eval.json").is_file():
        found.append(f"{run / 'eval.json'} measured the model saved before this training continued (metrics.json has "
                     f"this run's eval loss): llmtune eval {run} measures the new one")  # fmt: skip
    return found


def full_state_dict_for_final_save(trainer) -> None:
    """Checkpoints may be sharded, but the final model must be one HF folder: the Trainer saves nothing otherwise."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is not None and "SHARDED" in str(plugin.state_dict_type):
        plugin.set_state_dict_type("FULL_STATE_DICT")
