"""How tensor and context parallelism split one model's memory across GPUs, for the estimate's rows.

Pure arithmetic on the recipe and the model's shape; plan/memory/peak.py turns the splits into rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtune.plan.memory.facts import NOT_ATTENTION_ONLY, ModelFacts

# Megatron-LM's activation count per layer (Korthikanti et al. 2022): of 34 s*b*h bytes, tensor parallelism
# splits 24 (attention and MLP insides) and leaves 10 whole on every rank (the residual stream, layer norms, dropout
# masks); the attention scores (5 a s^2 b) split with the heads.
TP_REPLICATED_ACTIVATIONS = 10 / 34


@dataclass(frozen=True)
class Split:
    name: str  # the row's strategy, e.g. "tensor parallel (8-way)"
    states: int  # the model states (and optimizer scratch, held gradients) are divided by this
    saved: float  # multipliers of the activations saved for backward, the logits and the recomputed layer
    logits: float
    recompute: float
    fsdp: bool  # the row's weights are gathered in 16 bits by FSDP2 (its layout and allocator)


def tensor_parallel_degree(recipe, facts: ModelFacts, gpus_per_machine: int) -> int:
    """The recipe's tensor_parallel_size, else the largest degree within one machine that divides the heads."""
    if recipe.tensor_parallel_size > 1:
        return recipe.tensor_parallel_size
    return max(t for t in range(1, min(gpus_per_machine, 8) + 1)
               if facts.num_heads % t == 0 and facts.num_kv_heads % t == 0)  # fmt: skip


def tensor_parallel_split(recipe, tp: int) -> Split:
    """Every weight split tp ways (transformers' tp_plan splits the projections, embeddings and head; norms stay
    whole), FSDP2 over dp_shard_size on top; activations as Megatron counts them (under gradient checkpointing only
    each layer's input is saved: the residual stream, whole on every rank); the logits gathered whole for the loss."""
    share = TP_REPLICATED_ACTIVATIONS + (1 - TP_REPLICATED_ACTIVATIONS) / tp
    saved = 1.0 if recipe.gradient_checkpointing else share
    return Split(f"tensor parallel ({tp}-way)", tp * (recipe.dp_shard_size or 1), saved, 1.0, share, False)


def context_parallel_degree(recipe, facts: ModelFacts, gpus_per_machine: int) -> int:
    """The recipe's context_parallel_size, else the largest power of two within one machine that splits the sequence
    into 2 x degree chunks; 1 where context parallelism can't run this recipe (packing, non-sdpa attention,
    state-space layers, DeepSpeed)."""
    if recipe.context_parallel_size > 1:
        return recipe.context_parallel_size
    if recipe.sample_packing or recipe.attn_implementation not in (None, "sdpa") or recipe.flash_attention:
        return 1
    if facts.model_type in NOT_ATTENTION_ONLY or recipe.deepspeed is not None:
        return 1
    degree = 1
    while degree * 2 <= min(gpus_per_machine, 8) and recipe.sequence_len % (4 * degree) == 0:
        degree *= 2
    return degree


def context_parallel_split(cp: int, world: int) -> Split:
    """FSDP2 shards the states over every rank (the cp ranks shard too); every activation, the logits included,
    splits with the sequence (each rank holds 1/cp of each row)."""
    return Split(f"context parallel ({cp}-way)", max(world, cp), 1 / cp, 1 / cp, 1 / cp, True)
