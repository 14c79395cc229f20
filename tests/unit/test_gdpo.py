"""rl: gdpo is GRPO with each reward normalised within its group before the weighted sum (TRL's
multi_objective_aggregation: normalize_then_sum): one step of llmtune's GDPO trainer on a tiny model, its advantages
against a hand computation on the group (two rewards with known values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from llmtune.recipe.loader import recipe_from_mapping


def first(completions, **kwargs):
    return [1.0 if i == 0 else 0.0 for i in range(len(completions))]


def ramp(completions, **kwargs):
    return [float(i) for i in range(len(completions))]


def test_gdpo_normalises_each_reward_per_group_before_summing(tmp_path):
    import torch
    from tiny import make_tiny_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtune.train.engine.arguments import training_arguments
    from llmtune.train.rl.rewards import reward_functions
    from llmtune.train.rl.trainers import config_arguments, trainer_class, trl_classes

    model_dir = make_tiny_model(tmp_path / "tiny")
    raw = {"base_model": str(model_dir), "rl": "gdpo", "output_dir": str(tmp_path / "out"), "micro_batch_size": 4,
           "max_steps": 1, "chat_template": "chatml", "sequence_len": 64,
           "trl": {"num_generations": 4, "max_completion_length": 4, "reward_funcs": ["x.first", "x.ramp"],
                   "reward_weights": [1.0, 2.0]}, "datasets": [{"path": "x.jsonl"}]}  # fmt: skip
    recipe = recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe
    plan = {"precision": "no", "cluster": {"device": "cpu", "num_machines": 1}, "gradient_accumulation_steps": 1,
            "strategy": "single", "data_parallel_size": 1, "world_size": 1, "kernels": {}, "micro_batch_size": 4}  # fmt: skip
    args = training_arguments(recipe, plan, 4, False, config_class=trl_classes("gdpo")[0], use_cpu=True,
                              **config_arguments(recipe, "cpu"))  # fmt: skip
    assert args.multi_objective_aggregation == "normalize_then_sum"  # what rl: gdpo means
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rewards, _ = reward_functions(recipe, {"trl.reward_funcs[0]": first, "trl.reward_funcs[1]": ramp}, tmp_path)
    from datasets import Dataset

    trainer = trainer_class("gdpo")(model=model, reward_funcs=rewards, args=args, processing_class=tokenizer,
                                    train_dataset=Dataset.from_list([{"prompt": "Say hi"}] * 4))  # fmt: skip
    trainer.train()
    advantages = np.array(list(trainer._logs["advantages"]))  # TRL's record of the step's advantages (one group)

    def normalised(values):
        values = np.array(values)
        return (values - values.mean()) / (values.std(ddof=1) + 1e-4)

    summed = 1.0 * normalised([1, 0, 0, 0]) + 2.0 * normalised([0, 1, 2, 3])
    expected = (summed - summed.mean()) / (summed.std(ddof=1) + 1e-4)
    assert advantages == pytest.approx(expected, abs=1e-4)
    # GRPO's own (sum first, then normalise) would have given other advantages: the check can fail
    plain = normalised(np.array([1, 0, 0, 0]) + 2 * np.array([0, 1, 2, 3]))
    assert not np.allclose(expected, plain, atol=1e-3)
