"""Resuming on another allocation: the checkpoint a run would resume from, the world it was saved on, and how the
run continues on this one (the same global batch, through gradient accumulation) or why it can't.

The checkpoint's marker (llmtune-complete.json) records its allocation; markers written before it did record only
the world size, and the rest is read from the recipe as it is today.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError
from llmtune.train.checkpoints import MARKER, last_complete  # torch-free

# Checkpoints another world size loads as they are, by family: DDP's hold every rank's full state (the model, the
# optimizer); plain FSDP2's are torch distributed checkpoints (or one full state dict), which reshard on load
MOVABLE = {"single": "replicated", "ddp": "replicated", "fsdp2": "fsdp2"}


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


def resume_checkpoint(recipe) -> Path | None:
    """The checkpoint `llmtune train` would resume from: resume_from_checkpoint, else the newest complete one."""
    if recipe.resume_from_checkpoint:
        return Path(recipe.resume_from_checkpoint)
    output_dir = Path(recipe.output_dir)
    try:
        if not recipe.auto_resume_from_checkpoints or not output_dir.is_dir():
            return None
        return last_complete(output_dir)
    except OSError:  # a name no file system takes (too long): nothing to resume; the run reports the path itself
        return None


def saved_allocation(recipe, checkpoint: Path) -> Saved | None:
    """The allocation `checkpoint` was saved on; None when it isn't an llmtune checkpoint that says."""
    try:
        info = json.loads((checkpoint / MARKER).read_text())
    except (OSError, ValueError):
        return None
    world = info.get("world_size")
    if not isinstance(world, int) or world < 1:
        return None
    data_parallel = info.get("data_parallel_size") or world
    batch = (
        info.get("global_batch_size") or recipe.micro_batch_size * recipe.gradient_accumulation_steps * data_parallel
    )
    return Saved(checkpoint, int(info.get("step", 0)), world, data_parallel, batch, info.get("strategy"),
                 info.get("mesh"))  # fmt: skip


def resumed_accumulation(
    recipe, strategy: str, world: int, data_parallel: int, mesh: dict | None, titles: dict[str, str]
) -> tuple[int, str] | None:
    """When the run resumes a checkpoint saved on another world size: (the gradient accumulation that keeps its
    global batch here, the line that says so). None when there is nothing to resume or the allocation is the same.
    UserError, with what will work, when it can't resume here. `titles`: the strategies' names, as the plan shows them."""
    checkpoint = resume_checkpoint(recipe)
    saved = saved_allocation(recipe, checkpoint) if checkpoint else None
    if saved is None or saved.world_size == world:
        return None
    name = saved.path.name
    written = saved.strategy or strategy
    if saved.strategy and MOVABLE.get(saved.strategy, saved.strategy) != MOVABLE.get(strategy, strategy):
        raise UserError(
            f"{name} was saved by {titles.get(written, written)}; this launch runs "
            f"{titles.get(strategy, strategy)}: a checkpoint resumes only under the strategy that wrote it",
            "resume with the recipe's strategy keys as they were, or start over in another output_dir "
            "(auto_resume_from_checkpoints: false trains from the start)",
        )
    if written not in MOVABLE or mesh or saved.mesh:
        title = titles.get(written, written) + (" (with a device mesh)" if mesh or saved.mesh else "")
        raise UserError(
            f"{name} was saved by {saved.world_size} process(es); this launch has {world}: llmtune resumes {title} "
            f"checkpoints only at the world size that wrote them (DDP's and plain FSDP2's on any)",
            f"resume with --num-processes {saved.world_size} (the allocation that saved it), or start over in "
            "another output_dir (auto_resume_from_checkpoints: false trains from the start)",
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
    accumulation = saved.global_batch_size // (micro * data_parallel)
    before = saved.global_batch_size // (micro * saved.data_parallel_size)
    line = (f"resuming {name} (world size {saved.world_size}) on world size {world}: gradient accumulation "
            f"{before} -> {accumulation}, global batch {saved.global_batch_size} kept")  # fmt: skip
    return accumulation, line
