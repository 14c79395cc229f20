"""A run resumed from a checkpoint: every figure of its report, model card and metrics.json says what it covers (the
whole run, or only the launch that resumed it), and the mean train loss covers the whole run where the history does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from llmtune.post.report import write_report
from llmtune.train.checkpoint.final import model_card
from llmtune.train.runtime.report import loss_over_run, resumed_figures

LOSSES = [6.2613, 5.9671, 5.8412, 5.7493, 5.7192, 5.6859]  # steps 1-6 as a 4-step run resumed to 6 logged them


def _history(losses: dict[int, float]) -> list[dict]:
    history = []
    for step, loss in losses.items():
        history.append({"loss": loss, "learning_rate": 1e-3, "epoch": step / 6, "step": step})
        if step == 4:  # the first launch's eval, saved in checkpoint-4's trainer_state.json
            history.append({"eval_loss": 5.7447, "epoch": 4 / 6, "step": 4})
    return [*history, {"train_runtime": 0.06, "train_loss": 5.7026, "epoch": 1.0, "step": 6}]


def _resumed(**more) -> dict:
    return {"steps": 6, "tokens_seen": 638, "tokens_seen_this_run": 212, "train_loss": 5.7026,
            "train_loss_steps": [5, 6], "final_loss": 5.6859, "tokens_per_second_whole_run": 523.12,
            "tokens_per_second_steady": None, "train_seconds": 0.41, "resumed_from": "/runs/full/checkpoint-4",
            "log_history": _history(dict(enumerate(LOSSES, start=1))), "step_seconds": [0.02, 0.01],
            "step_real_tokens": [106, 106], "world_size": 1, **more}  # fmt: skip


def _summary_rows(tmp_path, metrics: dict) -> dict[str, str]:
    (tmp_path / "metrics.json").write_text(json.dumps(metrics))
    text = (write_report(tmp_path) / "summary.md").read_text()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("|")]
    return {key: value for key, value in cells if key and key != "---"}


def test_a_resumed_runs_summary_labels_this_launchs_figures_and_averages_the_loss_over_every_step(tmp_path):
    rows = _summary_rows(tmp_path, _resumed())
    whole = sum(LOSSES) / 6
    assert rows["steps"] == "6 (resumed from checkpoint-4: steps 5-6 in this launch)"
    assert rows["tokens seen"] == "638 (212 since the resume)"
    assert rows["training time"] == "0.0 min for steps 5-6, since the resume (523.12 tokens/s over those steps)"
    assert rows["mean train loss"] == f"{whole:.4f} (steps 1-6); 5.7026 over steps 5-6, since the resume"
    assert rows["final train loss"] == "5.6859"


def test_a_run_from_step_zero_reads_over_the_whole_run_as_before(tmp_path):
    metrics = {k: v for k, v in _resumed().items() if k not in ("train_loss_steps", "resumed_from")}
    rows = _summary_rows(tmp_path, {**metrics, "tokens_seen_this_run": 638, "train_loss": 5.9})
    assert rows["steps"] == "6" and rows["tokens seen"] == "638" and rows["mean train loss"] == "5.9000"
    assert rows["training time"] == "0.0 min (523.12 tokens/s over the whole run)"


def test_the_whole_runs_loss_weighs_each_log_by_the_steps_it_covers_and_says_when_logs_skipped_steps(tmp_path):
    assert loss_over_run(_history({2: 4.0, 4: 2.0, 5: 1.0})) == {"mean": (8 + 4 + 1) / 5, "steps": [1, 5],
                                                                 "every_step": False}  # fmt: skip
    assert loss_over_run([{"eval_loss": 1.0, "step": 1}]) is None
    logged_every_other = _history({2: 4.0, 4: 2.0, 5: 1.0})
    rows = _summary_rows(tmp_path, _resumed(steps=5, train_loss_steps=[5, 5], log_history=logged_every_other))
    assert (
        rows["mean train loss"]
        == "2.6000 (steps 1-5, the mean of the logged losses); 5.7026 over step 5, since the resume"
    )


def test_a_resume_whose_history_lacks_the_earlier_steps_labels_its_loss_as_the_launchs(tmp_path):
    rows = _summary_rows(tmp_path, _resumed(log_history=_history({5: 5.7192, 6: 5.6859})))
    assert rows["mean train loss"] == "5.7026 (steps 5-6, since the resume)"


def test_a_resumed_runs_metrics_and_model_card_name_the_figures_that_cover_this_launch_only():
    metrics = _resumed()
    metrics.update(resumed_figures(metrics))
    assert metrics["since_resume"] == {"steps": [5, 6], "figures": [
        "train_loss", "train_seconds", "tokens_per_second_whole_run", "tokens_seen_this_run", "step_seconds",
        "step_real_tokens"]}  # fmt: skip
    assert metrics["train_loss_whole_run"] == pytest.approx(sum(LOSSES) / 6) and metrics[
        "train_loss_whole_run_steps"] == [1, 6]  # fmt: skip
    recipe = SimpleNamespace(adapter=None, datasets=[], base_model="base", output_dir="/runs/full")
    card = model_card(recipe, {"title": "single process", "world_size": 1}, metrics, None)
    assert ("Resumed from `checkpoint-4`: `train_loss`, `train_seconds`, `tokens_per_second_whole_run`, "
            "`tokens_seen_this_run`, `step_seconds`, `step_real_tokens` cover steps 5-6 (this launch) only; the other "
            "figures cover the whole run.") in card  # fmt: skip
    # the pipeline loop: resumed, its train loss the whole loaded history's already; the steps from the checkpoint
    pipeline = {"steps": 8, "train_loss": 2.0, "train_seconds": 1.0, "resumed_from": "/r/checkpoint-6"}
    assert resumed_figures(pipeline) == {"since_resume": {"steps": [7, 8], "figures": ["train_seconds"]}}
    assert resumed_figures({"steps": 8, "train_loss": 2.0, "resumed_from": None}) == {}
