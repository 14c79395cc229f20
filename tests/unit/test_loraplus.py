"""LoRA+ (loraplus_lr_ratio): peft's optimizer over a LoRA model's groups, built by the Trainer llmtune runs, and
refused where something else builds the optimizer (it was refused outright; Axolotl users' recipes carry it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import tiny_llama_config

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping

BASE = {"base_model": "org/m", "output_dir": "/x", "datasets": [{"path": "o/d", "type": "alpaca"}],
        "adapter": "lora", "learning_rate": 1e-3, "weight_decay": 0.01}  # fmt: skip


def recipe(**keys):
    return recipe_from_mapping({**BASE, **keys}, Path("r.yml"), check_files=False).recipe


def test_the_trainer_steps_b_at_the_ratio_a_at_the_rate_with_the_recipe_s_weight_decay():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM, TrainingArguments

    from llmtune.train.engine.trainer import LlmtuneTrainer

    model = get_peft_model(LlamaForCausalLM(tiny_llama_config(64)), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    args = TrainingArguments(output_dir="/tmp/unused", learning_rate=1e-3, weight_decay=0.01, use_cpu=True,
                             report_to=[], optim="adamw_torch")  # fmt: skip
    trainer = LlmtuneTrainer(model=model, args=args)
    trainer.recipe = recipe(loraplus_lr_ratio=16)
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is torch.optim.AdamW
    names = {id(p): n for n, p in model.named_parameters()}
    rates = {names[id(p)].split(".")[-3]: (group["lr"], group["weight_decay"]) for group in optimizer.param_groups
             for p in group["params"]}  # fmt: skip
    assert rates == {"lora_A": (1e-3, 0.01), "lora_B": (16e-3, 0.01)}
    assert sum(len(group["params"]) for group in optimizer.param_groups) == sum(
        p.requires_grad for p in model.parameters())  # every trainable parameter, once
    plain = LlmtuneTrainer(model=model, args=args)
    plain.recipe = recipe()
    assert {group["lr"] for group in plain.create_optimizer().param_groups} == {1e-3}


def test_loraplus_is_refused_where_its_optimizer_would_not_run():
    recipe(loraplus_lr_ratio=16, loraplus_lr_embedding=1e-5)  # accepted, with its embedding rate
    assert recipe(loraplus_lr_ratio=None).loraplus_lr_ratio is None  # an empty key, as Axolotl's YAML leaves it
    for keys, said in (({"adapter": None}, "needs adapter: lora or qlora"),
                       ({"optimizer": "muon"}, "optimizer: muon replaces")):  # fmt: skip
        with pytest.raises(UserError, match=said):
            recipe(loraplus_lr_ratio=16, **keys)


def test_a_deepspeed_optimizer_that_would_ignore_loraplus_is_refused_at_the_plan():
    """A config's optimizer section is built by DeepSpeed over one group: refused. Offload alone was refused too
    (DeepSpeed's CPU Adam came from such a section); the Trainer now builds that CPU Adam over LoRA+'s groups."""
    from llmtune.plan.deepspeed import build_deepspeed_config

    inline = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}
    with pytest.raises(UserError, match="loraplus_lr_ratio needs the Trainer to build the optimizer, and deepspeed: "
                                        "the inline mapping has its own optimizer section"):  # fmt: skip
        build_deepspeed_config(recipe(loraplus_lr_ratio=16, deepspeed=inline), 2, "bf16", None)
    for preset in ("zero2", "zero3_offload"):
        config, notes = build_deepspeed_config(recipe(loraplus_lr_ratio=16, deepspeed=preset), 2, "bf16", None)
        assert "optimizer" not in config  # the Trainer builds it: LoRA+ runs
    assert "optimizer offload: DeepSpeed's CPU AdamW runs the optimizer step, over the Trainer's parameter groups " \
        "(no weight decay on biases and norms)" in notes  # fmt: skip
