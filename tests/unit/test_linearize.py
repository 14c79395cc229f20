"""llama4_linearized_experts: the per-expert linear layout computes what transformers' fused experts compute, both
checkpoint layouts load into it, and the LoRA target list keeps regex entries (experts.gate_projs.[0-9]+$)."""

from __future__ import annotations

import re

import pytest
from tiny import load_tokenizer

from llmtune.errors import UserError
from llmtune.train.model import linearize
from llmtune.train.model.targets import target_pattern


def tiny_llama4(path):
    import torch
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    tok = load_tokenizer()
    config = Llama4TextConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=32, intermediate_size_mlp=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=1,
                              no_rope_layers=[1, 1], attention_chunk_size=256, rope_scaling=None,
                              max_position_embeddings=256)  # fmt: skip
    torch.manual_seed(0)
    model = Llama4ForCausalLM(config).float().eval()
    with torch.no_grad():  # the fused experts start at zero in transformers: give them weights to compare
        for layer in model.model.layers:
            layer.feed_forward.experts.gate_up_proj.normal_(std=0.2)
            layer.feed_forward.experts.down_proj.normal_(std=0.2)
    model.save_pretrained(str(path))
    return model


def test_linear_experts_compute_what_the_fused_ones_do_and_both_layouts_load(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    fused = tiny_llama4(tmp_path / "fused")
    with linearize.linear_experts(fused.config):
        linear = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fused"))
    assert linearize.fill_from_fused(linear, str(tmp_path / "fused"), None, False, lambda _: None) == 2
    experts = linear.model.layers[0].feed_forward.experts
    assert type(experts).__name__ == "LinearizedExperts" and len(experts.gate_projs) == 4
    gate_up = fused.model.layers[0].feed_forward.experts.gate_up_proj
    assert torch.equal(experts.up_projs[3].weight, gate_up[3, :, 32:].t())  # the second half is up
    ids = torch.tensor([[1, 20, 35, 8, 77, 12, 5, 9]])
    with torch.no_grad():
        expected = fused(input_ids=ids).logits
        assert torch.allclose(linear.eval()(input_ids=ids).logits, expected, atol=1e-6)
    linear.save_pretrained(str(tmp_path / "linear"))  # Axolotl's "Linearized" checkpoints: loaded as they are
    with linearize.linear_experts(fused.config):
        again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "linear")).eval()
    assert linearize.fill_from_fused(again, str(tmp_path / "linear"), None, False, lambda _: None) == 0
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, expected, atol=1e-6)
    with pytest.raises(UserError, match="with a 4/8-bit load needs a linearized checkpoint"):
        linearize.fill_from_fused(again, str(tmp_path / "fused"), None, True, lambda _: None)


def test_fused_keys_of_a_multimodal_checkpoint_are_found_by_layer():
    match = linearize.FUSED.fullmatch("language_model.model.layers.12.feed_forward.experts.gate_up_proj")
    assert match and match.groups() == ("12", "gate_up_proj")
    assert not linearize.FUSED.fullmatch("model.layers.1.feed_forward.shared_expert.down_proj")


def test_regex_entries_in_a_target_list_become_one_pattern_keeping_suffix_matches():
    assert target_pattern(["q_proj", "v_proj"]) == ["q_proj", "v_proj"]  # peft's own suffix matching
    pattern = target_pattern(["self_attn.q_proj", "experts.gate_projs.[0-9]+$"])
    matches = lambda name: bool(re.fullmatch(pattern, name))  # noqa: E731 - peft fullmatches a string target
    assert matches("model.layers.0.self_attn.q_proj") and matches("model.layers.3.feed_forward.experts.gate_projs.15")
    assert not matches("model.layers.0.feed_forward.experts.gate_projs") and not matches("model.x_self_attn.q_proj")
