"""What a run saved, and a full state dict out of it: the final save, or the newest complete checkpoint.

A checkpoint of sharded states is consolidated with each engine's own tools: DeepSpeed ZeRO partitions with
DeepSpeed's zero_to_fp32, FSDP sharded state dicts with torch.distributed.checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError
from llmtune.train.model.shards import ShardWriter, iter_tensors


@dataclass
class RunWeights:
    kind: str  # "adapter" | "full" | "deepspeed" | "fsdp"
    folder: Path  # where the weights (or the checkpoint) are
    note: str


def find_weights(run: Path, chosen: Path | None = None) -> RunWeights:
    """The weights a merge reads: the final save, else the newest complete checkpoint; `chosen`: that checkpoint."""
    from llmtune.plan.checkpoint_layout import MARKER
    from llmtune.train.checkpoint.folders import last_complete

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

    kind = kind_of(run) if chosen is None else None
    if kind in ("adapter", "full"):
        return RunWeights(kind, run, f"the final save in {run}")
    if chosen is not None and not (chosen / MARKER).is_file():
        raise UserError(f"{chosen} is not a complete checkpoint (no {MARKER}: its save never finished)",
                        "merge a complete checkpoint-N of the run, or the run itself")  # fmt: skip
    checkpoint = chosen or last_complete(run)
    if checkpoint is not None and (run / "relora").is_dir():
        # a checkpoint's adapter is ReLoRA's current cycle only; the earlier ones are merged into the base weights
        # in memory, and only the final save stacks them all into one adapter
        if chosen is not None:
            raise UserError(f"{run} is a ReLoRA run: {checkpoint.name}'s adapter is the cycle it was in only (the "
                            "earlier cycles are folded into the base in memory, never saved)",
                            "merge the run's final save (llmtune merge RUN)")  # fmt: skip
        raise UserError(f"{run} is a ReLoRA run that stopped before its final save: {checkpoint.name}'s adapter is "
                        "its last cycle only", "resume the run (llmtune train, same recipe) so it saves the adapter "
                        "of every cycle, then merge")  # fmt: skip
    if checkpoint is not None and (kind := kind_of(checkpoint)):
        how = {"deepspeed": "consolidated from its DeepSpeed ZeRO partitions",
               "fsdp": "consolidated from its FSDP sharded state dict",
               "adapter": "its adapter"}.get(kind, "its full weights")  # fmt: skip
        why = "the checkpoint asked for" if chosen is not None else "the run has no final save"
        return RunWeights(kind, checkpoint, f"{checkpoint.name}, {how} ({why})")
    raise UserError(f"{run} has no model, adapter or complete checkpoint to merge",
                    "train it first (llmtune train), or resume it so it saves")  # fmt: skip


PLAN = Path("llmtune") / "plan.json"


def has_tokenizer(folder: str | Path | None) -> bool:
    """A tokenizer saved in this folder (a run's, a merged model's; an adapter or a checkpoint may have none)."""
    return folder is not None and any(
        (Path(folder) / name).exists() for name in ("tokenizer_config.json", "tokenizer.json")
    )


def run_of(folder: Path) -> tuple[Path, Path | None]:
    """(run, checkpoint) of a folder given to merge/eval/infer/chat: a run is (run, None); one checkpoint-N of a run is
    (its run, it), so its weights are read with the run's recipe and base. `.` from inside a checkpoint works too."""
    folder = folder.absolute()
    if folder.name.startswith("checkpoint-") and not (folder / PLAN).exists() and (folder.parent / PLAN).exists():
        return folder.parent, folder
    return folder, None


def loadable_weights(folder: Path, command: str) -> tuple[RunWeights | None, Path]:
    """For the commands that load a model as it is (eval, infer, chat): the weights of a run folder (its final save,
    else its newest complete checkpoint) or of one checkpoint-N of a run, and the run; sharded states send the user to
    a merge. (None, folder) where `folder` is no llmtune run (a model or adapter folder)."""
    folder = folder.absolute()
    run, chosen = run_of(folder)
    if not (run / PLAN).exists():
        return None, folder
    weights = find_weights(run, chosen)
    if weights.kind in ("deepspeed", "fsdp"):
        engine = "DeepSpeed ZeRO" if weights.kind == "deepspeed" else "FSDP"
        raise UserError(f"{weights.folder} holds sharded {engine} states, which only a merge turns into a model",
                        f"llmtune merge {weights.folder}, then llmtune {command} "
                        f"{run / f'merged-{weights.folder.name}'}")  # fmt: skip
    return weights, run


def plan_recipe(folder: Path) -> dict:
    """The recipe mapping a run (or its merged folder) saved in its plan, as written; {} where there is none or it
    can't be read (for what only sharpens a message or a prompt; run_recipe validates it)."""
    try:
        recipe = json.loads((folder / PLAN).read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        return {}
    return recipe if isinstance(recipe, dict) else {}


def run_recipe(run: Path, needed: bool = True, hint: str | None = None):
    """The recipe a run saved in its plan; one that this llmtune's schema no longer takes (a run of an older or newer
    llmtune) is one line when it is needed (an adapter's base, eval's data), else None."""
    import pydantic

    from llmtune.recipe import Recipe

    try:
        return Recipe.model_validate(json.loads((run / PLAN).read_text())["recipe"])
    except (OSError, ValueError, KeyError, pydantic.ValidationError) as err:
        if not needed:
            return None
        first = str(err).splitlines()[0][:160]
        raise UserError(f"{run / PLAN}: its recipe can't be read by this llmtune ({first})",
                        hint or f"pass the recipe with the model: llmtune eval RECIPE.yaml --model {run}") from None  # fmt: skip


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
    folder = next(
        iter(sorted(weights.folder.glob("pytorch_model_fsdp_*")) or sorted(weights.folder.glob("model_fsdp_*")))
    )
    return load_dcp_model(folder)


def load_dcp_model(folder: Path) -> dict:
    """The model tensors of a torch.distributed.checkpoint folder, whole, in this one process.

    DCP loads into a state dict it is given; the checkpoint's own metadata says each tensor's shape and dtype, so
    the template is built from it (public API only; see docs/private-api.md). accelerate saves FSDP's sharded state
    as {"model": state_dict}: the names are given back without that "model." level.
    """
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if isinstance(item, dcp.TensorStorageMetadata)}  # fmt: skip
    with warnings.catch_warnings():  # it warns that it loads in one process, which is what no_dist asks
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    paths = {key: tuple((metadata.planner_data or {}).get(key, (key,))) for key in state}  # key -> its nested path
    if any(len(path) > 1 and path[0] == "model" for path in paths.values()):
        return {".".join(map(str, path[1:])): state[key] for key, path in paths.items()
                if len(path) > 1 and path[0] == "model"}  # fmt: skip
    return state


def write_full_weights(weights: RunWeights, writer: ShardWriter, target, progress: Callable) -> None:
    """A full fine-tune's weights (saved whole, or consolidated from a sharded checkpoint) into the writer."""
    if weights.kind == "full":
        for name, tensor in progress(iter_tensors(weights.folder), "writing shards", total=None):
            writer.add(name, tensor.to(target))
        return
    state = consolidate(weights)
    for name in progress(list(state), "writing shards", total=len(state)):
        writer.add(name, state.pop(name).to(target))
