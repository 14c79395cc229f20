"""The GPU fast path, applied to the loaded model before adapters and wrapping.

- Liger kernels through liger-kernel's own per-model entry point (`apply_liger_kernel_to_<model_type>`,
  given the instance), imported lazily: only a recipe that asks for them needs the package.
- flash_attention_2 over packed rows: transformers finds the examples in a packed row from its
  position_ids only when the batch is a single row; with micro_batch_size > 1 the plain causal
  kernel would let every example attend to the ones packed before it. So the decoder gets the
  examples' boundaries (cu_seq_lens) itself, and the varlen kernel keeps them apart.
- torch.compile is the HF Trainer's: `compile_arguments` gives the TrainingArguments keys.

In CPU rehearsal none of it runs (the planner has said so once); sdpa's block mask keeps packed
examples apart there.
"""

from __future__ import annotations

import inspect

from llmtune.errors import UserError
from llmtune.recipe.kernels import INSTALL_HINT, SHOWN, Kernels, compile_arguments, resolve_kernels

__all__ = ["compile_arguments", "kernels_for", "apply_kernels", "apply_liger", "keep_packed_rows_apart"]

# Liger's keywords for the GLU MLP kernel, by model family; the recipe's liger_glu_activation turns on whichever exists
GLU_KEYWORDS = ("swiglu", "geglu")


def flash_attn_importable() -> bool:
    """Imported for real: a wheel built for another torch or CUDA fails here rather than inside the first step."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or an OSError/RuntimeError from a mismatched extension
        return False
    return True


def current_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def kernels_for(recipe, precision: str, device: str | None = None) -> Kernels:
    """The kernels this rank uses. CPU rehearsal hides the GPUs (CUDA_VISIBLE_DEVICES=''), so no CUDA means rehearsal."""
    device = device or current_device()
    strategy = "pipeline" if recipe.pipeline_parallel_size > 1 else None
    flash = device == "cuda" and recipe.attn_implementation == "flash_attention_2" and flash_attn_importable()
    from llmtune.train.model.varlen import torch_varlen

    return resolve_kernels(recipe, device, precision, strategy, flash, varlen_available=torch_varlen() is not None)


def apply_kernels(model, kernels: Kernels, log) -> None:
    """Liger on the instance, and the packed-rows boundaries for flash attention."""
    applied = apply_liger(model, kernels.liger, log) if kernels.liger_on else []
    if kernels.attention == "flash_attention_2":
        keep_packed_rows_apart(model)
    parts = [f"liger {', '.join(applied)} ({model.config.model_type})"] if applied else []
    if kernels.attention and not (kernels.batches and kernels.batches.padding_free):  # the batches line names it
        parts.append(f"attention {kernels.attention}")
    if kernels.compile:
        parts.append(f"torch.compile {kernels.compile['torch_compile_backend']} (by the Trainer)")
    if parts:
        log("kernels: " + "; ".join(parts))
    if kernels.attention_fallback and kernels.device == "cuda":
        log(kernels.attention_fallback)


def apply_liger(model, wanted: dict[str, bool], log) -> list[str]:
    """Call liger-kernel's entry point for this model type with every kernel named: Liger's own defaults turn most
    kernels on, so one the recipe didn't ask for is passed as False. Returns the kernels applied."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        asked = ", ".join(SHOWN.get(n, n) for n, on in wanted.items() if on)
        raise UserError(f"the recipe asks for Liger kernels ({asked}) but liger-kernel can't be imported ({err})",
                        INSTALL_HINT) from None  # fmt: skip
    model_type = getattr(model.config, "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        log(f"liger: liger-kernel has no kernels for model type {model_type!r}; training without them")
        return []
    kwargs, applied, missing = liger_arguments(apply, wanted)
    if missing:
        log(f"liger: {model_type} has no Liger {', '.join(missing)} kernel; the rest are applied")
    apply(model=model, **kwargs)
    return applied


def liger_arguments(apply, wanted: dict[str, bool]) -> tuple[dict[str, bool], list[str], list[str]]:
    """(keyword arguments for `apply`, kernels on, kernels asked for that this model type lacks)."""
    parameters = inspect.signature(apply).parameters
    glu = next((k for k in GLU_KEYWORDS if k in parameters), None)
    requested = {(glu or "glu") if name == "glu" else name: on for name, on in wanted.items()}
    kwargs = {name: bool(requested.get(name, False)) for name, p in parameters.items() if isinstance(p.default, bool)}
    applied = [name for name, on in kwargs.items() if on]
    missing = [SHOWN.get(n, n) for n, on in requested.items() if on and n not in kwargs]
    return kwargs, applied, missing


def keep_packed_rows_apart(model) -> None:
    """Give the decoder the packed examples' boundaries, so flash attention's varlen kernel keeps them apart.

    Hooked on the decoder (model.model), not the CausalLM: PEFT calls the CausalLM's forward directly (no hooks),
    while every CausalLM forward, Liger's included, calls the decoder as a module.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    decoder.register_forward_pre_hook(_add_boundaries, with_kwargs=True)


def _add_boundaries(module, args, kwargs):
    position_ids = kwargs.get("position_ids")
    if (
        position_ids is None
        or position_ids.dim() != 2
        or position_ids.shape[-1] == 1  # one token at a time: generation
        or kwargs.get("attention_mask") is not None  # padded rows: transformers unpads with the mask
        or kwargs.get("past_key_values") is not None
        or kwargs.get("cu_seq_lens_q") is not None
    ):
        return None
    cu_seq_lens, longest = packed_boundaries(position_ids)
    extra = {
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": longest,
        "max_length_k": longest,
    }
    return args, {**kwargs, **extra}


def packed_boundaries(position_ids):
    """(cumulative lengths over the flattened batch, longest example) from position ids that restart per example.

    An example starts wherever the position is not the previous one + 1, and every row starts one: the collator's
    padding restarts at 0 too, so it is an example of its own that no real token attends to.
    """
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    first = starts.reshape(-1).nonzero().reshape(-1)
    total = torch.tensor([position_ids.numel()], device=position_ids.device)
    cu_seq_lens = torch.cat([first, total]).to(torch.int32)
    return cu_seq_lens, int(cu_seq_lens.diff().max())


def batch_layout(recipe, plan: dict, model, log):
    """The plan's batch layout on this rank: padding-free batches where the loaded model's attention takes them
    (the model is switched to the varlen kernel), padded rows elsewhere; said in one line."""
    from llmtune.recipe.batches import PADDED, SEQUENCE_SPLIT, Batches, attention_dropout, with_attention_dropout
    from llmtune.train.model.varlen import apply, unsupported

    batches = kernels_for(recipe, plan["precision"], plan["cluster"]["device"]).batches
    batches = with_attention_dropout(batches, attention_dropout(model.config.to_dict()))  # as varlen.py attends
    if batches.layout == SEQUENCE_SPLIT and not apply(model, batches.attention):
        why = unsupported(model)
        if recipe.sample_packing:
            raise UserError(f"context parallelism under DeepSpeed with sample_packing can't run with this model: {why}; "
                            "Ulysses drops the attention mask, and nothing else would keep packed examples apart",
                            "set sample_packing: false (each row then attends causally as a whole, its padding at "
                            "the end)")  # fmt: skip
        batches = Batches(SEQUENCE_SPLIT, None, None, f"the model's own attention, causal over each whole row: {why}")
    if batches.padding_free and not apply(model, batches.attention):
        why = unsupported(model)
        if recipe.batch_flattening is True:
            raise UserError(f"batch_flattening: true can't run with this model: {why}", "remove batch_flattening")
        batches = Batches(PADDED, reason=why)
    if batches.layout == PADDED and recipe.sample_packing:
        from llmtune.train.model.varlen import packing_leaks

        leak = packing_leaks(model)
        if leak:
            hint = ("remove batch_flattening: false (padding-free batches keep the examples apart in this model), "
                    "or set sample_packing: false" if recipe.batch_flattening is False and not unsupported(model)
                    else "set sample_packing: false")  # fmt: skip
            raise UserError(f"sample_packing on padded rows can't run with this model: {leak}", hint)
        log("batches: packed rows, padded to the batch, position_ids restarting at each example, which the model's "
            f"causal mask reads to keep the examples apart ({batches.reason})")  # fmt: skip
        return batches
    log(f"batches: {batches.describe()}")
    return batches
