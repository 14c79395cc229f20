"""Checkpoints resume can trust, for the Trainer path and the pipeline loop alike.

A checkpoint is written into a staging folder, gets a marker file once every rank has finished
writing, and is renamed into `<output_dir>/checkpoint-N` in one step. Resume only picks folders
with the marker, so a crash or kill during a save leaves nothing it would load. Rotation
(`save_total_limit`) counts complete checkpoints only and never deletes the newest one.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from llmtune.plan.checkpoint_layout import (  # noqa: F401  (the layout, read by the plan too)
    MARKER,
    STAGING,
    STOP_FILE,
    complete_checkpoints,
    incomplete_checkpoints,
    last_complete,
    read_marker,
    step_of,
)


def stop_requested(config_dir: str | Path) -> bool:
    """Whether the launcher asked the ranks to checkpoint and stop; each machine's first rank looks (one stat)."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and (Path(config_dir) / STOP_FILE).exists()


def resume_point(recipe, log) -> str | None:
    """The newest checkpoint with the completion marker (auto-resume), else resume_from_checkpoint: the plan's
    resume_checkpoint, which says why."""
    from llmtune.plan.resume import newer_than_named

    named = recipe.resume_from_checkpoint
    output_dir = Path(recipe.output_dir)
    if not recipe.auto_resume_from_checkpoints or not output_dir.is_dir():
        return named
    last = last_complete(output_dir)
    if named and last is not None and newer_than_named(last, Path(named)):
        log(f"resuming {last.name} of this run, not resume_from_checkpoint {named} (where it started)")
        return str(last)
    if named:
        return named
    newest = step_of(last) if last else -1
    skipped = [p.name for p in incomplete_checkpoints(output_dir) if step_of(p) > newest]
    if skipped:
        log(f"ignoring {', '.join(skipped)}: not marked complete (an interrupted save, or another tool's checkpoint)")
    return str(last) if last else None


def clear_staging(output_dir: Path) -> None:
    """What a killed save left behind; called before training starts."""
    shutil.rmtree(Path(output_dir) / STAGING, ignore_errors=True)
    for stale in Path(output_dir).glob(".checkpoint-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def publish(staged: Path, final: Path, info: dict) -> None:
    """Mark a fully written checkpoint complete and move it into place (one rename)."""
    (staged / MARKER).write_text(json.dumps({**info, "time": time.time()}))
    if final.exists():  # the same step saved again (e.g. after a resume): replace it
        trash = final.with_name(f".{final.name}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(final, trash)
        os.replace(staged, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staged, final)


def rotate(output_dir: Path, limit: int | None, keep: Path | None = None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond `limit`; never the newest, never `keep` (the best)."""
    if not limit:
        return []
    done = complete_checkpoints(output_dir)
    newest = done[-1] if done else None
    removable = [
        p for p in done[: max(0, len(done) - limit)] if p != newest and (keep is None or p.resolve() != keep.resolve())
    ]
    for old in removable:
        shutil.rmtree(old, ignore_errors=True)
    return removable
