"""Recipe + Cluster -> Plan: the strategy, its sizes, the generated configs and the commands.

Pure: reads at most a local config.json or DeepSpeed JSON, imports no torch.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.plan.accelerate_config import build_accelerate_config, fsdp_section
from llmtune.plan.checks import (
    STRATEGY_TITLES,
    _check_async_checkpoint,
    _check_elastic_sizes,
    _check_muon_offload,
    _check_relora,
    _qat_notes,
    check_chat_templates,
    check_expert_dropout,
    check_kto_batch,
    check_unfrozen_patterns,
    check_wrap_class,
    eval_notes,
    fsdp2_notes,
    gptq_check,
    system_message_notes,
    warmup_notes,
)
from llmtune.plan.cluster import Cluster
from llmtune.plan.commands import ELASTIC, _command, _environment
from llmtune.plan.deepspeed import build_deepspeed_config, optimizer_offloaded
from llmtune.plan.memory.facts import read_model_facts
from llmtune.plan.mesh import plan_mesh
from llmtune.plan.padding_free import planned_batches
from llmtune.plan.pipeline import PipelinePlan, pipeline_plan
from llmtune.plan.relayout import check_layout
from llmtune.plan.resume import length_line, resumed_accumulation
from llmtune.plan.resume_checks import check_resume, check_weights_only
from llmtune.plan.vocabulary import check_adapter_vocabulary, check_new_tokens
from llmtune.recipe import Recipe
from llmtune.recipe.kernels import INSTALL_HINT, Kernels, fused_optimizer, resolve_kernels
from llmtune.recipe.loader import PER_MACHINE_KEYS, recipe_fingerprint
from llmtune.recipe.preference import ONLINE_METHODS


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
    recipe_digest: str = ""  # the resolved recipe's hash: every machine of a launch must run the same one

    @property
    def title(self) -> str:
        title = STRATEGY_TITLES[self.strategy] + (
            f" + {self.offload.upper()} offload" if self.offload != "none" else ""
        )
        cp = (self.mesh or {}).get("context_parallel", 1)
        return title + (f" + context parallel ({cp}-way{', Ulysses' if self.strategy.startswith('zero') else ''})"
                        if cp > 1 else "")  # fmt: skip

    @property
    def zero_stage(self) -> int:
        return int(self.strategy[-1]) if self.strategy.startswith("zero") else 0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data["cluster"] = self.cluster.to_dict()
        data["title"] = self.title
        return data


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
    """bf16: auto (Axolotl's default, and llmtune's) is bf16 on Ampere and newer GPUs and fp16 before them, as Axolotl
    resolves it; fp16 asked for wins over it. Planned away from the GPUs (no nvidia-smi here), auto is bf16."""
    auto = recipe.bf16 == "auto" and not recipe.fp16
    if cluster.rehearsal:
        if recipe.precision != "no" and not auto:
            notes.append(f"CPU rehearsal: {recipe.precision} mixed precision becomes fp32 (the GPU run keeps "
                         f"{recipe.precision})")  # fmt: skip
        return "no"
    if not auto:
        return recipe.precision
    from llmtune.plan.memory.fit import gpu_compute_capability_of_this_machine

    capability = gpu_compute_capability_of_this_machine()
    said = "bf16: auto" if "bf16" in recipe.model_fields_set else "bf16: auto (the default, as in Axolotl)"
    if capability is not None and capability < 8.0:
        notes.append(f"precision fp16: {said} on GPUs of compute capability {capability:g}, which have no bf16 "
                     "(Ampere, 8.0, is the first); set bf16: false for fp32")  # fmt: skip
        return "fp16"
    if "bf16" not in recipe.model_fields_set:
        notes.append(f"precision bf16: {said}; a GPU before Ampere gets fp16, and bf16: false gives fp32")
    return "bf16"


def _resumed_batch(recipe, resume: bool, world: int, data_parallel: int) -> int | None:
    """The gradient accumulation a resume on another world size will keep the checkpoint's global batch with, for
    a DeepSpeed file that pins train_batch_size to it (checked before the resume's own arithmetic, which says more)."""
    from llmtune.plan.resume import resume_checkpoint, saved_allocation

    checkpoint = resume_checkpoint(recipe) if resume else None
    saved = saved_allocation(recipe, checkpoint) if checkpoint else None
    per_step = recipe.micro_batch_size * data_parallel
    if saved is None or saved.world_size == world or not saved.global_batch_size or saved.global_batch_size % per_step:
        return None
    return saved.global_batch_size // per_step


def make_plan(recipe: Recipe, cluster: Cluster, config_dir: str | None = None, resume: bool = False) -> Plan:
    """Resolve the recipe for this cluster. Raises UserError for sizes or combinations that can't work.

    `resume`: the plan of `llmtune train` (and of `llmtune plan`, which shows it): what resuming output_dir's
    checkpoint takes from the recipe as it is now is checked (length, micro-batch, files, data, adapter). validate,
    rehearse, doctor and the wizard plan the recipe alone."""
    config_dir = str(Path(config_dir or Path(recipe.output_dir) / "llmtune").resolve())
    notes: list[str] = []
    world = cluster.num_processes
    facts = read_model_facts(recipe.base_model_config or recipe.base_model)
    notes += cluster.notes()
    precision = _precision(recipe, cluster, notes)
    strategy = choose_strategy(recipe, world)
    pipeline = pipeline_plan(recipe, world, facts) if strategy == "pipeline" else None
    if pipeline and not recipe.pipeline_microbatches and pipeline.microbatches != recipe.gradient_accumulation_steps:
        notes.append(f"pipeline: {pipeline.microbatches} micro-batches per step, not gradient_accumulation_steps "
                     f"{recipe.gradient_accumulation_steps}: a pipeline of {pipeline.stages} stages needs at least as many (set pipeline_microbatches to choose)")  # fmt: skip
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
    notes += eval_notes(recipe, facts) + system_message_notes(recipe) + warmup_notes(recipe)
    if pipeline and (recipe.precision == "fp16" or precision == "fp16"):  # (bf16: auto on a GPU without bf16 too)
        # refused in rehearsal too: the GPU run would refuse it
        raise UserError("pipeline runs take bf16 or fp32: fp16 needs loss scaling, which the pipeline loop does not do",
                        "set bf16: true on a GPU with bf16, or bf16: false (fp32)")  # fmt: skip
    if pipeline and world > 1 and (cluster.device, cluster.backend) == ("cuda", "gloo"):
        # measured on an H100 (torch 2.11): gloo's send/recv of CUDA tensors fails with "Bad address"
        raise UserError("pipeline stages pass activations with send/recv, which gloo cannot do on CUDA tensors",
                        "run pipeline stages on separate GPUs (NCCL), or rehearse them with --device cpu")  # fmt: skip
    mesh, shared_output = plan_mesh(recipe, strategy, world, cluster, facts, notes)
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
        deepspeed_config, ds_notes = build_deepspeed_config(recipe, data_parallel, precision, facts, cluster.rehearsal,
                                                            _resumed_batch(recipe, resume, world, data_parallel))  # fmt: skip
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
            said = ("fsdp_version: 1" if recipe.fsdp_version or settings.version else
                    "FSDP1 (the fsdp: word list without fsdp_version runs FSDP1, as in Axolotl)")  # fmt: skip
            raise UserError(f"{said} can't be rehearsed on CPU (its state dict can't be saved there)",
                            "rehearse with fsdp_version: 2 (FSDP1 is deprecated in transformers); `llmtune plan` or "
                            "`validate` with --device cuda checks the FSDP1 plan for GPU machines without running it")  # fmt: skip
        if recipe.model_recomputes_for_fsdp:
            settings = settings.model_copy(update={"activation_checkpointing": False})
            notes.append("fsdp_config.activation_checkpointing with an adapter: the model's own activation "
                         "checkpointing instead (the same recomputation per decoder layer): under FSDP's checkpoint "
                         "wrapper PEFT finds none of the adapter's weights, and the adapter would be saved empty")  # fmt: skip
        check_wrap_class(settings.transformer_layer_cls_to_wrap, facts)
        if version == 2:
            notes += fsdp2_notes(recipe, settings)
        fsdp = fsdp_section(version, settings)
        offload = "cpu" if settings.offload_params else "none"
        if world == 1:
            notes.append("FSDP with one process shards nothing; it runs, but DDP/single would be faster")
        if settings.activation_checkpointing and recipe.gradient_checkpointing:
            notes.append("gradient_checkpointing and fsdp_config.activation_checkpointing are both on: FSDP's "
                         "recomputes each wrapped layer (transformers refuses the two together)")  # fmt: skip
    check_chat_templates(recipe)
    check_new_tokens(recipe)
    check_adapter_vocabulary(recipe)
    check_expert_dropout(recipe, facts)
    check_unfrozen_patterns(recipe)
    check_kto_batch(recipe)
    for key in ("early_stopping_patience", "load_best_model_at_end", "eval_steps", "evals_per_epoch", "eval_strategy"):
        if getattr(recipe, key) not in (None, False, "no") and not (recipe.val_set_size or recipe.test_datasets):
            notes.append(f"{key}: no effect: the recipe has no eval data (set val_set_size or test_datasets)")
    if recipe.gptq:
        notes.append(gptq_check(recipe, strategy))
    if recipe.activation_offloading:
        notes.append("activation offloading: not on the CPU rehearsal (activations are in host memory already)"
                     if cluster.rehearsal else "activation offloading: each checkpointed layer's input is held in "
                     "pinned CPU memory (transformers' checkpoint offload); slower steps, less GPU memory")  # fmt: skip
    kernels = _kernels(recipe, cluster, precision, strategy, mesh)
    deepspeed_steps = bool(deepspeed_config) and (
        "optimizer" in deepspeed_config or optimizer_offloaded(deepspeed_config)
    )
    kernels.optimizer = fused_optimizer(recipe, cluster.device, strategy, deepspeed_steps)
    if recipe.rl in ONLINE_METHODS:
        kernels.generation, kernels.vllm_share = _generation(recipe, cluster, facts, data_parallel, precision)
    if kernels.optimizer:
        kernels.notes.append(f"optimizer: {kernels.optimizer} for the recipe's {recipe.optimizer} (the same AdamW, "
                             "fused into one kernel per step on CUDA)")  # fmt: skip
    elif deepspeed_steps and "optimizer" not in deepspeed_config and recipe.optimizer != "adamw_torch":
        kernels.optimizer = "adamw_torch"  # the Trainer's AdamW, which accelerate hands to DeepSpeed's CPU Adam
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
                            "set rdzv_endpoint in the recipe, e.g. 10.0.0.5:2379")  # fmt: skip
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
    weights_only = strategy == "tp" and recipe.save_only_model  # snapshots a run never resumes
    resume = resume and not weights_only
    relayout = check_layout(recipe, strategy, STRATEGY_TITLES, deepspeed_config, fsdp) if resume else None
    if relayout:  # another ZeRO layout: the engine loads the checkpoint's universal conversion (the worker converts)
        notes.append(relayout)
        deepspeed_config["checkpoint"] = {**deepspeed_config.get("checkpoint", {}), "load_universal": True}
    # (validate, rehearse and the wizard plan the recipe alone: output_dir's checkpoint is train's and plan's)
    resumed = resumed_accumulation(recipe, strategy, world, data_parallel, mesh, STRATEGY_TITLES, offload) \
        if resume else None  # fmt: skip
    if resumed:  # the checkpoint it resumes was saved on another world size: keep its global batch
        accumulation = resumed.accumulation
        global_batch = recipe.micro_batch_size * accumulation * data_parallel
        notes.append(resumed.line)
        if deepspeed_config:
            deepspeed_config.update(gradient_accumulation_steps=accumulation, train_batch_size=global_batch)
            if resumed.universal:  # the engine reads <checkpoint>/latest_universal (the worker converts first)
                deepspeed_config["checkpoint"] = {**deepspeed_config.get("checkpoint", {}), "load_universal": True}
    if resume:
        notes.extend(
            note
            for note in (
                length_line(recipe),
                *check_resume(recipe),
                check_weights_only(recipe, strategy, STRATEGY_TITLES[strategy]),
            )
            if note
        )
    _check_elastic_sizes(recipe, cluster, strategy, global_batch)
    if recipe.lisa_n_layers:
        if world > 1:
            raise UserError(f"lisa_n_layers changes which parameters train as it goes, which {world} ranks' gradient "
                            "sync (DDP, FSDP, DeepSpeed) can't follow; LISA runs in one process",
                            "use --num-processes 1 (LISA is for fitting a full fine-tune on one GPU)")  # fmt: skip
        notes.append(f"LISA: {recipe.lisa_n_layers} of the layers at {recipe.lisa_layers_attribute}, drawn again every "
                     f"{recipe.lisa_step_interval} steps (seeded), train at a time; embeddings, norms and head always")  # fmt: skip
    if recipe.lr_quadratic_warmup:  # with lr_scheduler: cosine only (the recipe refuses it elsewhere)
        notes.append("lr_quadratic_warmup: the warm-up rises as (step / warmup)^2, then cosine decay to 0")
    if recipe.use_eaft:
        notes.append(f"EAFT loss: each trained token's cross-entropy weighted by the entropy of its top-{recipe.eaft_k} "
                     f"next-token probabilities (power {recipe.eaft_alpha})")  # fmt: skip
    env = _environment(cluster, strategy, precision)
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
        kernels.to_dict(), mesh, shared_output, recipe_fingerprint(recipe, PER_MACHINE_KEYS),
    )  # fmt: skip


def _generation(recipe: Recipe, cluster: Cluster, facts, data_parallel: int, precision: str):
    """GRPO's generation: the plan's lines on where it runs and what it takes, and colocated vLLM's share of each
    GPU where llmtune computes it (llmtune/plan/generation.py)."""
    from llmtune.plan import generation
    from llmtune.plan.memory.buffers import DEFAULT_GPU_BYTES
    from llmtune.plan.memory.peak import estimate
    from llmtune.recipe.online import generation_mode

    generation.check_batches(recipe, data_parallel)
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
    kernels = resolve_kernels(recipe, cluster.device, precision, strategy, flash, _torch_has_varlen(), mesh,
                              refine_batches=lambda batches: planned_batches(recipe, batches))  # fmt: skip
    if kernels.liger_on and importlib.util.find_spec("liger_kernel") is None:
        kernels.notes.append(f"liger-kernel is not installed here; the GPU run needs it: {INSTALL_HINT}")
    return kernels
