"""Which strategy to recommend: the seeds' decision guide as data, applied to the per-GPU estimates."""

from __future__ import annotations

from typing import Protocol


class Estimate(Protocol):
    """What recommend() needs of an estimate row (plan.estimate.Estimate), without importing that module back."""

    strategy: str

    def fits(self, gpu_memory: float, cpu_memory: float | None = None) -> bool: ...


# The seeds' decision guide as data. For each kind of cluster, strategies in order of preference, each
# with its reason; the first one whose per-GPU total fits (and whose offload fits the CPU) wins.
REASONS = {
    "single / DDP": "the model and its optimizer fit one GPU: plain data parallel has the least communication",
    "ZeRO-1": "sharding only the optimizer states is enough and costs no extra communication over DDP",
    "ZeRO-2": "sharding optimizer states and gradients is enough; parameters stay whole on every GPU",
    "pipeline": "the model doesn't fit one GPU but each stage's layers do; stages exchange only activations",
    "ZeRO-3": "only sharding the parameters too makes it fit (needed when even one layer is too big for a stage)",
    "FSDP full shard": "only sharding the parameters too makes it fit (needed when even one layer is too big for a stage)",
    "FSDP shard grad op": "sharding gradients and optimizer states is enough; parameters stay whole (FSDP's ZeRO-2)",
    "FSDP hybrid shard": "sharding within each machine fits and keeps the all-gathers off the slow links between machines",
    "ZeRO-2 + CPU offload": "nothing fits on the GPUs alone; offloading optimizer states and gradients to CPU does",
    "ZeRO-3 + CPU offload": "nothing fits on the GPUs alone; offloading parameters and optimizer to CPU does",
    "ZeRO-3 + NVMe offload": "even CPU memory is too small; ZeRO-Infinity offloads to NVMe",
    "context parallel": "sharding states is not enough: the activations of these long sequences must be split too; "
                        "context parallelism splits every row (and its activations) across GPUs",
    "tensor parallel": "sharding states is not enough: the activations (or one layer) must be split too, which only "
                       "tensor parallelism does; it needs the fast links inside one machine",
}  # fmt: skip
_OFFLOAD = ["ZeRO-2 + CPU offload", "ZeRO-3 + CPU offload", "ZeRO-3 + NVMe offload"]
PREFERENCE = {
    # one machine: pipeline before ZeRO-3 (the seeds' order: pipeline, ZeRO, tensor parallel)
    "one machine": ["single / DDP", "ZeRO-1", "ZeRO-2", "pipeline", "ZeRO-3", "FSDP full shard", "context parallel",
                    "tensor parallel", *_OFFLOAD],
    # several machines, fast interconnect (InfiniBand, NVLink across nodes): ZeRO/FSDP scale well
    "fast": ["single / DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full shard", "FSDP hybrid shard", "pipeline",
             "context parallel", "tensor parallel", *_OFFLOAD],
    # several machines, slow interconnect (Ethernet): keep the heavy traffic inside machines, DP + PP
    "slow": ["single / DDP", "ZeRO-1", "pipeline", "FSDP hybrid shard", "ZeRO-2", "ZeRO-3", "FSDP full shard",
             "context parallel", "tensor parallel", *_OFFLOAD],
}  # fmt: skip


def recommend(
    estimates: list[Estimate], gpu_memory: float, num_machines: int = 1, interconnect: str = "fast",
    cpu_memory: float | None = None,
) -> tuple[Estimate, str] | None:  # fmt: skip
    """The first strategy of the cluster's preference order whose total fits, with its reason; None if none does."""
    profile = "one machine" if num_machines <= 1 else interconnect
    by_name = {e.name: e for e in estimates}
    for name in PREFERENCE[profile]:
        row = by_name.get(name)
        if row is not None and row.fits(gpu_memory, cpu_memory):
            return row, REASONS[name]
    return None
