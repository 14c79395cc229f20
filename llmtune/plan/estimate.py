"""Per-GPU memory of a recipe under each strategy: model states by the ZeRO paper's accounting, plus activations.

Model states with mixed-precision Adam take (2 + 2 + K)·Ψ bytes, K = 12 (fp32 master weights, momentum,
variance); ZeRO-1 divides the K·Ψ of optimizer states by the data-parallel size N_d, ZeRO-2 also the 2·Ψ
of gradients, ZeRO-3 (and FSDP full shard) also the 2·Ψ of parameters. Offload moves what it offloads to CPU
(or NVMe). Pure arithmetic on the model's config: nothing is built.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def state_bytes(optimizer: str, mixed: bool) -> Bytes:
    master = 4.0 if mixed else 0.0  # fp32 master weights live with the optimizer under mixed precision
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

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.overhead


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


def estimate(recipe, facts: ModelFacts, data_parallel: int, gpus_per_machine: int, stages: int = 1) -> list[Estimate]:
    """One Estimate per strategy, per GPU."""
    mixed = recipe.precision != "no" or recipe.bf16 == "auto"
    psi = facts.total_params()
    base = state_bytes(recipe.optimizer, mixed)
    if recipe.adapter:
        trainable = lora_parameters(
            facts, recipe.lora_r, "all-linear" if recipe.lora_target_linear else recipe.lora_target_modules
        )
        frozen = psi * (0.5 + 0.5 / 32 if recipe.load_in_4bit else 1.0 if recipe.load_in_8bit else base.params)
        params, grads, optimizer = frozen + 4.0 * trainable, 4.0 * trainable, 8.0 * trainable
    else:
        params, grads, optimizer = base.params * psi, base.grads * psi, base.optimizer * psi
    acts = activation_bytes(facts, recipe.micro_batch_size, recipe.sequence_len, recipe.gradient_checkpointing, mixed)
    n = max(1, data_parallel)
    per_machine = max(1, min(n, gpus_per_machine))
    rows = [
        ("single / DDP", params, grads, optimizer, 0.0, 0.0),
        ("ZeRO-1", params, grads, optimizer / n, 0.0, 0.0),
        ("ZeRO-2", params, grads / n, optimizer / n, 0.0, 0.0),
        ("ZeRO-3 / FSDP full shard", params / n, grads / n, optimizer / n, 0.0, 0.0),
        ("ZeRO-2 + CPU offload", params, grads / n, 0.0, optimizer / n * per_machine, 0.0),
        ("ZeRO-3 + CPU offload", 0.0, grads / n, 0.0, (params + optimizer) / n * per_machine, 0.0),
        ("ZeRO-3 + NVMe offload", 0.0, grads / n, 0.0, 0.0, (params + optimizer) / n * per_machine),
        ("FSDP hybrid shard", params / per_machine, grads / per_machine, optimizer / per_machine, 0.0, 0.0),
    ]
    estimates = [Estimate(name, p, g, o, acts, FRAMEWORK_OVERHEAD, cpu, nvme) for name, p, g, o, cpu, nvme in rows]
    if stages > 1:
        share = 1 / stages  # balanced stages; the first also holds the embeddings, counted in the share
        estimates.append(Estimate(f"pipeline ({stages} stages, per stage)", params * share, grads * share,
                                  optimizer * share, acts, FRAMEWORK_OVERHEAD, 0.0, 0.0))  # fmt: skip
    return estimates


# The seeds' decision rule as data: the first strategy (in this order of preference) that fits wins.
PREFERENCE = [
    ("single / DDP", "the model and its optimizer fit one GPU: plain data parallel has the least communication"),
    ("ZeRO-1", "sharding only the optimizer states is enough and costs no extra communication over DDP"),
    ("ZeRO-2", "sharding optimizer states and gradients is enough; parameters stay whole on every GPU"),
    ("pipeline", "the model doesn't fit one GPU; pipeline stages send only activations between GPUs"),
    ("ZeRO-3 / FSDP full shard", "only sharding the parameters too makes it fit"),
    ("FSDP hybrid shard", "sharding within each machine fits and keeps the all-gathers off the slow links"),
    ("ZeRO-2 + CPU offload", "nothing fits on the GPUs alone; offloading optimizer states to CPU does"),
    ("ZeRO-3 + CPU offload", "nothing fits on the GPUs alone; offloading parameters and optimizer to CPU does"),
    ("ZeRO-3 + NVMe offload", "even CPU memory is too small; ZeRO-Infinity offloads to NVMe"),
]


def recommend(estimates: list[Estimate], gpu_memory: float) -> tuple[Estimate, str] | None:
    by_prefix = {e.strategy.split(" (")[0]: e for e in estimates}
    for name, reason in PREFERENCE:
        row = by_prefix.get(name)
        if row is not None and row.total <= gpu_memory:
            return row, reason
    return None


def parse_size(text: str) -> float:
    """'80GB', '24 GiB', '512MB' -> bytes."""
    units = {"gib": 2**30, "gb": 1e9, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12}
    cleaned = text.strip().lower().replace(" ", "")
    for unit, scale in units.items():
        if cleaned.endswith(unit):
            return float(cleaned[: -len(unit)]) * scale
    return float(cleaned) * 1e9
