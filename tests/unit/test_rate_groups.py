"""embedding_lr, embedding_lr_scale and lr_groups (Axolotl's learning rates by parameter group; they were refused):
the Trainer's own optimizer class over the recipe's groups, the schedule keeping their ratios, and one line where a
group would change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny import tiny_llama_config

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping

BASE = {"base_model": "org/m", "output_dir": "/x", "datasets": [{"path": "o/d", "type": "alpaca"}],
        "learning_rate": 1e-3, "weight_decay": 0.01}  # fmt: skip
ATTENTION = {"name": "attention", "modules": ["self_attn.o_proj.weight", "self_attn.q_proj"], "lr": 5e-4}


def recipe(**keys):
    return recipe_from_mapping({**BASE, **keys}, Path("r.yml"), check_files=False).recipe


def trainer_for(model, **keys):
    from transformers import TrainingArguments

    from llmtune.train.engine.trainer import LlmtuneTrainer

    args = TrainingArguments(output_dir="/tmp/unused", learning_rate=1e-3, weight_decay=0.01, use_cpu=True,
                             report_to=[], optim="adamw_torch", warmup_steps=2)  # fmt: skip
    trainer = LlmtuneTrainer(model=model, args=args)
    trainer.recipe = recipe(**keys)
    return trainer


def rates_by_name(model, optimizer) -> dict[str, tuple[float, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    found = {names[id(p)]: (group["lr"], group["weight_decay"]) for group in optimizer.param_groups
             for p in group["params"]}  # fmt: skip
    assert len(found) == sum(len(group["params"]) for group in optimizer.param_groups)  # each parameter once
    assert set(found) == {n for n, p in model.named_parameters() if p.requires_grad}  # every trainable one
    return found


def test_full_fine_tune_groups_embeddings_and_modules_and_the_schedule_keeps_their_ratios():
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_llama_config(64))
    trainer = trainer_for(model, embedding_lr_scale=0.1, lr_groups=[ATTENTION])
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is torch.optim.AdamW  # the Trainer's class for optim: adamw_torch
    rates = rates_by_name(model, optimizer)
    for name, (lr, decay) in rates.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            expected = (1e-4, 0.0)  # learning_rate x scale, no decay (as Axolotl groups embeddings)
        elif ".self_attn.o_proj." in name or ".self_attn.q_proj." in name:
            expected = (5e-4, 0.01)
        elif "norm" in name:
            expected = (1e-3, 0.0)  # the Trainer's rule: no decay on norms
        else:
            expected = (1e-3, 0.01)
        assert (lr, decay) == pytest.approx(expected), name
    # the Trainer's schedule scales each group from its own peak: after warm-up every ratio holds
    scheduler = trainer.create_scheduler(num_training_steps=10, optimizer=optimizer)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    peaks = {group["initial_lr"]: group["lr"] for group in optimizer.param_groups}
    factors = {round(lr / peak, 9) for peak, lr in peaks.items()}
    assert len(factors) == 1 and 0 < factors.pop() < 1, peaks


def test_lora_with_trained_embeddings_and_a_group_of_lora_weights():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM(tiny_llama_config(64)), LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]))  # fmt: skip
    trainer = trainer_for(model, adapter="lora", embedding_lr=2e-5,
                          lr_groups=[{"name": "b", "modules": ["lora_B"], "lr": 4e-3}])  # fmt: skip
    rates = rates_by_name(model, trainer.create_optimizer())
    assert {n: r for n, r in rates.items() if "modules_to_save" in n} == {
        "base_model.model.model.embed_tokens.modules_to_save.default.weight": (2e-5, 0.0),
        "base_model.model.lm_head.modules_to_save.default.weight": (2e-5, 0.0)}  # fmt: skip
    assert {r for n, r in rates.items() if "lora_B" in n} == {(4e-3, 0.01)}
    assert {r for n, r in rates.items() if "lora_A" in n} == {(1e-3, 0.01)}


def test_a_group_that_would_change_nothing_is_one_line_with_a_name_that_matches():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    model = get_peft_model(LlamaForCausalLM(tiny_llama_config(64)), LoraConfig(r=4, target_modules=["o_proj"]))
    # Axolotl's documented example names the full weight, which LoRA leaves frozen: it silently did nothing there
    trainer = trainer_for(model, adapter="lora", lr_groups=[{**ATTENTION, "modules": ["self_attn.o_proj.weight"]}])
    with pytest.raises(UserError) as refused:
        trainer.create_optimizer()
    assert refused.value.one_line().startswith("lr_groups[0] (attention): no trainable parameter's name contains "
                                               "'self_attn.o_proj.weight'")  # fmt: skip
    assert "e.g. 'model.layers.0.self_attn.o_proj.lora_A.default.weight'" in refused.value.hint
    frozen = trainer_for(model, adapter="lora", embedding_lr=1e-5)
    with pytest.raises(UserError) as refused:
        frozen.create_optimizer()
    assert refused.value.message.startswith("embedding_lr: the model's embeddings (model.embed_tokens, lm_head) don't")
    assert "lora_modules_to_save: [embed_tokens, lm_head]" in refused.value.hint


def test_what_can_t_carry_the_groups_is_refused_before_the_run():
    recipe(embedding_lr=1e-5, lr_groups=[ATTENTION])  # accepted together
    for keys, said in (
        ({"embedding_lr": 1e-5, "embedding_lr_scale": 0.5}, "embedding_lr and embedding_lr_scale are both set"),
        ({"lr_groups": [ATTENTION, ATTENTION]}, "the name 'attention' is used twice"),
        ({"lr_groups": [{**ATTENTION, "modules": []}]}, r"lr_groups\[0\].modules"),
        ({"embedding_lr": 1e-5, "optimizer": "muon"}, "optimizer: muon replaces"),
        ({"lr_groups": [ATTENTION], "adapter": "lora", "loraplus_lr_ratio": 16}, "loraplus_lr_ratio and lr_groups"),
        ({"embedding_lr": 1e-5, "fsdp_version": 1, "fsdp_config": {"use_orig_params": False}}, "use_orig_params: true"),
    ):
        with pytest.raises(UserError, match=said):
            recipe(**keys)
    from llmtune.plan.deepspeed import build_deepspeed_config

    inline = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW"}}
    with pytest.raises(UserError, match="lr_groups needs the Trainer to build the optimizer, and deepspeed: "
                                        "the inline mapping has its own optimizer section"):  # fmt: skip
        build_deepspeed_config(recipe(lr_groups=[ATTENTION], deepspeed=inline), 2, "bf16", None)


@pytest.mark.parametrize("keys", [{}, {"embedding_lr_scale": 0.1, "lr_groups": [ATTENTION]}], ids=["plain", "groups"])
def test_an_offloaded_optimizer_is_deepspeeds_cpu_adam_over_the_trainers_groups(monkeypatch, keys):
    """ZeRO's optimizer offload steps with DeepSpeed's CPU Adam. Built from the config's optimizer section it had one
    group of every parameter, so weight decay reached biases and norms and lr_groups were refused. Now the plan
    leaves the section out and the Trainer builds torch's AdamW (for any AdamW the recipe names), which accelerate
    hands DeepSpeed as the CPU Adam of the same groups, in AdamW's decoupled mode (a DeepSpeedCPUAdam of the Trainer's
    own would be taken for another optimizer: L2 decay). (The real one in a 2-rank run, its groups' weight decay
    read from the engine: tests/integration/test_distributed.py, zero3-offload.)"""
    import deepspeed.ops.adam
    from accelerate.utils.deepspeed import map_pytorch_optim_to_deepspeed
    from transformers import LlamaForCausalLM

    from llmtune.plan import make_cluster, make_plan
    from llmtune.train.engine.arguments import training_arguments

    class CPUAdam(torch.optim.AdamW):  # DeepSpeed's signature; the real one compiles its C++ op when built
        def __init__(self, params, adamw_mode, **kwargs):
            self.adamw_mode = adamw_mode
            super().__init__(params, **kwargs)

    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", CPUAdam)
    offloaded = recipe(deepspeed="zero3_offload", optimizer="adamw_bnb_8bit", output_dir="/tmp/unused", **keys)
    plan = make_plan(offloaded, make_cluster(num_processes=1, device="cpu"))
    assert "optimizer" not in plan.deepspeed_config
    assert training_arguments(offloaded, plan.to_dict(), 100, has_eval=False).optim == "adamw_torch"
    assert any(note.startswith("optimizer offload: DeepSpeed's CPU AdamW runs the optimizer step (instead of "
                               "adamw_bnb_8bit") for note in plan.notes), plan.notes  # fmt: skip
    model = LlamaForCausalLM(tiny_llama_config(64))
    built = trainer_for(model, **keys).create_optimizer()
    assert type(built) is torch.optim.AdamW
    handed = map_pytorch_optim_to_deepspeed(built)  # what accelerate gives deepspeed.initialize under offload
    assert type(handed) is CPUAdam and handed.adamw_mode
    expected = rates_by_name(model, built)
    assert rates_by_name(model, handed) == expected
    assert {decay for _, decay in expected.values()} == {0.0, 0.01}  # norms without, the rest with


def test_wrapper_segments_leave_the_names_a_recipe_writes():
    from llmtune.train.objectives.optimizers import clean_name

    assert clean_name("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module."
                      "self_attn.o_proj.weight") == "model.layers.0.self_attn.o_proj.weight"  # fmt: skip


def test_an_offload_config_that_lets_a_torch_optimizer_step_on_the_cpu_says_so():
    """Axolotl's zero3_bf16_cpuoffload_all.json sets zero_force_ds_cpu_optimizer: false: accelerate then leaves the
    Trainer's AdamW as it is, stepping on the CPU (slower than DeepSpeed's CPU Adam); the plan says which runs."""
    from llmtune.plan.deepspeed import build_deepspeed_config

    inline = {"zero_force_ds_cpu_optimizer": False, "zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu"}, "offload_param": {"device": "cpu"}}}  # fmt: skip
    config, notes = build_deepspeed_config(recipe(deepspeed=inline), 2, "bf16", None)
    assert "optimizer" not in config and config["zero_force_ds_cpu_optimizer"] is False
    assert any(note.startswith("optimizer offload: torch's AdamW (zero_force_ds_cpu_optimizer: false") for note in notes)
    _, notes = build_deepspeed_config(recipe(deepspeed="zero3_offload"), 2, "bf16", None)
    assert any(note.startswith("optimizer offload: DeepSpeed's CPU AdamW runs") for note in notes), notes
