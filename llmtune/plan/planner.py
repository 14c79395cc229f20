"""Recipe + Cluster -> Plan: the strategy, its sizes, the generated configs and the commands.

Pure: reads at most a local config.json or DeepSpeed JSON, imports no torch.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.plan.accelerate_config import build_accelerate_config, fsdp_section
from llmtune.plan.cluster import Cluster
from llmtune.plan.deepspeed import build_deepspeed_config
from llmtune.plan.memory.facts import ModelFacts, read_model_facts
from llmtune.plan.mesh import (
    check_tensor_parallel_loss,
    hybrid_mesh,
    tensor_parallel_mesh,
    tensor_parallel_shared_output,
)
from llmtune.plan.pipeline import bubble_fraction, split_layers
from llmtune.plan.resume import resumed_accumulation
from llmtune.recipe import Recipe
from llmtune.recipe.kernels import INSTALL_HINT, Kernels, fused_optimizer, liger_requested, resolve_kernels
from llmtune.recipe.preference import ONLINE_METHODS

STRATEGY_TITLES = {
    "single": "single process", "ddp": "DDP (data parallel)", "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2", "zero3": "DeepSpeed ZeRO-3", "fsdp1": "FSDP1", "fsdp2": "FSDP2",
    "pipeline": "pipeline parallel", "tp": "tensor parallel",
}  # fmt: skip


@dataclass
class PipelinePlan:
    stages: int
    microbatches: int
    schedule: str
    virtual_stages: int
    bubble: float
    layers_per_stage: list[list[int]] | None  # [first, last) per stage, when the config is known
    params_per_stage: list[int] | None


@dataclass
class Plan:
    strategy: str
    offload: str  # none | cpu | nvme
    world_size: int
    data_parallel_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    global_batch_size: int
    precision: str
    cluster: Cluster
    config_dir: str
    accelerate_config: dict[str, Any] | None
    deepspeed_config: dict[str, Any] | None
    env: dict[str, str]
    commands: list[list[str]]  # one per machine, by machine rank
    pipeline: PipelinePlan | None = None
    notes: list[str] = field(default_factory=list)
    rdzv_backend: str = "static"  # c10d: torchrun's elastic rendezvous (machines join in any order, may rejoin)
    min_machines: int | None = None  # c10d: the job runs with any machine count from this up to num_machines
    kernels: dict[str, Any] = field(default_factory=dict)  # on GPUs: liger kernels, attention, torch.compile
    mesh: dict[str, int] | None = None  # tp: {tensor_parallel, dp_shard, dp_replicate}; ranks = their product
    shared_output_dir: str | None = None  # what needs every machine to see one output_dir (the check-in tests it)

    @property
    def title(self) -> str:
        title = STRATEGY_TITLES[self.strategy]
        return title + (f" + {self.offload.upper()} offload" if self.offload != "none" else "")

    @property
    def zero_stage(self) -> int:
        return int(self.strategy[-1]) if self.strategy.startswith("zero") else 0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data["cluster"] = self.cluster.to_dict()
        data["title"] = self.title
        return data


def gptq_check(recipe, strategy: str) -> str:
    """A GPTQ base trains LoRA through transformers' GPTQ integration (optimum and gptqmodel), replicated: its
    packed integer weights are buffers that ZeRO-3, FSDP and tensor parallelism don't shard."""
    import importlib.util

    if strategy in ("zero3", "tp", "pipeline") or strategy.startswith("fsdp"):
        raise UserError(f"gptq: true under {STRATEGY_TITLES.get(strategy, strategy)} is not supported: GPTQ's packed "
                        "weights are buffers the engine can't shard", "use DDP or ZeRO-1/2 (a GPTQ base is small "
                        "already), or adapter: qlora on the 16-bit model")  # fmt: skip
    missing = [name for name in ("optimum", "gptqmodel") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"gptq: true (a GPTQ base) is not supported here: it needs {' and '.join(missing)} "
                        "(transformers loads GPTQ weights through them), not installed", f"pip install "
                        f"{' '.join(missing)}, or use adapter: qlora on the 16-bit model")  # fmt: skip
    return "GPTQ base: loaded as quantized (its quantization_config), LoRA trains over its dequantized weights"


def choose_strategy(recipe: Recipe, world_size: int) -> str:
    if recipe.pipeline_parallel_size > 1:
        return "pipeline"
    if recipe.deepspeed is not None:
        return "zero"  # the stage comes from the resolved config
    if recipe.tensor_parallel_size > 1:
        return "tp"
    fsdp = recipe.resolved_fsdp()
    if fsdp:
        return f"fsdp{fsdp[0]}"
    return "ddp" if world_size > 1 else "single"


def _precision(recipe: Recipe, cluster: Cluster, notes: list[str]) -> str:
    precision = "bf16" if recipe.bf16 == "auto" and not cluster.rehearsal else recipe.precision
    if recipe.bf16 == "auto" and cluster.rehearsal:
        precision = "no"
    if cluster.rehearsal and precision != "no":
        notes.append(f"CPU rehearsal: {precision} mixed precision becomes fp32 (the GPU run keeps {precision})")
        return "no"
    return precision


def _pipeline_plan(recipe: Recipe, world: int, facts: ModelFacts | None) -> PipelinePlan:
    stages = recipe.pipeline_parallel_size
    if world % stages:
        raise UserError(
            f"world size {world} is not divisible by pipeline_parallel_size {stages} "
            f"(world = stages x data-parallel replicas; {world} / {stages} = {world / stages:.2f})",
            f"use --num-processes {stages * max(1, world // stages) or stages}",
        )
    accumulation = recipe.gradient_accumulation_steps
    if recipe.pipeline_microbatches and accumulation > 1 and recipe.pipeline_microbatches != accumulation:
        raise UserError(
            f"pipeline_microbatches ({recipe.pipeline_microbatches}) and gradient_accumulation_steps "
            f"({accumulation}) disagree",
            "in a pipeline the micro-batches of one step are the accumulation steps: set only pipeline_microbatches",
        )
    microbatches = recipe.pipeline_microbatches or max(accumulation, stages)
    if microbatches < stages:
        raise UserError(f"pipeline_microbatches ({microbatches}) is fewer than pipeline_parallel_size ({stages})")
    virtual = recipe.pipeline_virtual_stages if recipe.pipeline_schedule == "interleaved_1f1b" else 1
    layers = params = None
    if facts:
        try:
            ranges = split_layers(
                [facts.layer_params()] * facts.num_layers,
                facts.embedding_params(),
                facts.hidden_size + (0 if facts.tie_word_embeddings else facts.embedding_params()),
                stages * virtual,
            )
        except ValueError:
            raise UserError(
                f"pipeline_parallel_size {stages} x {virtual} virtual stages needs at least {stages * virtual} "
                f"layers, but the model has {facts.num_layers}",
                "use fewer stages",
            ) from None
        layers = [[r.start, r.stop] for r in ranges]
        params = [len(r) * facts.layer_params() for r in ranges]
        params[0] += facts.embedding_params()
        params[-1] += facts.hidden_size + (0 if facts.tie_word_embeddings else facts.embedding_params())
    return PipelinePlan(
        stages, microbatches, recipe.pipeline_schedule, virtual, bubble_fraction(stages, microbatches), layers, params
    )


def make_plan(recipe: Recipe, cluster: Cluster, config_dir: str | None = None) -> Plan:
    """Resolve the recipe for this cluster. Raises UserError for sizes or combinations that can't work."""
    config_dir = str(Path(config_dir or Path(recipe.output_dir) / "llmtune").resolve())
    notes: list[str] = []
    world = cluster.num_processes
    facts = read_model_facts(recipe.base_model_config or recipe.base_model)
    precision = _precision(recipe, cluster, notes)
    strategy = choose_strategy(recipe, world)
    pipeline = _pipeline_plan(recipe, world, facts) if strategy == "pipeline" else None
    if recipe.optimizer == "muon" and strategy not in ("single", "ddp", "fsdp2"):
        what = {"zero": "DeepSpeed", "tp": "tensor parallelism"}.get(strategy, strategy)
        raise UserError(f"optimizer: muon under {what} is not supported (it orthogonalizes whole weight matrices: "
                        "one process, DDP or FSDP2, as in Axolotl)", "use fsdp_version: 2, or adamw_torch")  # fmt: skip
    if recipe.optimizer == "muon" and strategy == "fsdp2":
        _check_muon_offload(recipe)
    if recipe.relora:
        notes.append(_check_relora(recipe, strategy))
    if recipe.async_checkpoint:
        notes.append(_check_async_checkpoint(recipe, strategy, facts))
    if pipeline and recipe.precision == "fp16":  # refused in rehearsal too: the GPU run would refuse it
        raise UserError("pipeline runs take bf16 or fp32: fp16 needs loss scaling, which the pipeline loop does not do",
                        "set bf16: true (or fp16: false)")  # fmt: skip
    if pipeline and world > 1 and (cluster.device, cluster.backend) == ("cuda", "gloo"):
        # measured on an H100 (torch 2.11): gloo's send/recv of CUDA tensors fails with "Bad address"
        raise UserError("pipeline stages pass activations with send/recv, which gloo cannot do on CUDA tensors",
                        "run pipeline stages on separate GPUs (NCCL), or rehearse them with --device cpu")  # fmt: skip
    mesh = shared_output = None
    if strategy == "tp":
        check_tensor_parallel_loss(recipe)
        mesh = tensor_parallel_mesh(recipe, world, facts, notes)
        shared_output = tensor_parallel_shared_output(recipe, cluster, notes)
    elif strategy.startswith("fsdp"):
        mesh = hybrid_mesh(recipe, world, recipe.resolved_fsdp()[0], notes, facts)
    data_parallel = world // pipeline.stages if pipeline else world
    if mesh:  # ranks of one tensor/context-parallel group see the same rows: only data-parallel ranks split the data
        data_parallel = mesh["dp_shard"] * mesh["dp_replicate"]
    accumulation = pipeline.microbatches if pipeline else recipe.gradient_accumulation_steps
    global_batch = recipe.micro_batch_size * accumulation * data_parallel

    deepspeed_config = fsdp = None
    offload = "none"
    if strategy not in ("tp", "fsdp1", "fsdp2") and (recipe.dp_shard_size or recipe.dp_replicate_size):
        raise UserError("dp_shard_size / dp_replicate_size lay out FSDP2 (or tensor-parallel) ranks; this recipe "
                        f"runs {STRATEGY_TITLES[strategy]}", "add fsdp_version: 2, or remove them")  # fmt: skip
    ds_path = None
    if strategy == "zero":
        deepspeed_config, ds_notes = build_deepspeed_config(recipe, data_parallel, precision, facts)
        notes += ds_notes
        zero = deepspeed_config["zero_optimization"]
        stage = int(zero.get("stage", 0))
        if stage not in (1, 2, 3):
            raise UserError(f"deepspeed: zero_optimization.stage is {stage}; llmtune runs stages 1, 2 and 3")
        strategy = f"zero{stage}"
        devices = {(zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
        offload = "nvme" if "nvme" in devices else "cpu" if "cpu" in devices else "none"
        if recipe.adapter == "qlora" and stage == 3:
            notes.append("QLoRA under ZeRO-3: each rank loads the 4-bit model whole (transformers builds quantized "
                         "models without zero.Init), then DeepSpeed partitions the 4-bit weights, stored in the "
                         "compute dtype")  # fmt: skip
        ds_path = str(Path(config_dir) / "deepspeed.json")
    elif strategy.startswith("fsdp"):
        version, settings = recipe.resolved_fsdp()
        if version == 2 and settings.sharding_strategy.startswith("HYBRID"):
            raise UserError("fsdp: HYBRID_SHARD needs fsdp_version: 1", "or use FULL_SHARD with FSDP2")
        if version == 1 and cluster.rehearsal:
            # torch 2.13 segfaults gathering an FSDP1 full state dict on CPU (the final save): a rehearsal that can't
            # save proves nothing. (Its sharded resume: tests/integration/test_fsdp1_resume.py.)
            raise UserError("fsdp_version: 1 can't be rehearsed on CPU (its state dict can't be saved there)",
                            "rehearse with fsdp_version: 2 (FSDP1 is deprecated in transformers), or run on GPUs")  # fmt: skip
        fsdp = fsdp_section(version, settings)
        offload = "cpu" if settings.offload_params else "none"
        if world == 1:
            notes.append("FSDP with one process shards nothing; it runs, but DDP/single would be faster")
        if settings.activation_checkpointing and recipe.gradient_checkpointing:
            notes.append("gradient_checkpointing and fsdp_config.activation_checkpointing are both on: FSDP's "
                         "recomputes each wrapped layer (transformers refuses the two together)")  # fmt: skip

    if recipe.gptq:
        notes.append(gptq_check(recipe, strategy))
    if recipe.activation_offloading:
        notes.append("activation offloading: not on the CPU rehearsal (activations are in host memory already)"
                     if cluster.rehearsal else "activation offloading: each checkpointed layer's input is held in "
                     "pinned CPU memory (transformers' checkpoint offload); slower steps, less GPU memory")  # fmt: skip
    kernels = _kernels(recipe, cluster, precision, strategy, mesh)
    kernels.optimizer = fused_optimizer(recipe, cluster.device, strategy, deepspeed_config)
    if recipe.rl in ONLINE_METHODS:
        kernels.generation, kernels.vllm_share = _generation(recipe, cluster, facts, data_parallel, precision)
    if kernels.optimizer:
        kernels.notes.append(f"optimizer: {kernels.optimizer} for the recipe's {recipe.optimizer} (the same AdamW, "
                             "fused into one kernel per step on CUDA)")  # fmt: skip
    notes += kernels.notes
    if recipe.qat:
        notes += _qat_notes(recipe)
    accelerate = None
    if strategy != "single":
        accelerate = build_accelerate_config(
            strategy, cluster, precision, ds_path, int(strategy[-1]) if ds_path else 0, fsdp, recipe.rdzv_backend
        )
    if cluster.num_machines > 1:
        notes.append("several machines: check them first with `llmtune doctor` and the same flags (stack, GPUs, "
                     "storage, network, collectives), or add --preflight to llmtune train")  # fmt: skip
    if recipe.rdzv_backend in ELASTIC and cluster.num_machines == 1:
        raise UserError(f"rdzv_backend: {recipe.rdzv_backend} is for jobs on several machines (it gathers machines, "
                        "not processes)", "on one machine, max_restarts alone restarts the ranks after a crash")  # fmt: skip
    if recipe.rdzv_backend == "etcd":
        if not recipe.rdzv_endpoint:
            raise UserError("rdzv_backend: etcd needs rdzv_endpoint: host:port of the etcd server",
                            "set rdzv_endpoint in the recipe or pass --rdzv-endpoint, e.g. 10.0.0.5:2379")  # fmt: skip
        if strategy != "ddp":
            raise UserError(f"rdzv_backend: etcd with {STRATEGY_TITLES[strategy]} is not supported: llmtune runs "
                            "torchrun's elastic agent directly for it, with DDP ranks only",
                            "use DDP (no deepspeed/fsdp/pipeline keys), or rdzv_backend: c10d")  # fmt: skip
        notes.append(f"rendezvous: etcd at {recipe.rdzv_endpoint} (torchrun's etcd-v2 backend), off the training "
                     "machines: the job survives losing any machine, machine 0 included, down to "
                     f"{recipe.min_machines or cluster.num_machines} machine(s); every machine must reach it")  # fmt: skip
    elif recipe.rdzv_backend == "c10d":
        notes.append(f"rendezvous: c10d; its store lives on machine 0 ({cluster.main_process_ip}), so losing machine 0 "
                     "ends the job whatever max_restarts says (rdzv_backend: etcd keeps it off the training machines)")  # fmt: skip
    resumed = resumed_accumulation(recipe, strategy, world, data_parallel, mesh, STRATEGY_TITLES, offload)
    if resumed:  # the checkpoint it resumes was saved on another world size: keep its global batch
        accumulation = resumed.accumulation
        global_batch = recipe.micro_batch_size * accumulation * data_parallel
        notes.append(resumed.line)
        if deepspeed_config:
            deepspeed_config.update(gradient_accumulation_steps=accumulation, train_batch_size=global_batch)
            if resumed.universal:  # the engine reads <checkpoint>/latest_universal (the worker converts first)
                deepspeed_config["checkpoint"] = {**deepspeed_config.get("checkpoint", {}), "load_universal": True}
    _check_elastic_sizes(recipe, cluster, strategy, global_batch)
    if recipe.lisa_n_layers:
        if world > 1:
            raise UserError(f"lisa_n_layers changes which parameters train as it goes, which {world} ranks' gradient "
                            "sync (DDP, FSDP, DeepSpeed) can't follow; LISA runs in one process",
                            "use --num-processes 1 (LISA is for fitting a full fine-tune on one GPU)")  # fmt: skip
        notes.append(f"LISA: {recipe.lisa_n_layers} of the layers at {recipe.lisa_layers_attribute}, drawn again every "
                     f"{recipe.lisa_step_interval} steps (seeded), train at a time; embeddings, norms and head always")  # fmt: skip
    if recipe.lr_quadratic_warmup:
        from llmtune.recipe.training import quadratic_warmup

        notes.append("lr_quadratic_warmup: the warm-up rises as (step / warmup)^2, then cosine decay"
                     if quadratic_warmup(recipe) else f"lr_quadratic_warmup: no effect with lr_scheduler "
                     f"{recipe.lr_scheduler} (Axolotl applies it to cosine only)")  # fmt: skip
    if recipe.use_eaft:
        notes.append(f"EAFT loss: each trained token's cross-entropy weighted by the entropy of its top-{recipe.eaft_k} "
                     f"next-token probabilities (power {recipe.eaft_alpha})")  # fmt: skip
    env = _environment(cluster, strategy)
    if cluster.launcher == "deepspeed":
        if recipe.rdzv_backend in ELASTIC or recipe.max_restarts:
            raise UserError(f"rdzv_backend: {recipe.rdzv_backend} and max_restarts are torchrun's; DeepSpeed's launcher "
                            "has neither",
                            "use --launcher accelerate for an elastic job")  # fmt: skip
        # DeepSpeed's launcher exports only a few variables to the machines it starts: the rest go in this file
        env["DS_ENV_FILE"] = str(Path(config_dir) / "deepspeed_env")
    if recipe.rdzv_backend in ELASTIC:
        # a fresh TCP store for the ranks of every rendezvous round: a machine that restarted (its restart count
        # back at 0) and the survivors (at 1) then meet in the same clean store, instead of stale keys of the dead
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    commands = [_command(strategy, config_dir, rank, recipe, cluster) for rank in range(cluster.num_machines)]
    return Plan(
        strategy, offload, world, data_parallel, recipe.micro_batch_size, accumulation, global_batch, precision,
        cluster, config_dir, accelerate, deepspeed_config, env, commands, pipeline, notes, recipe.rdzv_backend,
        recipe.min_machines if recipe.min_machines and recipe.min_machines < cluster.num_machines else None,
        kernels.to_dict(), mesh, shared_output,
    )  # fmt: skip


def _check_async_checkpoint(recipe: Recipe, strategy: str, facts: ModelFacts | None) -> str:
    """async_checkpoint runs through torch's distributed checkpoint; refused where the engine writes its own
    checkpoints or the Trainer's format is needed. Returns the plan's note, with the host memory it stages into."""
    refusals = {
        "zero": ("DeepSpeed writes ZeRO checkpoints itself; its decoupled checkpoint engine (DeepSpeed >= 0.17) "
                 "writes through its async_io op (libaio), which llmtune doesn't drive yet",
                 "remove async_checkpoint (ZeRO checkpoints are then written synchronously), or use fsdp_version: 2"),
        "fsdp1": ("FSDP1's sharded checkpoints go through accelerate's synchronous save", "use fsdp_version: 2"),
        "pipeline": ("pipeline stages checkpoint in llmtune's own loop, synchronously", "remove async_checkpoint"),
    }  # fmt: skip
    key = "zero" if strategy.startswith("zero") else strategy
    if key in refusals:
        why, hint = refusals[key]
        raise UserError(f"async_checkpoint is not supported here: {why}", hint)
    if recipe.early_stopping_patience:
        raise UserError("async_checkpoint with early_stopping_patience is not supported: keeping the best checkpoint "
                        "reloads it in the Trainer's own format", "remove one of them")  # fmt: skip
    if recipe.save_strategy == "no":
        return "async_checkpoint: no effect (save_strategy: no)"
    size = ""
    if facts is not None:
        from llmtune.plan.memory.peak import estimate

        row = next(r for r in estimate(recipe, facts, 1, 1) if r.name == "single / DDP")
        staged = row.staging / 2**30
        shown = f"{staged:.1f} GiB" if staged >= 0.1 else f"{row.staging / 2**20:.1f} MiB"
        size = f" (up to {shown} per rank, less where the states are sharded)"
    return (f"async_checkpoint: each checkpoint's model and optimizer states are copied to pinned host memory{size} "
            "and written by a background thread while training goes on; a checkpoint counts for resume once every "
            "rank has finished writing it, and a save waits for the previous write")  # fmt: skip


def _check_relora(recipe: Recipe, strategy: str) -> str:
    """ReLoRA's restarts change whole weights and the optimizer's state in place: one process or DDP, and an
    optimizer whose state holds one plain number per parameter. Returns the plan's note."""
    if strategy not in ("single", "ddp"):
        what = "DeepSpeed" if strategy == "zero" else STRATEGY_TITLES[strategy]
        raise UserError(f"relora under {what} is not supported: a restart merges each LoRA into its whole base weight "
                        "and prunes the optimizer's state in place, which sharded or split weights don't allow "
                        "(Axolotl refuses DeepSpeed and FSDP too)",
                        "run ReLoRA in one process or with DDP")  # fmt: skip
    if recipe.optimizer == "adafactor" or recipe.optimizer.endswith(("8bit", "4bit")):
        kind = "factored" if recipe.optimizer == "adafactor" else "quantized"
        raise UserError(f"relora with optimizer: {recipe.optimizer} is not supported: a restart prunes the optimizer's "
                        f"state value by value, and this optimizer's state is {kind}",
                        "use adamw_torch (or another 32-bit optimizer)")  # fmt: skip
    method = recipe.relora_prune_method
    ratio = recipe.relora_pruned_fraction
    return (f"ReLoRA: every {recipe.jagged_restart_steps} steps the LoRA is merged into the base weights and "
            f"restarted, {ratio:.1%} of its optimizer state zeroed ({method}); the LR falls over "
            f"{recipe.jagged_restart_anneal_steps} steps before and warms up over {recipe.jagged_restart_warmup_steps} "
            f"after each restart; the saved adapter holds every cycle (rank lora_r x cycles)")  # fmt: skip


def _check_muon_offload(recipe: Recipe) -> None:
    """Muon's Newton-Schulz step gathers each whole matrix (DTensor.full_tensor) on the device its shard is on;
    with FSDP2 offload the shards and their gradients live on the CPU, which NCCL can't gather (gloo can: a CPU
    rehearsal would pass), so it is refused on every device."""
    if not recipe.resolved_fsdp()[1].offload_params:
        return
    key = "fsdp_config.offload_params" if recipe.fsdp_config and recipe.fsdp_config.offload_params else "fsdp: offload"
    raise UserError(f"optimizer: muon with {key} is not supported: its Newton-Schulz step needs each whole weight "
                    "matrix on the GPU, and FSDP2 offload keeps the shards and their gradients on the CPU, where NCCL "
                    "can't gather them", f"remove {key} (muon runs under FSDP2 without offload), or use optimizer: "
                    "adamw_torch")  # fmt: skip


def _generation(recipe: Recipe, cluster: Cluster, facts, data_parallel: int, precision: str):
    """GRPO's generation: the plan's lines on where it runs and what it takes, and colocated vLLM's share of each
    GPU where llmtune computes it (llmtune/plan/generation.py)."""
    from llmtune.plan import generation
    from llmtune.plan.memory.buffers import DEFAULT_GPU_BYTES
    from llmtune.plan.memory.peak import estimate
    from llmtune.recipe.online import generation_mode

    training = None
    if facts is not None:
        rows = estimate(recipe, facts, data_parallel, cluster.processes_per_machine)
        training = rows[0].total if rows else None  # DDP's row: colocated vLLM shares a GPU with a whole replica
    lines = generation.describe(recipe, "RECIPE", training, DEFAULT_GPU_BYTES, cluster.rehearsal, facts,
                                data_parallel, precision in ("bf16", "fp16"))  # fmt: skip
    share = None
    if generation_mode(recipe) == "colocate" and not cluster.rehearsal:
        share = generation.colocate_share(recipe, training or 0.0, DEFAULT_GPU_BYTES)
    return lines, share


def _torch_has_varlen() -> bool:
    """torch >= 2.10 has torch.nn.attention.varlen; read from the installed version, not imported (the plan stays
    torch-free)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(part) for part in version("torch").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (2, 10)


def _kernels(recipe: Recipe, cluster: Cluster, precision: str, strategy: str, mesh: dict | None) -> Kernels:
    """The fast path as the GPU run will take it (shown by `llmtune plan`); in rehearsal, notes that it is off."""
    # Looked up, not imported: the plan stays fast and torch-free. The worker imports it for real.
    flash = not cluster.rehearsal and importlib.util.find_spec("flash_attn") is not None
    kernels = resolve_kernels(recipe, cluster.device, precision, strategy, flash, _torch_has_varlen(), mesh)
    if kernels.liger_on and importlib.util.find_spec("liger_kernel") is None:
        kernels.notes.append(f"liger-kernel is not installed here; the GPU run needs it: {INSTALL_HINT}")
    return kernels


def _qat_notes(recipe: Recipe) -> list[str]:
    from llmtune.recipe.qat import INSTALL_HINT as QAT_HINT

    notes = [recipe.qat.describe() + "; the saved model keeps full-precision weights: quantize it afterwards to the "
             "same scheme (torchao) for deployment"]  # fmt: skip
    if recipe.qat.weight_dtype == "nvfp4":
        notes.append("qat nvfp4: rounded with torchao's NVFP4 quantizer and multiplied in high precision (emulated: "
                     "runs on any GPU and in rehearsal; torchao's own NVFP4 matmuls need Blackwell)")  # fmt: skip
    if liger_requested(recipe)["fused_linear_cross_entropy"]:
        notes.append("qat: the fused linear cross-entropy reads lm_head's weight directly, so lm_head trains without "
                     "fake quantization on GPUs")  # fmt: skip
    if importlib.util.find_spec("torchao") is None:
        notes.append(f"torchao is not installed here; the run needs it: {QAT_HINT}")
    return notes


def _check_elastic_sizes(recipe: Recipe, cluster: Cluster, strategy: str, global_batch: int) -> None:
    """min_machines: every machine count it allows must keep the global batch (by more accumulation)."""
    least = recipe.min_machines
    if least is None:
        return
    if recipe.rdzv_backend not in ELASTIC:
        raise UserError("min_machines needs rdzv_backend: c10d or etcd (torchrun's elastic rendezvous)")
    if least > cluster.num_machines:
        raise UserError(f"min_machines {least} is more than --num-machines {cluster.num_machines}")
    if least == cluster.num_machines:
        return
    if strategy != "ddp":
        raise UserError(f"min_machines {least} < --num-machines {cluster.num_machines} changes the world size, which "
                        f"{STRATEGY_TITLES[strategy]} checkpoints can't follow",
                        "use DDP (no deepspeed/fsdp/pipeline keys), or set min_machines to --num-machines")  # fmt: skip
    per_step = recipe.micro_batch_size * cluster.processes_per_machine
    bad = [m for m in range(least, cluster.num_machines + 1) if global_batch % (per_step * m)]
    if bad:
        raise UserError(f"with {', '.join(map(str, bad))} machine(s) the global batch {global_batch} can't be kept "
                        f"(it is not a multiple of micro_batch_size x processes = {per_step} per machine)",
                        "raise min_machines, or choose gradient_accumulation_steps so every machine count divides it")  # fmt: skip


def elastic_sizes(plan: dict, world: int) -> dict:
    """The plan's sizes for a world the elastic rendezvous formed (fewer machines: more accumulation)."""
    if world == plan["world_size"]:
        return {}
    per_machine = plan["world_size"] // plan["cluster"]["num_machines"]
    least = plan.get("min_machines")
    if not least or world % per_machine or not least * per_machine <= world <= plan["world_size"]:
        raise UserError(f"the launcher started {world} process(es) but the plan has world size {plan['world_size']}")
    return {"world_size": world, "data_parallel_size": world,
            "gradient_accumulation_steps": plan["global_batch_size"] // (plan["micro_batch_size"] * world)}  # fmt: skip


def _environment(cluster: Cluster, strategy: str) -> dict[str, str]:
    env = {"TOKENIZERS_PARALLELISM": "false"}
    if cluster.num_processes > 1 or strategy != "single":  # torchrun's own prefix, [default0]:, names no rank
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"
    if cluster.rehearsal:
        cores = os.cpu_count() or 1
        env["OMP_NUM_THREADS"] = str(max(1, cores // cluster.processes_per_machine))
        env["CUDA_VISIBLE_DEVICES"] = ""
        if strategy.startswith("zero"):
            env["DS_ACCELERATOR"] = "cpu"
    return env


def _command(strategy: str, config_dir: str, machine_rank: int, recipe: Recipe, cluster: Cluster) -> list[str]:
    plan_file = str(Path(config_dir) / "plan.json")
    restarts = ["--max_restarts", str(recipe.max_restarts)] if recipe.max_restarts else []
    if cluster.launcher == "deepspeed":
        return _deepspeed_command(plan_file, config_dir, machine_rank, cluster)
    if strategy == "single":
        if restarts:  # torchrun's elastic agent does the restarting, even for one process
            return ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", *restarts,
                    "-m", "llmtune.train", plan_file]  # fmt: skip
        return ["python", "-m", "llmtune.train", plan_file]
    if recipe.rdzv_backend == "etcd" or (
        recipe.rdzv_backend == "c10d" and recipe.min_machines and recipe.min_machines < cluster.num_machines
    ):
        return _torchrun_elastic_command(plan_file, config_dir, machine_rank, recipe, cluster)
    rendezvous = ["--rdzv_conf", f"timeout={recipe.rdzv_timeout}"] if cluster.num_machines > 1 else []
    if recipe.rdzv_backend == "c10d":
        # join_timeout: how long a round waits for every machine (also a restarted one to come back);
        # last_call: once enough have joined, how long late ones may still make this round
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_conf", _c10d_conf(recipe, machine_rank)]
    # every rank's output also goes to <config_dir>/logs/.../attempt_N/<local rank>/, lines prefixed [rankR]:
    logs = ["--tee", "3", "--log_dir", str(Path(config_dir) / "logs")]
    return [
        "accelerate", "launch", "--config_file", str(Path(config_dir) / "accelerate_config.yaml"),
        "--machine_rank", str(machine_rank), *restarts, *rendezvous, *logs, "-m", "llmtune.train", plan_file,
    ]  # fmt: skip


def _deepspeed_command(plan_file: str, config_dir: str, machine_rank: int, cluster: Cluster) -> list[str]:
    """DeepSpeed's launcher. Over ssh only machine 0 runs it (it starts the others with pdsh); with --no-ssh every
    machine runs it with its own --node_rank. Without a hostfile, llmtune writes one for this machine."""
    if cluster.ssh and machine_rank > 0:
        return []  # started by machine 0 over ssh
    hostfile = cluster.hostfile or str(Path(config_dir) / "hostfile")
    command = ["deepspeed", "--hostfile", hostfile, "--master_addr", cluster.main_process_ip,
               "--master_port", str(cluster.main_process_port)]  # fmt: skip
    if not cluster.ssh:
        command += ["--no_ssh", "--node_rank", str(machine_rank)]
    else:  # llmtune checks every host itself first and names the one that fails (DeepSpeed checks the first only,
        command += ["--no_ssh_check"]  # and even for a hostfile of one machine, which needs no ssh)
    return [*command, "--no_local_rank", "--module", "llmtune.train", plan_file]


ELASTIC = ("c10d", "etcd")  # torchrun's elastic rendezvous backends


def etcd_job_id(recipe: Recipe) -> str:
    """The rendezvous id every machine of this job derives alike (from the output folder it names); the launcher
    appends the launch's generation (llmtune/launch/etcd.py)."""
    import hashlib

    return "llmtune-" + hashlib.sha1(recipe.output_dir.encode()).hexdigest()[:12]


def _c10d_conf(recipe: Recipe, machine_rank: int) -> str:
    # join_timeout: how long a round waits for machines (also a restarted one to come back); last_call: once enough
    # have joined, how long late ones may still make this round. Machine 0 (whose address is the endpoint) hosts
    # the rendezvous store: said outright, because torch's guess compares host names, which fails on a secondary
    # interface.
    # read_timeout bounds reaching the store too (torch's default, 60 s, would outlast a short rdzv_timeout)
    return (f"join_timeout={recipe.rdzv_timeout},last_call_timeout=2,close_timeout=10,"
            f"read_timeout={recipe.rdzv_timeout},is_host={int(machine_rank == 0)}")  # fmt: skip


def _torchrun_elastic_command(plan_file: str, config_dir: str, machine_rank: int, recipe: Recipe,
                              cluster: Cluster) -> list[str]:  # fmt: skip
    """torchrun itself, for a world that may shrink or grow: accelerate launch fixes --nnodes to one number. With
    etcd the rendezvous lives in the etcd server; its run id gets the launch's generation at launch (an etcd
    rendezvous, once closed by a finished or failed job, takes no one again)."""
    least = recipe.min_machines or cluster.num_machines
    if recipe.rdzv_backend == "etcd":
        conf = (f"join_timeout={recipe.rdzv_timeout},last_call_timeout=2,close_timeout=10,"
                f"read_timeout={recipe.rdzv_timeout}")  # fmt: skip
        rendezvous = ["--rdzv_backend", "etcd-v2", "--rdzv_endpoint", recipe.rdzv_endpoint,
                      "--rdzv_id", etcd_job_id(recipe), "--rdzv_conf", conf]  # fmt: skip
    else:
        rendezvous = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{cluster.main_process_ip}:{cluster.main_process_port}",
                      "--rdzv_conf", _c10d_conf(recipe, machine_rank)]  # fmt: skip
    return [
        "python", "-m", "torch.distributed.run", "--nnodes", f"{least}:{cluster.num_machines}",
        "--nproc_per_node", str(cluster.processes_per_machine), *rendezvous, "--max_restarts", str(recipe.max_restarts),
        "--tee", "3", "--log_dir", str(Path(config_dir) / "logs"), "-m", "llmtune.train", plan_file,
    ]  # fmt: skip
