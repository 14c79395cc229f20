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
