"""Fit and recommendation: the estimate of a recipe on a cluster (every strategy's row, labelled measured or
modelled), the seeds' decision guide as data applied to it, the pre-launch check that the planned strategy fits,
and what this machine has."""

from __future__ import annotations

import functools
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from llmtune.plan.memory import preference
from llmtune.plan.memory.buffers import FIT_FRACTION, GB
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.peak import Estimate, estimate
from llmtune.plan.memory.recommend import recommend
from llmtune.plan.memory.states import trainable_parameters


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
    remedy: str = "add GPUs"  # what would lower the figures, of what the recipe doesn't do already
    assumes: str = ""  # the recipe's settings the figures are for

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
    from llmtune.plan.memory.facts import find_config_json, read_model_facts

    name = recipe.base_model_config or recipe.base_model
    facts = read_model_facts(name, fetch=True)
    if facts is None:
        found = find_config_json(name)
        if found is not None:  # there, but not the shape of a decoder this estimate knows
            raise UserError(f"{found} doesn't give a decoder's shape that the estimate reads (its heads, hidden size, "
                            "layers and vocabulary)", "point base_model_config at a causal LM's config.json")  # fmt: skip
        local = Path(str(name)).expanduser()
        if local.exists():  # a local file or folder that isn't a model's
            raise UserError(f"{local} holds no model config (config.json)" + (": it is a file" if local.is_file()
                            else ""), "point base_model at a model's folder (or base_model_config at its "
                            "config.json)")  # fmt: skip
        raise UserError(f"can't read the config of {recipe.base_model} (not local, not cached, Hub unreachable)",
                        "point base_model_config at a local config.json, or download the model first")  # fmt: skip
    return facts


def estimate_recipe(
    recipe, gpus_per_machine: int, num_machines: int, gpu_memory: float, cpu_memory: float | None = None,
    interconnect: str = "fast", facts: ModelFacts | None = None, mixed: bool | None = None,
) -> Report:  # fmt: skip
    """Every strategy's row for the recipe on this cluster, labelled, with the recommendation (`llmtune estimate`)."""
    facts = facts or model_facts_for(recipe)
    return report_for(recipe, facts, gpus_per_machine, num_machines, gpu_memory, cpu_memory, interconnect, mixed)


def report_for(recipe, facts: ModelFacts, gpus_per_machine: int, num_machines: int, gpu_memory: float,
               cpu_memory: float | None = None, interconnect: str = "fast", mixed: bool | None = None) -> Report:  # fmt: skip
    """estimate_recipe for a model whose facts are read already."""
    world = gpus_per_machine * num_machines
    stages = recipe.pipeline_parallel_size
    if stages <= 1 and gpus_per_machine > 1:
        stages = min(gpus_per_machine, facts.num_layers)  # what a pipeline inside one machine would hold
    # a pipeline recipe's other rows are those strategies on the same GPUs, every rank data parallel
    flat = recipe.model_copy(update={"pipeline_parallel_size": 1}) if recipe.pipeline_parallel_size > 1 else recipe
    rows = estimate(flat, facts, world, gpus_per_machine, stages, mixed=mixed)
    stepped_foreach = estimate(flat, facts, world, gpus_per_machine, stages, mixed=mixed, fused=False)
    rows = [labelled(row, recipe, world, facts.model_type, twin)
            for row, twin in zip(rows, stepped_foreach, strict=True)]  # fmt: skip
    choice = recommend(rows, gpu_memory, num_machines, interconnect, cpu_memory, recipe)
    return Report(recipe.base_model, facts.total_params(), trainable_parameters(recipe, facts), gpus_per_machine,
                  num_machines, gpu_memory, cpu_memory, interconnect, rows, choice,
                  preference.batch_note(recipe), remedy(recipe), assumptions(recipe))  # fmt: skip


def assumptions(recipe) -> str:
    """The recipe's settings every row is computed for."""
    packed = ", packed" if recipe.sample_packing else ""
    method = {"lora": f"LoRA r={recipe.lora_r}", "qlora": f"QLoRA r={recipe.lora_r}"}.get(recipe.adapter, "full")
    if recipe.unfrozen_parameters and not recipe.adapter:
        from llmtune.plan.memory.unfrozen import unfrozen_share

        share = unfrozen_share(recipe)
        method += (f", training the {share:.1%} of parameters unfrozen_parameters matches" if share is not None else
                   " (unfrozen_parameters not counted: the model's config isn't on this machine, so every "
                   "parameter is counted as trained)")  # fmt: skip
    return (f"for: {method}, sequence_len {recipe.sequence_len}{packed}, micro_batch_size {recipe.micro_batch_size}, "
            f"gradient checkpointing {'on' if recipe.gradient_checkpointing else 'off'}, optimizer {recipe.optimizer}, "
            f"precision {recipe.precision or 'auto'}")  # fmt: skip


def remedy(recipe) -> str:
    """What would make a recipe need less GPU memory, leaving out what it does already."""
    ways = ["add GPUs"]
    if recipe.micro_batch_size > 1:
        ways.append("lower micro_batch_size")
    if not recipe.gradient_checkpointing:
        ways.append("turn on gradient_checkpointing")
    if recipe.sequence_len > 2048:
        ways.append("shorten sequence_len")
    ways.append({None: "use LoRA", "lora": "use QLoRA (adapter: qlora)"}.get(recipe.adapter, "use fewer LoRA targets"))
    return ", ".join(ways[:-1]) + f", or {ways[-1]}"


def labelled(row: Estimate, recipe, world_size: int, model_type: str, foreach: Estimate | None = None) -> Estimate:
    """The row with its basis: "measured on H100" where a recorded GPU run covers it, else "modelled". `foreach`:
    the row as the recorded runs stepped AdamW (foreach, before the plan fused it on CUDA): where its total differs,
    the fused step's saving is modelled, not measured."""
    from llmtune.plan.memory.basis import MODELLED, basis

    label, why = basis(recipe, row.name, world_size, model_type)
    if label != MODELLED and foreach is not None and abs(foreach.total - row.total) > 0.005 * foreach.total:
        label, why = MODELLED, (f"adamw_torch steps fused on CUDA (adamw_torch_fused), {_gb(foreach.total - row.total)}"
                                " less at the step than the recorded runs' foreach AdamW: that saving is modelled")  # fmt: skip
    return replace(row, basis=label, basis_reason=why)


def _gb(size: float) -> str:
    return f"{size / GB:.1f} GB"


def row_for_plan(plan) -> str:
    """The estimate row that describes what a plan runs."""
    if plan.strategy.startswith("zero"):
        name = f"ZeRO-{plan.zero_stage}"
        if plan.offload == "cpu":
            return f"{name} + CPU offload" if plan.zero_stage in (2, 3) else name
        return f"{name} + NVMe offload" if plan.offload == "nvme" else name
    if (plan.mesh or {}).get("context_parallel", 1) > 1 and plan.strategy != "tp":
        return "context parallel"  # FSDP2 over the cp ranks, each holding 1/cp of every row (the Ulysses split: ZeRO)
    if plan.strategy.startswith("fsdp"):
        sharding = str((plan.accelerate_config or {}).get("fsdp_config", {}).get("fsdp_sharding_strategy", ""))
        return {"HYBRID_SHARD": "FSDP hybrid shard", "SHARD_GRAD_OP": "FSDP shard grad op"}.get(
            sharding, "FSDP full shard"
        )
    if plan.strategy == "tp":
        return "tensor parallel"
    return "pipeline" if plan.strategy == "pipeline" else "single / DDP"


def planned_row(report: Report, plan) -> Estimate:
    """The row of what the plan runs, adjusted where its offload or sharding is one the table has no row for:
    ZeRO-3 offloading its parameters and its optimizer to different places (or only one of them), ZeRO-1 offloading
    its optimizer, FSDP offloading parameters (with their gradients and optimizer states), FSDP2 sharding over fewer
    GPUs than the world (HSDP)."""
    row = report.row(row_for_plan(plan))
    zero = (plan.deepspeed_config or {}).get("zero_optimization") or {}

    def device(key: str) -> str:
        return str((zero.get(key) or {}).get("device", "none")) if isinstance(zero.get(key), dict) else "none"

    params_to, optimizer_to = device("offload_param"), device("offload_optimizer")
    if plan.zero_stage == 3 and params_to != optimizer_to:
        return _zero3_offload(report, params_to, optimizer_to)
    if plan.zero_stage == 1 and optimizer_to != "none":  # ZeRO-2's offload, with ZeRO-1's whole gradients on each GPU
        whole, offloaded = report.row("ZeRO-1"), report.row("ZeRO-2 + CPU offload")
        if optimizer_to == "nvme":  # the optimizer states on NVMe, the fp32 gradients it steps on in CPU memory
            states = whole.optimizer * report.gpus_per_machine
            offloaded = replace(offloaded, cpu=offloaded.cpu - states, nvme=states)
        return replace(offloaded, strategy=f"ZeRO-1 + {PLACES[optimizer_to]} offload", grads=whole.grads,
                       held_grads=whole.held_grads)  # fmt: skip
    if plan.strategy.startswith("fsdp") and plan.offload == "cpu":  # parameters, gradients, optimizer on the CPU
        states = row.params + row.grads + row.optimizer
        return replace(row, strategy=f"{row.strategy} + CPU offload", params=0.0, grads=0.0, optimizer=0.0,
                       held_grads=0.0, temporaries=0.0, cpu=states * report.gpus_per_machine)  # fmt: skip
    mesh = plan.mesh or {}
    shard = mesh.get("dp_shard", 0) * mesh.get("context_parallel", 1)  # FSDP2 shards over dp_shard x cp ranks
    world = report.gpus_per_machine * report.num_machines
    if plan.strategy == "fsdp2" and mesh.get("dp_replicate", 1) > 1 and 0 < shard < world:
        grow = world / shard  # the states shard over those ranks, not over every rank
        return replace(row, strategy=f"FSDP2 hybrid shard ({shard}-way)", params=row.params * grow,
                       grads=row.grads * grow, optimizer=row.optimizer * grow, held_grads=row.held_grads * grow)  # fmt: skip
    return row


PLACES = {"cpu": "CPU", "nvme": "NVMe"}


def _zero3_offload(report: Report, params_to: str, optimizer_to: str) -> Estimate:
    """ZeRO-3 with parameters and optimizer offloaded to different places ("none", "cpu", "nvme"): ZeRO-3's row
    with each offloaded part moved where it goes, per machine. The optimizer's fp32 gradients go to CPU memory with
    it, whether its states are on the CPU or NVMe (as the NVMe row has them)."""
    sharded, offloaded = report.row("ZeRO-3"), report.row("ZeRO-3 + CPU offload")
    per_machine = report.gpus_per_machine
    host = {"cpu": 0.0, "nvme": 0.0}
    row = sharded
    if params_to != "none":  # the parameters off the GPU, gathered onto it layer by layer
        host[params_to] += (sharded.params - offloaded.params) * per_machine
        row = replace(row, params=offloaded.params, gathered=offloaded.gathered)
    if optimizer_to != "none":  # the states and their step off the GPU; its fp32 gradients in CPU memory
        host[optimizer_to] += sharded.optimizer * per_machine
        host["cpu"] += report.row("ZeRO-3 + NVMe offload").cpu
        row = replace(row, optimizer=0.0, step_copy=0.0, temporaries=0.0)
    where = ", ".join(f"{part} to {PLACES[to]}" for part, to in (("parameters", params_to), ("optimizer", optimizer_to))
                      if to != "none")  # fmt: skip
    return replace(row, strategy=f"ZeRO-3 + offload ({where})", cpu=host["cpu"], nvme=host["nvme"])


def _nvidia_smi(fields: str) -> list[list[str]] | None:
    """One row per GPU this process may use (CUDA_VISIBLE_DEVICES by index or UUID, as CUDA reads it): the fields
    asked for, from nvidia-smi (no torch import); None where nvidia-smi is absent or fails (an old driver that
    doesn't know a field fails the query)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu=index,uuid,{fields}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]
    return visible_rows(rows, os.environ.get("CUDA_VISIBLE_DEVICES"))


def visible_rows(rows: list[list[str]], visible: str | None) -> list[list[str]]:
    """The rows (index, uuid, ...) of the GPUs CUDA_VISIBLE_DEVICES names; CUDA stops at the first entry that names
    no GPU. Entries it can't map here (MIG instances) leave every GPU counted."""
    if visible is None:
        return rows
    chosen: list[list[str]] = []
    for entry in (e.strip() for e in visible.split(",")):
        if entry.startswith("MIG-"):
            return rows
        match = [r for r in rows if entry and (r[0] == entry or (entry.startswith("GPU-") and r[1].startswith(entry)))]
        if not match:
            break
        chosen.append(match[0])
    return chosen


def gpu_memory_of_this_machine() -> float | None:
    """Memory of the smallest GPU this process may use, from nvidia-smi; None when it can't be read."""
    rows = _nvidia_smi("memory.total")
    try:
        sizes = [float(row[2]) * 2**20 for row in rows or []]  # MiB
    except (ValueError, IndexError):
        return None
    return min(sizes) if sizes else None


# compute capability by the GPU's name, for drivers before R510, whose nvidia-smi has no compute_cap field
_CAPABILITY_BY_NAME = (("H100", 9.0), ("H200", 9.0), ("H800", 9.0), ("GH200", 9.0), ("L40", 8.9), ("L4", 8.9),
                       ("RTX 40", 8.9), ("A100", 8.0), ("A800", 8.0), ("A30", 8.0), ("A10", 8.6), ("A40", 8.6),
                       ("RTX A", 8.6), ("RTX 30", 8.6), ("A16", 8.6), ("A2", 8.6), ("T4", 7.5), ("RTX 20", 7.5),
                       ("TITAN RTX", 7.5), ("QUADRO RTX", 7.5), ("V100", 7.0), ("TITAN V", 7.0), ("P100", 6.0),
                       ("P40", 6.1), ("P4", 6.1), ("K80", 3.7))  # fmt: skip


def capability_from_name(name: str) -> float | None:
    upper = name.upper()
    return next((cap for key, cap in _CAPABILITY_BY_NAME if key in upper), None)


@functools.lru_cache(maxsize=1)
def gpu_compute_capability_of_this_machine() -> float | None:
    """The lowest compute capability among the GPUs this process may use (8.0 is Ampere, the first with bf16), from
    nvidia-smi's compute_cap, or from the GPU's name on a driver without that field; None where it can't be read
    (no GPU here: a plan written for another machine)."""
    rows = _nvidia_smi("compute_cap")
    if rows is not None:
        caps = [_number(row[2]) if len(row) > 2 else None for row in rows]
    else:
        caps = [capability_from_name(",".join(row[2:])) for row in _nvidia_smi("name") or []]
    if None in caps:
        return None  # a GPU of unknown capability: auto stays bf16, as on a machine without GPUs
    return min(caps) if caps else None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def cpu_memory_of_this_machine() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(recipe, plan, gpu_memory: float, facts: ModelFacts | None = None) -> str:
    """Stop before launch when the planned strategy can't fit; returns a one-line summary when it does."""
    return fits_line(recipe, plan, gpu_memory, facts or model_facts_for(recipe))


def fits_line(recipe, plan, gpu_memory: float, facts: ModelFacts) -> str:
    """check_fits for a model whose facts are read already (the pre-launch check reads them once)."""
    from llmtune.errors import UserError

    cluster = plan.cluster
    report = report_for(recipe, facts, cluster.processes_per_machine, cluster.num_machines, gpu_memory,
                        cpu_memory_of_this_machine())  # fmt: skip
    row = planned_row(report, plan)
    name = row.strategy
    limit = FIT_FRACTION * gpu_memory
    sizes = (f"{row.total / GB:.1f} GB per GPU under {name} (llmtune estimate: peak allocated "
             f"{row.allocated / GB:.1f} + allocator reserve {row.reserve / GB:.1f} + CUDA context "
             f"{row.overhead / GB:.1f}); the GPUs have {gpu_memory / GB:.0f} GB and llmtune refuses above "
             f"{FIT_FRACTION:.0%} of that, {limit / GB:.1f} GB")  # fmt: skip
    cpu = report.cpu_memory
    if row.fits(gpu_memory) and cpu is not None and row.cpu > cpu:
        raise UserError(f"{name} offloads about {row.cpu / GB:.0f} GB to this machine's CPU memory, which has "
                        f"{cpu / GB:.0f} GB", "use more machines, NVMe offload (deepspeed: zero3_nvme), LoRA, or "
                        "pass --no-memory-check")  # fmt: skip
    if row.fits(gpu_memory):
        return sizes
    better = (
        f"{report.choice[0].strategy} would fit ({report.choice[1]})"
        if report.choice
        else (f"nothing fits on these GPUs: {report.remedy}")
    )
    raise UserError(f"the plan needs about {sizes}", f"{better}; see `llmtune estimate`, or pass --no-memory-check")
