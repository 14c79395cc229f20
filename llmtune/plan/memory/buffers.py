"""Buffers, the allocator's reserve and the CUDA context: what a GPU holds beyond the model states and the
activations, as PyTorch's caching allocator sees it, and the share of a GPU llmtune lets an estimate fill.

Pure arithmetic on the model's shape, like the rest of plan/. The activation terms follow transformers' Llama
code op by op (what autograd saves for backward, per token and decoder layer), and are checked against the
tensors autograd really saves in tests/unit/test_gpu_memory.py. The two allocator constants below are
calibrated on one H100 (torch 2.11+cu130, transformers 5.17; issues 17 and 32) against
torch.cuda.max_memory_reserved plus the CUDA context; `benchmarks/gpu_memory.py` measures more configurations."""

from __future__ import annotations

from dataclasses import dataclass

from llmtune.plan.memory.compute import fixed_shapes

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


# torch's foreach optimizers allocate one fp32 temporary per parameter at the step (_multi_tensor_adam's
# exp_avg_sq_sqrt, rmsprop's avg, adagrad's std); fused and bitsandbytes kernels update in place
FOREACH_TEMPORARY = {"adamw_torch": 4.0, "rmsprop": 4.0, "adagrad": 4.0}


def optimizer_temporaries(optimizer: str, trainable: float, largest: float) -> float:
    """Bytes the optimizer allocates during its step and frees after it."""
    if optimizer == "adafactor":
        return 8.0 * largest  # transformers' Adafactor: the update and grad^2 of one parameter at a time
    return FOREACH_TEMPORARY.get(optimizer, 0.0) * trainable


# check_fits and recommend() refuse a total above this share of the GPU: the calibration's lowest row was 0.5%
# below reserved + context (FSDP2, issue 32), and nvidia-smi's memory.total includes memory no process can allocate
FIT_FRACTION = 0.95

DEFAULT_GPU_BYTES = 80 * 2**30  # where the plan has no GPU size to go by (llmtune estimate's default, 80GB)

# ZeRO-3's live-parameter budget in elements (DeepSpeed's default), which llmtune's DeepSpeed presets write as
# stage3_max_live_parameters: the estimate counts it as gathered memory
MAX_LIVE_PARAMETERS = 1_000_000_000
