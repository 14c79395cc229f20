"""What a run saved, and a full state dict out of it: the final save, or the newest complete checkpoint.

A checkpoint of sharded states is consolidated with each engine's own tools: DeepSpeed ZeRO partitions with
DeepSpeed's zero_to_fp32, FSDP sharded state dicts with torch.distributed.checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError
from llmtune.post.shards import ShardWriter, iter_tensors


@dataclass
class RunWeights:
    kind: str  # "adapter" | "full" | "deepspeed" | "fsdp"
    folder: Path  # where the weights (or the checkpoint) are
    note: str


def find_weights(run: Path) -> RunWeights:
    from llmtune.train.checkpoints import last_complete

    def kind_of(folder: Path) -> str | None:
        if (folder / "adapter_config.json").exists():
            return "adapter"
        if (folder / "model.safetensors").exists() or (folder / "model.safetensors.index.json").exists():
            return "full"
        if any(folder.glob("pytorch_model*.bin")):
            return "full"
        if any(folder.glob("global_step*")) or (folder / "latest").exists():
            return "deepspeed"
        if any(folder.glob("pytorch_model_fsdp_*")) or any(folder.glob("model_fsdp_*")):
            return "fsdp"
        return None

    kind = kind_of(run)
    if kind in ("adapter", "full"):
        return RunWeights(kind, run, f"the final save in {run}")
    checkpoint = last_complete(run)
    if checkpoint is not None and (kind := kind_of(checkpoint)):
        how = {"deepspeed": "consolidated from its DeepSpeed ZeRO partitions",
               "fsdp": "consolidated from its FSDP sharded state dict"}.get(kind, "its full weights")  # fmt: skip
        return RunWeights(kind, checkpoint, f"{checkpoint.name}, {how} (the run has no final save)")
    raise UserError(f"{run} has no model, adapter or complete checkpoint to merge",
                    "train it first (llmtune train), or resume it so it saves")  # fmt: skip


def consolidate(weights: RunWeights) -> dict:
    """A sharded DeepSpeed/FSDP checkpoint as one full state dict (fp32)."""
    if weights.kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        tag = None
        if not (weights.folder / "latest").exists():
            tag = sorted(weights.folder.glob("global_step*"), key=lambda p: int(p.name[11:] or 0))[-1].name
        state = get_fp32_state_dict_from_zero_checkpoint(str(weights.folder), tag=tag)
        return {key.removeprefix("module."): value for key, value in state.items()}
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = next(
        iter(sorted(weights.folder.glob("pytorch_model_fsdp_*")) or sorted(weights.folder.glob("model_fsdp_*")))
    )
    state = _load_state_dict_from_keys(checkpoint_id=str(folder))
    return dict(state.get("model", state))


def write_full_weights(weights: RunWeights, writer: ShardWriter, target, progress: Callable) -> None:
    """A full fine-tune's weights (saved whole, or consolidated from a sharded checkpoint) into the writer."""
    if weights.kind == "full":
        for name, tensor in progress(iter_tensors(weights.folder), "writing shards", total=None):
            writer.add(name, tensor.to(target))
        return
    state = consolidate(weights)
    for name in progress(list(state), "writing shards", total=len(state)):
        writer.add(name, state.pop(name).to(target))
