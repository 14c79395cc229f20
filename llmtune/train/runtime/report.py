"""What a rank reports of its run beyond the Trainer's metrics: its peak resident memory, the estimate of the
plan's GPU memory beside the measured peaks, the start-up phases, the ranks' reports merged; and the line a
run stopped on request leaves."""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.train.runtime.progress import log, mark, startup_seconds


def stopped(step: int) -> dict:
    """Stopped on request: a checkpoint of this step is saved; the run is not finished (no final model, no metrics)."""
    log(f"stopped on request after step {step}; checkpoint-{step} is saved: run the same command to resume from it")
    return {"stopped_at": step}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def planned_memory(recipe, plan: dict) -> dict:
    """On GPUs, the estimate of this plan's per-GPU memory, recorded beside the measured CUDA peaks."""
    if plan["cluster"]["device"] != "cuda":
        return {}
    from types import SimpleNamespace

    import torch

    from llmtune.plan.memory.fit import estimate_recipe, row_for_plan

    cluster, strategy = plan["cluster"], plan["strategy"]
    view = SimpleNamespace(strategy=strategy, offload=plan["offload"], accelerate_config=plan["accelerate_config"],
                           zero_stage=int(strategy[-1]) if strategy.startswith("zero") else 0)  # fmt: skip
    try:
        report = estimate_recipe(recipe, cluster["num_processes"] // cluster["num_machines"], cluster["num_machines"],
                                 torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)  # fmt: skip
        row = report.row(row_for_plan(view))
    except UserError:  # a model shape the estimate doesn't know: nothing to compare with
        return {}
    return {"estimate_total_bytes": int(row.total), "estimate_allocated_bytes": int(row.allocated)}


def startup(first_step_end: float | None) -> dict[str, float]:
    """Seconds per phase from `llmtune train` to the end of the first optimizer step (engine start included)."""
    if first_step_end:
        mark("first_step", first_step_end)
    return startup_seconds()


def merge_reports(first_batches: list[dict] | None, shards: list[dict]) -> list[dict]:
    by_rank = {r["rank"]: dict(r) for r in first_batches or []}
    for shard in shards:
        by_rank.setdefault(shard["rank"], {"rank": shard["rank"]}).update(shard)
    return [by_rank[r] for r in sorted(by_rank)]
