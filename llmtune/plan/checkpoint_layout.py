"""What a checkpoint folder is on disk, torch-free: `<output_dir>/checkpoint-N`, complete once it holds the marker
(llmtune-complete.json, written last: what the run that saved it was), the staging folder saves are written into,
and the file the launcher leaves to ask the ranks to checkpoint and stop. The plan reads it to plan a resume; the
launcher and the checkpoint manager (llmtune/train/checkpoint/) read and write by it."""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER = "llmtune-complete.json"
STAGING = ".checkpoint-staging"
STOP_FILE = "stop-requested"  # in <config_dir>: the launcher asks the ranks to checkpoint and stop (SIGUSR1)


def step_of(path: Path) -> int:
    try:
        return int(path.name.rsplit("-", 1)[-1])
    except ValueError:
        return -1


def complete_checkpoints(output_dir: Path) -> list[Path]:
    found = [p for p in Path(output_dir).glob("checkpoint-*") if (p / MARKER).is_file()]
    return sorted(found, key=step_of)


def incomplete_checkpoints(output_dir: Path) -> list[Path]:
    return sorted((p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and not (p / MARKER).is_file()),
                  key=step_of)  # fmt: skip


def last_complete(output_dir: Path) -> Path | None:
    done = complete_checkpoints(output_dir)
    return done[-1] if done else None


def read_marker(checkpoint: str | Path) -> dict | None:
    """What a complete checkpoint's marker says of the run that saved it; None when there is no readable marker."""
    try:
        info = json.loads((Path(checkpoint) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def files_in(folder: Path) -> list[str]:
    """The files of a checkpoint folder, as paths relative to it (the marker left out: it is written after)."""
    folder = Path(folder)
    found = []
    for root, _, names in os.walk(folder):
        for name in names:
            relative = (Path(root) / name).relative_to(folder).as_posix()
            if relative != MARKER:
                found.append(relative)
    return sorted(found)
