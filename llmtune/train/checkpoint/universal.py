"""A checkpoint DeepSpeed resumes through its universal checkpoint: a ZeRO checkpoint on another data-parallel size
or in another ZeRO layout (stage, offload, sub-group size), and a DDP checkpoint of a full fine-tune under ZeRO.

A ZeRO checkpoint holds each rank's slice of the flat optimizer state, cut for the data-parallel size that wrote it.
DeepSpeed's `ds_to_universal` rewrites it as one folder per parameter (its fp32 weights and each optimizer state,
whole), and the engine loads that at any data-parallel size when its config says `checkpoint.load_universal`; a DDP
checkpoint's weights and AdamW state are written in the same form here (`from_replicated`). The plan sets that key
when the sizes, the layouts or the strategies differ (llmtune/plan/resume.py, relayout.py); the first rank converts
before the engine starts, and `fit_layout` writes what the new layout's engine reads beside the per-parameter
files. `<checkpoint>/latest_universal` is written after everything else, so its presence means a finished
conversion, and a half-written one (a killed job) is removed and redone.

Repairs after DeepSpeed's universal load (DeepSpeed 0.19.8): ZeRO-3 (runtime/zero/stage3.py
`load_hp_checkpoint_state_from_checkpoint_dir_stage3`) gives every sub-group's optimizer state the same `step`
tensor, which Adam then advances once per sub-group at each step (a wrong bias correction), and copies the first
parameter group's hyperparameters onto every group (the no-decay group gets weight decay); both are undone from the
converted files. Every stage sets `step` as the file holds it, a tensor, where DeepSpeed's CPU Adam (offload) counts
in a number and torch's Adam refuses a number: it is given the type the optimizer steps.
"""

from __future__ import annotations

import contextlib
import io
import os
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


def fit_layout(
    checkpoint: Path, folder: Path, stage: int, engine_schedules: bool, decays: list[float] | None = None
) -> list[str]:
    """Make a universal folder loadable by another ZeRO layout than the one that saved it (another stage, offload on
    or off, another sub-group size): what the engine of `stage` reads beside the per-parameter files. Returns what
    was written. ZeRO-1/2 read the optimizer's global state at the top of zero/optimizer_state.pt and its model
    states (the step, the schedule) from mp_rank_00_model_states.pt; ZeRO-3 reads them under optimizer_state_dict and
    from zero_pp_rank_0_mp_rank_00_model_states.pt. Who steps the learning-rate schedule moves with the optimizer's
    builder: DeepSpeed (a config's optimizer section) keeps its state in the model states, the Trainer in
    scheduler.pt. So does the grouping: DeepSpeed builds one group of every parameter, the Trainer two (weight decay
    and none), offloaded or not. `decays`: the weight decay of each of this layout's groups when the grouping
    changed; the saved groups must then share one learning rate, which each new group continues."""
    import torch

    written = []
    global_path = folder / "zero" / "optimizer_state.pt"
    saved = torch.load(global_path, map_location="cpu", weights_only=False)  # DeepSpeed's own file, as it reads it
    inner = saved.get("optimizer_state_dict") or {}
    groups = saved.get("param_groups") or inner.get("param_groups")
    if not groups:
        raise RuntimeError(f"{global_path}: no parameter groups")
    if decays is not None and len(decays) != len(groups):
        groups = [{**_uniform(groups, global_path), "weight_decay": decay} for decay in decays]
    step = ((inner.get("state") or {}).get(0) or {}).get("step")  # ZeRO-3's conversion keeps it here
    step = _saved_step(folder) if step is None else step
    wanted = {"param_groups": groups, "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": groups}}
    if any(saved.get(key) != value for key, value in wanted.items()):
        saved.update(wanted)
        _replace(global_path, lambda path: torch.save(saved, path))
        written.append(global_path.name)
    states = sorted(folder.glob("*model_states.pt"))
    if not states:
        raise RuntimeError(f"{folder}: no model states file")
    model = torch.load(states[0], map_location="cpu", weights_only=False, mmap=True)
    scheduler = checkpoint / "scheduler.pt"
    kept = model.get("lr_scheduler")
    if kept is None:
        kept = torch.load(scheduler, map_location="cpu", weights_only=True)  # (a state dict of numbers)
    schedule = _fit_schedule(kept, len(groups), checkpoint)  # (DeepSpeed drops empty groups: a DDP LoRA's second)
    model["lr_scheduler"] = schedule if engine_schedules else None
    if not engine_schedules and (schedule is not kept or not scheduler.is_file()):  # where the Trainer reads it
        _replace(scheduler, lambda path: torch.save(schedule, path))
        written.append(scheduler.name)
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
    model["module"] = {}  # a universal load takes the weights from zero/ (a ZeRO-1/2 file holds all of them)
    _replace(folder / name, lambda path: torch.save(dict(model), path))
    written.append(name)
    return written


def _uniform(groups: list[dict], path: Path) -> dict:
    """The one set of hyperparameters groups share (weight decay aside), for regrouping them."""
    first = {key: value for key, value in groups[0].items() if key not in ("params", "weight_decay")}
    for group in groups[1:]:
        if any(group.get(key) != value for key, value in first.items()):
            raise RuntimeError(f"{path}: its parameter groups differ beyond weight decay; they can't be regrouped")
    return first


def _fit_schedule(state: dict, groups: int, checkpoint: Path) -> dict:
    """A LambdaLR state with one entry per parameter group (DeepSpeed's optimizer has one, the Trainer's two); the
    schedule is the same function of the step for every group, so an entry is repeated or dropped."""
    lists = [key for key in ("base_lrs", "_last_lr", "lr_lambdas") if isinstance(state.get(key), list)]
    if all(len(state[key]) == groups for key in lists):
        return state
    if any(state[key] and any(item != state[key][0] for item in state[key]) for key in lists):
        raise RuntimeError(f"{checkpoint}: its schedule differs between parameter groups; it can't be regrouped")
    return {**state, **{key: [state[key][0]] * groups for key in lists if state[key]}}


def _saved_step(folder: Path):
    """The optimizer step the per-parameter files were saved at (a ZeRO-1/2 conversion writes step.pt)."""
    import torch

    for path in sorted((folder / "zero").glob("*/step.pt")):
        return torch.load(path, map_location="cpu", weights_only=False)
    raise RuntimeError(f"{folder / 'zero'}: no step.pt")


def _replace(path: Path, write) -> None:
    staged = path.with_name(path.name + ".tmp")
    write(staged)
    os.replace(staged, path)


def repair_universal_load(zero_optimizer, folder: Path, stage: int) -> int:
    """After DeepSpeed loaded a universal checkpoint: give each sub-group its own `step`, in the type the optimizer
    steps (torch's Adam a tensor, DeepSpeed's CPU Adam a number) and, for ZeRO-3, each parameter group its own saved
    hyperparameters. Returns the number of groups restored."""
    import torch

    inner = zero_optimizer.optimizer  # the torch optimizer ZeRO steps (ZeRO-3: one sub-group at a time)
    numeric = type(inner).__name__.startswith("DeepSpeedCPU")
    for state in inner.state.values():
        step = state.get("step")
        if step is None:
            continue
        value = float(step.item() if torch.is_tensor(step) else step)
        state["step"] = int(value) if numeric else torch.tensor(value, dtype=torch.float32)
    if stage != 3:
        return 0
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


def from_replicated(checkpoint: Path, model, step: int, data_parallel: int, log=print) -> Path:
    """Write a DDP (or one process's) checkpoint of a full fine-tune as DeepSpeed's universal checkpoint, so that a
    ZeRO run resumes it with AdamW's moments: each trainable parameter's weights (the saved model's), exp_avg,
    exp_avg_sq and step, under the name DeepSpeed gives it. optimizer.pt holds the state by position in the Trainer's
    two groups (weight decay, then none, in the model's order); the live model (`model`, as the resuming run loaded
    it) gives the names, and each saved state's shape must be its parameter's. Returns the universal folder."""
    import deepspeed
    import torch
    from transformers import Trainer

    done = converted_folder(checkpoint)
    if done:
        return done
    saved = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)  # torch's own state dict
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    decay = set(Trainer.get_decay_parameter_names(None, model))  # (the Trainer's grouping; it reads no state)
    order = [item for item in trainable if item[0] in decay] + [item for item in trainable if item[0] not in decay]
    sizes = [len(group["params"]) for group in saved["param_groups"]]
    expected = [sum(name in decay for name, _ in trainable), sum(name not in decay for name, _ in trainable)]
    if sizes != expected:
        raise RuntimeError(f"{checkpoint / 'optimizer.pt'}: parameter groups of {sizes} parameters; this model's "
                           f"trainable parameters group as {expected}")  # fmt: skip
    weights = _saved_weights(checkpoint)
    adapter = getattr(model, "active_adapter", None)  # peft saves a LoRA's tensors without its adapter's name
    if isinstance(adapter, str):
        weights = {_named(name, adapter): tensor for name, tensor in weights.items()}
    output = checkpoint / f"global_step{step}_universal"
    shutil.rmtree(output, ignore_errors=True)  # what a killed conversion left
    started = time.time()
    positions = [index for group in saved["param_groups"] for index in group["params"]]
    for index, (name, param) in zip(positions, order, strict=True):
        state = saved["state"].get(index) or {}
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if set(state) != {"step", "exp_avg", "exp_avg_sq"} or tuple(state["exp_avg"].shape) != shape:
            raise RuntimeError(
                f"{checkpoint / 'optimizer.pt'}: the state of {name} isn't AdamW's for its shape {shape}"
            )
        found = weights.get(name)
        if found is None:
            raise RuntimeError(f"{checkpoint}: the saved model has no {name}")
        folder = output / "zero" / name
        folder.mkdir(parents=True)
        for key, tensor in (
            ("fp32", found),
            ("exp_avg", state["exp_avg"]),
            ("exp_avg_sq", state["exp_avg_sq"]),
        ):
            torch.save({"cat_dim": 0, "param": tensor.float().contiguous()}, folder / f"{key}.pt")
        torch.save(torch.tensor(float(state["step"])), folder / "step.pt")
    kept = [group for group in saved["param_groups"] if group["params"]]  # (ZeRO drops an empty group: a LoRA's)
    groups = [{**{key: value for key, value in group.items() if key != "params"}, "params": [number]}
              for number, group in enumerate(kept)]  # fmt: skip
    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__}, output / "zero" / "optimizer_state.pt")
    torch.save({"module": {}, "optimizer": None, "lr_scheduler": None, "global_steps": step,
                "global_samples": 0, "skipped_steps": 0, "dp_world_size": data_parallel, "mp_world_size": 1,
                "ds_version": deepspeed.__version__, "buffer_names": [], "data_sampler": None, "random_ltd": None},
               output / "mp_rank_00_model_states.pt")  # fmt: skip
    (checkpoint / UNIVERSAL_DONE).write_text(output.name)  # last: the conversion is complete
    log(f"converted {checkpoint.name} to DeepSpeed's universal checkpoint ({output.name}, {len(order)} parameters "
        f"with AdamW's state) in {time.time() - started:.1f} s")  # fmt: skip
    return output


def _named(saved: str, adapter: str) -> str:
    """A LoRA tensor's name in the model (`...lora_A.default.weight`) from its name in adapter_model.safetensors."""
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"):
        saved = saved.replace(f".{part}.", f".{part}.{adapter}.")
    return saved


def _saved_weights(checkpoint: Path) -> dict:
    """The saved model's tensors by name (model.safetensors or its shards; a LoRA's adapter_model.safetensors)."""
    from safetensors.torch import load_file

    files = sorted(checkpoint.glob("model*.safetensors")) or sorted(checkpoint.glob("adapter_model.safetensors"))
    if not files:
        raise RuntimeError(f"{checkpoint}: no model*.safetensors or adapter_model.safetensors")
    weights = {}
    for path in files:
        weights.update(load_file(path))
    return weights
