"""Warm-up as Axolotl computes it (core/builders/base.py, _configure_warmup_and_logging): a recipe written for
Axolotl without warmup keys warmed up there and trained at its full rate from step 1 here."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.recipe.loader import recipe_from_mapping

PLAN = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "single", "micro_batch_size": 2,
        "data_parallel_size": 1, "gradient_accumulation_steps": 1}  # fmt: skip
ROWS = 58  # at micro-batch 2: 29 steps an epoch


def recipe(tmp_path: Path, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "micro_batch_size": 2,
            "output_dir": str(tmp_path)}  # fmt: skip
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


@pytest.mark.parametrize(("changes", "steps"), [
    ({"num_epochs": 4}, 3),  # neither key: 3% of 116 steps, rounded down
    ({"num_epochs": 1}, 0),  # 3% of 29: none
    ({"num_epochs": 200}, 100),  # 3% of 5800 is 174: at most 100
    ({"num_epochs": 1, "max_steps": 50}, 0),  # Axolotl's total: num_epochs' steps (29), capped by max_steps
    ({"num_epochs": 3, "max_steps": 50}, 2),  # int(1.5) is one step, and one becomes two
    ({"warmup_ratio": 0.1, "num_epochs": 1, "max_steps": 25}, 2),  # int(2.5), where transformers' ceil gave 3
    ({"warmup_ratio": 0.1, "num_epochs": 1, "max_steps": 50}, 2),  # a ratio of min(29, 50)
    ({"warmup_steps": 1}, 2),  # one step becomes two
    ({"warmup_steps": 0, "num_epochs": 200}, 0),  # none, said
    ({"warmup_steps": 7}, 7),
])  # fmt: skip
def test_the_warmup_is_axolotl_s(tmp_path, changes, steps):
    from llmtune.train.engine.arguments import training_arguments

    args = training_arguments(recipe(tmp_path, **changes), PLAN, ROWS, False)
    assert args.warmup_steps == steps and args.get_warmup_steps(args.max_steps if args.max_steps > 0 else 29) == steps


def test_the_plan_says_when_the_default_warmup_applies(tmp_path):
    from llmtune.plan import make_cluster, make_plan

    said = [n for n in make_plan(recipe(tmp_path), make_cluster(device="cpu")).notes if n.startswith("warm-up")]
    assert said == ["warm-up: the recipe sets neither warmup_steps nor warmup_ratio: Axolotl's default, 3% of the "
                    "run's steps (at most 100; set warmup_steps: 0 for none)"]  # fmt: skip
    for given in ({"warmup_steps": 0}, {"warmup_ratio": 0.05}):
        assert not [n for n in make_plan(recipe(tmp_path, **given), make_cluster(device="cpu")).notes
                    if n.startswith("warm-up")]  # fmt: skip


def test_a_pipeline_warms_up_by_the_same_rule():
    from types import SimpleNamespace

    from llmtune.train.objectives.schedule import run_steps, warmup_steps

    plain = SimpleNamespace(warmup_steps=None, warmup_ratio=None, num_epochs=4, max_steps=None)
    assert run_steps(plain, 29) == 116 and warmup_steps(plain, 116) == 3
    assert warmup_steps(plain, None) == 0.03  # the run's length unknown: the ratio, for transformers
