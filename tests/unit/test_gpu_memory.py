"""The activation terms of llmtune.plan.memory.activations against what autograd really saves for backward.

A 2-layer Llama-shaped model runs one forward with labels on CPU, under bf16 autocast where the GPU run would
use it; a saved-tensors hook records every tensor autograd keeps (by storage, once each, parameters left out).
The formula must match it within 1% (it leaves out the ids, labels and rotary tables), so that the GPU
calibration rests on counted bytes, not on a fudge factor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.plan.memory.activations import activations, head_bytes, logits_bytes, weight_copies
from llmtune.plan.memory.compute import LINEARS, Kernels, Widths, trains, widths
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.states import quantized_base_bytes
from llmtune.recipe.loader import recipe_from_mapping

SHAPE = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "intermediate_size": 512, "vocab_size": 1000}  # fmt: skip
BATCH, SEQ = 2, 64


def recipe(**changes):
    base = {"base_model": "m", "datasets": [{"path": "d", "type": "alpaca"}], "sequence_len": SEQ,
            "micro_batch_size": BATCH, "sample_packing": True}  # fmt: skip
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def saved_by_autograd(model, autocast: bool) -> int:
    """Bytes of every tensor autograd saves in one forward with labels, parameters excluded."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    torch.manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 10 :] = 0  # a padded row: transformers passes a mask, as it does for packed rows
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            model(input_ids=ids, attention_mask=mask, labels=ids)
    return sum(saved.values())


def build(attention: str, weights: str, tied: bool, lora: list[str] | None):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPE, tie_word_embeddings=tied, attn_implementation=attention, use_cache=False)
    model = LlamaForCausalLM(config).train()
    if weights == "bf16":
        model = model.to(torch.bfloat16)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=lora))
        model.enable_input_require_grads()  # so the first layer saves what every other layer saves
    return model


def predicted(r, w: Widths, attention: str, tied: bool) -> float:
    """What autograd keeps at the end of the forward: saved activations, weight copies, log-softmax output."""
    facts = ModelFacts("llama", SHAPE["hidden_size"], SHAPE["num_hidden_layers"], SHAPE["num_attention_heads"],
                       SHAPE["num_key_value_heads"], SHAPE["intermediate_size"], SHAPE["vocab_size"], tied)  # fmt: skip
    k = Kernels(attention, "torch", False, False)
    acts = activations(r, facts, w, k)
    trainable = 0
    if r.adapter:
        from llmtune.plan.memory.states import trainable_parameters

        trainable = trainable_parameters(r, facts)
    tokens = BATCH * SEQ
    return acts.saved + weight_copies(r, facts, w, trainable) + 4 * facts.vocab_size * tokens


CASES = {
    # name: (recipe changes, attention, model weights, autocast, widths, tied, LoRA targets)
    "full fp32 weights + bf16 autocast, sdpa": ({"bf16": True}, "sdpa", "fp32", True, Widths(2, 4, True), True, None),
    "full, eager attention": ({"bf16": True}, "eager", "fp32", True, Widths(2, 4, True), False, None),
    "full bf16 model (DeepSpeed's layout)": ({"bf16": True}, "sdpa", "bf16", False, Widths(2, 2, False), True, None),
    "full fp32": ({}, "sdpa", "fp32", False, Widths(4, 4, False), True, None),
    "LoRA q,v on a bf16 base": ({"bf16": True, "adapter": "lora", "lora_target_modules": ["q_proj", "v_proj"]},
                                "sdpa", "bf16", True, Widths(2, 2, True), True, ["q_proj", "v_proj"]),
    "LoRA all linear": ({"bf16": True, "adapter": "lora", "lora_target_linear": True}, "sdpa", "bf16", True,
                        Widths(2, 2, True), True, list(LINEARS)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_activation_formula_covers_what_autograd_saves(case):
    changes, attention, weights, autocast, widths, tied, lora = CASES[case]
    measured = saved_by_autograd(build(attention, weights, tied, lora), autocast)
    expected = predicted(recipe(**changes), widths, attention, tied)
    print(f"{case}: autograd saved {measured:,} bytes, formula {expected:,.0f} ({measured / expected:.3f})")
    # the ids, labels and the rotary cos/sin are left out of the formula: under 1% here, less on real shapes
    assert 0.97 <= measured / expected <= 1.01


def test_widths_follow_how_llmtune_loads_the_weights():
    assert widths(recipe(bf16=True), True, False) == Widths(2, 4, True)  # fp32 weights, autocast
    assert widths(recipe(bf16=True), True, True) == Widths(2, 2, False)  # DeepSpeed's bf16 engine
    lora = recipe(bf16=True, adapter="lora")
    assert widths(lora, True, False) == Widths(2, 2, True)  # a 16-bit base
    qlora = recipe(bf16=True, adapter="qlora", load_in_4bit=True)
    assert widths(qlora, True, False) == Widths(2, 4, True)  # prepare_model_for_kbit_training: fp32 embeddings


def test_checkpointing_keeps_one_input_per_layer_and_rebuilds_one_layer():
    facts = ModelFacts("llama", 4096, 32, 32, 8, 14336, 49152, False)
    w, k = Widths(2, 4, True), Kernels("sdpa", "torch", False, False)
    plain = activations(recipe(bf16=True, sequence_len=1024), facts, w, k)
    kept = activations(recipe(bf16=True, sequence_len=1024, gradient_checkpointing=True), facts, w, k)
    tokens = BATCH * 1024
    head = head_bytes(facts, w, trains(recipe()), k) * tokens
    assert kept.saved - head == pytest.approx(32 * 4 * 4096 * tokens)  # each layer's fp32 input
    assert kept.recompute == pytest.approx((plain.saved - head) / 32)
    assert plain.recompute == 0


def test_logits_peak_is_three_fp32_copies_and_the_fused_loss_never_makes_them():
    facts = ModelFacts("llama", 2048, 16, 32, 8, 8192, 49152, True)
    w, t = Widths(2, 4, True), trains(recipe())
    peak, idle = logits_bytes(facts, 8192, w, t, Kernels("sdpa", "torch", False, False))
    assert peak == 12 * 8192 * 49152 and idle == 2 * 8192 * 49152
    fused, _ = logits_bytes(facts, 8192, w, t, Kernels("sdpa", "fused", False, False))
    assert fused < peak / 8  # chunks of tokens x hidden, and lm_head's weight gradient


def test_a_4bit_base_keeps_embeddings_and_head_in_fp32_and_pays_for_its_absmax():
    facts = ModelFacts("llama", 4096, 32, 32, 8, 14336, 49152, False)  # Llama-3.1-8B's shape, SmolLM2's vocabulary
    linear = facts.linear_params()
    kept = facts.total_params() - linear
    double = quantized_base_bytes(recipe(adapter="qlora", load_in_4bit=True), facts)
    single = quantized_base_bytes(recipe(adapter="qlora", load_in_4bit=True, bnb_4bit_use_double_quant=False), facts)
    assert double == pytest.approx(linear * (0.5 + 1 / 64 + 4 / (64 * 256)) + 4 * kept)
    assert single - double == pytest.approx(linear * (4 / 64 - 1 / 64 - 4 / (64 * 256)))
    assert double / 1e9 == pytest.approx(5.21, abs=0.01)  # issue 17 measured 5.27 GB held, adapters included
