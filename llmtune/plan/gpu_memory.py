"""What a GPU holds beyond the ZeRO paper's model states, as PyTorch's caching allocator sees it.

Pure arithmetic on the model's shape, like the rest of plan/. The activation terms follow transformers' Llama
code op by op (what autograd saves for backward, per token and decoder layer), and are checked against the
tensors autograd really saves in tests/unit/test_gpu_memory.py. The two allocator constants below are
calibrated on one H100 (torch 2.11+cu130, transformers 5.17; issues 17 and 32) against
torch.cuda.max_memory_reserved plus the CUDA context; `benchmarks/gpu_memory.py` measures more configurations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmtune.plan.model_facts import ModelFacts

GB = 1e9
# The CUDA context (driver state, kernel images of torch/cuBLAS/NCCL) lives outside the caching allocator, so
# max_memory_reserved never shows it (PyTorch's notes on memory_allocated/memory_reserved). Measured alone on an
# H100 (torch 2.11+cu130), after one matmul: 718 MB.
CUDA_CONTEXT = 0.72 * GB
# The caching allocator's reserve beyond the allocated peak. llmtune's workers run with expandable segments
# (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the user sets their own): freed pages serve any later
# size, so the reserve is a base plus a fraction of the transient bytes (allocated and freed within a step),
# whatever the batch shapes. 14 H100 runs (benchmarks/gpu_memory.py; 1B and 8B Llama shapes, full, LoRA, QLoRA,
# single, ZeRO-2/3, ZeRO-3 + offload, FSDP2, checkpointing on and off, packed and padded) measured a reserve
# (reserved - allocated) of 1.0-1.7 GB on 5-25 GB of transient, 3.1 GB for ZeRO-2 (its flat buffers), and 5.7 GB
# for FSDP2, whose all-gathers run on a stream of their own (the allocator keeps a pool per stream).
# The base is a floor, not a slope: the runs with the least transient (checkpointed LoRA and QLoRA, 5-10 GB) kept
# 1.1-1.7 GB. It was 0.5 GB when fitted with the estimate's total, CUDA context included, set against reserved memory
# alone, so the 0.72 GB context stood in for the rest of the floor; compared like for like (total against reserved
# + context) that left 8 of the 14 runs under, the lowest 6.5% under. 1.2 GB (0.5 + 0.72) puts every run within
# 0.995-1.074 of reserved + context (tests/unit/test_estimate.py holds it to 0.95-1.10).
EXPANDABLE_BASE = 1.2 * GB
EXPANDABLE_FRACTION = {"default": 0.10, "fsdp": 0.20}
# Without expandable segments (a user's own PYTORCH_CUDA_ALLOC_CONF): blocks are cached by size, so idle blocks
# count one by one (estimate.with_reserve), plus a fraction of the transient bytes. Fixed shapes (packed rows, or
# rows padded to sequence_len) replay the same allocations every step and fragment less than variable-length
# padded batches. On 8 H100 runs the fraction that met each run's reserved peak ranged from 0 to 0.5 (QLoRA: 0.8);
# no constant fits them all, which is why llmtune turns expandable segments on.
RESERVE_FRACTION = {"fixed": 0.25, "variable": 0.45}


ALLOC_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch's names for the allocator's settings
EXPANDABLE_DEFAULT = "expandable_segments:True"  # what llmtune's workers set when the user set neither


def allocator_setting(env) -> str | None:
    """The user's own allocator settings, under either of torch's names, or None."""
    return next((env[name] for name in ALLOC_CONF if env.get(name)), None)


def expandable_segments(env) -> bool:
    """Whether the workers' allocator uses expandable segments: llmtune's default unless the user set a config."""
    setting = allocator_setting(env)
    if not setting:
        return True
    return "expandable_segments:true" in setting.replace(" ", "").lower()


@dataclass(frozen=True)
class Allocator:
    """How the caching allocator reserves beyond the allocated peak, for one estimate row."""

    expandable: bool
    fraction: float  # of the transient bytes
    base: float = 0.0  # bytes, expandable segments only


def allocator(recipe, expandable: bool, fsdp: bool = False) -> Allocator:
    if expandable:
        return Allocator(True, EXPANDABLE_FRACTION["fsdp" if fsdp else "default"], EXPANDABLE_BASE)
    return Allocator(False, RESERVE_FRACTION["fixed" if fixed_shapes(recipe) else "variable"])


NF4_BLOCK = 64  # bitsandbytes' default blocksize for 4-bit weights: one absmax per 64 weights
NESTED_BLOCK = 256  # double quantization: the absmaxes in 8 bits, one fp32 absmax per 256 of them
LOSS_FP32_COPIES = 3  # log-softmax output, NLL gradient, log-softmax gradient: all fp32, all alive at once
# torch's foreach optimizers allocate one fp32 temporary per parameter at the step (_multi_tensor_adam's
# exp_avg_sq_sqrt, rmsprop's avg, adagrad's std); fused and bitsandbytes kernels update in place
FOREACH_TEMPORARY = {"adamw_torch": 4.0, "rmsprop": 4.0, "adagrad": 4.0}
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


# --- activations, per token ----------------------------------------------------------------------------------


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
    h, i, c = facts.hidden_size, facts.intermediate_size, w.compute
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
    return (2 if k.liger_glu else 3) * w.compute * facts.intermediate_size


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


# --- weights and optimizer ------------------------------------------------------------------------------------


GPTQ_GROUP = 128


def quantized_base_bytes(recipe, facts: ModelFacts) -> float:
    """A k-bit base as bitsandbytes stores it. NF4/FP4: half a byte per weight plus one absmax per 64-weight
    block (fp32; with double quantization 8 bits, plus an fp32 absmax per 256 blocks). LLM.int8: a byte per
    weight plus an fp32 scale per output row. The modules left unquantized (embeddings, lm_head, norms) are
    made fp32 by peft's prepare_model_for_kbit_training, which llmtune calls."""
    quantized = facts.linear_params()
    if recipe.gptq:  # GPTQ's common form: 4-bit weights, an fp16 scale and a 4-bit zero point per 128 weights
        per_weight = 0.5 + (2 + 0.5) / GPTQ_GROUP
    elif recipe.load_in_4bit:
        double = recipe.bnb_4bit_use_double_quant
        absmax = (1 + 4 / NESTED_BLOCK) / NF4_BLOCK if double else 4 / NF4_BLOCK
        per_weight = 0.5 + absmax
    else:
        per_weight = 1.0 + 4 / facts.hidden_size
    return quantized * per_weight + 4.0 * (facts.total_params() - quantized)


def weight_copies(recipe, facts: ModelFacts, w: Widths, trainable: int) -> float:
    """16-bit copies of fp32 weights made by autocast and kept until backward: every linear weight of a full
    fine-tune (lm_head's too, tied or not), the fp32 lm_head of a k-bit base, fp32 LoRA adapters."""
    if not w.autocast or w.compute >= 4:
        return 0.0
    if not recipe.adapter:
        return w.compute * (facts.linear_params() + facts.embedding_params())
    head = facts.embedding_params() if (recipe.load_in_4bit or recipe.load_in_8bit or recipe.gptq) else 0
    return w.compute * (trainable + head)


def optimizer_temporaries(optimizer: str, trainable: float, largest: float) -> float:
    """Bytes the optimizer allocates during its step and frees after it."""
    if optimizer == "adafactor":
        return 8.0 * largest  # transformers' Adafactor: the update and grad^2 of one parameter at a time
    return FOREACH_TEMPORARY.get(optimizer, 0.0) * trainable


# --- the allocator ---------------------------------------------------------------------------------------------


def fixed_shapes(recipe) -> bool:
    """Packed rows, or rows padded to sequence_len: every batch has the same shape."""
    return bool(recipe.sample_packing or recipe.pad_to_sequence_len)


def in_flight_microbatches(recipe, stages: int) -> int:
    """1F1B (and GPipe) keep up to `stages` micro-batches in flight on the first stage."""
    microbatches = getattr(recipe, "pipeline_microbatches", None) or max(recipe.gradient_accumulation_steps, stages)
    return min(stages, microbatches) if recipe.pipeline_schedule != "gpipe" else microbatches


def layers_per_stage(facts: ModelFacts, stages: int) -> int:
    return math.ceil(facts.num_layers / max(1, stages))
