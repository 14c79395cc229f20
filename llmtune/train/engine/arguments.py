"""TrainingArguments from the recipe and the plan: every recipe key is mapped here, none ignored."""

from __future__ import annotations

import math
import os
from pathlib import Path


def fsdp_checkpointing(plan: dict) -> bool:
    """FSDP's own activation checkpointing is on (the plan's resolved FSDP section): it recomputes per wrapped layer,
    so gradient_checkpointing (the model's own, which transformers refuses beside it) is left to FSDP; both keys ask
    for the same recomputation."""
    section = (plan.get("accelerate_config") or {}).get("fsdp_config") or {}
    return plan["strategy"].startswith("fsdp") and bool(section.get("fsdp_activation_checkpointing"))


def model_checkpointing(recipe, plan: dict) -> bool:
    """The model's own activation checkpointing is on: gradient_checkpointing, unless FSDP's replaces it, or
    fsdp_config.activation_checkpointing with an adapter, which the plan gives to the model (planner's note)."""
    if fsdp_checkpointing(plan):
        return False
    return bool(recipe.gradient_checkpointing) or (
        plan["strategy"].startswith("fsdp") and recipe.model_recomputes_for_fsdp
    )


def steps_per_epoch(train_rows: int, plan: dict, drop_last: bool = False) -> int:
    """Optimizer steps per epoch, as the Trainer counts them: each rank's micro-batches (the last round of them
    wrapped around to fill every rank, or dropped with dataloader_drop_last), in steps of the accumulation."""
    rounds = plan["micro_batch_size"] * plan["data_parallel_size"]
    micro = train_rows // rounds if drop_last else math.ceil(train_rows / rounds)
    return max(1, math.ceil(micro / plan["gradient_accumulation_steps"]))


def _check_drop_last(recipe, plan: dict, train_rows: int) -> None:
    """dataloader_drop_last with fewer training rows than one round of micro-batches: nothing would train (the
    Trainer stops on a loader without length)."""
    from llmtune.errors import UserError

    rounds = plan["micro_batch_size"] * plan["data_parallel_size"]
    if recipe.dataloader_drop_last and train_rows < rounds:
        raise UserError(f"dataloader_drop_last drops every training row: {train_rows} don't fill one round of "
                        f"micro_batch_size {plan['micro_batch_size']} x {plan['data_parallel_size']} data-parallel "
                        "rank(s)", "remove dataloader_drop_last, or lower micro_batch_size")  # fmt: skip


def _every(steps: float | None, per_epoch: int | None, epoch_steps: int,
           max_steps: int | None = None) -> tuple[str, float | None]:  # fmt: skip
    """(strategy, steps) for Axolotl's save_steps/saves_per_epoch style pairs. Per epoch, or per run where max_steps
    ends it within the first epoch (Axolotl's fraction of the total steps: `max_steps: 6` with `saves_per_epoch: 2`
    saves at 3 and 6, not only at the end)."""
    if steps is not None:
        return "steps", steps
    if per_epoch:
        return "steps", max(1, min(epoch_steps, max_steps or epoch_steps) // per_epoch)
    return "epoch", None


# Optimizers whose implementation lives in another package than transformers: package, pip name.
OPTIMIZER_PACKAGES = {"adamw_torch_4bit": ("torchao", "torchao"), "adamw_torch_8bit": ("torchao", "torchao")}


def optim_args_text(value) -> str | None:
    """optim_args as TrainingArguments takes it: 'key=value,...' (a mapping's values written as YAML wrote them)."""
    if not value:
        return None
    if isinstance(value, dict):
        return ",".join(f"{key}={str(item).lower() if isinstance(item, bool) else item}" for key, item in value.items())
    return str(value)


def _check_optimizer_package(optimizer: str) -> None:
    """One line instead of the Trainer's ImportError at the first step."""
    import importlib.util

    from llmtune.errors import UserError

    package = OPTIMIZER_PACKAGES.get(optimizer)
    if package and importlib.util.find_spec(package[0]) is None:
        raise UserError(f"optimizer: {optimizer} needs {package[0]}, which is not installed",
                        f"pip install {package[1]}, or use adamw_torch / adamw_bnb_8bit")  # fmt: skip


def _check_bf16_device(precision: str, rehearsal: bool) -> None:
    """One line where this GPU has no bf16 (before Ampere), instead of the Trainer's error at the first step."""
    import torch

    if precision == "bf16" and not rehearsal and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        from llmtune.errors import UserError

        raise UserError(f"bf16 needs an Ampere or newer GPU; this one is a {torch.cuda.get_device_name()}",
                        "set bf16: false and fp16: true (or fp32: neither), and plan again")  # fmt: skip


def _sampling(recipe) -> str:
    """curriculum_sampling trains on rows in data order (Axolotl's sequential sampler)."""
    if recipe.curriculum_sampling:
        return "sequential"
    return "group_by_length" if recipe.group_by_length else "random"


def _checkpointing_arguments(on: bool, options: dict, offload: bool = False) -> dict:
    """Activation checkpointing under the name the installed transformers takes today: `activation_checkpointing` in
    recent releases (5.24 here), where the older `gradient_checkpointing` names still work but raise a FutureWarning
    each; older releases know only those.

    `offload` (activation_offloading): transformers holds what each checkpointed layer keeps for its recompute, the
    layer's input, in pinned CPU memory (torch's save_on_cpu around each checkpoint), from its `offload` option."""
    import inspect
    from dataclasses import fields

    from transformers import PreTrainedModel, TrainingArguments

    from llmtune.errors import UserError

    name = "activation" if "activation_checkpointing" in {f.name for f in fields(TrainingArguments)} else "gradient"
    if on and offload:
        enable = getattr(PreTrainedModel, f"{name}_checkpointing_enable")
        if "offload" not in inspect.signature(enable).parameters:
            import transformers

            raise UserError(f"activation_offloading needs transformers' checkpoint offload, which transformers "
                            f"{transformers.__version__} lacks", "pip install -U transformers, or remove "
                            "activation_offloading (and any offload value of gradient_checkpointing)")  # fmt: skip
        options = {**options, "offload": True}
    return {f"{name}_checkpointing": on, f"{name}_checkpointing_kwargs": options}


def training_arguments(recipe, plan: dict, train_rows: int, has_eval: bool, config_class=None, **extra):
    """TrainingArguments (or `config_class`, a TRL config that extends them, with its own fields in `extra`)."""
    from transformers import TrainingArguments

    from llmtune.train.checkpoint.manifest import own_disk

    _check_optimizer_package(recipe.optimizer)
    _check_drop_last(recipe, plan, train_rows)
    epoch_steps = steps_per_epoch(train_rows, plan, recipe.dataloader_drop_last)
    precision = plan["precision"]
    rehearsal = plan["cluster"]["device"] == "cpu"
    _check_bf16_device(precision, rehearsal)
    kernels = plan.get("kernels") or {}
    save_strategy, save_steps = _every(recipe.save_steps, recipe.saves_per_epoch, epoch_steps, recipe.max_steps)
    save_strategy = recipe.save_strategy or save_strategy
    eval_strategy, eval_steps = _every(recipe.eval_steps, recipe.evals_per_epoch, epoch_steps, recipe.max_steps)
    eval_strategy = (recipe.eval_strategy or eval_strategy) if has_eval else "no"
    from llmtune.recipe.training import named_schedule

    scheduler, scheduler_kwargs = named_schedule(recipe)  # (quadratic warm-up: the trainer builds its own)
    from llmtune.train.objectives.schedule import run_steps, warmup_steps

    warmup = warmup_steps(recipe, run_steps(recipe, epoch_steps))  # Axolotl's rule, its 3% default included
    kwargs = dict(
        output_dir=recipe.output_dir,
        per_device_train_batch_size=recipe.micro_batch_size,
        per_device_eval_batch_size=recipe.eval_batch_size or recipe.micro_batch_size,
        gradient_accumulation_steps=plan["gradient_accumulation_steps"],
        num_train_epochs=recipe.num_epochs,
        max_steps=recipe.max_steps or -1,
        # muon: the trainer builds it; adamw_torch on CUDA: the fused twin where the plan chose it
        optim="adamw_torch" if recipe.optimizer == "muon" else (kernels.get("optimizer") or recipe.optimizer),
        optim_args=optim_args_text(recipe.optim_args),
        learning_rate=recipe.learning_rate,
        lr_scheduler_type=scheduler,
        lr_scheduler_kwargs=scheduler_kwargs,
        warmup_steps=warmup,
        weight_decay=recipe.weight_decay,
        adam_beta1=recipe.adam_beta1,
        adam_beta2=recipe.adam_beta2,
        adam_epsilon=recipe.adam_epsilon,
        max_grad_norm=recipe.max_grad_norm,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        tf32=recipe.tf32 and not rehearsal or None,
        **_checkpointing_arguments(
            model_checkpointing(recipe, plan),
            recipe.gradient_checkpointing_kwargs or {"use_reentrant": False},
            # a CPU rehearsal's activations are in host memory already (and pinning needs an accelerator)
            bool(recipe.activation_offloading) and not rehearsal,
        ),
        seed=recipe.seed,
        data_seed=recipe.seed if recipe.data_seed is None else recipe.data_seed,
        logging_steps=recipe.logging_steps,
        logging_first_step=True,
        save_strategy=save_strategy,
        save_steps=save_steps or 500,
        save_total_limit=recipe.save_total_limit,
        # a machine whose output_dir machine 0 can't see (the launcher found out at check-in, train/manifest.py):
        # its first rank writes the files rank 0 alone writes on shared storage (ZeRO: use_node_local_storage)
        save_on_each_node=own_disk(),
        # tensor parallel: the Trainer refuses to checkpoint the optimizer; llmtune's trainer saves it itself
        save_only_model=recipe.save_only_model or plan["strategy"] == "tp",
        eval_strategy=eval_strategy,
        eval_steps=eval_steps,
        train_sampling_strategy=_sampling(recipe),
        neftune_noise_alpha=recipe.neftune_noise_alpha,
        **(kernels.get("loader") or {"dataloader_num_workers": 0, "dataloader_pin_memory": False}),
        # pinned batches are copied to the GPU without blocking the host (accelerate's non_blocking)
        accelerator_config={"non_blocking": bool((kernels.get("loader") or {}).get("dataloader_pin_memory"))},
        report_to=recipe.trackers or "none",
        run_name=recipe.wandb_name,
        ddp_timeout=recipe.ddp_timeout,
        ddp_find_unused_parameters=recipe.ddp_find_unused_parameters,
        ddp_bucket_cap_mb=recipe.ddp_bucket_cap_mb,
        remove_unused_columns=False,
        dataloader_drop_last=recipe.dataloader_drop_last,  # training's batches only (LlmtuneTrainer's eval loader)
        use_cpu=rehearsal and not plan["strategy"].startswith("zero"),
        disable_tqdm=True,  # llmtune's own progress line replaces the Trainer's bar and its dict lines
    )
    if (recipe.early_stopping_patience or recipe.load_best_model_at_end) and has_eval:
        metric = recipe.metric_for_best_model or "eval_loss"
        kwargs.update(load_best_model_at_end=True, metric_for_best_model=metric,
                      greater_is_better=recipe.greater_is_better)  # fmt: skip
        if kwargs["save_strategy"] != kwargs["eval_strategy"] or kwargs["save_steps"] != (eval_steps or 500):
            kwargs.update(save_strategy=eval_strategy, save_steps=eval_steps or 500)
    kwargs["accelerator_config"] = {**kwargs["accelerator_config"], **extra.pop("accelerator_config", {})}
    kwargs.update(extra)
    return (config_class or TrainingArguments)(**kwargs)


def tracking_env(recipe, output_dir: Path) -> None:
    """Tracker settings go through the environment variables each integration reads (never secrets)."""
    values = {
        "WANDB_PROJECT": recipe.wandb_project, "WANDB_ENTITY": recipe.wandb_entity, "WANDB_MODE": recipe.wandb_mode,
        "WANDB_RUN_ID": recipe.wandb_run_id, "WANDB_WATCH": recipe.wandb_watch, "WANDB_LOG_MODEL": recipe.wandb_log_model,
        "MLFLOW_EXPERIMENT_NAME": recipe.mlflow_experiment_name,
        "MLFLOW_TRACKING_URI": recipe.mlflow_tracking_uri or (f"file:{output_dir / 'mlruns'}" if "mlflow" in recipe.trackers else None),
        # MLflow 3 refuses file stores unless told: the default here is a local file store in the output folder
        "MLFLOW_ALLOW_FILE_STORE": "true" if "mlflow" in recipe.trackers and not recipe.mlflow_tracking_uri else None,
        # wandb writes its run folder (offline: the whole run) under WANDB_DIR, else the current directory
        "WANDB_DIR": str(output_dir) if "wandb" in recipe.trackers else None,
    }  # fmt: skip
    for key, value in values.items():
        if value is not None:
            os.environ.setdefault(key, str(value))
