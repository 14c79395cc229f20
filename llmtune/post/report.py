"""The training report: `<output_dir>/report/` with the loss curve, throughput over time and a summary.

Written by rank 0 at the end of every run, and rebuilt from metrics.json by `llmtune report RUN_DIR`.
The plotted numbers are written beside the pictures (curves.json), so anything can re-plot or check them.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.errors import UserError, reading
from llmtune.post.report_preference import plot_preference, preference_curves, preference_section
from llmtune.train.runtime.report import launch_steps, loss_since_start, span_text


def _throughput(metrics: dict) -> str:
    whole = metrics.get("tokens_per_second_whole_run", metrics.get("tokens_per_second"))  # older runs: one figure
    steady = metrics.get("tokens_per_second_steady")
    # resumed: the figures are this launch's (its train() call), not the whole run's
    over = "over those steps" if launch_steps(metrics) else "over the whole run"
    return f"{whole} tokens/s {over}" + (f", {steady} after the warm-up steps" if steady else "")


def _training_time(metrics: dict) -> str:
    minutes, span = (metrics.get("train_seconds") or 0) / 60, launch_steps(metrics)
    steps = f" for {span_text(span)}, since the resume" if span else ""
    return f"{minutes:.1f} min{steps} ({_throughput(metrics)})"


def _steps(metrics: dict):
    span = launch_steps(metrics)
    if not span:
        return metrics.get("steps")
    checkpoint = Path(str(metrics["resumed_from"])).name
    return f"{metrics.get('steps')} (resumed from {checkpoint}: {span_text(span)} in this launch)"


def _mean_loss(metrics: dict) -> str | None:
    """The mean train loss over the whole run where the history has every launch's losses; else labelled with the
    steps it covers (a resumed launch's Trainer averages its own steps only)."""
    loss, span = metrics.get("train_loss"), metrics.get("train_loss_steps")
    if loss is None or not span:
        return _fmt(loss)
    whole = loss_since_start(metrics.get("log_history") or [], span[0])
    if whole is None:
        return f"{loss:.4f} ({span_text(span)}, since the resume)"
    logged = "" if whole["every_step"] else ", the mean of the logged losses"
    since = f"{loss:.4f} over {span_text(span)}, since the resume"
    return f"{whole['mean']:.4f} ({span_text(whole['steps'])}{logged}); {since}"


def _gpu_memory(metrics: dict) -> str | None:
    """The largest per-rank CUDA peaks, beside the estimate the run was planned with (GPU runs only)."""
    ranks = [r for r in metrics.get("ranks") or [] if "cuda_max_reserved_bytes" in r]
    if not ranks:
        return None
    gb = 1e9
    allocated = max(r["cuda_max_allocated_bytes"] for r in ranks) / gb
    reserved = max(r["cuda_max_reserved_bytes"] for r in ranks) / gb
    estimate = metrics.get("estimate_total_bytes")
    return (f"{allocated:.1f} GB allocated, {reserved:.1f} GB reserved (largest rank)"
            + (f"; estimate {estimate / gb:.1f} GB" if estimate else ""))  # fmt: skip


def curves(metrics: dict) -> dict:
    """Train loss and learning rate, eval loss, and throughput, each against the optimizer step; for a preference
    run also TRL's reward margin and accuracy ("preference", absent otherwise)."""
    history = metrics.get("log_history") or []
    train = [e for e in history if "loss" in e and "step" in e]
    evals = [e for e in history if "eval_loss" in e and "step" in e]
    seconds, real = metrics.get("step_seconds") or [], metrics.get("step_real_tokens") or []
    preference = preference_curves(history)
    data = {
        "train": {"step": [e["step"] for e in train], "loss": [e["loss"] for e in train],
                  "learning_rate": [e.get("learning_rate") for e in train]},
        "eval": {"step": [e["step"] for e in evals], "loss": [e["eval_loss"] for e in evals]},
        "throughput": {"step": list(range(1, len(seconds) + 1)),
                       "tokens_per_second": [t / s if s else None for t, s in zip(real, seconds, strict=False)]},
    }  # fmt: skip
    return {**data, "preference": preference} if preference else data


def prepare_plotting() -> None:
    """Import the plotting library (the report's slowest part), with the file-only backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401


def _plot_loss(data: dict, path: Path) -> list[str]:
    """Draw loss.png (a preference run: the reward margin in a panel below); returns each axis's label."""
    prepare_plotting()
    import matplotlib.pyplot as plt

    preference = data.get("preference")
    if preference:
        figure, (axis, lower) = plt.subplots(2, 1, figsize=(8, 7.5), dpi=100, sharex=True, height_ratios=(3, 2))
    else:
        figure, axis = plt.subplots(figsize=(8, 4.5), dpi=100)
    axis.plot(data["train"]["step"], data["train"]["loss"], label="train loss", color="tab:blue")
    if data["eval"]["step"]:
        axis.plot(data["eval"]["step"], data["eval"]["loss"], "o-", label="eval loss", color="tab:orange")
    axis.set_xlabel("" if preference else "step")  # the shared step axis is labelled under the lower panel
    axis.set_ylabel("loss")
    axis.grid(alpha=0.3)
    lines, labels = axis.get_legend_handles_labels()
    rates = data["train"]["learning_rate"]
    if any(r is not None for r in rates):
        second = axis.twinx()
        second.plot(data["train"]["step"], rates, "--", color="tab:gray", label="learning rate")
        second.set_ylabel("learning rate")
        more_lines, more_labels = second.get_legend_handles_labels()
        lines, labels = lines + more_lines, labels + more_labels
    axis.legend(lines, labels, loc="upper right")
    if preference:
        plot_preference(lower, preference)
    figure.tight_layout()
    figure.savefig(path)
    drawn = [a.get_ylabel() for a in figure.axes]
    plt.close(figure)
    return drawn


def _plot_throughput(data: dict, path: Path) -> None:
    prepare_plotting()
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 3.5), dpi=100)
    axis.plot(data["throughput"]["step"], data["throughput"]["tokens_per_second"], color="tab:green")
    axis.set_xlabel("step")
    axis.set_ylabel("real tokens/s (rank 0)")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def _summary(run: Path, metrics: dict, plan: dict, recipe: dict, data: dict | None = None) -> str:
    method = {"lora": "LoRA", "qlora": "QLoRA"}.get(recipe.get("adapter") or "", "full fine-tune")
    evals = [e["eval_loss"] for e in metrics.get("log_history") or [] if "eval_loss" in e]
    final_eval = metrics.get("eval_loss", evals[-1] if evals else None)
    rows = [
        ("model", f"`{recipe.get('base_model')}` ({method})"),
        ("strategy", f"{plan.get('title', metrics.get('strategy'))}, world size {metrics.get('world_size')}"),
        ("global batch", f"{plan.get('global_batch_size')} = micro-batch {plan.get('micro_batch_size')} x "
                         f"accumulation {plan.get('gradient_accumulation_steps')} x data-parallel {plan.get('data_parallel_size')}"),
        ("steps", _steps(metrics)),
        ("tokens seen", _tokens_seen(metrics)),
        ("training time", _training_time(metrics)),
        ("peak GPU memory", _gpu_memory(metrics)),
        ("final train loss", _fmt(metrics.get("final_loss"))),
        ("mean train loss", _mean_loss(metrics)),
        ("final eval loss", _fmt(final_eval)),
        ("model saved in", f"`{run}`" + (" (adapter: `llmtune merge` folds it into the base)" if recipe.get("adapter") else "")
         if not metrics.get("stopped_at") else f"no final save: the run stopped; curves up to `{metrics['stopped_at']}`"),
    ]  # fmt: skip
    table = "\n".join(f"| {k} | {v} |" for k, v in rows if v is not None)
    preference = preference_section(metrics, recipe, (data or curves(metrics)).get("preference"))
    datasets = "\n".join(
        f"- `{d.get('path')}` ({d.get('type') or 'pretokenized'})" for d in recipe.get("datasets") or []
    )
    return (
        f"# Training report: {run.name}\n\n| | |\n| --- | --- |\n{table}\n\n{preference}## Data\n\n{datasets}\n\n"
        "## Curves\n\n![loss](loss.png)\n\n![throughput](throughput.png)\n\n"
        "The plotted numbers are in `curves.json`; the full recipe and plan in `../llmtune/`.\n"
    )


def _stopped_run(run: Path) -> dict:
    """A run that stopped before its final save: the curves its newest complete checkpoint's trainer state holds."""
    from llmtune.plan.checkpoint_layout import last_complete

    checkpoint = last_complete(run) if run.is_dir() else None
    state_file = checkpoint / "trainer_state.json" if checkpoint else None
    if state_file is None or not state_file.is_file():
        raise UserError(f"{run} has no metrics.json and no complete checkpoint to read the curves from",
                        "pass the output_dir of a run that finished or saved a checkpoint")  # fmt: skip
    with reading(state_file):
        state = json.loads(state_file.read_text())
    return {
        "log_history": state.get("log_history") or [],
        "steps": state.get("global_step"),
        "stopped_at": str(checkpoint),
    }


def _tokens_seen(metrics: dict) -> str | None:
    if metrics.get("tokens_seen") is not None:
        this_launch = metrics.get("tokens_seen_this_run") if launch_steps(metrics) else None
        return f"{metrics['tokens_seen']:,}" + (
            f" ({this_launch:,} since the resume)" if this_launch is not None else ""
        )
    if metrics.get("tokens_seen_this_run") is not None:  # resumed from a checkpoint that didn't count them
        return f"{metrics['tokens_seen_this_run']:,} since the resume"
    return None


def _fmt(value) -> str | None:
    return None if value is None else f"{value:.4f}"


def write_report(run: Path, metrics: dict | None = None) -> Path:
    """(Re)build run/report/ from the run's metrics.json and plan; returns the folder."""
    metrics_file, plan_file = run / "metrics.json", run / "llmtune" / "plan.json"
    if metrics is None:
        if not run.is_dir():
            raise UserError(f"{run} does not exist" if not run.exists() else f"{run} is not a folder",
                            "pass the output_dir of a finished run")  # fmt: skip
        if metrics_file.exists():
            with reading(metrics_file):
                metrics = json.loads(metrics_file.read_text())
        else:
            metrics = _stopped_run(run)
    payload = json.loads(plan_file.read_text()) if plan_file.exists() else {}
    from llmtune.plan.files import writing

    folder = run / "report"
    data = curves(metrics)
    summary = _summary(run, metrics, payload.get("plan", {}), payload.get("recipe", {}), data)
    with writing(folder):  # a read-only run folder: one line naming it
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "curves.json").write_text(json.dumps(data, indent=1) + "\n")
        _plot_loss(data, folder / "loss.png")
        _plot_throughput(data, folder / "throughput.png")
        (folder / "summary.md").write_text(summary)
    return folder
