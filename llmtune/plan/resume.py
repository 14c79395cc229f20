"""Resuming on another allocation: the checkpoint a run would resume from, the world it was saved on, and how the
run continues on this one (the same global batch, through gradient accumulation) or why it can't.

The checkpoint's marker (llmtune-complete.json) records its allocation; markers written before it did record only
the world size, and the rest is read from the recipe as it is today.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.checkpoint_layout import last_complete, read_marker

# Checkpoints another world size loads, by family: DDP's hold every rank's full state (the model, the optimizer);
# plain FSDP2's are torch distributed checkpoints (or one full state dict), which reshard on load; ZeRO's are
# converted first to DeepSpeed's universal checkpoint (one file per parameter and state), which any data-parallel
# size loads (llmtune/train/checkpoint/universal.py)
# (FSDP1's sharded optimizer state loaded onto 4 ranks from 2 failed in DCP's planner: tests/integration/test_fsdp1_resume.py)
MOVABLE = {"single": "replicated", "ddp": "replicated", "fsdp2": "fsdp2", "zero1": "zero1", "zero2": "zero2",
           "zero3": "zero3"}  # fmt: skip
UNIVERSAL_DONE = "latest_universal"  # DeepSpeed writes it last, naming the converted folder: the conversion is complete


def _family(strategy: str) -> str:
    """Strategies whose checkpoints load into each other: ZeRO's stages through DeepSpeed's universal checkpoint
    (plan/relayout.py refuses what it can't carry over before this is asked)."""
    return "zero" if strategy.startswith("zero") else MOVABLE.get(strategy, strategy)


def replicated_to_zero(saved: str | None, now: str) -> bool:
    """A DDP (or one process's) checkpoint resumed under ZeRO: written as the universal checkpoint (relayout.py)."""
    return saved in ("ddp", "single") and now.startswith("zero")


@dataclass(frozen=True)
class Saved:
    """What a complete checkpoint's marker says of the allocation that wrote it."""

    path: Path
    step: int
    world_size: int
    data_parallel_size: int
    global_batch_size: int
    strategy: str | None  # None: an older marker, which didn't record it
    mesh: dict | None = None  # HSDP, context or tensor parallel sizes, when the run had them
    rows_seen: int | None = None  # rows trained up to this checkpoint, over all ranks (older markers: None)
    rows_per_epoch: int | None = None
    rows_are: str | None = None  # "packed sequences" where sample_packing packed the examples (older markers: None)


@dataclass(frozen=True)
class Resumed:
    """How a run continues a checkpoint saved on another allocation."""

    accumulation: int  # the gradient accumulation that keeps the checkpoint's global batch here
    line: str  # what the plan and the run say
    universal: bool = False  # a ZeRO checkpoint, loaded through DeepSpeed's universal checkpoint


def start_over(recipe) -> str:
    """How to train the recipe from the start instead of resuming: true to where the checkpoint comes from (a
    resume_from_checkpoint is resumed in any output_dir; auto-resume reads output_dir's own)."""
    try:
        saved_here = recipe.auto_resume_from_checkpoints and last_complete(Path(recipe.output_dir)) is not None
    except OSError:
        saved_here = False
    if recipe.resume_from_checkpoint and saved_here:
        return "remove resume_from_checkpoint and set auto_resume_from_checkpoints: false (output_dir has checkpoints)"
    if recipe.resume_from_checkpoint:
        return "remove resume_from_checkpoint"
    return "auto_resume_from_checkpoints: false, or another output_dir"


def resume_checkpoint(recipe) -> Path | None:
    """The checkpoint `llmtune train` would resume from: the newest complete one in output_dir (auto-resume), else
    resume_from_checkpoint. A run started from resume_from_checkpoint that crashed after saving its own checkpoints
    resumes the newest of them, not the named one again (see newer_than_named)."""
    named = Path(recipe.resume_from_checkpoint) if recipe.resume_from_checkpoint else None
    output_dir = Path(recipe.output_dir)
    try:
        if not recipe.auto_resume_from_checkpoints or not output_dir.is_dir():
            return named
        last = last_complete(output_dir)
    except OSError:  # a name no file system takes (too long): nothing to resume; the run reports the path itself
        return named
    return last if last is not None and newer_than_named(last, named) else named


def newer_than_named(last: Path, named: Path | None) -> bool:
    """output_dir's newest complete checkpoint wins over resume_from_checkpoint when the run that saved it started
    from that checkpoint (its marker's `started_from`): it is the same run, further on. Otherwise the named one is
    kept: a checkpoint of an earlier attempt that started elsewhere, or going back to an earlier step of the run.
    Markers older than `started_from`: output_dir's wins over a named checkpoint outside it."""
    if named is None:
        return True
    info = read_marker(last) or {}
    if "started_from" in info:
        return bool(info["started_from"]) and Path(info["started_from"]).resolve() == named.resolve()
    return named.resolve().parent != last.resolve().parent


def started_from(resume: str, output_dir: Path, marker: dict) -> str | None:
    """What a run resuming `resume` records as where it started: the checkpoint it was named to start from, carried
    over from checkpoint to checkpoint of its own (None: it started from the base model)."""
    own = Path(resume).resolve().parent == Path(output_dir).resolve() and bool(marker)
    return marker.get("started_from") if own else str(Path(resume).resolve())


def saved_allocation(recipe, checkpoint: Path) -> Saved | None:
    """The allocation `checkpoint` was saved on; None when it isn't an llmtune checkpoint that says."""
    info = read_marker(checkpoint)
    world = (info or {}).get("world_size")
    if not isinstance(world, int) or world < 1:
        return None
    data_parallel = info.get("data_parallel_size") or world
    batch = (
        info.get("global_batch_size") or recipe.micro_batch_size * recipe.gradient_accumulation_steps * data_parallel
    )
    return Saved(checkpoint, int(info.get("step", 0)), world, data_parallel, batch, info.get("strategy"),
                 info.get("mesh"), info.get("rows_seen"), info.get("rows_per_epoch"), info.get("rows_are"))  # fmt: skip


def zero_tag(checkpoint: Path) -> str | None:
    """The folder of a ZeRO checkpoint's engine state (global_stepN), from DeepSpeed's `latest` file."""
    try:
        tag = (checkpoint / "latest").read_text().strip()
    except OSError:
        return None
    return tag if (checkpoint / tag).is_dir() else None


def check_convertible(checkpoint: Path, data_parallel: int, again: str, recipe) -> None:
    """A ZeRO checkpoint can be converted to the universal checkpoint (or was): it holds its engine state, with every
    rank's optimizer slice in one folder. UserError otherwise, `again` saying what will work."""
    if (checkpoint / UNIVERSAL_DONE).is_file():
        return
    tag = zero_tag(checkpoint)
    if tag is None:
        raise UserError(f"{checkpoint.name} has no DeepSpeed engine state (no `latest` file naming a global_stepN "
                        f"folder)", f"resume from a checkpoint a ZeRO run saved, or start over: {start_over(recipe)}")  # fmt: skip
    slices = len(list((checkpoint / tag).glob("*optim_states.pt")))
    if slices < data_parallel:  # machines with their own disks each kept their ranks' slices
        raise UserError(
            f"{checkpoint.name} holds the optimizer slices of {slices} of the {data_parallel} ranks that saved it "
            f"(in {checkpoint / tag}); converting it needs all of them in one folder",
            f"copy the other machines' {tag}/*optim_states.pt into {checkpoint / tag}, or {again}",
        )


def universal_line(saved: Saved, data_parallel: int) -> str:
    """What loading a ZeRO checkpoint on another data-parallel size takes: its conversion, or that it's done."""
    if (saved.path / UNIVERSAL_DONE).is_file():
        return f"{saved.path.name} was converted to DeepSpeed's universal checkpoint already"
    tag = zero_tag(saved.path)
    size = sum(f.stat().st_size for f in (saved.path / tag).glob("*optim_states.pt")) if tag else 0
    return (f"{saved.path.name} is converted to DeepSpeed's universal checkpoint first (ds_to_universal, "
            f"data-parallel size {saved.data_parallel_size} -> {data_parallel}; about {size / 2**30:.2g} GiB more "
            f"on disk; `llmtune checkpoint reshard` does it ahead)")  # fmt: skip


def resumed_accumulation(
    recipe,
    strategy: str,
    world: int,
    data_parallel: int,
    mesh: dict | None,
    titles: dict[str, str],
    offload: str,
) -> Resumed | None:
    """When the run resumes a checkpoint saved on another world size: how it continues here (the gradient
    accumulation that keeps its global batch, the line that says so, whether ZeRO state goes through a universal
    checkpoint). None when there is nothing to resume or the allocation is the same. UserError, with what will work,
    when it can't resume here. `titles`: the strategies' names, as the plan shows them."""
    checkpoint = resume_checkpoint(recipe)
    saved = saved_allocation(recipe, checkpoint) if checkpoint else None
    if saved is None:
        return None
    name = saved.path.name
    written = saved.strategy or strategy
    converted = replicated_to_zero(saved.strategy, strategy)  # (relayout.py said how)
    if saved.strategy and _family(saved.strategy) != _family(strategy) and not converted:
        # at any world size: the same one too, where ZeRO's and FSDP's states would be missed (a DDP resume of a
        # ZeRO checkpoint restarted its optimizer silently) or not found (every rank's traceback)
        raise UserError(
            f"{name} was saved by {titles.get(written, written)}; this launch runs "
            f"{titles.get(strategy, strategy)}: a checkpoint resumes only under the strategy that wrote it",
            f"resume with the recipe's strategy keys as they were, or start over: {start_over(recipe)}",
        )
    if saved.world_size == world:
        return _same_world(recipe, saved, data_parallel)
    if written not in MOVABLE or mesh or saved.mesh:
        title = titles.get(written, written) + (" (with a device mesh)" if mesh or saved.mesh else "")
        raise UserError(
            f"{name} was saved by {saved.world_size} process(es); this launch has {world}: llmtune resumes {title} "
            f"checkpoints only at the world size that wrote them (DDP's, ZeRO's and plain FSDP2's on any)",
            f"resume with --num-processes {saved.world_size} (the allocation that saved it), or start over: "
            f"{start_over(recipe)}",
        )
    micro = recipe.micro_batch_size
    if saved.global_batch_size % (micro * data_parallel):
        raise UserError(
            f"{name} trained at global batch {saved.global_batch_size}; on {data_parallel} data-parallel process(es) "
            f"it can't be kept ({saved.global_batch_size} is not a multiple of micro_batch_size {micro} x "
            f"{data_parallel})",
            f"resume with --num-processes {saved.world_size} (or a count that divides "
            f"{saved.global_batch_size // micro})",
        )
    again = f"resume with --num-processes {saved.world_size} (the allocation that saved it)"
    if recipe.group_by_length:
        raise UserError(
            f"{name} was saved by {saved.world_size} process(es); this launch has {world}, and group_by_length draws "
            "its length-sorted batches per process: the rows already trained can't be told apart on another count",
            f"{again}, or set group_by_length: false before the first run",
        )
    universal = written.startswith("zero") and saved.data_parallel_size != data_parallel
    if universal and offload == "nvme":
        raise UserError(
            f"{name} was saved by {saved.world_size} process(es) with the optimizer on NVMe; this launch has {world}: "
            "DeepSpeed reads NVMe-offloaded optimizer state back only on the ranks that wrote it",
            f"{again}, or start over: {start_over(recipe)}",
        )
    if universal:
        check_convertible(saved.path, saved.data_parallel_size, again, recipe)
    accumulation = saved.global_batch_size // (micro * data_parallel)
    before = saved.global_batch_size // (micro * saved.data_parallel_size)
    line = (f"resuming {name} (world size {saved.world_size}) on world size {world}: gradient accumulation "
            f"{before} -> {accumulation}, global batch {saved.global_batch_size} kept")  # fmt: skip
    if saved.rows_seen is not None and saved.rows_per_epoch:
        epochs, into = divmod(saved.rows_seen, saved.rows_per_epoch)
        unit = saved.rows_are or "rows"
        if saved.rows_seen <= saved.rows_per_epoch:
            line += f", {saved.rows_seen} of {saved.rows_per_epoch} {unit} seen"
        else:
            where = f"epoch {epochs + 1}: {into} of {saved.rows_per_epoch}" if into else f"{epochs} epochs done"
            line += f", {saved.rows_seen} {unit} seen ({where})"
    if universal:
        line += "; " + universal_line(saved, data_parallel)
    return Resumed(accumulation, line, universal)


def _same_world(recipe, saved: Saved, data_parallel: int) -> Resumed | None:
    """The world that saved the checkpoint, with micro_batch_size or gradient_accumulation_steps changed since (a
    smaller micro-batch after an OOM): the checkpoint's global batch is kept through the accumulation, as on another
    world size. The Trainer counts the data already trained and the schedule in the checkpoint's steps; at another
    global batch it would skip a wrong number of rows."""
    micro = recipe.micro_batch_size
    planned = micro * recipe.gradient_accumulation_steps * data_parallel
    if saved.global_batch_size == planned:
        return None
    name = saved.path.name
    if saved.global_batch_size % (micro * data_parallel):
        raise UserError(
            f"{name} trained at global batch {saved.global_batch_size}; micro_batch_size {micro} on {data_parallel} "
            f"data-parallel process(es) can't keep it ({saved.global_batch_size} is not a multiple of "
            f"{micro * data_parallel}), and a resume at another global batch would skip the wrong rows",
            f"use a micro_batch_size that divides {saved.global_batch_size // data_parallel}, or start over: "
            f"{start_over(recipe)}",
        )
    accumulation = saved.global_batch_size // (micro * data_parallel)
    line = (f"resuming {name} at the global batch it trained with, {saved.global_batch_size}: micro_batch_size {micro} "
            f"x gradient accumulation {accumulation} x {data_parallel} (the recipe's gives {planned}; the resume "
            "counts the rows already trained in the checkpoint's steps)")  # fmt: skip
    return Resumed(accumulation, line)


def _finished_here(recipe) -> bool:
    """output_dir's metrics.json is this very recipe's (its fingerprint): the run finished and nothing changed."""
    import json

    from llmtune.recipe.loader import recipe_fingerprint

    try:
        metrics = json.loads((Path(recipe.output_dir) / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and metrics.get("recipe_fingerprint") == recipe_fingerprint(recipe)


def length_line(recipe) -> str | None:
    """What resuming with another training length does, from the checkpoint's trainer_state.json: the Trainer builds
    the learning-rate schedule for the new length and loads only the step it had reached into it, and the trainer sets
    every group to the new schedule's rate there (trainer.py `_rates_at_the_schedules_step`). A checkpoint at or past the length asked for is refused: the Trainer would run
    one more step there, at a rate past its schedule's end (that is what rerunning a finished run with any key
    changed would do). None when the length is the one the checkpoint was saved with (or nothing is resumed)."""
    import json

    checkpoint = resume_checkpoint(recipe)
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text()) if checkpoint else None
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return None
    step, name = state["global_step"], checkpoint.name
    if recipe.max_steps:
        before, now, unit = state.get("max_steps"), recipe.max_steps, "max_steps"
        reached = now <= step
    else:
        before, now, unit = state.get("num_train_epochs"), recipe.num_epochs, "num_epochs"
        ended = isinstance(state.get("max_steps"), int) and step >= state["max_steps"]
        reached = ended and isinstance(state.get("epoch"), (int, float)) and state["epoch"] >= now
    if before is None:
        return None
    if not recipe.max_steps:
        before, now = f"{float(before):g}", f"{float(now):g}"
    same = str(before) == str(now)
    finished = (Path(recipe.output_dir) / "metrics.json").is_file()  # (the same recipe: "nothing to do" before this)
    if reached and same and not finished and not recipe.max_steps:
        # killed after its last checkpoint, before the final save: the Trainer's epoch loop has nothing left and
        # goes straight to the final save
        return f"resuming {name}, the run's last step ({step}): no step is trained, the final model is written"
    if reached and same and finished and _finished_here(recipe):  # `llmtune plan` of a finished run, unchanged
        return (f"{name} is the last step of this recipe's finished run (its metrics.json): llmtune train has "
                "nothing to do")  # fmt: skip
    if reached:
        run = (f"it was saved by a run of {before}" if not same else "the end of its run, which finished; the recipe "
               "changed since" if finished else "the run's last step; it stopped before its final save, and the "
               "Trainer would run one step past its schedule's end")  # fmt: skip
        raise UserError(
            f"{name} is at step {step}, and {unit} is {now} ({run}): there is no step left to train",
            f"raise {unit} to train on; for the model at {name}: llmtune merge {checkpoint}; to train the recipe from "
            f"the start: {start_over(recipe)}",
        )
    if same:
        return None
    return (f"resuming {name} at step {step} with {unit} {before} -> {now}: the learning-rate schedule "
            f"({recipe.lr_scheduler}) is rebuilt for the new length, and goes on from step {step + 1} at its rate "
            "there")  # fmt: skip
