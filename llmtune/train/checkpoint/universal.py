"""A ZeRO checkpoint resumed on another data-parallel size, through DeepSpeed's universal checkpoint.

A ZeRO checkpoint holds each rank's slice of the flat optimizer state, cut for the data-parallel size that wrote it.
DeepSpeed's `ds_to_universal` rewrites it as one folder per parameter (its fp32 weights and each optimizer state,
whole), and the engine loads that at any data-parallel size when its config says `checkpoint.load_universal`. The
plan sets that key when the sizes differ (llmtune/plan/resume.py); the first rank converts here before the engine
starts. DeepSpeed writes `<checkpoint>/latest_universal` after everything else, so its presence means a finished
conversion, and a half-written one (a killed job) is removed and redone.

Two repairs after DeepSpeed's ZeRO-3 universal load (DeepSpeed 0.19.8, runtime/zero/stage3.py
`load_hp_checkpoint_state_from_checkpoint_dir_stage3`): it gives every sub-group's optimizer state the same `step`
tensor, which Adam then advances once per sub-group at each step (a wrong bias correction); and it copies the first
parameter group's hyperparameters onto every group (the no-decay group gets weight decay). Both are undone from the
converted files. ZeRO-1/2 load both correctly.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from argparse import Namespace
from pathlib import Path

from llmtune.plan.resume import UNIVERSAL_DONE, zero_tag


def converted_folder(checkpoint: Path) -> Path | None:
    """The universal folder of a converted checkpoint; None when it was not (completely) converted."""
    try:
        name = (checkpoint / UNIVERSAL_DONE).read_text().strip()
    except OSError:
        return None
    return checkpoint / name if (checkpoint / name).is_dir() else None


def convert(checkpoint: Path, log=print) -> Path:
    """Convert a ZeRO checkpoint to DeepSpeed's universal checkpoint next to its engine state (one process, CPU);
    returns the universal folder. A finished conversion is kept as it is."""
    done = converted_folder(checkpoint)
    if done:
        return done
    tag = zero_tag(checkpoint)
    if tag is None:
        raise FileNotFoundError(f"{checkpoint}: no `latest` file naming a global_stepN folder (not a ZeRO checkpoint)")
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    output = checkpoint / f"{tag}_universal"
    shutil.rmtree(output, ignore_errors=True)  # what a killed conversion left
    started = time.time()
    args = Namespace(input_folder=str(checkpoint / tag), output_folder=str(output), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True,
                     # HF models carry no universal_checkpoint_info (DeepSpeed records it for its own TP modules only)
                     inject_missing_state=True)  # fmt: skip
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):  # its progress lines and bars
        ds_to_universal(args)  # failures raise
    size = sum(f.stat().st_size for f in output.rglob("*") if f.is_file())
    log(f"converted {checkpoint.name} to DeepSpeed's universal checkpoint ({output.name}, {size / 2**20:.1f} MiB) "
        f"in {time.time() - started:.1f} s")  # fmt: skip
    return output


def repair_zero3_load(zero_optimizer, folder: Path) -> int:
    """After DeepSpeed loaded a universal checkpoint into a ZeRO-3 optimizer: give each sub-group its own `step`
    tensor and each parameter group its own saved hyperparameters. Returns the number of groups restored."""
    import torch

    inner = zero_optimizer.optimizer  # the torch optimizer ZeRO-3 steps one sub-group at a time
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()
    # DeepSpeed's own file from this run's checkpoint; it pickles its loss scaler and ZeRO enums, and DeepSpeed
    # reads it the same way (weights_only=False) a moment before
    saved = torch.load(folder / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False)
    groups = saved["optimizer_state_dict"]["param_groups"]
    if len(groups) != len(inner.param_groups):
        raise RuntimeError(
            f"{folder}: {len(groups)} saved parameter groups, the optimizer has {len(inner.param_groups)}"
        )
    for group, kept in zip(inner.param_groups, groups, strict=True):
        group.update({key: value for key, value in kept.items() if key != "params"})
    return len(groups)
