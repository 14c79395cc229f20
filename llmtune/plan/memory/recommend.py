"""The recommendation: the seeds' decision guide as data (for each kind of cluster, strategies in order of
preference, each with its reason), applied to the estimate's rows and to what the recipe can run."""

from __future__ import annotations

from llmtune.plan.memory.peak import Estimate

# The seeds' decision guide as data. For each kind of cluster, strategies in order of preference, each
# with its reason; the first one whose per-GPU total fits (and whose offload fits the CPU) wins.
REASONS = {
    "single / DDP": "the model and its optimizer fit one GPU: plain data parallel has the least communication",
    "ZeRO-1": "sharding only the optimizer states is enough and costs no extra communication over DDP",
    "ZeRO-2": "sharding optimizer states and gradients is enough; parameters stay whole on every GPU",
    "pipeline": "the model doesn't fit one GPU but each stage's layers do; stages exchange only activations",
    "ZeRO-3": "only sharding the parameters too makes it fit",
    "FSDP full shard": "only sharding the parameters too makes it fit",
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
    # one machine: pipeline before ZeRO-3 (the seeds' order: pipeline, ZeRO, tensor parallel), where its bubble is
    # small (see recommend)
    "one machine": ["single / DDP", "ZeRO-1", "ZeRO-2", "pipeline", "ZeRO-3", "FSDP full shard", "context parallel",
                    "tensor parallel", *_OFFLOAD],
    # several machines, fast interconnect (InfiniBand, NVLink across nodes): ZeRO/FSDP scale well
    "fast": ["single / DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full shard", "FSDP hybrid shard", "pipeline",
             "context parallel", "tensor parallel", *_OFFLOAD],
    # several machines, slow interconnect (Ethernet): keep the heavy traffic inside machines (the seeds' DP + PP + TP
    # + ZeRO-1): sharding within a machine, then a pipeline or tensor parallelism inside one, before ZeRO-2/3's
    # traffic between machines
    "slow": ["single / DDP", "ZeRO-1", "pipeline", "FSDP hybrid shard", "tensor parallel", "ZeRO-2", "ZeRO-3",
             "FSDP full shard", "context parallel", *_OFFLOAD],
}  # fmt: skip
# a pipeline whose idle share ((stages - 1) / (micro-batches + stages - 1)) is above this is preferred after the
# strategies that shard: docs/strategies.md asks for micro-batches >= 4 x stages, a bubble of about a fifth
BUBBLE_LIMIT = 0.2
BETWEEN_MACHINES = {"ZeRO-2", "ZeRO-3", "FSDP full shard", "context parallel"}  # their collectives span every rank


def unavailable(recipe) -> dict[str, str]:
    """Strategies the recipe can't run (the recipe's own rules refuse them): never recommended."""
    out = {}
    if recipe.adapter or recipe.qat:
        out["tensor parallel"] = "tensor parallelism trains the full weights (no adapter, no qat)"
    if (
        recipe.adapter == "qlora"
        or recipe.qat
        or recipe.lisa_n_layers
        or recipe.use_eaft
        or recipe.activation_offloading
    ):
        out["pipeline"] = "the pipeline runs without QLoRA, qat, LISA, EAFT and activation offloading"
    return out


def pipeline_bubble(recipe, stages: int) -> float:
    """The idle share of a pipeline of `stages` for this recipe's micro-batches, (p - 1) / (m + p - 1), with the
    micro-batches plan/pipeline.py gives it."""
    microbatches = recipe.pipeline_microbatches or max(recipe.gradient_accumulation_steps, stages)
    return (stages - 1) / (microbatches + stages - 1)


def recommend(
    estimates: list[Estimate], gpu_memory: float, num_machines: int = 1, interconnect: str = "fast",
    cpu_memory: float | None = None, recipe=None,
) -> tuple[Estimate, str] | None:  # fmt: skip
    """The first strategy of the cluster's preference order whose total fits, with its reason; None if none does.
    With the recipe: strategies it can't run are skipped, and a pipeline with a large bubble comes after sharding."""
    profile = "one machine" if num_machines <= 1 else interconnect
    by_name = {e.name: e for e in estimates}
    order = [name for name in PREFERENCE[profile] if recipe is None or name not in unavailable(recipe)]
    reasons = dict(REASONS)
    pipeline = by_name.get("pipeline")
    if pipeline is not None and recipe is not None and "pipeline" in order:
        stages = int(pipeline.strategy.split("(")[1].split()[0])
        bubble = pipeline_bubble(recipe, stages)
        reasons["pipeline"] = f"{REASONS['pipeline']} (bubble {bubble:.0%} at its micro-batches)"
        if bubble > BUBBLE_LIMIT and profile != "slow":
            order.remove("pipeline")
            order.insert(order.index("FSDP full shard") + 1, "pipeline")
    if profile == "slow":
        for name in BETWEEN_MACHINES:
            reasons[name] = f"{REASONS[name]}; its collectives cross the slow links between machines every step"
    for name in order:
        row = by_name.get(name)
        if row is not None and row.fits(gpu_memory, cpu_memory):
            return row, reasons[name]
    return None
