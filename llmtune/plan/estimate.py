"""Per-GPU memory of a recipe under each strategy: model states by the ZeRO paper's accounting, plus activations.

Model states with mixed-precision Adam take (2 + 2 + K)·Ψ bytes, K = 12 (fp32 master weights, momentum,
variance); ZeRO-1 divides the K·Ψ of optimizer states by the data-parallel size N_d, ZeRO-2 also the 2·Ψ
of gradients, ZeRO-3 (and FSDP full shard) also the 2·Ψ of parameters. Offload moves what it offloads to CPU
(or NVMe). Pure arithmetic on the model's config: nothing is built.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from llmtune.plan.model_facts import ModelFacts

GB = 1e9
FRAMEWORK_OVERHEAD = 1.0 * GB  # CUDA context, kernels, allocator slack
EIGHT_BIT = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "paged_lion_8bit")


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
    activations: float
    overhead: float
    cpu: float  # offloaded bytes per machine
    nvme: float
    gathered: float = 0.0  # ZeRO-3/FSDP: the largest layer all-gathered in full (params + grads) while it runs
    step_copy: float = 0.0  # DeepSpeed: the fp32 copy of the gradient partition its optimizer steps on

    @property
    def name(self) -> str:
        """The strategy without its detail: 'pipeline (4 stages, per stage)' -> 'pipeline'."""
        return self.strategy.split(" (")[0]

    def fits(self, gpu_memory: float, cpu_memory: float | None = None) -> bool:
        return self.total <= gpu_memory and (cpu_memory is None or self.cpu <= cpu_memory)

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer states: the ZeRO paper's (2 + 2 + K)·Ψ, partitioned."""
        return self.params + self.grads + self.optimizer

    @property
    def buffers(self) -> float:
        return self.gathered + self.step_copy

    @property
    def total(self) -> float:
        return self.model_states + self.buffers + self.activations + self.overhead


def activation_bytes(facts: ModelFacts, micro_batch: int, seq: int, checkpointing: bool, mixed: bool) -> float:
    """Activations kept for backward, with a fused attention kernel (no s^2 scores kept), plus the logits."""
    width = 2 if mixed else 4
    tokens = micro_batch * seq
    h, inter = facts.hidden_size, facts.intermediate_size
    # per layer and token: attention inputs/outputs (~6h values) + MLP inputs and intermediates (~3·inter) + norms
    per_layer = tokens * (8 * h + 3 * inter) * width
    layers = (facts.num_layers * tokens * h * width + per_layer) if checkpointing else facts.num_layers * per_layer
    logits = tokens * facts.vocab_size * (width + 4 + 4)  # logits, their fp32 copy for the loss, its gradient
    return layers + logits


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
    same total for every optimizer (4 + 4 + moments = 2 + 2 + 4 + moments), split differently.
    """
    psi = facts.total_params()
    base = state_bytes(recipe.optimizer, mixed, master=True) if deepspeed else state_bytes(recipe.optimizer, False)
    if not recipe.adapter:
        return base.params * psi, base.grads * psi, base.optimizer * psi
    trainable = trainable_parameters(recipe, facts)
    width = 2.0 if mixed else 4.0  # the frozen base is kept in the compute dtype
    frozen = psi * (0.5 + 0.5 / 32 if recipe.load_in_4bit else 1.0 if recipe.load_in_8bit else width)
    adapter = state_bytes(recipe.optimizer, False, master=deepspeed)  # adapters train in fp32
    return frozen + adapter.params * trainable, adapter.grads * trainable, adapter.optimizer * trainable


def estimate(
    recipe, facts: ModelFacts, data_parallel: int, gpus_per_machine: int, stages: int = 1, mixed: bool | None = None
) -> list[Estimate]:
    """One Estimate per strategy, per GPU. `mixed` overrides the recipe's precision (CPU rehearsals run fp32)."""
    mixed = is_mixed(recipe) if mixed is None else mixed
    params, grads, optimizer = _states(recipe, facts, mixed, deepspeed=False)
    zp, zg, zo = _states(recipe, facts, mixed, deepspeed=True)
    acts = activation_bytes(facts, recipe.micro_batch_size, recipe.sequence_len, recipe.gradient_checkpointing, mixed)
    n = max(1, data_parallel)
    per_machine = max(1, min(n, gpus_per_machine))
    width = 2.0 if mixed else 4.0
    # gathered while a layer runs: its params, and their grads unless the base is frozen
    largest = width * (1 if recipe.adapter else 2) * max(facts.layer_params(), facts.embedding_params())
    # DeepSpeed flattens each param group's gradient partition to fp32 before stepping it (measured; and
    # the "4_grads_32bit" of its own estimate functions); with offload that copy lives on the CPU.
    fp32_grads = 4.0 * trainable_parameters(recipe, facts)
    #      name                        params  grads    optimizer cpu (per machine)                   nvme  gathered  step copy
    rows = [
        ("single / DDP",               params, grads,   optimizer, 0.0, 0.0, 0.0, 0.0),
        ("ZeRO-1",                     zp,     zg,      zo / n,    0.0, 0.0, 0.0, fp32_grads / n),
        ("ZeRO-2",                     zp,     zg / n,  zo / n,    0.0, 0.0, 0.0, fp32_grads / n),
        ("ZeRO-3",                     zp / n, zg / n,  zo / n,    0.0, 0.0, largest, fp32_grads / n),
        ("ZeRO-2 + CPU offload",       zp,     0.0,     0.0,       (zg + fp32_grads + zo) / n * per_machine, 0.0, 0.0, 0.0),
        ("ZeRO-3 + CPU offload",       0.0,    0.0,     0.0,       (zp + zg + fp32_grads + zo) / n * per_machine, 0.0, largest, 0.0),
        ("ZeRO-3 + NVMe offload",      0.0,    0.0,     0.0,       (zg + fp32_grads) / n * per_machine, (zp + zo) / n * per_machine, largest, 0.0),
        ("FSDP full shard",            params / n, grads / n, optimizer / n, 0.0, 0.0, largest, 0.0),
        ("FSDP shard grad op",         params, grads / n, optimizer / n, 0.0, 0.0, 0.0, 0.0),
        ("FSDP hybrid shard",          params / per_machine, grads / per_machine, optimizer / per_machine, 0.0, 0.0, largest, 0.0),
    ]  # fmt: skip
    estimates = [Estimate(name, p, g, o, acts, FRAMEWORK_OVERHEAD, cpu, nvme, gathered, step)
                 for name, p, g, o, cpu, nvme, gathered, step in rows]  # fmt: skip
    if stages > 1:
        # balanced stages, but a stage holds at least one whole layer (or the embeddings)
        share = max(1 / stages, max(facts.layer_params(), facts.embedding_params()) / facts.total_params())
        estimates.append(Estimate(f"pipeline ({stages} stages, per stage)", params * share, grads * share,
                                  optimizer * share, acts, FRAMEWORK_OVERHEAD, 0.0, 0.0))  # fmt: skip
    return estimates


# The seeds' decision guide as data. For each kind of cluster, strategies in order of preference, each
# with its reason; the first one whose per-GPU total fits (and whose offload fits the CPU) wins.
REASONS = {
    "single / DDP": "the model and its optimizer fit one GPU: plain data parallel has the least communication",
    "ZeRO-1": "sharding only the optimizer states is enough and costs no extra communication over DDP",
    "ZeRO-2": "sharding optimizer states and gradients is enough; parameters stay whole on every GPU",
    "pipeline": "the model doesn't fit one GPU but each stage's layers do; stages exchange only activations",
    "ZeRO-3": "only sharding the parameters too makes it fit (needed when even one layer is too big for a stage)",
    "FSDP full shard": "only sharding the parameters too makes it fit (needed when even one layer is too big for a stage)",
    "FSDP shard grad op": "sharding gradients and optimizer states is enough; parameters stay whole (FSDP's ZeRO-2)",
    "FSDP hybrid shard": "sharding within each machine fits and keeps the all-gathers off the slow links between machines",
    "ZeRO-2 + CPU offload": "nothing fits on the GPUs alone; offloading optimizer states and gradients to CPU does",
    "ZeRO-3 + CPU offload": "nothing fits on the GPUs alone; offloading parameters and optimizer to CPU does",
    "ZeRO-3 + NVMe offload": "even CPU memory is too small; ZeRO-Infinity offloads to NVMe",
}  # fmt: skip
_OFFLOAD = ["ZeRO-2 + CPU offload", "ZeRO-3 + CPU offload", "ZeRO-3 + NVMe offload"]
PREFERENCE = {
    # one machine: pipeline before ZeRO-3 (the seeds' order: pipeline, ZeRO, tensor parallel)
    "one machine": ["single / DDP", "ZeRO-1", "ZeRO-2", "pipeline", "ZeRO-3", "FSDP full shard", *_OFFLOAD],
    # several machines, fast interconnect (InfiniBand, NVLink across nodes): ZeRO/FSDP scale well
    "fast": ["single / DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP full shard", "FSDP hybrid shard", "pipeline", *_OFFLOAD],
    # several machines, slow interconnect (Ethernet): keep the heavy traffic inside machines, DP + PP
    "slow": ["single / DDP", "ZeRO-1", "pipeline", "FSDP hybrid shard", "ZeRO-2", "ZeRO-3", "FSDP full shard", *_OFFLOAD],
}  # fmt: skip


def recommend(
    estimates: list[Estimate], gpu_memory: float, num_machines: int = 1, interconnect: str = "fast",
    cpu_memory: float | None = None,
) -> tuple[Estimate, str] | None:  # fmt: skip
    profile = "one machine" if num_machines <= 1 else interconnect
    by_name = {e.name: e for e in estimates}
    for name in PREFERENCE[profile]:
        row = by_name.get(name)
        if row is not None and row.fits(gpu_memory, cpu_memory):
            return row, REASONS[name]
    return None


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

    def fits(self, row: Estimate) -> bool:
        return row.fits(self.gpu_memory, self.cpu_memory)

    def row(self, name: str) -> Estimate:
        return next(r for r in self.rows if r.name == name)

    def to_dict(self) -> dict:
        rows = [{**asdict(r), "model_states": r.model_states, "total": r.total, "fits": self.fits(r)}
                for r in self.rows]  # fmt: skip
        choice = {"strategy": self.choice[0].strategy, "reason": self.choice[1]} if self.choice else None
        return {**{k: v for k, v in asdict(self).items() if k not in ("rows", "choice")}, "rows": rows,
                "recommended": choice}  # fmt: skip


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
    rows = estimate(recipe, facts, data_parallel, gpus_per_machine, stages, mixed=mixed)
    choice = recommend(rows, gpu_memory, num_machines, interconnect, cpu_memory)
    return Report(recipe.base_model, facts.total_params(), trainable_parameters(recipe, facts), gpus_per_machine,
                  num_machines, gpu_memory, cpu_memory, interconnect, rows, choice)  # fmt: skip


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
    summary = f"{row.total / GB:.1f} GB of {gpu_memory / GB:.0f} GB per GPU ({name}, by llmtune estimate)"
    if row.fits(gpu_memory):
        return summary
    better = (
        f"{report.choice[0].strategy} would fit ({report.choice[1]})"
        if report.choice
        else (
            "nothing fits on these GPUs: add GPUs, lower micro_batch_size, turn on gradient_checkpointing, or use LoRA"
        )
    )
    raise UserError(f"the plan needs about {row.total / GB:.1f} GB per GPU under {name} but the GPUs have "
                    f"{gpu_memory / GB:.0f} GB", f"{better}; see `llmtune estimate`, or pass --no-memory-check")  # fmt: skip


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
