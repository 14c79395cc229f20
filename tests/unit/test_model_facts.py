"""The planner's parameter count, from config.json alone, against the model transformers builds from that config:
dense, explicit head_dim, mixture-of-experts layouts (routed, shared, dense-first, interleaved) and latent attention."""

from __future__ import annotations

import pytest

from llmtune.plan.memory.facts import facts_from_config

SHAPE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": 512}  # fmt: skip
CASES = {
    "llama": {},
    "qwen3": {"head_dim": 32},  # head_dim isn't hidden / heads (Qwen3-32B: 64 x 128 against 5120)
    "gemma3_text": {"head_dim": 32},  # ties its embeddings by its config class's default
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {"num_experts": 8, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                  "num_experts_per_tok": 2, "decoder_sparse_step": 2},
    "qwen3_moe": {"num_experts": 8, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "mlp_only_layers": [0],
                  "head_dim": 16},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "llama4_text": {"num_local_experts": 4, "intermediate_size_mlp": 128, "interleave_moe_layer_step": 2,
                    "num_experts_per_tok": 1, "head_dim": 16},
    "deepseek_v3": {"n_routed_experts": 8, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "num_experts_per_tok": 2, "q_lora_rank": None, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1},
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(CASES))
def test_parameters_from_config_json_are_the_built_model_s(model_type):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**SHAPE, **CASES[model_type])
    saved = {k: v for k, v in config.to_dict().items() if k != "tie_word_embeddings" or model_type != "gemma3_text"}
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    facts = facts_from_config(saved)
    # what is left out: per-head norms (q_norm/k_norm) and a shared expert's gate, a few hundred of ~300k
    assert facts.total_params() == pytest.approx(built, rel=0.005), (facts.total_params(), built)
    assert facts.tie_word_embeddings == config.tie_word_embeddings
    experts = facts.num_experts
    assert (experts > 0) == ("expert" in str(CASES[model_type]))
    if experts:  # a token goes through its chosen experts (and the shared ones), not through all of them
        assert facts.active_intermediate_size < experts * facts.expert_intermediate_size
        assert facts.largest_layer_params() > facts.layer_params() or facts.moe_layers == facts.num_layers


def test_a_mixture_of_experts_model_is_counted_whole_for_its_states_and_not_for_its_activations():
    """Qwen3-30B-A3B's published config: 30.5B parameters (the old count, 2.9B, planned DDP on 80 GB GPUs)."""
    config = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
              "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768,
              "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "vocab_size": 151936, "tie_word_embeddings": False}  # fmt: skip
    facts = facts_from_config(config)
    assert facts.total_params() / 1e9 == pytest.approx(30.53, abs=0.01)
    assert facts.active_intermediate_size == 8 * 768


def test_which_layers_are_mixture_of_experts_ones_follows_each_family_s_key():
    shape = {**SHAPE, "num_hidden_layers": 6, "num_experts": 4}
    assert facts_from_config({**shape, "decoder_sparse_step": 2}).moe_layers == 3  # Qwen-MoE: layers 1, 3, 5
    assert facts_from_config({**shape, "interleave_moe_layer_step": 3}).moe_layers == 2  # Llama 4: 2, 5
    # DeepSeek: from first_k_dense_replace on, every moe_layer_freq-th layer counting from layer 0: 2 and 4
    assert facts_from_config({**shape, "first_k_dense_replace": 1, "moe_layer_freq": 2}).moe_layers == 2
    assert facts_from_config({**shape, "mlp_only_layers": [0, 5]}).moe_layers == 4


def test_qlora_on_a_mixture_of_experts_keeps_the_fused_experts_16_bit_and_counts_them_so(tmp_path):
    """bitsandbytes quantizes linear layers only; transformers fuses MoE experts into 3D tensors, which stayed bf16
    and then went fp32 in peft's prepare_model_for_kbit_training (Qwen3-30B-A3B: ~116 GB of experts), while the
    estimate counted them 4-bit."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from llmtune.plan import make_cluster, make_plan
    from llmtune.plan.memory.states import quantized_base_bytes
    from llmtune.plan.render import summary_lines
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.model.adapters import _with_adapter

    shape = {**SHAPE, **CASES["qwen3_moe"]}
    AutoModelForCausalLM.from_config(CONFIG_MAPPING["qwen3_moe"](**shape)).save_pretrained(tmp_path / "moe")
    recipe = recipe_from_mapping({"base_model": str(tmp_path / "moe"), "adapter": "qlora", "load_in_4bit": True,
                                  "lora_target_linear": True, "bf16": True, "output_dir": str(tmp_path / "o"),
                                  "datasets": [{"path": "org/d", "type": "alpaca"}]}, Path("r.yaml"),
                                 check_files=False).recipe  # fmt: skip
    four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", quantization_config=four_bit, dtype=torch.bfloat16)
    model = _with_adapter(model, recipe)
    params = dict(model.named_parameters())
    fused = [param for name, param in params.items() if ".layers.1.mlp.experts." in name and "lora_" not in name]
    assert len(fused) == 2 and all(param.dtype == torch.bfloat16 for param in fused)  # the experts: 16-bit, as loaded
    norm = next(param for name, param in params.items() if name.endswith("layers.1.post_attention_layernorm.weight"))
    assert norm.dtype == torch.float32  # peft's preparation for the rest, as before
    assert next(param for name, param in params.items() if "layers.1.self_attn.q_proj.base_layer" in name).dtype \
        == torch.uint8  # fmt: skip
    facts = facts_from_config(shape)
    experts = facts.routed_expert_params()
    assert experts == 3 * 3 * 64 * 32 * 8  # layers 1-3 (layer 0 is dense), gate + up + down of 8 experts
    linear_4bit = facts.linear_params() - experts
    assert quantized_base_bytes(recipe, facts) == pytest.approx(
        linear_4bit * (0.5 + (1 + 4 / 256) / 64) + 2 * experts + 4 * (facts.total_params() - linear_4bit - experts))
    assert recipe.bnb_4bit_use_double_quant  # Axolotl's default: 8-bit absmaxes
    method = dict(summary_lines(make_plan(recipe, make_cluster(1, device="cuda")), recipe))["method"]
    assert f"its fused expert weights, {experts / facts.total_params():.0%} of the model, stay 16-bit" in method
