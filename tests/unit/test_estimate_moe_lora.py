"""The estimate's adapter size for a mixture of experts equals what peft builds (the loaded model's own count): the
routed experts' fused tensors are adapted in some families and left frozen in others, and lora_target_parameters
adapts them where all-linear doesn't (llmtune/plan/memory/experts.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.plan.memory.facts import facts_from_config
from llmtune.plan.memory.states import trainable_parameters
from llmtune.recipe.loader import recipe_from_mapping

SHAPE = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_local_experts": 4, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 12}  # fmt: skip
QWEN2_MOE_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def recipe(**keys):
    raw = {"base_model": "tiny", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "adapter": "lora", "lora_r": 4,
           "lora_alpha": 8, **keys}  # fmt: skip
    return recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe


def peft_count(model_type: str, shape: dict, keys: dict) -> tuple[int, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.train.model.adapters import attach_adapter, parameter_counts

    known = AutoConfig.for_model(model_type).to_dict()  # the family's own keys: others would be stored and read back
    config = AutoConfig.for_model(model_type, **{k: v for k, v in shape.items() if k in known})
    adapted = attach_adapter(AutoModelForCausalLM.from_config(config), recipe(**keys))
    return parameter_counts(adapted)[0], config.to_dict()


@pytest.mark.parametrize(("model_type", "keys"), [
    ("mixtral", {"lora_target_linear": True}),  # peft maps its experts: gate and up fused at rank 2r
    ("qwen3_moe", {"lora_target_linear": True}),
    ("olmoe", {"lora_target_linear": True}),
    ("qwen3_moe", {"lora_target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]}),
    ("qwen3_moe", {"lora_target_modules": ["q_proj", "down_proj"]}),  # down alone: no fused pair needed
    ("qwen2_moe", {"lora_target_linear": True}),  # experts frozen: the shared expert's layers only
    ("qwen2_moe", {"lora_target_linear": True, "lora_target_parameters": QWEN2_MOE_EXPERTS}),  # now at rank r
    ("phimoe", {"lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
    ("llama", {"lora_target_linear": True}),  # dense: unchanged
    ("llama", {"lora_target_linear": True, "lora_modules_to_save": ["embed_tokens", "lm_head"]}),  # whole copies
    ("mixtral", {"lora_target_modules": ["q_proj"], "lora_modules_to_save": ["lm_head"]}),
])  # fmt: skip
def test_adapter_size_equals_peft_s(model_type, keys):
    shape = {**SHAPE, "shared_expert_intermediate_size": 20} if model_type == "qwen2_moe" else SHAPE
    built, config = peft_count(model_type, shape, keys)
    estimated = trainable_parameters(recipe(**keys), facts_from_config(config))
    assert estimated == built, (model_type, keys, estimated, built)


@pytest.mark.parametrize(("model_type", "keys"), [
    ("mixtral", {"lora_target_linear": True}),  # Axolotl's mixtral example: lora_dropout 0.05
    ("mixtral", {"lora_target_modules": ["q_proj", "v_proj"]}),  # the experts untouched
    ("qwen3_moe", {"lora_target_linear": True}),
    ("qwen2_moe", {"lora_target_linear": True}),  # experts frozen
    ("qwen2_moe", {"lora_target_linear": True, "lora_target_parameters": QWEN2_MOE_EXPERTS}),
    ("llama", {"lora_target_linear": True}),
])  # fmt: skip
def test_lora_dropout_on_fused_experts_is_refused_at_plan_time_exactly_where_peft_refuses_it(model_type, keys):
    """peft's ParamWrapper (LoRA on a fused expert tensor) takes no dropout: peft refused it after the model had
    loaded, under a hint about lora_target_linear."""
    from llmtune.errors import UserError
    from llmtune.plan.checks import check_expert_dropout

    shape = {**SHAPE, "shared_expert_intermediate_size": 20} if model_type == "qwen2_moe" else SHAPE
    keys = {**keys, "lora_dropout": 0.05}
    try:
        peft_count(model_type, shape, keys)
        peft_refuses = False
    except UserError as err:
        peft_refuses = "lora_dropout" in err.message
    _, config = peft_count(model_type, shape, {**keys, "lora_dropout": 0.0})
    try:
        check_expert_dropout(recipe(**keys), facts_from_config(config))
        planned_refusal = False
    except UserError as err:
        planned_refusal = err.hint.startswith("set lora_dropout: 0")
    assert planned_refusal == peft_refuses, (model_type, keys)
    if model_type == "mixtral" and keys.get("lora_target_linear"):
        assert peft_refuses  # the case the probe met
