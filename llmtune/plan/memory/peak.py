"""Per-GPU memory of a recipe under each strategy: model states by the ZeRO paper's accounting, plus what a GPU
really holds around them (activations, logits, buffers, the allocator's reserve, the CUDA context).

Model states with mixed-precision Adam take (2 + 2 + K)·Ψ bytes, K = 12 (fp32 master weights, momentum,
variance); ZeRO-1 divides the K·Ψ of optimizer states by the data-parallel size N_d, ZeRO-2 also the 2·Ψ
of gradients, ZeRO-3 (and FSDP full shard) also the 2·Ψ of parameters. Offload moves what it offloads to CPU
(or NVMe). The peak is the larger of two moments: the start of backward (no gradients yet, every activation and
the fp32 logits alive) and the optimizer step (every gradient, no activations); the terms come from the floors below
(states, activations, buffers). Pure arithmetic on the model's config: nothing is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from llmtune.plan.memory import activations as act
from llmtune.plan.memory import buffers, compute, preference
from llmtune.plan.memory.buffers import CUDA_CONTEXT, FIT_FRACTION, MAX_LIVE_PARAMETERS
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.states import _states, quantization_state_bytes, trainable_parameters


@dataclass
class Estimate:
    strategy: str
    params: float
    grads: float
    optimizer: float
    activations: float  # saved for backward and alive at the loss: layers (or their checkpoints) and the head
    overhead: float  # the CUDA context, outside the caching allocator
    cpu: float  # offloaded bytes per machine
    nvme: float
    gathered: float = 0.0  # ZeRO-3/FSDP: the largest layer all-gathered in full (params + grads) while it runs
    step_copy: float = 0.0  # DeepSpeed: the fp32 copy of the gradient partition its optimizer steps on
    logits: float = 0.0  # the loss's peak: tokens x vocab in fp32, three times (gpu_memory.logits_bytes)
    weight_copies: float = 0.0  # 16-bit copies of fp32 weights that autocast makes and backward keeps
    held_grads: float = 0.0  # the part of `grads` already allocated while the forward runs
    comm: float = 0.0  # persistent communication buffers: DDP's gradient buckets, DeepSpeed's reduce buckets
    temporaries: float = 0.0  # the optimizer's scratch during its step
    recompute: float = 0.0  # gradient checkpointing: one layer's activations rebuilt during backward
    reserve: float = 0.0  # the caching allocator's: blocks cached but idle at the peak, and fragmentation
    reference: float = 0.0  # preference training's frozen reference model (estimate_preference), on this GPU
    staging: float = 0.0  # async_checkpoint: this rank's model and optimizer states copied to host memory (in cpu)
    loading: float = 0.0  # QLoRA under ZeRO-3: the whole 4-bit model on each GPU as it loads, before partitioning
    reference_where: str = ""  # how this row holds it, or why there is none ("" without preference training)
    basis: str = "modelled"  # or "measured on H100": whether a recorded GPU run covers this row (estimate_basis)
    basis_reason: str = ""  # why a row is modelled

    @property
    def name(self) -> str:
        """The strategy without its detail: 'pipeline (4 stages, per stage)' -> 'pipeline'."""
        return self.strategy.split(" (")[0]

    def fits(self, gpu_memory: float, cpu_memory: float | None = None) -> bool:
        return self.total <= FIT_FRACTION * gpu_memory and (cpu_memory is None or self.cpu <= cpu_memory)

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states: the ZeRO paper's (2 + 2 + K)·Ψ, partitioned."""
        return self.params + self.grads + self.optimizer

    @property
    def buffers(self) -> float:
        return self.gathered + self.step_copy + self.comm + self.temporaries

    @property
    def persistent(self) -> float:
        """Allocated from one step to the next: what the allocator never gets back."""
        return self.params + self.optimizer + self.held_grads + self.comm + self.reference

    @property
    def at_loss(self) -> float:
        """The start of backward: every saved activation and the fp32 logits, no new gradient yet (the Trainer
        frees gradients after each step, set_to_none)."""
        return self.persistent + self.gathered + self.weight_copies + self.activations + self.logits

    @property
    def in_backward(self) -> float:
        """Checkpointed backward: the checkpoints still kept and one layer rebuilt."""
        return self.persistent + self.gathered + self.activations + self.recompute if self.recompute else 0.0

    @property
    def at_step(self) -> float:
        """The optimizer step: every gradient and the optimizer's copies and scratch, no activations."""
        return self.model_states + self.reference + self.comm + self.step_copy + self.temporaries

    @property
    def allocated(self) -> float:
        """The peak torch.cuda.max_memory_allocated should show."""
        return max(self.at_loss, self.in_backward, self.at_step, self.loading)

    @property
    def peak_at(self) -> str:
        phases = {"loss": self.at_loss, "backward": self.in_backward, "step": self.at_step, "load": self.loading}
        return max(phases, key=phases.__getitem__)

    @property
    def total(self) -> float:
        """What the process takes on the GPU: the allocated peak, the allocator's reserve, the CUDA context."""
        return self.allocated + self.reserve + self.overhead


def with_reserve(row: Estimate, idle_at_loss: float, allocator: buffers.Allocator) -> Estimate:
    """The row with the caching allocator's reserve: max_memory_reserved - max_memory_allocated.

    Expandable segments (llmtune's default): a base plus a fraction of the transient bytes (allocated and freed
    within a step). Otherwise blocks the allocator caches but can't use at the loss (idle_at_loss: the 16-bit
    logits' block, the layer working set that checkpointed forwards free before the loss, DeepSpeed's flat
    gradient buffers) plus fragmentation, a fraction of the transient bytes."""
    row = replace(row, reserve=0.0)
    transient = max(row.at_loss, row.in_backward, row.at_step) - row.persistent  # (loading is not a step's)
    if allocator.expandable:
        return replace(row, reserve=allocator.base + allocator.fraction * transient)
    reserved = max(row.at_loss + idle_at_loss, row.in_backward, row.at_step)
    return replace(row, reserve=reserved - row.allocated + allocator.fraction * transient)


@dataclass(frozen=True)
class _Layout:
    """The GPU-only terms of one way of holding the weights: as llmtune loads them, or as a 16-bit model."""

    acts: act.Activations
    copies: float


def _layout(recipe, facts: ModelFacts, mixed: bool, sixteen_bit: bool, trainable: int, stages: int = 1) -> _Layout:
    widths = compute.widths(recipe, mixed, sixteen_bit)
    kernels = preference.loss_kernel(recipe, compute.kernels(recipe, pipeline=stages > 1))
    if stages > 1:
        layers, in_flight = act.layers_per_stage(facts, stages), act.in_flight_microbatches(recipe, stages)
        acts = act.activations(recipe, facts, widths, kernels, layers, in_flight)
    else:
        acts = act.activations(recipe, facts, widths, kernels)
    return _Layout(acts, act.weight_copies(recipe, facts, widths, trainable))


def _split_activations(layout: _Layout, saved: float, logits: float, recompute: float) -> _Layout:
    """The layout with its activations scaled: what one rank keeps when a parallelism splits them."""
    acts = layout.acts
    return _Layout(replace(acts, saved=acts.saved * saved, logits=acts.logits * logits,
                           idle_logits=acts.idle_logits * logits, recompute=acts.recompute * recompute,
                           offloaded=acts.offloaded * saved), layout.copies)  # fmt: skip


def _gpu_row(base: Estimate, layout: _Layout, held: float, comm: float, temporaries: float, idle_flat: float,
             allocator: buffers.Allocator, share: float = 1.0, per_machine: int = 1) -> Estimate:  # fmt: skip
    acts = layout.acts
    row = replace(base, activations=acts.saved, logits=acts.logits, weight_copies=layout.copies * share,
                  held_grads=held, comm=comm, temporaries=temporaries, recompute=acts.recompute,
                  cpu=base.cpu + acts.offloaded * per_machine)  # fmt: skip
    return with_reserve(row, acts.idle_logits + acts.recompute + idle_flat, allocator)


def estimate(
    recipe,
    facts: ModelFacts,
    data_parallel: int,
    gpus_per_machine: int,
    stages: int = 1,
    mixed: bool | None = None,
    expandable: bool | None = None,
    fused: bool = True,
) -> list[Estimate]:
    """One Estimate per strategy, per GPU. `mixed` overrides the recipe's precision (CPU rehearsals run fp32);
    `expandable` the allocator mode, which otherwise follows PYTORCH_CUDA_ALLOC_CONF as the workers will. `fused`:
    the recipe's adamw_torch steps as adamw_torch_fused, as the plan runs it on CUDA (every row but the pipeline's,
    whose own loop steps it); False for a run that stepped foreach AdamW (the recorded calibration runs)."""
    rows = _estimate(recipe, facts, data_parallel, gpus_per_machine, stages, mixed, expandable, fused)
    if recipe.async_checkpoint:
        per_machine = max(1, min(max(1, data_parallel), gpus_per_machine))
        share = trainable_parameters(recipe, facts) / max(1, facts.total_params())
        for row in rows:
            if not row.name.startswith("ZeRO"):  # (refused there: DeepSpeed writes its own checkpoints)
                row.staging = row.optimizer + row.params * min(1.0, share)
                row.cpu += row.staging * per_machine
    return rows


def _estimate(recipe, facts: ModelFacts, data_parallel: int, gpus_per_machine: int, stages: int,
              mixed: bool | None, expandable: bool | None, fused: bool = True) -> list[Estimate]:  # fmt: skip
    mixed = compute.is_mixed(recipe) if mixed is None else mixed
    params, grads, optimizer = _states(recipe, facts, mixed, deepspeed=False)
    zp, zg, zo = _states(recipe, facts, mixed, deepspeed=True)
    n = max(1, data_parallel)
    per_machine = max(1, min(n, gpus_per_machine))
    width = 2.0 if mixed else 4.0
    # gathered while a layer runs: its params, and their grads unless the base is frozen
    largest = width * (1 if recipe.adapter else 2) * max(facts.largest_layer_params(), facts.embedding_params())
    # ZeRO-3 keeps gathered parameters alive up to stage3_max_live_parameters (llmtune's presets: 1e9, with a
    # reuse distance as long): a 1B model stays gathered through forward and backward. Offloaded, every live
    # parameter is a GPU copy (measured on an H100: 1B full fine-tune, ZeRO-3 + CPU offload, 1.7 GB above the
    # one-layer count); on the GPU, this rank's own partition is among them.
    live = width * min(MAX_LIVE_PARAMETERS, facts.total_params())
    gathered_zero3 = max(largest, live * (1 - 1 / n))
    gathered_offload = max(largest, live)
    # DeepSpeed flattens each param group's gradient partition to fp32 before stepping it (measured; and
    # the "4_grads_32bit" of its own estimate functions); with offload that copy lives on the CPU.
    trainable = trainable_parameters(recipe, facts)
    fp32_grads = 4.0 * trainable
    # parameters over the ranks that shard them; a 4-bit base's quantization state stays whole on each
    kept = quantization_state_bytes(recipe, facts)

    def sharded(held: float, ranks: int) -> float:
        return (held - kept) / ranks + kept

    #      name                        params  grads    optimizer cpu (per machine)                   nvme  gathered  step copy
    rows = [
        ("single / DDP",               params, grads,   optimizer, 0.0, 0.0, 0.0, 0.0),
        ("ZeRO-1",                     zp,     zg,      zo / n,    0.0, 0.0, 0.0, fp32_grads / n),
        ("ZeRO-2",                     zp,     zg / n,  zo / n,    0.0, 0.0, 0.0, fp32_grads / n),
        ("ZeRO-3",                     sharded(zp, n), zg / n, zo / n, 0.0, 0.0, gathered_zero3, fp32_grads / n),
        ("ZeRO-2 + CPU offload",       zp,     0.0,     0.0,       (zg + fp32_grads + zo) / n * per_machine, 0.0, 0.0, 0.0),
        ("ZeRO-3 + CPU offload",       kept,   0.0,     0.0,       (zp - kept + zg + fp32_grads + zo) / n * per_machine, 0.0, gathered_offload, 0.0),
        ("ZeRO-3 + NVMe offload",      kept,   0.0,     0.0,       (zg + fp32_grads) / n * per_machine, (zp - kept + zo) / n * per_machine, gathered_offload, 0.0),
        ("FSDP full shard",            sharded(params, n), grads / n, optimizer / n, 0.0, 0.0, largest, 0.0),
        ("FSDP shard grad op",         params, grads / n, optimizer / n, 0.0, 0.0, 0.0, 0.0),
        ("FSDP hybrid shard",          sharded(params, per_machine), grads / per_machine, optimizer / per_machine, 0.0, 0.0, largest, 0.0),
    ]  # fmt: skip
    forward = preference.forward_recipe(recipe)  # preference training: chosen and rejected in one forward
    loaded = _layout(forward, facts, mixed, False, trainable)
    sixteen = _layout(forward, facts, mixed, True, trainable)  # DeepSpeed's bf16 engine, FSDP's bf16 parameters
    # context parallelism under DeepSpeed (Ulysses): each rank holds 1/C of every row's activations and logits
    ulysses = recipe.context_parallel_size if recipe.deepspeed is not None else 1
    zero = _split_activations(sixteen, 1 / ulysses, 1 / ulysses, 1 / ulysses) if ulysses > 1 else sixteen
    # gradients of earlier micro-batches stay allocated through the next forward
    accumulating = recipe.gradient_accumulation_steps > 1

    def held(gradients: float) -> float:
        return gradients if accumulating else 0.0

    foreach = buffers.optimizer_temporaries(recipe.optimizer, trainable, facts.embedding_params())
    stepped = "adamw_torch_fused" if fused and recipe.optimizer == "adamw_torch" else recipe.optimizer
    scratch = buffers.optimizer_temporaries(stepped, trainable, facts.embedding_params())
    ds_buckets = 2 * width * facts.hidden_size**2  # overlap_comm: two reduce buckets of hidden^2 (llmtune's presets)
    # DDP's reducer keeps its buckets beside the gradients: gradient_as_bucket_view (off in accelerate and the
    # Trainer) would save "the total gradients size" (torch DistributedDataParallel's documentation)
    ddp_buckets = grads if n > 1 else 0.0
    # DeepSpeed's flat gradient buffers (the 16-bit partition it reduces into, the fp32 copy its optimizer steps
    # on) are single blocks bigger than any activation: the allocator caches them in segments of their own that
    # sit idle while the next forward runs. ZeRO-3 allocates its 16-bit partition once, so it is held, not idle.
    zero_flat = (0.0 if accumulating else zg / n) + fp32_grads / n
    # per row: the weights' layout, gradients held in forward, persistent comm buffers, the optimizer's scratch,
    # idle flat buffers. FSDP gathers its parameters in bf16 (its mixed-precision policy): the 16-bit layout.
    extras = {
        "single / DDP":          (loaded,  held(grads),        ddp_buckets, scratch,               0.0),
        "ZeRO-1":                (zero,    held(zg),           ds_buckets,  scratch / n,           zero_flat),
        "ZeRO-2":                (zero,    held(zg / n),       ds_buckets,  scratch / n,           zero_flat),
        "ZeRO-3":                (zero,    zg / n,             ds_buckets,  scratch / n,           fp32_grads / n),
        "ZeRO-2 + CPU offload":  (zero,    0.0,                ds_buckets,  0.0,                   0.0),
        "ZeRO-3 + CPU offload":  (zero,    0.0,                ds_buckets,  0.0,                   0.0),
        "ZeRO-3 + NVMe offload": (zero,    0.0,                ds_buckets,  0.0,                   0.0),
        "FSDP full shard":       (sixteen, held(grads / n),    0.0,         scratch / n,           0.0),
        "FSDP shard grad op":    (sixteen, held(grads / n),    0.0,         scratch / n,           0.0),
        "FSDP hybrid shard":     (sixteen, held(grads / per_machine), 0.0,  scratch / per_machine, 0.0),
    }  # fmt: skip
    expandable = buffers.expandable_segments(os.environ) if expandable is None else expandable
    # the caching allocator's reserve: FSDP's all-gathers run on a stream (and a pool) of their own
    allocators = {fsdp: buffers.allocator(recipe, expandable, fsdp=fsdp) for fsdp in (False, True)}
    # QLoRA under ZeRO-3: transformers builds quantized models without zero.Init, so each rank holds the whole
    # 4-bit model (and its 16-bit embeddings and head) until DeepSpeed partitions it (the plan's note says so)
    whole = params if recipe.load_in_4bit else 0.0
    estimates = [_gpu_row(Estimate(name, p, g, o, 0.0, CUDA_CONTEXT, cpu, nvme, gathered, step,
                                   loading=whole if name.startswith("ZeRO-3") else 0.0), *extras[name],
                          allocators[name.startswith("FSDP")], per_machine=per_machine)
                 for name, p, g, o, cpu, nvme, gathered, step in rows]  # fmt: skip
    if preference.method(recipe):  # TRL's trainers run no split strategy (llmtune.recipe.preference.check)
        return preference.with_reference(estimates, recipe, facts, mixed, trainable, n, per_machine)
    from llmtune.plan.memory.parallel import (
        context_parallel_degree,
        context_parallel_split,
        tensor_parallel_degree,
        tensor_parallel_split,
    )

    splits = []
    cp = context_parallel_degree(recipe, facts, per_machine)
    if cp > 1:
        splits.append(context_parallel_split(cp, n))
    tp = tensor_parallel_degree(recipe, facts, per_machine)
    if tp > 1:
        splits.append(tensor_parallel_split(recipe, tp))
    for split in splits:
        layout = _split_activations(sixteen if split.fsdp else loaded, split.saved, split.logits, split.recompute)
        base = Estimate(split.name, sharded(params, split.states), grads / split.states, optimizer / split.states, 0.0,
                        CUDA_CONTEXT, 0.0, 0.0, largest if split.fsdp else 0.0)  # fmt: skip
        estimates.append(_gpu_row(base, layout, held(grads) / split.states, 0.0,
                                  scratch / split.states, 0.0, allocators[split.fsdp],
                                  1 / split.states, per_machine))  # fmt: skip
    if stages > 1:
        # balanced stages, but a stage holds at least one whole layer (or the embeddings); its micro-batches'
        # gradients accumulate through the step. The first stage's in-flight activations and the last stage's
        # logits are both counted: the row is the worst stage, or a little more
        share = max(1 / stages, max(facts.largest_layer_params(), facts.embedding_params()) / facts.total_params())
        stage = _layout(recipe, facts, mixed, False, trainable, stages)
        base = Estimate(f"pipeline ({stages} stages, per stage)", params * share, grads * share, optimizer * share,
                        0.0, CUDA_CONTEXT, 0.0, 0.0)  # fmt: skip
        estimates.append(_gpu_row(base, stage, grads * share, 0.0, foreach * share, 0.0,
                                  allocators[False], share))  # fmt: skip
    return estimates
