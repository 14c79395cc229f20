"""What each rank actually did, gathered on every rank: the check that a run is not silently wrong.

Each rank reports its rank, the world size it sees, and a fingerprint of its first batch. If the
world size differs from the plan, or two data-parallel ranks got the same first batch (data not
split: the failure mode of DeepSpeed or FSDP quietly degrading on CPU), the run stops.
"""

from __future__ import annotations

import socket

from llmtune.errors import UserError
from llmtune.plan.mesh import ranks_per_batch
from llmtune.train.data.collate import fingerprint
from llmtune.train.runtime import collectives


class SilentlyWrongRun(RuntimeError):
    pass


def gather(report: dict) -> list[dict]:
    return collectives.all_gather_objects(report)


def duplicate_rows(dataset) -> int:
    """Rows of the train set that repeat an earlier row (0: every row is distinct): tokenized rows by their
    input_ids, online RL's prompt rows (no input_ids until generation) by their content."""
    import json

    seen: set[int] = set()
    for index in range(len(dataset)):
        row = dataset[index]
        ids = row.get("input_ids") if isinstance(row, dict) else None
        seen.add(hash(tuple(ids)) if ids is not None else hash(json.dumps(row, sort_keys=True, default=str)))
    return len(dataset) - len(seen)


def check_first_batch(input_ids, plan: dict, accelerate_world: int, dataset, whole: tuple | None = None) -> list[dict]:
    """Gather every rank's view of the run and stop it if the ranks don't form the planned job.

    `dataset`: the train rows (each with input_ids), read only when two data-parallel groups collide."""
    world, rank = collectives.world_size(), collectives.rank()
    report = {"rank": rank, "host": socket.gethostname(), "world_size": world, "accelerate_world_size": accelerate_world,
              "first_batch": fingerprint(input_ids), "first_batch_width": int(input_ids.shape[-1])}  # fmt: skip
    if whole is not None:  # Ulysses: this rank holds a chunk of each row; the batch is the one its group splits
        report.update(first_batch=whole[0], first_batch_width=whole[1], chunk=report["first_batch"],
                      chunk_width=report["first_batch_width"])  # fmt: skip
    reports = gather(report)
    planned = plan["world_size"]
    for seen in reports:
        if seen["world_size"] != planned or seen["accelerate_world_size"] != planned:
            raise SilentlyWrongRun(
                f"rank {seen['rank']} sees world size {seen['world_size']} (accelerate: {seen['accelerate_world_size']}) "
                f"but the plan has {planned}; the ranks would not train as one job"
            )
    # Every data-parallel rank (pipeline runs use their own loop) must see its own rows: first batches differ
    # between data-parallel groups, and are the same within a tensor- or context-parallel group (consecutive
    # ranks, which split one forward pass by layer slices or by sequence chunks).
    mesh = plan.get("mesh") or {}
    group = ranks_per_batch(mesh)  # consecutive ranks that share rows
    groups: dict[int, set] = {}
    for seen in reports:
        groups.setdefault(seen["rank"] // group, set()).add(seen["first_batch"])
    if any(len(batches) > 1 for batches in groups.values()):
        raise SilentlyWrongRun("the ranks of one tensor-parallel group received different batches: each would "
                               "compute its slice of a different forward pass")  # fmt: skip
    _check_groups_differ(groups, group, plan, dataset)
    return reports


def _check_groups_differ(groups: dict[int, set], group: int, plan: dict, dataset) -> None:
    """At most one pair of data-parallel groups may share a first batch, and only when the dataset repeats rows
    (two copies of a row can open two groups' batches by chance); more is a sharding bug, not chance."""
    if len(dataset) < plan["micro_batch_size"] * plan["data_parallel_size"]:
        return  # too few rows to give every group its own first batch: the sampler wraps around and repeats them
    ranks_by_batch: dict[str, list[int]] = {}
    for index, batches in sorted(groups.items()):
        ranks_by_batch.setdefault(next(iter(batches)), []).append(index * group)
    same = [ranks for ranks in ranks_by_batch.values() if len(ranks) > 1]
    pairs = sum(len(ranks) * (len(ranks) - 1) // 2 for ranks in same)
    if not pairs:
        return
    repeated = duplicate_rows(dataset) if pairs == 1 else None  # hashing every row only where it can decide
    if repeated:
        return
    named = "; ".join(" and ".join(map(str, ranks)) for ranks in same)
    why = (f"{pairs} colliding pairs among {len(groups)} groups (repeated rows explain at most one)" if pairs > 1
           else "and the dataset has no repeated rows")  # fmt: skip
    raise SilentlyWrongRun(f"data-parallel ranks {named} received the same first batch, {why}: the data is not being "
                           "split across ranks, so they would train on the same examples")  # fmt: skip


SEQUENCE_MIXERS = (
    "Mamba",
    "DeltaNet",
    "LinearAttention",
    "LightningAttention",
    "ShortConv",
    "Recurrent",
    "Rwkv",
    "SSM",
)


def check_attention_only(model) -> None:
    """Context parallelism splits attention only: refuse a model with other sequence-mixing layers (from the loaded
    module classes, for families the planner's list doesn't name)."""
    for name, module in model.named_modules():
        kind = type(module).__name__
        if any(word in kind for word in SEQUENCE_MIXERS):
            raise UserError(f"context parallelism for {type(model).__name__} is not supported: {name} ({kind}) mixes "
                            "tokens outside attention and would see each rank's chunk as a whole sequence",
                            "use tensor_parallel_size or FSDP2 alone")  # fmt: skip


class SequenceSeen:
    """Context parallelism: the sequence lengths this rank's model receives in its first forward passes."""

    def __init__(self, model, steps: int = 2):
        self.lengths: list[int] = []
        self.steps = steps
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._record)

    def _record(self, module, args):
        if len(self.lengths) < self.steps:
            self.lengths.append(int(args[0].shape[-1]))
        else:
            self.handle.remove()


def local_parameter_numel(model) -> int:
    """Parameters this rank actually holds: its ZeRO-3 partition or FSDP shard, else the full tensor. FSDP2 keeps
    the root module's parameters gathered after a forward without backward (an evaluation's): they are sharded
    again first (FSDPModule.reshard), as the next step would."""
    from llmtune.train.runtime.memory import local_tensor

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        FSDPModule = ()  # noqa: N806
    for module in model.modules():
        if FSDPModule and isinstance(module, FSDPModule):
            module.reshard()
    return sum(local_tensor(param).numel() for param in model.parameters())


def checkpointing_report(model) -> str:
    """Who recomputes activations in this rank's live model: "fsdp" (torch's checkpoint wrapper around layers,
    accelerate's FSDP activation_checkpointing), "model" (the model's own, transformers') or "none"."""
    # by the class's ancestry: FSDP2's fully_shard gives each module it shards a subclass ("FSDPCheckpointWrapper")
    if any(any(c.__name__ == "CheckpointWrapper" for c in type(module).__mro__) for module in model.modules()):
        return "fsdp"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    on = getattr(base, "is_activation_checkpointing", None)
    on = getattr(base, "is_gradient_checkpointing", False) if on is None else on
    return "model" if on else "none"


def optimizer_report(optimizer) -> dict:
    """The optimizer this rank stepped (the torch one inside accelerate's or DeepSpeed's wrapper): its class, whether
    its kernel is fused, and the peak learning rate of each parameter group (lr_groups, embedding_lr, LoRA+)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    rates = sorted({group.get("initial_lr", group["lr"]) for group in inner.param_groups})
    return {"optimizer_class": type(inner).__name__, "optimizer_fused": bool(getattr(inner, "defaults", {}).get("fused")),
            "optimizer_peak_rates": rates}  # fmt: skip


def engine_report(trainer) -> dict:
    """What this rank really ran, read from the live engine objects after training (not from the plan).

    Loss parity cannot tell ZeRO-1 from ZeRO-2 or DDP, nor ZeRO-3 with offload from without: these can.
    """
    wrapped = trainer.model_wrapped
    kind = type(wrapped).__name__
    split = _mesh_report(trainer.model)
    if split:
        fsdp2 = _fsdp2_units(trainer.model)
        return {"engine": "tensor_parallel" + ("+fsdp2" if fsdp2 else ""), "wrapped_units": fsdp2, **split}
    if kind == "DeepSpeedEngine":
        return _deepspeed_report(wrapped, getattr(trainer.args, "parallelism_config", None))
    if kind == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel

        return {"engine": "fsdp1", "sharding_strategy": wrapped.sharding_strategy.name,
                "state_dict_type": FullyShardedDataParallel.get_state_dict_type(wrapped).state_dict_type.name,
                "wrapped_units": sum(isinstance(m, FullyShardedDataParallel) for m in wrapped.modules())}  # fmt: skip
    fsdp2 = _fsdp2_units(trainer.model)
    if fsdp2:
        plugin = trainer.accelerator.state.fsdp_plugin
        # "Shard(0)": torch prints placements as S(0) or Shard(dim=0) depending on the version
        placements = {f"{type(pl).__name__}({getattr(pl, 'dim', '')})" for p in trainer.model.parameters()
                      for pl in getattr(p, "placements", ())[:1]}  # fmt: skip
        mesh = next((p.device_mesh for p in trainer.model.parameters() if hasattr(p, "device_mesh")), None)
        shape = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=False)) if mesh is not None else {}
        return {"engine": "fsdp2", "wrapped_units": fsdp2, "placements": sorted(placements), "mesh": shape,
                "state_dict_type": str(plugin.state_dict_type).rsplit(".", 1)[-1]}  # fmt: skip
    if kind == "DistributedDataParallel":
        return {"engine": "ddp", "optimizer": type(trainer.optimizer.optimizer).__name__}
    return {"engine": "none", "optimizer": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__}


def _mesh_report(model) -> dict | None:
    """A tensor-parallel model's device mesh as this rank holds it: dimension sizes, this rank's coordinates, and
    the local shapes of the first layer's weights (what each rank really keeps of them)."""
    mesh, shapes = None, {}
    for name, param in model.named_parameters():
        if not hasattr(param, "device_mesh"):
            continue
        if param.device_mesh.mesh_dim_names and "tp" in param.device_mesh.mesh_dim_names:
            mesh = mesh or param.device_mesh
        if ".layers.0." in name or ".h.0." in name:
            shapes[name] = list(param.to_local().shape)
    if mesh is None:
        return None
    names = mesh.mesh_dim_names
    return {"mesh": dict(zip(names, mesh.mesh.shape, strict=True)),
            "coordinates": dict(zip(names, mesh.get_coordinate() or [], strict=False)), "local_shapes": shapes}  # fmt: skip


def _deepspeed_report(engine, parallelism=None) -> dict:
    zero = engine.optimizer
    name = type(zero).__name__
    if name == "DeepSpeedZeroOptimizer_Stage3":
        stage, optimizer_offloaded, param_offloaded = 3, zero.offload_optimizer, zero.offload_param
    elif name == "DeepSpeedZeroOptimizer":
        stage, optimizer_offloaded, param_offloaded = (2 if zero.partition_gradients else 1), zero.cpu_offload, False
    else:
        stage, optimizer_offloaded, param_offloaded = 0, False, False

    def device(offloaded: bool, config) -> str:
        return str(getattr(config, "device", "none")).rsplit(".", 1)[-1] if offloaded else "none"

    report = {"engine": "deepspeed", "zero_stage": stage, "zero_optimizer": name,
              "optimizer": type(engine.basic_optimizer).__name__,
              "weight_decay": [group.get("weight_decay") for group in engine.basic_optimizer.param_groups],
              "offload_optimizer": device(optimizer_offloaded, engine.zero_offload_optimizer()),
              "offload_param": device(param_offloaded, engine.zero_offload_param())}  # fmt: skip
    if getattr(engine, "sequence_parallel_size", 1) > 1:  # Ulysses: its group, and whether it wraps the attention
        from deepspeed.runtime.sequence_parallel import parallel_state_sp
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attention = parallelism.sp_handler.sp_attn_implementation
        report["sequence_parallel"] = {"size": engine.sequence_parallel_size, "attention": attention,
                                       "rank": parallel_state_sp.get_sequence_parallel_rank(),
                                       "wrapper": getattr(ALL_ATTENTION_FUNCTIONS[attention], "__name__", "")}  # fmt: skip
    return report


def _fsdp2_units(model) -> int:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    return sum(isinstance(module, FSDPModule) for module in model.modules())
