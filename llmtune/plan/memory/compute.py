"""How the run computes, as far as memory is concerned: the precision of its activations (widths), what it trains,
and the kernels that change what is kept (attention, loss, Liger's norm and GLU). Read by every term above it."""

from __future__ import annotations

from dataclasses import dataclass

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Widths:
    """Bytes per value of the activations: how the run's precision lays them out."""

    compute: int  # matmul inputs and outputs: 2 under bf16/fp16, 4 in fp32
    residual: int  # the residual stream: fp32 when the embeddings are (fp32 weights, k-bit bases), else compute
    autocast: bool  # fp32 tensors are cast to 16 bits on every call: each cast is a new tensor


@dataclass(frozen=True)
class Trains:
    """What is trained, which decides what autograd saves."""

    full: bool  # every weight (saves linear inputs and normalised values)
    adapted: frozenset[str]  # LoRA-adapted linear layers
    rank: int
    dropout: bool


@dataclass(frozen=True)
class Kernels:
    attention: str  # eager, sdpa, flash_attention_2, flex_attention
    loss: str  # torch (transformers' fp32 upcast), liger (cross-entropy in place), fused (no full logits)
    liger_norm: bool
    liger_glu: bool


def is_mixed(recipe) -> bool:
    return recipe.precision != "no" or recipe.bf16 == "auto"


def widths(recipe, mixed: bool, sixteen_bit_model: bool) -> Widths:
    """sixteen_bit_model: DeepSpeed's bf16 engine or FSDP's bf16 parameters; else the weights as llmtune loads
    them (fp32 for a full fine-tune, 16-bit bases for LoRA, fp32 embeddings after prepare_model_for_kbit_training)."""
    if not mixed:
        return Widths(4, 4, False)
    if sixteen_bit_model:
        return Widths(2, 2, False)
    fp32_embeddings = not recipe.adapter or recipe.load_in_4bit or recipe.load_in_8bit or recipe.gptq
    return Widths(2, 4 if fp32_embeddings else 2, True)


def trains(recipe) -> Trains:
    if not recipe.adapter:
        return Trains(True, frozenset(), 0, False)
    targets = "all-linear" if recipe.lora_target_linear else recipe.lora_target_modules
    chosen = LINEARS if targets is None or isinstance(targets, str) else tuple(targets)  # family default: all
    return Trains(False, frozenset(chosen), recipe.lora_r, recipe.lora_dropout > 0)


def kernels(recipe, pipeline: bool = False) -> Kernels:
    """The kernels the GPU run uses that change memory (llmtune.recipe.kernels decides; read defensively)."""
    liger = {}
    try:
        from llmtune.recipe.kernels import liger_requested

        liger = liger_requested(recipe)
    except (ImportError, AttributeError):
        pass
    loss = "torch"
    if liger.get("fused_linear_cross_entropy") and not pipeline:
        loss = "fused"
    elif liger.get("cross_entropy") and not pipeline:
        loss = "liger"
    attention = recipe.attn_implementation or "sdpa"  # transformers' default where the model supports it
    if pipeline and attention == "flash_attention_2":
        attention = "sdpa"  # pipeline stages pass their own block mask (llmtune.recipe.kernels)
    return Kernels(attention, loss, bool(liger.get("rms_norm")), bool(liger.get("glu")))


def fixed_shapes(recipe) -> bool:
    """Packed rows, or rows padded to sequence_len: every batch has the same shape."""
    return bool(recipe.sample_packing or recipe.pad_to_sequence_len)
