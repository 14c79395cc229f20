"""LoRA target and modules_to_save names against the model's own modules: peft adapts what matches and says nothing
of an entry that matches nothing, so a typo or another family's name would train without that layer."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import tiny_llama_config
from transformers import LlamaForCausalLM

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.model.adapters import attach_adapter


def recipe(**keys):
    raw = {"base_model": "tiny", "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "adapter": "lora", **keys}
    return recipe_from_mapping(raw, Path("r.yaml"), check_files=False).recipe


@pytest.fixture
def model():
    return LlamaForCausalLM(tiny_llama_config(64))


@pytest.mark.parametrize(("keys", "named"), [
    ({"lora_target_modules": ["q_proj", "o_prj"]}, "lora_target_modules: 'o_prj'"),
    ({"lora_target_modules": ["c_attn"]}, "lora_target_modules: 'c_attn'"),  # GPT-2's name on a Llama
    ({"lora_target_linear": True, "lora_modules_to_save": ["embed_tokens", "wte"]}, "lora_modules_to_save: 'wte'"),
])  # fmt: skip
def test_a_name_that_matches_no_module_is_refused(model, keys, named):
    with pytest.raises(UserError) as caught:
        attach_adapter(model, recipe(**keys))
    assert named in caught.value.message and "llama" in caught.value.message
    assert "q_proj" in caught.value.hint and "\n" not in caught.value.message
    if "lora_modules_to_save" in keys:  # GPT-2's embedding name on a Llama: the hint names this model's
        assert caught.value.hint.startswith("its embedding layers are named embed_tokens; ")


@pytest.mark.parametrize("keys", [
    {"lora_target_modules": ["q_proj", "self_attn.v_proj"]},  # peft's suffix match, with a dotted path too
    {"lora_target_modules": ["q_proj", "mlp.(gate|up)_proj"]},  # a regex entry: peft's own matching decides
    {"lora_target_linear": True, "lora_modules_to_save": ["embed_tokens", "lm_head"]},
])  # fmt: skip
def test_names_of_this_model_attach(model, keys):
    adapted = attach_adapter(model, recipe(**keys))
    targets = adapted.peft_config["default"].target_modules
    assert targets and adapted.base_model.targeted_module_names


def test_a_fused_experts_parameter_named_as_a_module_points_at_lora_target_parameters(model):
    import torch

    model.model.layers[0].mlp.register_parameter("gate_up_proj", torch.nn.Parameter(torch.zeros(2, 4, 4)))
    with pytest.raises(UserError, match="'gate_up_proj' is a parameter") as caught:
        attach_adapter(model, recipe(lora_target_modules=["q_proj", "gate_up_proj"]))
    assert caught.value.hint == "list it under lora_target_parameters instead"


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    return Qwen2MoeForCausalLM(Qwen2MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=16,
                                              shared_expert_intermediate_size=32))  # fmt: skip


def test_fused_experts_left_frozen_are_said_with_the_key_that_trains_them():
    """peft's all-linear reaches Qwen2-MoE's shared expert but not its routed experts (3D tensors): the run says so,
    and the key it names, used as said, adapts them (and then nothing is said)."""
    from llmtune.train.model.adapters import frozen_experts

    adapted = attach_adapter(qwen2_moe(), recipe(lora_target_linear=True))
    said = frozen_experts(adapted)
    assert said == ("the routed experts stay frozen: 2 fused expert modules (Qwen2MoeExperts, e.g. "
                    "model.layers.0.mlp.experts) hold their weights as 3D tensors, which this adapter's target "
                    "modules don't reach; to train them add lora_target_parameters: [mlp.experts.gate_up_proj, "
                    "mlp.experts.down_proj]")  # fmt: skip
    assert not any(p.requires_grad for n, p in adapted.named_parameters() if "experts" in n)
    keys = {"lora_target_linear": True, "lora_target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    adapted = attach_adapter(qwen2_moe(), recipe(**keys))
    assert frozen_experts(adapted) is None
    assert sum(1 for n, p in adapted.named_parameters() if "experts" in n and "lora_" in n and p.requires_grad) == 8
    from transformers import LlamaForCausalLM

    assert frozen_experts(attach_adapter(LlamaForCausalLM(tiny_llama_config(64)), recipe(lora_target_linear=True))) is None


def tiny_moe(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=4,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(("model_type", "names"), [
    ("qwen3_moe", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("mixtral", ["q_proj", "v_proj", "w1", "w2", "w3"]),
])  # fmt: skip
def test_transformers_4_expert_names_attach_to_the_fused_experts(model_type, names):
    """A recipe written for transformers 4 names each expert's linear layers; transformers 5 fuses them into 3D
    tensors and peft maps the names onto them: the run adapts the experts (it was refused as 'names no module')."""
    from llmtune.train.model.adapters import frozen_experts

    adapted = attach_adapter(tiny_moe(model_type), recipe(lora_target_modules=names))
    trained = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert any("experts" in n and "lora_" in n for n in trained) and any("q_proj.lora_A" in n for n in trained)
    assert frozen_experts(adapted) is None


def test_half_of_a_fused_pair_and_an_expert_name_peft_cant_map_are_one_line():
    with pytest.raises(UserError) as caught:  # gate_proj and up_proj are one tensor in transformers 5
        attach_adapter(tiny_moe("qwen3_moe"), recipe(lora_target_modules=["q_proj", "gate_proj", "down_proj"]))
    assert "without also targeting up_proj" in caught.value.message and "add the missing name" in caught.value.hint
    with pytest.raises(UserError) as caught:  # peft maps no per-expert names for PhiMoE: its experts are parameters
        attach_adapter(tiny_moe("phimoe"), recipe(lora_target_modules=["q_proj", "w1"]))
    assert "'w1' names no module of this model (phimoe)" in caught.value.message
    assert "lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]" in caught.value.hint


def test_linear_layers_peft_takes_lora_off_are_said():
    """peft 0.21 maps gate_proj, up_proj and down_proj of DeepSeek-V3 onto its fused experts and drops those names
    from the dense first layer's MLP and the shared experts: all-linear, or the names listed, left them frozen
    without a word (found training a tiny DeepSeek-V3). A model peft adapts whole says nothing."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from llmtune.train.model.adapters import frozen_linears

    config = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                              topk_group=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                              v_head_dim=8)  # fmt: skip
    for keys in ({"lora_target_linear": True}, {"lora_target_modules": ["o_proj", "gate_proj", "up_proj", "down_proj"]}):
        adapted = attach_adapter(DeepseekV3ForCausalLM(config), recipe(**keys))
        said = frozen_linears(adapted, recipe(**keys))
        assert said and said.startswith("6 linear layers the LoRA targets name stay frozen (down_proj, gate_proj, "
                                        "up_proj; e.g. model.layers.0.mlp.gate_proj)"), said  # fmt: skip
    for model in (LlamaForCausalLM(tiny_llama_config(64)), qwen2_moe()):
        assert frozen_linears(attach_adapter(model, recipe(lora_target_linear=True)), recipe(lora_target_linear=True)) is None


def test_peft_options_axolotl_passes_reach_peft_and_inits_that_rewrite_the_base_are_refused(model):
    """lora_rank_pattern, lora_alpha_pattern, peft_init_lora_weights (true, false, gaussian), peft_layers_pattern,
    peft_ensure_weight_tying and peft_autocast_adapter_dtype go to peft as Axolotl passes them (they were refused);
    pissa/olora rewrite the base weights the saved adapter then depends on, eva/corda need a data pass: refused."""
    import torch

    keys = {"lora_target_modules": ["q_proj", "v_proj"], "lora_rank_pattern": {"v_proj": 4}, "lora_alpha_pattern":
            {"v_proj": 8}, "peft_init_lora_weights": "gaussian", "peft_autocast_adapter_dtype": False}  # fmt: skip
    adapted = attach_adapter(model.to(torch.bfloat16), recipe(**keys))
    config = adapted.peft_config["default"]
    assert (config.rank_pattern, config.alpha_pattern, config.init_lora_weights) == ({"v_proj": 4}, {"v_proj": 8},
                                                                                     "gaussian")  # fmt: skip
    layer = adapted.base_model.model.model.layers[0].self_attn
    assert layer.v_proj.lora_A["default"].weight.shape[0] == 4 and layer.q_proj.lora_A["default"].weight.shape[0] == 8
    assert layer.q_proj.lora_B["default"].weight.dtype == torch.bfloat16  # not upcast: autocast off
    assert layer.q_proj.lora_B["default"].weight.abs().sum() == 0  # gaussian still starts B at zero
    for value in ("pissa", "olora", "eva"):
        with pytest.raises(UserError, match=f"'{value}' "):
            recipe(peft_init_lora_weights=value)


def test_one_string_of_target_modules_is_said_to_be_a_regex_with_the_list_to_write(model):
    """`lora_target_modules: q_proj` (a string, as YAML users write one item): peft matches the whole module name
    against it as a regex and finds nothing; the hint said to set module names this model has, which it named."""
    with pytest.raises(UserError) as caught:
        attach_adapter(model, recipe(lora_target_modules="q_proj"))
    assert caught.value.message.startswith("LoRA could not be attached")
    assert caught.value.hint.endswith("write a list, lora_target_modules: [q_proj]")
