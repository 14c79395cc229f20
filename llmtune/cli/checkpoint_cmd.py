"""`llmtune checkpoint PATH`: the checkpoints of a run (an output_dir) or one checkpoint folder, with the allocation
each was saved on (what a resume elsewhere has to match or convert), and the one a resume would pick."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmtune.errors import UserError

Where = Annotated[Path, typer.Argument(help="A run's output_dir, or one checkpoint-N folder in it.")]


def describe(folder: Path) -> list[str]:
    """One line per checkpoint of `folder` (an output_dir, or a checkpoint itself), oldest first."""
    import json

    from llmtune.plan.planner import STRATEGY_TITLES
    from llmtune.train.checkpoints import MARKER, complete_checkpoints, incomplete_checkpoints, step_of

    if (folder / MARKER).is_file() or folder.name.startswith("checkpoint-"):
        found = [folder]
    else:
        found = sorted([*complete_checkpoints(folder), *incomplete_checkpoints(folder)], key=step_of)
    lines = []
    for path in found:
        try:
            info = json.loads((path / MARKER).read_text())
        except (OSError, ValueError):
            lines.append(f"{path.name:<16} incomplete: a save that never finished (resume ignores it)")
            continue
        strategy = info.get("strategy")
        world = info.get("world_size", "?")
        line = f"{path.name:<16} step {info.get('step', step_of(path))}, world size {world}"
        if strategy:
            line += f" ({STRATEGY_TITLES.get(strategy, strategy)})"
        if info.get("global_batch_size"):
            line += f", data parallel {info['data_parallel_size']}, global batch {info['global_batch_size']}"
        if "stages" in info:
            line += f", {info['stages']} pipeline stages"
        lines.append(line)
    return lines


def checkpoint(where: Where) -> None:
    """Show a run's checkpoints: step, the world size and strategy that saved each, its global batch."""
    from llmtune.train.checkpoints import last_complete

    if not where.exists():
        raise UserError(f"{where}: no such folder", "give a run's output_dir or one of its checkpoint-N folders")
    lines = describe(where)
    if not lines:
        raise UserError(f"{where}: no checkpoint-N folders in it", "give a run's output_dir (the recipe's output_dir)")
    for line in lines:
        typer.echo(line)
    newest = last_complete(where) if not where.name.startswith("checkpoint-") else None
    if newest:
        typer.echo(f"a resume (auto_resume_from_checkpoints) starts from {newest.name}; on another world size, "
                   "`llmtune plan` says how it continues or why it can't")  # fmt: skip
