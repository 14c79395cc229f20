"""Attention over padding-free batches (llmtune/recipe/batches.py decides where they run).

One micro-batch is one sequence of concatenated rows; the collator gives the rows' cumulative lengths
(`cu_seq_lens_q`/`_k`, int32) and the longest row (`max_length_q`/`_k`, a Python int) on the host, and transformers
passes them down to the attention function as keyword arguments. llmtune registers that function with
transformers' AttentionInterface as `llmtune_varlen`; transformers builds no mask for an implementation it has no
mask function for, so there is no L x L mask and no host sync in the step.

- On CUDA in bf16/fp16: torch's varlen_attn (FlashAttention inside torch; causality is its window (-1, 0)).
- Elsewhere (the CPU rehearsal, fp32): SDPA row by row, causal. The same maths as attending to each row alone: this
  is the reference the GPU kernel is checked against, and what the CPU tests prove isolation and loss parity with.

flash_attention_2 (flash-attn installed) reads the same keyword arguments in transformers' own code, so it needs
nothing from here but the collator.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from llmtune.plan.memory.facts import NOT_ATTENTION_ONLY
from llmtune.plan.padding_free import passes_boundaries, text_layer
from llmtune.recipe.batches import VARLEN_ATTENTION
from llmtune.train.runtime.ranks import SEQUENCE_MIXERS

ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@functools.cache
def torch_varlen():
    """torch.nn.attention.varlen.varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def kernel_for(query: torch.Tensor) -> str:
    """'torch_varlen' where torch's kernel runs (CUDA, bf16/fp16), else 'sdpa_per_row'."""
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and torch_varlen() is not None:
        return "torch_varlen"
    return "sdpa_per_row"


def varlen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None, **kwargs):  # fmt: skip
    """transformers' attention signature: query (1, heads, tokens, dim), key/value (1, kv heads, tokens, dim);
    returns (output (1, tokens, heads, dim), None)."""
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError("llmtune_varlen: attention soft-capping and sinks have no varlen path (llmtune pads these "
                         "models' batches; this is a bug if you see it)")  # fmt: skip
    cu_seq_lens = kwargs.get("cu_seq_lens_q")
    positions = kwargs.get("position_ids")
    if cu_seq_lens is None and _rows_in(positions, query, key):
        # Ulysses (context parallelism under DeepSpeed): whole rows after its all-to-all, each padded, maybe packed,
        # with no mask; the examples are where position_ids restart. Attended as one flat sequence of examples.
        batch, tokens = query.shape[0], query.shape[2]
        flat = [t.transpose(0, 1).reshape(1, t.shape[1], batch * tokens, t.shape[3]) for t in (query, key, value)]
        cu_seq_lens, longest = boundaries(positions)
        out, _ = varlen_attention(module, *flat, None, dropout, scaling, sliding_window, softcap,
                                  cu_seq_lens_q=cu_seq_lens, max_length_q=longest)  # fmt: skip
        return out.reshape(batch, tokens, *out.shape[2:]), None
    if cu_seq_lens is None:  # no row boundaries: one causal sequence per batch row (generation, or a probe)
        return _causal(query, key, value, dropout if module.training else 0.0, scaling, sliding_window), None
    if query.shape[0] != 1:
        raise ValueError(f"llmtune_varlen: a padding-free batch is one sequence, got a batch of {query.shape[0]}")
    if kernel_for(query) == "torch_varlen" and not (dropout and module.training):
        longest = int(kwargs["max_length_q"])
        window = (-1, 0) if sliding_window is None else (sliding_window - 1, 0)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, dim)
        out = torch_varlen()(q, k, v, cu_seq_lens, cu_seq_lens, longest, longest, scale=scaling, window_size=window,
                             enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
        return out.unsqueeze(0), None
    bounds = cu_seq_lens.tolist()  # on the CPU already in the rehearsal; one small copy on the fp32 GPU path
    rows = [
        _causal(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout if module.training else 0.0,
            scaling,
            sliding_window,
        )  # fmt: skip
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(rows, dim=1), None


def _rows_in(positions, query, key) -> bool:
    """Whether position_ids describe the rows of this attention call (a training forward, not a cached decode)."""
    return (
        isinstance(positions, torch.Tensor) and positions.dim() == 2 and positions.shape[0] == query.shape[0]
        and positions.shape[1] == query.shape[2] == key.shape[2] and query.shape[2] > 1
    )  # fmt: skip


def boundaries(positions: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seq_lens int32, longest example) of (batch, tokens) position_ids read as one flat sequence: an example
    starts at each batch row and wherever a position is not its predecessor's plus one. One host read (the longest
    length is a Python int for the kernel), on the device where the positions are."""
    batch, tokens = positions.shape
    flat = positions.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[::tokens] = True
    edges = torch.cat([starts.nonzero().flatten(), flat.new_tensor([batch * tokens])]).to(torch.int32)
    return edges, int((edges[1:] - edges[:-1]).max())


def _causal(query, key, value, dropout: float, scaling: float | None, sliding_window: int | None):
    """Causal SDPA over each batch row as a whole; (batch, tokens, heads, dim)."""
    if key.shape[1] != query.shape[1]:  # grouped-query attention: each kv head serves a group of query heads
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    length = query.shape[2]
    if sliding_window is not None and length > sliding_window:
        positions = torch.arange(length, device=query.device)
        distance = positions[:, None] - positions[None, :]
        mask = (distance >= 0) & (distance < sliding_window)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)


def register() -> None:
    """Make `llmtune_varlen` an attention implementation transformers accepts (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)


def _base(model):
    """The transformers model under a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.cache
def _passes_boundaries(layer_class) -> bool:
    """plan/padding_free.passes_boundaries on a loaded decoder layer's forward; True where its source can't be read."""
    import inspect

    try:
        return passes_boundaries(inspect.getsource(layer_class.forward))
    except (OSError, TypeError):
        return True


def unsupported(model) -> str | None:
    """Why this model's attention can't read padding-free batches, or None when it can."""
    model = _base(model)
    compatible = getattr(type(model), "is_backend_compatible", None)
    if compatible is None or not compatible():
        return f"{type(model).__name__}'s modelling code doesn't take transformers' attention backends"
    configs = [model.config, *(getattr(model.config, name, None) for name in ("text_config",))]
    if any(getattr(c, "attn_logit_softcapping", None) for c in configs if c is not None):
        return "its attention soft-caps the logits (no varlen kernel here does)"
    if any(getattr(c, "model_type", None) in NOT_ATTENTION_ONLY for c in configs if c is not None):
        return f"{model.config.model_type} mixes tokens outside attention (linear or state-space layers)"
    for name, module in model.named_modules():
        kind = type(module).__name__
        layers = getattr(model, "_no_split_modules", None) or ()
        if kind in layers and text_layer(kind) and not _passes_boundaries(type(module)):
            return f"{kind} doesn't pass the batch's row boundaries on to its attention (the rows would attend to " \
                   "each other)"  # fmt: skip
        if any(word in kind for word in SEQUENCE_MIXERS):
            return f"{name} ({kind}) mixes tokens outside attention and would run across the concatenated rows"
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            return f"{name} has attention sinks (no varlen kernel here takes them)"
    return None


def packing_leaks(model) -> str | None:
    """Why packed rows on the padded path would attend to each other in this model, or None (the modelling code's
    mask factories without position_ids: plan/padding_free.mask_ignores_positions)."""
    import inspect
    import sys

    from llmtune.plan.padding_free import mask_ignores_positions

    base = _base(model)
    try:
        source = inspect.getsource(sys.modules[type(base).__module__])
    except (OSError, TypeError, KeyError):
        return None  # no source to read (compiled or remote code not on disk): not known to leak
    if mask_ignores_positions(source):
        return (f"{type(base).__name__}'s modelling code builds its attention mask without position_ids, "
                "so the examples packed into a row would attend to each other")  # fmt: skip
    return None


def apply(model, attention: str) -> bool:
    """Switch the loaded model to the padding-free kernel; False where it can't take them (`unsupported` says why)."""
    if unsupported(model):
        return False
    if attention == VARLEN_ATTENTION:
        register()
        _base(model).set_attn_implementation(VARLEN_ATTENTION)
    return True
