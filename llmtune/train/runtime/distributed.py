"""Per-rank process-group set-up and tear-down, for GPUs (NCCL) and for CPU rehearsal (gloo)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RankInfo:
    rank: int
    local_rank: int
    world_size: int
    training_kwargs: dict = field(default_factory=dict)  # extra TrainingArguments this strategy needs

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(plan: dict, collective_timeout: int = 1800) -> RankInfo:
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world != plan["world_size"]:  # an elastic job that formed with fewer machines (min_machines), or a mismatch
        from llmtune.plan.commands import elastic_sizes

        sizes = elastic_sizes(plan, world)
        plan.update(sizes)
        if rank == 0:
            print(f"[llmtune] elastic: {world} process(es) joined, so gradient accumulation is "
                  f"{sizes['gradient_accumulation_steps']} (global batch {plan['global_batch_size']} kept)",
                  file=sys.stderr, flush=True)  # fmt: skip
    from llmtune.train.runtime import collectives

    collectives.configure(plan["cluster"]["device"], local_rank)
    backend = backend_of(plan)
    if world > 1:
        _join_restarted_group(plan, rank, world, collective_timeout, backend)
    strategy = plan["strategy"]
    kwargs: dict = {}
    if world > 1 and (plan["cluster"]["device"], backend) == ("cuda", "gloo"):
        kwargs.update(_gloo_on_gpu(collective_timeout, local_rank))
    if plan["cluster"]["device"] == "cpu" and (world > 1 or strategy.startswith(("zero", "fsdp"))):
        from llmtune.train import rehearsal

        kwargs.update(rehearsal.configure(strategy))
    if strategy.startswith("zero"):
        kwargs["deepspeed"] = str(Path(plan["config_dir"]) / "deepspeed.json")
        if (plan.get("mesh") or {}).get("sequence_parallel") == "ulysses":
            kwargs["parallelism_config"] = ulysses_config(plan["mesh"]["context_parallel"])
        arch_list = arch_list_for_deepspeed(os.environ.get("TORCH_CUDA_ARCH_LIST"))
        if arch_list is not None and plan["cluster"]["device"] == "cuda":
            if rank == 0:
                print(f"[llmtune] TORCH_CUDA_ARCH_LIST {os.environ['TORCH_CUDA_ARCH_LIST']!r} -> {arch_list!r} for "
                      "DeepSpeed's op builder, which can't read arch suffixes", file=sys.stderr, flush=True)  # fmt: skip
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
    elif strategy.startswith("fsdp"):
        config = trainer_fsdp_config(plan["accelerate_config"]["fsdp_config"])
        if plan["cluster"]["device"] == "cpu":
            from llmtune.train import rehearsal

            config = rehearsal.fsdp_config(config)
        kwargs.update(fsdp=True, fsdp_config=config)
        if plan.get("mesh"):  # HSDP and context parallel: accelerate's own device mesh
            from accelerate import ParallelismConfig

            mesh = plan["mesh"]
            cp = mesh.get("context_parallel", 1)
            kwargs["parallelism_config"] = ParallelismConfig(dp_replicate_size=mesh["dp_replicate"],
                                                             dp_shard_size=mesh["dp_shard"], cp_size=cp)  # fmt: skip
            if cp > 1 and plan["cluster"]["device"] == "cpu":
                from llmtune.train import rehearsal

                rehearsal.context_parallel_on_cpu()
    return RankInfo(rank, local_rank, world, kwargs)


def backend_of(plan: dict) -> str:
    """The process group's backend: the plan's, else gloo on CPU and NCCL on GPUs."""
    return plan["cluster"].get("backend") or ("gloo" if plan["cluster"]["device"] == "cpu" else "nccl")


def ulysses_config(size: int):
    """accelerate's ParallelismConfig for DeepSpeed's Ulysses over `size` ranks; rows vary in length from batch to
    batch. The attention it wraps is set once the model is loaded (the worker names the model's own:
    llmtune_varlen, train/model/varlen.py, which accelerate's name check doesn't list but DeepSpeed takes, as it
    takes any attention transformers has registered)."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return ParallelismConfig(sp_backend="deepspeed", sp_size=size, sp_handler=handler)


def arch_list_for_deepspeed(value: str | None) -> str | None:
    """TORCH_CUDA_ARCH_LIST without arch-specific suffixes ("9.0a" -> "9.0"), or None when nothing needs it.

    DeepSpeed 0.19.8 builds its ops (async_io for NVMe offload, ...) for the listed archs and parses each minor
    number with int(): "9.0a", which Hopper images set, fails as "invalid literal for int() with base 10: '0a'"
    (measured on an H100, in zero.Init). The suffix only unlocks instructions those ops don't use.
    """
    import re

    if not value:
        return None
    parts = [part for part in re.split(r"[;\s]+", value.strip()) if part]
    fixed = [re.sub(r"^(\d+)\.(\d+)[a-z]+", r"\1.\2", part) for part in parts]
    return ";".join(dict.fromkeys(fixed)) if fixed != parts else None


def _gloo_on_gpu(collective_timeout: int, local_rank: int) -> dict:
    """Ranks sharing a GPU: form the group with gloo before accelerate would pick NCCL (which refuses two ranks
    on one GPU). accelerate, DeepSpeed and FSDP then find it formed; tensors stay on the GPU.

    accelerate's barrier (device_ids=[LOCAL_RANK]), the Trainer's DDP (device_ids) and DeepSpeed's set_device all
    take LOCAL_RANK for a GPU index: with more ranks than GPUs, rank 1 names a GPU that doesn't exist (measured on
    an H100: "invalid device ordinal", three places). So LOCAL_RANK becomes the GPU this rank shares."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=collective_timeout))
    os.environ["LOCAL_RANK"] = str(local_rank % max(torch.cuda.device_count(), 1))
    return {"ddp_backend": "gloo"}


def _join_restarted_group(plan: dict, rank: int, world: int, collective_timeout: int, backend: str) -> None:
    """After an elastic restart, form the process group under a fresh key prefix.

    torchrun's static rendezvous keeps one store for every attempt, so the restarted ranks would read the
    dead ranks' addresses from it (gloo: connection refused). A prefix per attempt isolates them;
    accelerate and DeepSpeed then find the group already formed.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or plan.get("rdzv_backend", "static") != "static":
        return  # c10d hands every round a fresh store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE), and restart counts differ
        # between a machine that restarted and the survivors, so a prefix by attempt would split them
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=collective_timeout)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout)  # fmt: skip
    dist.init_process_group(backend, store=dist.PrefixStore(f"llmtune/attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)  # fmt: skip


def trainer_fsdp_config(section: dict) -> dict:
    """TrainingArguments' fsdp_config from the accelerate config's fsdp section (one source of truth)."""
    config = {key.removeprefix("fsdp_"): value for key, value in section.items()}
    config["version"] = config.pop("version")
    config["cpu_offload"] = config.pop("offload_params", False)
    if config.get("version") == 1:
        config["reshard_after_forward"] = config.pop("sharding_strategy", "FULL_SHARD")
    return config
