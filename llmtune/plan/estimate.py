"""Per-GPU memory of a recipe under each strategy: model states by the ZeRO paper's accounting, plus what a GPU
really holds around them (activations, logits, buffers, the allocator's reserve, the CUDA context).

Model states with mixed-precision Adam take (2 + 2 + K)·Ψ bytes, K = 12 (fp32 master weights, momentum,
variance); ZeRO-1 divides the K·Ψ of optimizer states by the data-parallel size N_d, ZeRO-2 also the 2·Ψ
of gradients, ZeRO-3 (and FSDP full shard) also the 2·Ψ of parameters. Offload moves what it offloads to CPU
(or NVMe). The peak is the larger of two moments: the start of backward (no gradients yet, every activation and
the fp32 logits alive) and the optimizer step (every gradient, no activations); llmtune.plan.gpu_memory has the
terms that only a GPU shows. Pure arithmetic on the model's config: nothing is built.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

from llmtune.plan import estimate_preference as preference
from llmtune.plan import gpu_memory as gpu
from llmtune.plan.deepspeed import MAX_LIVE_PARAMETERS
from llmtune.plan.gpu_memory import CUDA_CONTEXT, GB
from llmtune.plan.model_facts import ModelFacts
from llmtune.plan.recommend import recommend

EIGHT_BIT = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit")
# check_fits and recommend() refuse a total above this share of the GPU: the calibration's lowest row was 0.5%
# below reserved + context (FSDP2, issue 32), and nvidia-smi's memory.total includes memory no process can allocate
FIT_FRACTION = 0.95
DEFAULT_GPU_BYTES = 80 * 2**30  # where the plan has no GPU size to go by (llmtune estimate's default, 80GB)


@dataclass(frozen=True)
class Bytes:
    """Bytes per parameter for one copy of the model states."""

    params: float
    grads: float
    optimizer: float  # K in the ZeRO paper


def state_bytes(optimizer: str, mixed: bool, master: bool | None = None) -> Bytes:
    """Bytes per parameter. Master weights: fp32 copies kept by the optimizer under mixed precision, and
    by DeepSpeed's ZeRO optimizers always (they clone their fp32 partition even when training in fp32)."""
    master = (4.0 if mixed else 0.0) if master is None else (4.0 if master else 0.0)
    moments = {"sgd": 0.0, "adafactor": 0.1, "lion_32bit": 4.0, "paged_lion_32bit": 4.0}.get(optimizer, 8.0)
    if optimizer in EIGHT_BIT:
        moments = 1.0 if "lion" in optimizer else 2.0
    width = 2.0 if mixed else 4.0
    return Bytes(width, width, master + moments)


def lora_parameters(facts: ModelFacts, rank: int, targets: list[str] | str | None) -> int:
    """Adapter parameters: r·(in + out) per adapted linear layer."""
    h, kv, inter = facts.hidden_size, facts.num_kv_heads * facts.head_dim, facts.intermediate_size
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
    chosen = list(shapes) if targets in (None, "all-linear") or isinstance(targets, str) else targets
    per_layer = sum(rank * (a + b) for name, (a, b) in shapes.items() if name in chosen)
    return per_layer * facts.num_layers


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
        return max(self.at_loss, self.in_backward, self.at_step)

    @property
    def peak_at(self) -> str:
        phases = {"loss": self.at_loss, "backward": self.in_backward, "step": self.at_step}
        return max(phases, key=phases.__getitem__)

    @property
    def total(self) -> float:
        """What the process takes on the GPU: the allocated peak, the allocator's reserve, the CUDA context."""
        return self.allocated + self.reserve + self.overhead


def with_reserve(row: Estimate, idle_at_loss: float, allocator: gpu.Allocator) -> Estimate:
    """The row with the caching allocator's reserve: max_memory_reserved - max_memory_allocated.

    Expandable segments (llmtune's default): a base plus a fraction of the transient bytes (allocated and freed
    within a step). Otherwise blocks the allocator caches but can't use at the loss (idle_at_loss: the 16-bit
    logits' block, the layer working set that checkpointed forwards free before the loss, DeepSpeed's flat
    gradient buffers) plus fragmentation, a fraction of the transient bytes."""
    row = replace(row, reserve=0.0)
    transient = row.allocated - row.persistent
    if allocator.expandable:
        return replace(row, reserve=allocator.base + allocator.fraction * transient)
    reserved = max(row.at_loss + idle_at_loss, row.in_backward, row.at_step)
    return replace(row, reserve=reserved - row.allocated + allocator.fraction * transient)


def is_mixed(recipe) -> bool:
    return recipe.precision != "no" or recipe.bf16 == "auto"


def trainable_parameters(recipe, facts: ModelFacts) -> int:
    if not recipe.adapter:
        return facts.total_params()
    return lora_parameters(
        facts, recipe.lora_r, "all-linear" if recipe.lora_target_linear else recipe.lora_target_modules
    )


def _states(recipe, facts: ModelFacts, mixed: bool, deepspeed: bool) -> tuple[float, float, float]:
    """Params, grads and optimizer bytes of one full copy of the model states.

    DeepSpeed keeps 16-bit params and grads and an fp32 master copy in the optimizer (the ZeRO paper's
    layout). DDP and FSDP as llmtune runs them keep fp32 weights and grads and autocast the compute: the
    same total for every optimizer (4 + 4 + moments = 2 + 2 + 4 + moments), split differently. A k-bit base
    is counted as bitsandbytes stores it, with the modules it leaves in fp32 (gpu_memory.quantized_base_bytes).
    """
    psi = facts.total_params()
    base = state_bytes(recipe.optimizer, mixed, master=True) if deepspeed else state_bytes(recipe.optimizer, False)
    if not recipe.adapter:
        return base.params * psi, base.grads * psi, base.optimizer * psi
    trainable = trainable_parameters(recipe, facts)
    width = 2.0 if mixed else 4.0  # the frozen base is kept in the compute dtype
    kbit = recipe.load_in_4bit or recipe.load_in_8bit or recipe.gptq
    frozen = gpu.quantized_base_bytes(recipe, facts) if kbit else psi * width
    adapter = state_bytes(recipe.optimizer, False, master=deepspeed)  # adapters train in fp32
    return frozen + adapter.params * trainable, adapter.grads * trainable, adapter.optimizer * trainable


def quantization_state_bytes(recipe, facts: ModelFacts) -> float:
    """The absmax blocks of a 4-bit base (part of gpu.quantized_base_bytes). They are attributes beside the packed
    weights, not parameters: ZeRO-3 and FSDP shard the packed weights (stored in the compute dtype) and leave
    these whole on every rank."""
    if not recipe.load_in_4bit:
        return 0.0
    double = recipe.bnb_4bit_use_double_quant
    return facts.linear_params() * ((1 + 4 / gpu.NESTED_BLOCK) / gpu.NF4_BLOCK if double else 4 / gpu.NF4_BLOCK)


@dataclass(frozen=True)
class _Layout:
    """The GPU-only terms of one way of holding the weights: as llmtune loads them, or as a 16-bit model."""

    acts: gpu.Activations
    copies: float


def _layout(recipe, facts: ModelFacts, mixed: bool, sixteen_bit: bool, trainable: int, stages: int = 1) -> _Layout:
    widths = gpu.widths(recipe, mixed, sixteen_bit)
    kernels = preference.loss_kernel(recipe, gpu.kernels(recipe, pipeline=stages > 1))
    if stages > 1:
        layers, in_flight = gpu.layers_per_stage(facts, stages), gpu.in_flight_microbatches(recipe, stages)
        acts = gpu.activations(recipe, facts, widths, kernels, layers, in_flight)
    else:
        acts = gpu.activations(recipe, facts, widths, kernels)
    return _Layout(acts, gpu.weight_copies(recipe, facts, widths, trainable))


def _gpu_row(base: Estimate, layout: _Layout, held: float, comm: float, temporaries: float, idle_flat: float,
             allocator: gpu.Allocator, share: float = 1.0, per_machine: int = 1) -> Estimate:  # fmt: skip
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
) -> list[Estimate]:
    """One Estimate per strategy, per GPU. `mixed` overrides the recipe's precision (CPU rehearsals run fp32);
    `expandable` the allocator mode, which otherwise follows PYTORCH_CUDA_ALLOC_CONF as the workers will."""
    rows = _estimate(recipe, facts, data_parallel, gpus_per_machine, stages, mixed, expandable)
    if recipe.async_checkpoint:
        per_machine = max(1, min(max(1, data_parallel), gpus_per_machine))
        share = trainable_parameters(recipe, facts) / max(1, facts.total_params())
        for row in rows:
            if not row.name.startswith("ZeRO"):  # (refused there: DeepSpeed writes its own checkpoints)
                row.staging = row.optimizer + row.params * min(1.0, share)
                row.cpu += row.staging * per_machine
    return rows


def _estimate(recipe, facts: ModelFacts, data_parallel: int, gpus_per_machine: int, stages: int,
              mixed: bool | None, expandable: bool | None) -> list[Estimate]:  # fmt: skip
    mixed = is_mixed(recipe) if mixed is None else mixed
    params, grads, optimizer = _states(recipe, facts, mixed, deepspeed=False)
    zp, zg, zo = _states(recipe, facts, mixed, deepspeed=True)
    n = max(1, data_parallel)
    per_machine = max(1, min(n, gpus_per_machine))
    width = 2.0 if mixed else 4.0
    # gathered while a layer runs: its params, and their grads unless the base is frozen
    largest = width * (1 if recipe.adapter else 2) * max(facts.layer_params(), facts.embedding_params())
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
    # gradients of earlier micro-batches stay allocated through the next forward
    accumulating = recipe.gradient_accumulation_steps > 1

    def held(gradients: float) -> float:
        return gradients if accumulating else 0.0

    scratch = gpu.optimizer_temporaries(recipe.optimizer, trainable, facts.embedding_params())
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
        "ZeRO-1":                (sixteen, held(zg),           ds_buckets,  scratch / n,           zero_flat),
        "ZeRO-2":                (sixteen, held(zg / n),       ds_buckets,  scratch / n,           zero_flat),
        "ZeRO-3":                (sixteen, zg / n,             ds_buckets,  scratch / n,           fp32_grads / n),
        "ZeRO-2 + CPU offload":  (sixteen, 0.0,                ds_buckets,  0.0,                   0.0),
        "ZeRO-3 + CPU offload":  (sixteen, 0.0,                ds_buckets,  0.0,                   0.0),
        "ZeRO-3 + NVMe offload": (sixteen, 0.0,                ds_buckets,  0.0,                   0.0),
        "FSDP full shard":       (sixteen, held(grads / n),    0.0,         scratch / n,           0.0),
        "FSDP shard grad op":    (sixteen, held(grads / n),    0.0,         scratch / n,           0.0),
        "FSDP hybrid shard":     (sixteen, held(grads / per_machine), 0.0,  scratch / per_machine, 0.0),
    }  # fmt: skip
    expandable = gpu.expandable_segments(os.environ) if expandable is None else expandable
    estimates = [_gpu_row(Estimate(name, p, g, o, 0.0, CUDA_CONTEXT, cpu, nvme, gathered, step), *extras[name],
                          gpu.allocator(recipe, expandable, fsdp=name.startswith("FSDP")), per_machine=per_machine)
                 for name, p, g, o, cpu, nvme, gathered, step in rows]  # fmt: skip
    if preference.method(recipe):  # TRL's trainers run no split strategy (llmtune.recipe.preference.check)
        return preference.with_reference(estimates, recipe, facts, mixed, trainable, n, per_machine)
    from llmtune.plan.estimate_parallel import (
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
        layout = sixteen if split.fsdp else loaded
        acts = replace(layout.acts, saved=layout.acts.saved * split.saved, logits=layout.acts.logits * split.logits,
                       idle_logits=layout.acts.idle_logits * split.logits,
                       recompute=layout.acts.recompute * split.recompute,
                       offloaded=layout.acts.offloaded * split.saved)  # fmt: skip
        base = Estimate(split.name, params / split.states, grads / split.states, optimizer / split.states, 0.0,
                        CUDA_CONTEXT, 0.0, 0.0, largest if split.fsdp else 0.0)  # fmt: skip
        estimates.append(_gpu_row(base, _Layout(acts, layout.copies), held(grads) / split.states, 0.0,
                                  scratch / split.states, 0.0, gpu.allocator(recipe, expandable, fsdp=split.fsdp),
                                  1 / split.states, per_machine))  # fmt: skip
    if stages > 1:
        # balanced stages, but a stage holds at least one whole layer (or the embeddings); its micro-batches'
        # gradients accumulate through the step. The first stage's in-flight activations and the last stage's
        # logits are both counted: the row is the worst stage, or a little more
        share = max(1 / stages, max(facts.layer_params(), facts.embedding_params()) / facts.total_params())
        stage = _layout(recipe, facts, mixed, False, trainable, stages)
        base = Estimate(f"pipeline ({stages} stages, per stage)", params * share, grads * share, optimizer * share,
                        0.0, CUDA_CONTEXT, 0.0, 0.0)  # fmt: skip
        estimates.append(_gpu_row(base, stage, grads * share, 0.0, scratch * share, 0.0,
                                  gpu.allocator(recipe, expandable), share))  # fmt: skip
    return estimates


@dataclass
class Report:
    """Everything `llmtune estimate` shows, for the CLI, `llmtune config` and the pre-launch check."""

    model: str
    total_params: int
    trainable_params: int
    gpus_per_machine: int
    num_machines: int
    gpu_memory: float
    cpu_memory: float | None
    interconnect: str
    rows: list[Estimate] = field(default_factory=list)
    choice: tuple[Estimate, str] | None = None
    preference: str = ""  # what a preference step runs through the model (estimate_preference.batch_note)

    def fits(self, row: Estimate) -> bool:
        return row.fits(self.gpu_memory, self.cpu_memory)

    def row(self, name: str) -> Estimate:
        return next(r for r in self.rows if r.name == name)

    def to_dict(self) -> dict:
        derived = ("model_states", "buffers", "at_loss", "at_step", "allocated", "peak_at", "total")
        rows = [{**asdict(r), **{name: getattr(r, name) for name in derived}, "fits": self.fits(r)} for r in self.rows]
        choice = {"strategy": self.choice[0].strategy, "reason": self.choice[1]} if self.choice else None
        return {**{k: v for k, v in asdict(self).items() if k not in ("rows", "choice")}, "fit_fraction": FIT_FRACTION,
                "rows": rows, "recommended": choice}  # fmt: skip


def model_facts_for(recipe) -> ModelFacts:
    from llmtune.errors import UserError
    from llmtune.plan.model_facts import read_model_facts

    facts = read_model_facts(recipe.base_model_config or recipe.base_model, fetch=True)
    if facts is None:
        raise UserError(f"can't read the config of {recipe.base_model} (not local, not cached, Hub unreachable)",
                        "point base_model_config at a local config.json, or download the model first")  # fmt: skip
    return facts


def estimate_recipe(
    recipe, gpus_per_machine: int, num_machines: int, gpu_memory: float, cpu_memory: float | None = None,
    interconnect: str = "fast", facts: ModelFacts | None = None, mixed: bool | None = None,
) -> Report:  # fmt: skip
    facts = facts or model_facts_for(recipe)
    world = gpus_per_machine * num_machines
    stages = recipe.pipeline_parallel_size
    if stages <= 1 and gpus_per_machine > 1:
        stages = min(gpus_per_machine, facts.num_layers)  # what a pipeline inside one machine would hold
    data_parallel = world // stages if recipe.pipeline_parallel_size > 1 else world
    rows = [labelled(row, recipe, world, facts.model_type)
            for row in estimate(recipe, facts, data_parallel, gpus_per_machine, stages, mixed=mixed)]  # fmt: skip
    choice = recommend(rows, gpu_memory, num_machines, interconnect, cpu_memory)
    return Report(recipe.base_model, facts.total_params(), trainable_parameters(recipe, facts), gpus_per_machine,
                  num_machines, gpu_memory, cpu_memory, interconnect, rows, choice,
                  preference.batch_note(recipe))  # fmt: skip


def labelled(row: Estimate, recipe, world_size: int, model_type: str) -> Estimate:
    """The row with its basis: "measured on H100" where a recorded GPU run covers it, else "modelled"."""
    from llmtune.plan.estimate_basis import basis

    label, why = basis(recipe, row.name, world_size, model_type)
    return replace(row, basis=label, basis_reason=why)


def row_for_plan(plan) -> str:
    """The estimate row that describes what a plan runs."""
    if plan.strategy.startswith("zero"):
        name = f"ZeRO-{plan.zero_stage}"
        if plan.offload == "cpu":
            return f"{name} + CPU offload" if plan.zero_stage in (2, 3) else name
        return f"{name} + NVMe offload" if plan.offload == "nvme" else name
    if plan.strategy.startswith("fsdp"):
        sharding = str((plan.accelerate_config or {}).get("fsdp_config", {}).get("fsdp_sharding_strategy", ""))
        return {"HYBRID_SHARD": "FSDP hybrid shard", "SHARD_GRAD_OP": "FSDP shard grad op"}.get(
            sharding, "FSDP full shard"
        )
    if plan.strategy == "tp":
        return "tensor parallel"
    if (plan.mesh or {}).get("context_parallel", 1) > 1:
        return "context parallel"
    return "pipeline" if plan.strategy == "pipeline" else "single / DDP"


def gpu_memory_of_this_machine() -> float | None:
    """Memory of the smallest visible GPU, from nvidia-smi (no torch import); None when it can't be read."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
        sizes = [float(line) * 2**20 for line in out.split() if line.strip()]  # MiB
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(sizes) if sizes else None


def cpu_memory_of_this_machine() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(recipe, plan, gpu_memory: float, facts: ModelFacts | None = None) -> str:
    """Stop before launch when the planned strategy can't fit; returns a one-line summary when it does."""
    from llmtune.errors import UserError

    facts = facts or model_facts_for(recipe)
    cluster = plan.cluster
    report = estimate_recipe(recipe, cluster.processes_per_machine, cluster.num_machines, gpu_memory,
                             cpu_memory_of_this_machine(), facts=facts)  # fmt: skip
    name = row_for_plan(plan)
    row = report.row(name)
    limit = FIT_FRACTION * gpu_memory
    sizes = (f"{row.total / GB:.1f} GB per GPU under {name} (llmtune estimate: peak allocated "
             f"{row.allocated / GB:.1f} + allocator reserve {row.reserve / GB:.1f} + CUDA context "
             f"{row.overhead / GB:.1f}); the GPUs have {gpu_memory / GB:.0f} GB and llmtune refuses above "
             f"{FIT_FRACTION:.0%} of that, {limit / GB:.1f} GB")  # fmt: skip
    if row.fits(gpu_memory):
        return sizes
    better = (
        f"{report.choice[0].strategy} would fit ({report.choice[1]})"
        if report.choice
        else (
            "nothing fits on these GPUs: add GPUs, lower micro_batch_size, turn on gradient_checkpointing, or use LoRA"
        )
    )
    raise UserError(f"the plan needs about {sizes}", f"{better}; see `llmtune estimate`, or pass --no-memory-check")


def parse_size_option(flag: str, text: str) -> float:
    from llmtune.errors import UserError

    try:
        return parse_size(text)
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a size", "write e.g. 80GB or 24GiB") from None


def parse_size(text: str) -> float:
    """'80GB', '24 GiB', '512MB', '100KB' -> bytes (a bare number is GB)."""
    units = {"gib": 2**30, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12, "kib": 2**10, "kb": 1e3}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if cleaned.endswith(unit):
            return float(cleaned[: -len(unit)]) * scale
    return float(cleaned) * 1e9
