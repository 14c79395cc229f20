"""Activations: what autograd saves for backward, per token and decoder layer, following transformers' Llama code op
by op (checked against the tensors autograd really saves in tests/unit/test_gpu_memory.py); the head and the
fp32 logits at the loss; autocast's 16-bit weight copies; gradient checkpointing, activation offload and the
micro-batches a pipeline stage keeps in flight."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtune.plan.memory.compute import Kernels, Trains, Widths, trains
from llmtune.plan.memory.facts import ModelFacts

LOSS_FP32_COPIES = 3  # log-softmax output, NLL gradient, log-softmax gradient: all fp32, all alive at once


def _norms(h: int, w: Widths, t: Trains, k: Kernels) -> float:
    """Two RMSNorms. transformers' LlamaRMSNorm saves its input in fp32 (4h) and 1/rms (4 bytes); when its
    weight trains, also the normalised value (residual width). Liger's kernel saves the input and 1/rms."""
    if k.liger_norm:
        return 2 * (w.residual * h + 4)
    return 2 * (4 * h + 4 + (w.residual * h if t.full else 0))


def _linear_inputs(facts: ModelFacts, w: Widths, t: Trains, k: Kernels) -> float:
    """What the linear layers save of their inputs: a trained weight needs its input for the weight gradient.

    Autocast casts an fp32 input afresh for every linear that reads it (a 16-bit copy each); peft casts a LoRA
    input to the adapter's fp32 and autocast back, again a copy per adapted layer."""
    h, i, c = facts.hidden_size, facts.active_intermediate_size, w.compute
    total = 0.0
    for names, features, reads in ((("q_proj", "k_proj", "v_proj"), h, "norm"), (("o_proj",), h, "attention"),
                                   (("gate_proj", "up_proj"), h, "norm"), (("down_proj",), i, "mlp")):  # fmt: skip
        if t.full:
            if reads == "norm":
                total += len(names) * c * features if w.residual > c else w.residual * features
            elif reads == "mlp" or k.attention == "eager":  # sdpa/flash save their output: o_proj reads it
                total += c * features
            continue
        adapted = sum(name in t.adapted for name in names)
        if not adapted:
            continue
        if w.autocast or t.dropout:
            total += adapted * c * features
        elif not (reads == "attention" and k.attention != "eager"):
            total += (w.residual if reads == "norm" else c) * features
        total += adapted * (c * t.rank + (features if t.dropout else 0))  # lora_B's input; dropout's bool mask
    return total


def _attention(facts: ModelFacts, seq: int, w: Widths, k: Kernels) -> float:
    """What the attention kernel saves. sdpa: q, k and v (transformers repeats k/v to every head whenever it
    passes a mask, as it does for packed and padded rows), the output, logsumexp (fp32 per head) and the
    boolean mask made additive, once per layer. flash/flex: k/v stay at the kv heads. eager: the seq x seq
    softmax per head in fp32, and its 16-bit copy that multiplies v."""
    h, kv, heads, c = facts.hidden_size, facts.num_kv_heads * facts.head_dim, facts.num_heads, w.compute
    if k.attention == "eager":
        return 3 * c * h + heads * seq * (4 + (c if c < 4 else 0))
    if k.attention in ("flash_attention_2", "flex_attention"):
        return 2 * c * h + 2 * c * kv + 4 * heads
    return 4 * c * h + 4 * heads + c * seq


def _mlp(facts: ModelFacts, w: Widths, k: Kernels) -> float:
    """SwiGLU: SiLU saves its input (gate), the product saves SiLU's output and up; Liger recomputes SiLU."""
    return (2 if k.liger_glu else 3) * w.compute * facts.active_intermediate_size


def layer_bytes(facts: ModelFacts, seq: int, w: Widths, t: Trains, k: Kernels) -> float:
    """Bytes one decoder layer saves for backward, per token (Llama-shaped: RMSNorm, GQA attention, SwiGLU)."""
    h = facts.hidden_size
    return _norms(h, w, t, k) + _linear_inputs(facts, w, t, k) + _attention(facts, seq, w, k) + _mlp(facts, w, k)


def head_bytes(facts: ModelFacts, w: Widths, t: Trains, k: Kernels) -> float:
    """The final norm and lm_head's input, per token (a frozen lm_head saves no input)."""
    h = facts.hidden_size
    norm = (w.residual * h + 4) if k.liger_norm else 4 * h + 4 + (w.residual * h if t.full else 0)
    if not t.full or k.loss == "fused":
        return norm
    return norm + (w.compute * h if w.residual > w.compute else w.residual * h)


def logits_bytes(facts: ModelFacts, tokens: int, w: Widths, t: Trains, k: Kernels) -> tuple[float, float]:
    """(peak bytes at the loss, bytes the allocator keeps idle beside them).

    transformers' ForCausalLMLoss upcasts the logits (`logits.float()`), and cross_entropy is log_softmax +
    nll_loss: at the start of backward three fp32 tensors of tokens x vocab are alive (log-softmax output, NLL
    gradient, log-softmax gradient), more than the forward's 16-bit logits + fp32 copy + log-softmax output.
    The 16-bit logits' block, freed before backward, is too small for an fp32 gradient: it stays idle.
    Liger's cross-entropy writes the gradient into the fp32 logits; its fused linear cross-entropy works in
    chunks of about tokens x hidden values and never makes the logits (it also makes lm_head's weight gradient).
    """
    v, h, c = facts.vocab_size, facts.hidden_size, w.compute
    if k.loss == "fused":
        return tokens * h * 3 * c + (4.0 * facts.embedding_params() if t.full else 0.0), 0.0
    if k.loss == "liger":
        return tokens * v * (4 + (c if c < 4 else 0)), 0.0
    return tokens * v * 4 * LOSS_FP32_COPIES, (tokens * v * c if c < 4 else 0.0)


@dataclass(frozen=True)
class Activations:
    saved: float  # what backward needs, alive at the loss: every layer's activations (or only each layer's input
    # under gradient checkpointing) and the head's
    logits: float
    idle_logits: float
    recompute: float  # under checkpointing: one layer's activations, rebuilt in backward (and made and freed by
    # every layer in forward)
    offloaded: float = 0.0  # activation_offloading: the layers' inputs, in CPU memory instead


def activations(recipe, facts: ModelFacts, w: Widths, k: Kernels, layers: int | None = None,
                in_flight: int = 1) -> Activations:  # fmt: skip
    """Per GPU, for `layers` decoder layers (default all) holding `in_flight` micro-batches (pipeline stages)."""
    layers = facts.num_layers if layers is None else layers
    seq = recipe.sequence_len
    tokens = recipe.micro_batch_size * seq
    t = trains(recipe)
    per_layer = layer_bytes(facts, seq, w, t, k) * tokens
    fsdp_checkpointing = getattr(recipe.fsdp_config, "activation_checkpointing", False)
    checkpointing = recipe.gradient_checkpointing or bool(fsdp_checkpointing)
    # torch.utils.checkpoint keeps each layer's input (the residual stream) and recomputes the rest in backward
    kept = w.residual * facts.hidden_size * tokens if checkpointing else per_layer
    logits, idle = logits_bytes(facts, tokens, w, t, k)
    head = head_bytes(facts, w, t, k) * tokens
    if checkpointing and getattr(recipe, "activation_offloading", False):
        # each layer's input goes to CPU memory as the forward passes it and comes back, one at a time, in
        # backward; the head's tensors (moved too, except under hidden_states) are counted on the GPU
        offloaded = in_flight * layers * kept
        return Activations(in_flight * kept + head, logits, idle, per_layer, offloaded)
    saved = in_flight * layers * kept + head
    return Activations(saved, logits, idle, per_layer if checkpointing else 0.0)


def weight_copies(recipe, facts: ModelFacts, w: Widths, trainable: int) -> float:
    """16-bit copies of fp32 weights made by autocast and kept until backward: every linear weight of a full
    fine-tune (lm_head's too, tied or not), the fp32 lm_head of a k-bit base, fp32 LoRA adapters."""
    if not w.autocast or w.compute >= 4:
        return 0.0
    if not recipe.adapter:
        return w.compute * (facts.linear_params() + facts.embedding_params())
    head = facts.embedding_params() if (recipe.load_in_4bit or recipe.load_in_8bit or recipe.gptq) else 0
    return w.compute * (trainable + head)


def in_flight_microbatches(recipe, stages: int) -> int:
    """1F1B (and GPipe) keep up to `stages` micro-batches in flight on the first stage."""
    microbatches = getattr(recipe, "pipeline_microbatches", None) or max(recipe.gradient_accumulation_steps, stages)
    return min(stages, microbatches) if recipe.pipeline_schedule != "gpipe" else microbatches


def layers_per_stage(facts: ModelFacts, stages: int) -> int:
    return math.ceil(facts.num_layers / max(1, stages))
