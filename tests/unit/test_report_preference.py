"""The training report of a preference run (rl:): TRL's reward margin and accuracy plotted under the loss, and a
summary section with the method, beta, reference and the first and last logged values; SFT reports unchanged."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import pytest

from llmtune.post.report import _plot_loss, curves, write_report
from llmtune.post.report_preference import recipe_beta
from llmtune.recipe.preference import beta


def _run(tmp_path, metrics: dict, recipe: dict):
    (tmp_path / "llmtune").mkdir()
    plan = {"title": "single process", "global_batch_size": 4, "micro_batch_size": 4}
    (tmp_path / "llmtune" / "plan.json").write_text(json.dumps({"plan": plan, "recipe": recipe}))
    (tmp_path / "metrics.json").write_text(json.dumps({"steps": 4, "final_loss": 0.5, **metrics}))
    folder = write_report(tmp_path)
    return json.loads((folder / "curves.json").read_text()), (folder / "summary.md").read_text(), folder


def _png_size(path) -> tuple[int, int]:
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the IHDR chunk
    return width, height


def _train(step: int, **values) -> dict:
    return {"loss": 0.7 - 0.05 * step, "learning_rate": 1e-3, "step": step, "epoch": step / 4, **values}


DPO_HISTORY = [
    _train(1, **{"rewards/margins": 0.0, "rewards/accuracies": 0.0, "rewards/chosen": 0.0, "logps/chosen": -44.0}),
    _train(2, **{"rewards/margins": 0.25, "rewards/accuracies": 0.5, "rewards/chosen": 0.1, "logps/chosen": -43.0}),
    {"eval_loss": 0.66, "eval_rewards/margins": 0.2, "eval_rewards/accuracies": 0.625, "step": 2},
    _train(3, **{"rewards/margins": 0.5, "rewards/accuracies": 0.75, "rewards/chosen": 0.2, "logps/chosen": -42.0}),
    _train(4, **{"rewards/margins": 0.8, "rewards/accuracies": 0.875, "rewards/chosen": 0.3, "logps/chosen": -41.0}),
    {"eval_loss": 0.6, "eval_rewards/margins": 0.7, "eval_rewards/accuracies": 0.75, "step": 4},
    {"train_runtime": 3.0, "train_loss": 0.6, "step": 4},
]  # fmt: skip


def test_a_dpo_report_plots_the_margin_and_accuracy_and_sums_them_up(tmp_path):
    preference = {"method": "dpo", "beta": 0.1, "reference": "adapter_disabled",
                  "first": {"rewards/margins": 0.0}, "last": {"rewards/margins": 0.8}}  # fmt: skip
    recipe = {"base_model": "tiny", "adapter": "lora", "rl": "dpo", "rl_beta": 0.1, "trl": None}
    data, summary, folder = _run(tmp_path, {"log_history": DPO_HISTORY, "preference": preference}, recipe)
    assert data["preference"] == curves({"log_history": DPO_HISTORY})["preference"]  # curves.json is curves()'s

    margin, accuracy = data["preference"]["margin"], data["preference"]["accuracy"]
    assert margin["train"] == {"step": [1, 2, 3, 4], "value": [0.0, 0.25, 0.5, 0.8]}
    assert margin["eval"] == {"step": [2, 4], "value": [0.2, 0.7]}
    assert accuracy["train"] == {"step": [1, 2, 3, 4], "value": [0.0, 0.5, 0.75, 0.875]}
    assert accuracy["eval"] == {"step": [2, 4], "value": [0.625, 0.75]}
    assert data["train"]["loss"] == [e["loss"] for e in DPO_HISTORY if "loss" in e]  # the loss curve as before

    # the loss panel (with its learning-rate twin) and the margin panel (with its accuracy twin), in one file
    assert _plot_loss(data, tmp_path / "again.png") == ["loss", "reward margin", "learning rate", "reward accuracy"]
    assert _png_size(folder / "loss.png") == (800, 750)

    assert "## Preference" in summary and summary.index("## Preference") < summary.index("## Data")
    for line in ["| method | DPO |", "| beta | 0.1 (rl_beta) |",
                 "| reference | the base model with the adapter switched off (no second copy) |",
                 "| reward margin (train) | 0.0000 (step 1) | 0.8000 (step 4) |",
                 "| reward accuracy (train) | 0.0000 (step 1) | 0.8750 (step 4) |",
                 "| reward margin (eval) | 0.2000 (step 2) | 0.7000 (step 4) |",
                 "| reward accuracy (eval) | 0.6250 (step 2) | 0.7500 (step 4) |"]:  # fmt: skip
        assert line in summary.splitlines(), line


def test_a_kto_report_has_the_margin_without_accuracies(tmp_path):
    history = [
        _train(1, **{"rewards/margins": 0.0, "rewards/chosen": 0.0, "rewards/rejected": 0.0, "kl": 0.0}),
        _train(2, **{"rewards/margins": -0.01, "rewards/chosen": 0.01, "rewards/rejected": 0.02, "kl": 0.05}),
        _train(3, **{"rewards/chosen": 0.02, "kl": 0.0}),  # a window of desirable rows only: no margin
        _train(4, **{"rewards/margins": 0.3, "rewards/chosen": 0.2, "rewards/rejected": -0.1, "kl": 0.01}),
    ]  # fmt: skip
    metrics = {"log_history": history, "ranks": [{"rank": 0, "reference": "DeepSpeedEngine", "reference_zero_stage": 3}],
               "preference": {"method": "kto", "beta": 0.2, "reference": "DeepSpeedEngine"}}  # fmt: skip
    recipe = {"base_model": "tiny", "rl": "kto", "rl_beta": None, "trl": {"beta": 0.2}}
    data, summary, folder = _run(tmp_path, metrics, recipe)

    assert data["preference"]["margin"]["train"] == {"step": [1, 2, 4], "value": [0.0, -0.01, 0.3]}
    assert data["preference"]["margin"]["eval"] == {"step": [], "value": []}
    assert data["preference"]["accuracy"] == {"train": {"step": [], "value": []}, "eval": {"step": [], "value": []}}
    assert _plot_loss(data, tmp_path / "again.png") == ["loss", "reward margin", "learning rate"]  # no accuracy axis

    lines = summary.splitlines()
    for line in ["| method | KTO |", "| beta | 0.2 (trl.beta) |",
                 "| reference | a frozen copy of the model (DeepSpeedEngine, ZeRO stage 3) |",
                 "| reward margin (train) | 0.0000 (step 1) | 0.3000 (step 4) |",
                 "| reward accuracy (train) | not logged | not logged |"]:  # fmt: skip
        assert line in lines, line
    assert "KTO's rows are not pairs, so it logs no accuracy" in summary
    assert not any(line.startswith("| reward margin (eval)") for line in lines)


def test_an_sft_report_has_no_preference_section_and_the_same_single_panel(tmp_path):
    history = [_train(1), {"eval_loss": 0.66, "step": 1}, _train(2), {"train_runtime": 3.0, "step": 2}]
    data, summary, folder = _run(tmp_path, {"log_history": history}, {"base_model": "tiny", "adapter": "lora"})

    assert set(data) == {"train", "eval", "throughput"}  # curves.json as before: no "preference" key
    assert "Preference" not in summary and "reward" not in summary
    assert summary.index("| model saved in |") < summary.index("## Data")  # the main table runs straight into Data
    assert _plot_loss(data, tmp_path / "again.png") == ["loss", "learning rate"]
    assert _png_size(folder / "loss.png") == (800, 450)


def test_an_orpo_run_without_a_preference_block_reads_the_recipe_copy(tmp_path):
    history = [_train(1, **{"rewards/margins": 0.004, "rewards/accuracies": 0.5, "nll_loss": 6.2}),
               _train(2, **{"rewards/margins": 0.02, "rewards/accuracies": 0.75, "nll_loss": 6.1})]  # fmt: skip
    recipe = {"base_model": "tiny", "rl": "orpo", "orpo_alpha": 0.5, "rl_beta": None}
    _, summary, _ = _run(tmp_path, {"log_history": history}, recipe)
    lines = summary.splitlines()
    for line in ["| method | ORPO |", "| beta | 0.5 (orpo_alpha) |", "| reference | none (a reference-free method) |",
                 "| reward margin (train) | 0.0040 (step 1) | 0.0200 (step 2) |"]:  # fmt: skip
        assert line in lines, line


def test_a_preference_run_with_no_logged_margins_falls_back_on_the_preference_block(tmp_path):
    metrics = {"log_history": [_train(1)],
               "preference": {"method": "ipo", "beta": 0.3, "reference": "precomputed",
                              "first": {"rewards/margins": 0.1, "rewards/accuracies": 0.5},
                              "last": {"rewards/margins": 0.9, "rewards/accuracies": 1.0}}}  # fmt: skip
    data, summary, _ = _run(tmp_path, metrics, {})  # no recipe copy either
    assert "preference" not in data
    lines = summary.splitlines()
    for line in ["| method | IPO |", "| beta | 0.3 |",
                 "| reference | its log-probs, computed once before training (no model kept) |",
                 "| reward margin (train) | 0.1000 | 0.9000 |", "| reward accuracy (train) | 0.5000 | 1.0000 |"]:  # fmt: skip
        assert line in lines, line


@pytest.mark.parametrize("keys", [
    {"rl": "dpo", "rl_beta": 0.1}, {"rl": "dpo", "rl_beta": 0.1, "trl": {"beta": 0.3}}, {"rl": "kto"},
    {"rl": "orpo", "orpo_alpha": 0.2, "rl_beta": None}, {"rl": "orpo", "rl_beta": 0.4}, {"rl": "simpo", "rl_beta": 2.0},
    {"rl": "orpo", "orpo_alpha": 0.2, "trl": {"beta": 0.7}},
])  # fmt: skip
def test_the_reported_beta_is_the_one_the_trainer_was_given(keys):
    recipe = {"trl": None, "orpo_alpha": None, "rl_beta": None, **keys}
    assert recipe_beta(recipe)[0] == beta(SimpleNamespace(**recipe))
