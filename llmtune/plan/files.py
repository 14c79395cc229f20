"""Write a plan's files: what `llmtune plan --write` and `llmtune train` leave for people to read."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from llmtune.plan.planner import Plan


def atomic_write(path: Path, text: str) -> None:
    """Write a file so that a reader never sees it half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a run's files are meant to be shared
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def plan_files(plan: Plan, recipe_dict: dict, recipe_path: str, notes: list[str]) -> dict[str, str]:
    """File name -> text for everything a run's llmtune/ folder holds."""
    files = {
        "plan.json": json.dumps(
            {"plan": plan.to_dict(), "recipe": recipe_dict, "recipe_path": recipe_path, "notes": notes},
            indent=2,
            sort_keys=False,
        )
        + "\n",
        "recipe.resolved.yaml": yaml.safe_dump(recipe_dict, sort_keys=False),
    }
    if plan.accelerate_config:
        files["accelerate_config.yaml"] = yaml.safe_dump(plan.accelerate_config, sort_keys=True)
    if plan.deepspeed_config:
        files["deepspeed.json"] = json.dumps(plan.deepspeed_config, indent=2) + "\n"
    return files


def write_plan_files(directory: Path, files: dict[str, str]) -> list[Path]:
    written = []
    for name, text in files.items():
        atomic_write(directory / name, text)
        written.append(directory / name)
    return written
