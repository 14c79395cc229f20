"""`llmtune checkpoint PATH`: the checkpoints of a run (an output_dir) or one checkpoint folder, with the allocation
each was saved on (what a resume elsewhere has to match or convert), and the one a resume would pick.
`llmtune checkpoint reshard PATH`: make a checkpoint loadable on any world size ahead of the resume (ZeRO's: DeepSpeed's
universal checkpoint; the resume does it itself otherwise, on the first rank, while the others wait)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmtune.errors import UserError

Where = Annotated[str, typer.Argument(help="A run's output_dir or one checkpoint-N folder in it; or `reshard`, "
                                           "followed by one of those", show_default=False)]  # fmt: skip
Target = Annotated[Path | None, typer.Argument(help="With `reshard`: the checkpoint (or the run, for its newest).",
                                               show_default=False)]  # fmt: skip


def packed_run(run: Path) -> str | None:
    """What a run's checkpoints count as rows where its recipe packs the examples (sample_packing): packed
    sequences. For markers older than their `rows_are`."""
    from llmtune.post.consolidate import plan_recipe
    from llmtune.train.checkpoint.final import PACKED

    recipe = plan_recipe(run)
    return PACKED if recipe.get("sample_packing") and not recipe.get("rl") else None


def describe(folder: Path) -> list[str]:
    """One line per checkpoint of `folder` (an output_dir, or a checkpoint itself), oldest first."""
    from llmtune.plan.checkpoint_layout import files_in
    from llmtune.plan.checks import STRATEGY_TITLES
    from llmtune.plan.resume import UNIVERSAL_DONE
    from llmtune.train.checkpoint.folders import complete_checkpoints, incomplete_checkpoints, read_marker, step_of

    if read_marker(folder) is not None or folder.name.startswith("checkpoint-"):
        found = [folder]
    else:
        found = sorted([*complete_checkpoints(folder), *incomplete_checkpoints(folder)], key=step_of)
    lines = []
    for path in found:
        info = read_marker(path)
        if info is None:
            lines.append(f"{path.name:<16} no llmtune completion marker: an interrupted save, or another tool's "
                         "checkpoint (auto-resume ignores it; resume_from_checkpoint can name it)")  # fmt: skip
            continue
        strategy = info.get("strategy")
        world = info.get("world_size", "?")
        line = f"{path.name:<16} step {info.get('step', step_of(path))}, world size {world}"
        if strategy:
            layout = info.get("engine_layout") or {}
            shown = "; ".join(
                f"{key} {value}" for key, value in layout.items() if value not in ("none", "the Trainer's")
            )
            line += f" ({STRATEGY_TITLES.get(strategy, strategy)}{'; ' + shown if shown else ''})"
        if info.get("global_batch_size"):
            line += f", data parallel {info['data_parallel_size']}, global batch {info['global_batch_size']}"
        if info.get("rows_seen") is not None:
            unit = info.get("rows_are") or packed_run(path.parent) or "rows"
            line += f", {info['rows_seen']} {unit} seen" + (f" ({info['rows_per_epoch']} per epoch)"
                                                            if info.get("rows_per_epoch") else "")  # fmt: skip
        if "stages" in info:
            line += f", {info['stages']} pipeline stages"
        if (path / UNIVERSAL_DONE).is_file():
            line += "; converted to DeepSpeed's universal checkpoint"
        missing = sorted(set(info.get("files") or []) - set(files_in(path)))
        if missing:
            line += (
                f"; lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, which it was saved with "
                "(a resume refuses it)"
            )
        lines.append(line)
    return lines


def reshard(target: Path | None) -> None:
    """Convert a checkpoint so that any world size loads it (a ZeRO checkpoint to DeepSpeed's universal one)."""
    from llmtune.plan.checks import STRATEGY_TITLES
    from llmtune.plan.resume import MOVABLE
    from llmtune.train.checkpoint.folders import last_complete, read_marker

    if target is None:
        raise UserError(
            "`llmtune checkpoint reshard` needs the checkpoint", "llmtune checkpoint reshard OUTPUT_DIR/checkpoint-N"
        )
    if not target.is_dir():
        raise UserError(f"{target}: no such folder", "give a checkpoint-N folder, or a run's output_dir for its newest")
    checkpoint = target if read_marker(target) is not None else last_complete(target)
    info = read_marker(checkpoint) if checkpoint else None
    if info is None:
        raise UserError(f"{target}: no complete llmtune checkpoint (no {target.name}/llmtune-complete.json)",
                        "give a checkpoint-N folder a run saved, or its output_dir")  # fmt: skip
    strategy, world = info.get("strategy"), info.get("world_size")
    title = STRATEGY_TITLES.get(strategy, strategy or "an older llmtune")
    if strategy not in MOVABLE or info.get("mesh"):
        raise UserError(f"{checkpoint.name} was saved by {title}" + (" with a device mesh" if info.get("mesh") else "")
                        + f" on {world} process(es): llmtune resumes it only at that world size",
                        f"resume with --num-processes {world}")  # fmt: skip
    if not strategy.startswith("zero"):
        typer.echo(f"{checkpoint.name} ({title}) needs no conversion: it loads on any world size as it is")
        return
    from llmtune.plan.resume import zero_tag
    from llmtune.train.checkpoint.universal import convert, converted_folder

    if converted_folder(checkpoint):
        typer.echo(f"{checkpoint.name} was converted to DeepSpeed's universal checkpoint already")
        return
    if zero_tag(checkpoint) is None:
        raise UserError(f"{checkpoint.name} has no DeepSpeed engine state (no `latest` file naming a global_stepN "
                        "folder)", "give a checkpoint a ZeRO run saved")  # fmt: skip
    convert(checkpoint, typer.echo)
    typer.echo(f"{checkpoint.name} now resumes on any data-parallel size, and at another ZeRO stage, offload or "
               "sub-group size (the plan says how, e.g. `llmtune plan RECIPE --num-processes N`)")  # fmt: skip


def checkpoint(where: Where, target: Target = None) -> None:
    """Show a run's checkpoints (step, the world size and strategy that saved each, global batch, rows seen: packed
    sequences where sample_packing packs the examples), or, with `reshard`, convert one so that any world size
    resumes it."""
    from llmtune.train.checkpoint.folders import last_complete

    if where == "reshard":
        reshard(target)
        return
    if target is not None:
        raise UserError(f"unexpected argument {target}", "llmtune checkpoint PATH, or llmtune checkpoint reshard PATH")
    folder = Path(where)
    if not folder.exists():
        raise UserError(f"{folder}: no such folder", "give a run's output_dir or one of its checkpoint-N folders")
    lines = describe(folder)
    if not lines:
        raise UserError(f"{folder}: no checkpoint-N folders in it", "give a run's output_dir (the recipe's output_dir)")
    for line in lines:
        typer.echo(line)
    newest = last_complete(folder) if not folder.name.startswith("checkpoint-") else None
    if newest:
        typer.echo(f"a resume (auto_resume_from_checkpoints) starts from {newest.name}; on another world size, "
                   "`llmtune plan` says how it continues or why it can't")  # fmt: skip
