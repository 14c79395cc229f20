"""The pipeline loop's checkpoint format, behind the checkpoint manager: each stage's weights, optimizer and
scheduler in its own file. Every stage of replica 0 writes its file into the manager's staging folder; the manager
marks it and renames it into place, so a crash mid-save leaves nothing resume would pick. Data order is a function of
(seed, epoch, step), so resuming needs only the step count; another number of stages is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmtune.train.checkpoint.folders import MARKER


def save_interval(recipe, steps_per_epoch: int, total_steps: int) -> int | None:
    if recipe.save_strategy == "no":
        return None
    if recipe.save_steps is not None:
        return max(1, round(recipe.save_steps * total_steps)) if recipe.save_steps < 1 else int(recipe.save_steps)
    if recipe.saves_per_epoch:
        return max(1, steps_per_epoch // recipe.saves_per_epoch)
    return steps_per_epoch


def write(staged: Path, step: int, grid, params: dict, optimizer, scheduler) -> None:
    """This stage's file of checkpoint-`step` (replica 0's stages write; the others hold the same states)."""
    if grid.replica == 0:
        staged.mkdir(parents=True, exist_ok=True)
        state = {"params": {n: p.detach().cpu().clone() for n, p in params.items()},
                 "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step}  # fmt: skip
        torch.save(state, staged / f"stage-{grid.stage}.pt")


def load(checkpoint: Path, grid, params: dict, optimizer, scheduler) -> tuple[int, list]:
    """Restore this stage from a checkpoint; returns the step to continue from and the loss history so far."""
    marker = json.loads((checkpoint / MARKER).read_text())
    if marker["stages"] != grid.stages:
        from llmtune.errors import UserError

        raise UserError(f"{checkpoint} was written with {marker['stages']} pipeline stages, this run has {grid.stages}",
                        "resume with the same pipeline_parallel_size, or start a new output_dir")  # fmt: skip
    state = torch.load(checkpoint / f"stage-{grid.stage}.pt", weights_only=True)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state["params"][name])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    return state["step"], marker["history"]
