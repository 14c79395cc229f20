"""What a rank reports of its run beyond the Trainer's metrics: its peak resident memory, the estimate of the
plan's GPU memory beside the measured peaks, the start-up phases, the ranks' reports merged; the line a
run stopped on request leaves; and, for a run resumed from a checkpoint, which figures cover the whole run and which
only the launch that resumed it."""

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


def loss_over_run(log_history: list[dict]) -> dict | None:
    """The mean train loss over every step the history logged, a resumed run's earlier launches included (the
    Trainer resumes its history from the checkpoint, while its own train_loss is the mean over this launch only).
    Each logged loss is the mean since the previous log, so each weighs the steps it covers. `every_step`: False
    where logs skipped steps (logging_steps above 1, or a resume between two logs): the mean of what was logged."""
    logged = sorted({e["step"]: e["loss"] for e in log_history if "loss" in e and "step" in e}.items())
    if not logged:
        return None
    total, previous = 0.0, 0
    for step, loss in logged:
        total += loss * (step - previous)
        previous = step
    return {"mean": total / previous, "steps": [1, previous], "every_step": len(logged) == previous}


def launch_steps(metrics: dict) -> list[int] | None:
    """The steps this launch trained when it resumed a checkpoint ([first, last]); None for a run from step 0."""
    if metrics.get("train_loss_steps"):
        return list(metrics["train_loss_steps"])
    resumed, steps = metrics.get("resumed_from"), metrics.get("steps")
    if not resumed or not isinstance(steps, int):
        return None
    name = str(resumed).rstrip("/").rsplit("/", 1)[-1]
    start = int(name.split("-")[-1]) if name.startswith("checkpoint-") and name.split("-")[-1].isdigit() else None
    return [start + 1, steps] if start is not None else None


# what a resumed run's metrics.json figures cover: these, the launch that resumed; the rest, the whole run
LAUNCH_FIGURES = ("train_loss", "train_seconds", "tokens_per_second_whole_run", "tokens_per_second_steady",
                  "rows_seen_this_run", "tokens_seen_this_run", "step_seconds", "step_real_tokens",
                  "step_padded_tokens")  # fmt: skip


def resumed_figures(metrics: dict) -> dict:
    """For a resumed run: the whole run's mean train loss from its history, and which figures cover only the launch
    that resumed (`since_resume`), so that none reads as the whole run's. Empty for a run from step 0."""
    span = launch_steps(metrics)
    if span is None:
        return {}
    figures = [key for key in LAUNCH_FIGURES if metrics.get(key) is not None]
    if "train_loss_steps" not in metrics:  # the pipeline loop's train loss is its whole loaded history's already
        figures = [key for key in figures if key != "train_loss"]
    found = {"since_resume": {"steps": span, "figures": figures}}
    whole = loss_since_start(metrics.get("log_history") or [], span[0])
    if whole is not None:
        found.update(train_loss_whole_run=whole["mean"], train_loss_whole_run_steps=whole["steps"])
    return found


def loss_since_start(log_history: list[dict], resumed_at: int) -> dict | None:
    """loss_over_run, where the history holds the steps before `resumed_at` too (None: this launch's steps only)."""
    if not any("loss" in e and e.get("step", resumed_at) < resumed_at for e in log_history):
        return None
    return loss_over_run(log_history)


def span_text(span: list[int]) -> str:
    return f"step {span[0]}" if span[0] == span[1] else f"steps {span[0]}-{span[1]}"
