"""Recipe keys about the optimisation loop, checkpoints, precision and tracking."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none
from llmtune.recipe.choices import OTHER_OPTIMIZERS, OTHER_SCHEDULERS, check_choice

# transformers' OptimizerNames that llmtune supports (a unit test checks they exist there).
OPTIMIZERS = (
    "adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit",
    "paged_adamw_32bit", "adafactor", "sgd", "adagrad", "rmsprop", "lion_8bit", "lion_32bit",
    "paged_lion_8bit", "paged_lion_32bit", "adamw_torch_4bit", "adamw_torch_8bit", "ademamix", "ademamix_8bit",
    "paged_ademamix_32bit", "paged_ademamix_8bit",
)  # fmt: skip
# Optimizers llmtune builds itself (train/objectives/muon.py).
OWN_OPTIMIZERS = ("muon",)
# Optimizers Axolotl implements itself (its CustomSupportedOptimizers): named, so the error says what's missing.
AXOLOTL_OPTIMIZERS = (
    "optimi_adamw", "ao_adamw_4bit", "ao_adamw_8bit", "ao_adamw_fp8", "adopt_adamw", "came_pytorch",
    "dion", "flash_adamw", "flash_adam", "flash_sgd", "flash_sgdw", "flash_lion", "q_galore_adamw8bit",
)  # fmt: skip
LR_SCHEDULERS = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
    "inverse_sqrt", "cosine_with_min_lr", "warmup_stable_decay",
)  # fmt: skip
REPORT_TARGETS = ("none", "tensorboard", "wandb", "mlflow")
# gradient_checkpointing values of Axolotl's releases that ask for checkpoints offloaded to CPU ("unsloth": v0.5-v0.7;
# "offload", "offload_disk": since; today's Axolotl reads them as checkpointing + activation_offloading, as llmtune does)
OFFLOADED_CHECKPOINTING = ("unsloth", "offload", "offload_disk")


# `llmtune train --profile`: steps traced, and the step after which tracing starts (the warm-up is not the run)
PROFILE_STEPS = 5
PROFILE_START = 2


class LrGroup(Section):
    """One of lr_groups: trainable parameters whose names contain one of `modules` learn at `lr`."""

    name: str = Field(description="The group's name (in the run's log).")
    modules: list[str] = Field(min_length=1, description="Substrings of parameter names, e.g. self_attn.o_proj.weight.")
    lr: float = Field(gt=0, description="The group's peak learning rate (the schedule scales it as learning_rate).")


class TrainingKeys(Section):
    output_dir: str = Field("./outputs", description="Where checkpoints, the final model and reports go.")
    micro_batch_size: int = Field(1, gt=0, description="Rows per device per forward pass.")
    eval_batch_size: int | None = Field(None, gt=0, description="Rows per device in evaluation (default: micro).")
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    batch_size: int | None = Field(
        None, gt=0, description="Axolotl's older key, rows per GPU per optimizer step: read as "
        "gradient_accumulation_steps = batch_size // micro_batch_size (as Axolotl derives it; the resolved recipe "
        "keeps that alone); both set are refused, as Axolotl refuses them.",
    )  # fmt: skip
    num_epochs: float = Field(1.0, gt=0, description="Passes over the training data.")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps (wins over epochs).")
    optimizer: Literal[OPTIMIZERS + OWN_OPTIMIZERS] = Field(
        "adamw_torch",
        description="Optimizer (transformers' names; muon: Muon for weight matrices, AdamW for the rest).",
    )  # type: ignore[valid-type]
    optim_args: str | dict[str, str | int | float | bool] | None = Field(
        None, description="The optimizer's own arguments as transformers reads them ('key=value,...' or a mapping): "
        "taken by the optimizers that read any (GaLore, APOLLO, AdEMAMix, AnyPrecision AdamW, ...), ignored by the rest, "
        "as under Axolotl.",
    )  # fmt: skip
    lr_scheduler: Literal[LR_SCHEDULERS] = Field("cosine", description="Learning-rate schedule.")  # type: ignore[valid-type]
    lr_scheduler_kwargs: dict | None = Field(None, description="Extra arguments of transformers' schedule (refused "
                                             "with lr_quadratic_warmup or a cosine floor, which Axolotl ignores).")  # fmt: skip
    cosine_min_lr_ratio: float | None = Field(None, ge=0, le=1, description="cosine (or cosine_with_min_lr): floor "
                                              "the LR at this fraction of the peak; the floor of jagged restarts too "
                                              "(refused elsewhere, and beside lr_quadratic_warmup, as Axolotl ignores it).")  # fmt: skip
    cosine_constant_lr_ratio: float | None = Field(None, ge=0, le=1, description="cosine with cosine_min_lr_ratio: "
        "the decay reaches the floor at this fraction of the steps and the LR stays there (Axolotl's warm-up/decay/"
        "constant schedule; 0 has no effect, as there; refused without that floor or schedule).")  # fmt: skip
    lr_quadratic_warmup: bool = Field(False, description="cosine: warm up as (step / warmup)^2, not linearly, then "
                                      "decay to 0 (Axolotl's; refused with other schedules or a floor).")  # fmt: skip
    learning_rate: float = Field(2e-5, gt=0, description="Peak learning rate.")
    embedding_lr: float | None = Field(
        None, gt=0, description="The trainable input and output embeddings' peak learning rate (their weight decay "
        "is 0, as under Axolotl).",
    )  # fmt: skip
    embedding_lr_scale: float | None = Field(
        None, gt=0, description="The embeddings' learning rate as learning_rate times this (instead of embedding_lr)."
    )
    lr_groups: list[LrGroup] | None = Field(
        None, description="Learning rates by parameter name: [{name, modules: [name substrings], lr}]; the first "
        "group listed whose module a parameter's name contains sets its rate (every parameter of the group, biases "
        "and norms too); a group that matches no trainable parameter is refused when the optimizer is built.",
    )  # fmt: skip
    warmup_steps: int | None = Field(None, ge=0, description="Linear warm-up steps (a fraction below 1 is read as "
        "warmup_ratio, as transformers does; 1 becomes 2, as in Axolotl). With neither this nor warmup_ratio: "
        "Axolotl's default, 3% of the run's steps, at most 100 (0 for none).")  # fmt: skip
    warmup_ratio: float | None = Field(None, ge=0, lt=1, description="Warm-up as a fraction of the run's steps "
                                       "(num_epochs' steps, capped by max_steps), rounded down, as in Axolotl.")  # fmt: skip
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    adam_beta1: float = Field(0.9, gt=0, lt=1, description="Adam beta1.")
    adam_beta2: float = Field(0.999, gt=0, lt=1, description="Adam beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="Adam epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm (0: no clipping).")
    bf16: bool | Literal["auto"] = Field(
        "auto",
        description="bfloat16 mixed precision. 'auto' (Axolotl's default since v0.5.0): bf16 on Ampere and newer GPUs, "
        "fp16 before them, fp32 in the CPU rehearsal; false: fp32 unless fp16.",
    )
    fp16: bool = Field(False, description="float16 mixed precision with loss scaling.")
    tf32: bool = Field(False, description="Allow TF32 matmuls on Ampere+ GPUs.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward to save memory ('offload': with activation_offloading)."
    )
    gradient_checkpointing_kwargs: dict | None = Field(None, description="e.g. {use_reentrant: false}.")
    activation_offloading: bool | Literal["legacy", "disk", "hidden_states"] = Field(
        False,
        description="With gradient_checkpointing, hold each checkpointed layer's input in CPU memory (transformers' "
        "checkpoint offload); every Axolotl value reads so ('disk': CPU memory too).",
    )
    seed: int = Field(42, ge=0, description="Seed for weights of new layers, data order and dropout.")
    data_seed: int | None = Field(None, ge=0, description="Seed of the data order alone (default: seed).")
    logging_steps: float = Field(1, gt=0, description="Log every N steps (or a fraction of all steps, below 1).")
    save_strategy: Literal["steps", "epoch", "no"] | None = Field(None, description="When to checkpoint.")
    save_steps: float | None = Field(None, gt=0, description="Checkpoint every N steps (or a fraction of all steps).")
    saves_per_epoch: int | None = Field(
        None,
        gt=0,
        description="Checkpoints per epoch (per run where max_steps ends it within "
        "its first epoch, as Axolotl's fraction of the total steps).",
    )
    save_total_limit: int | None = Field(None, gt=0, description="Keep at most this many checkpoints.")
    save_only_model: bool = Field(False, description="Checkpoints without optimizer state (can't resume exactly).")
    async_checkpoint: bool = Field(
        False, description="llmtune's: stage each checkpoint's model and optimizer states in (pinned) host memory and "
        "write them in the background while training goes on (torch's distributed checkpoint); a checkpoint counts "
        "for resume once every rank's write has finished. Not with DeepSpeed, FSDP1 or pipelines.",
    )  # fmt: skip
    eval_strategy: Literal["steps", "epoch", "no"] | None = Field(None, description="When to evaluate.")
    eval_steps: float | None = Field(None, gt=0, description="Evaluate every N steps (or a fraction of all steps).")
    evals_per_epoch: int | None = Field(
        None,
        ge=0,
        description="Evaluations per epoch (0: no evaluation; per run where "
        "max_steps ends it within its first epoch, as saves_per_epoch).",
    )
    resume_from_checkpoint: str | None = Field(None, description="A checkpoint folder to resume from.")
    auto_resume_from_checkpoints: bool = Field(True, description="Resume from the last complete checkpoint found.")
    early_stopping_patience: int | None = Field(
        None,
        gt=0,
        description="Stop after this many evals without a lower eval loss; the best checkpoint's "
        "weights are saved (needs eval data).",
    )
    load_best_model_at_end: bool = Field(False, description="Save the weights of the best evaluation's checkpoint "
                                         "at the end (by metric_for_best_model; needs eval data; saves at each "
                                         "evaluation).")  # fmt: skip
    metric_for_best_model: str | None = Field(
        None, description="The eval metric load_best_model_at_end and early_stopping_patience compare (default "
        "eval_loss; an eval_ prefix is added as transformers adds it).",
    )  # fmt: skip
    greater_is_better: bool | None = Field(None, description="Whether a larger metric_for_best_model is better "
                                           "(default: not for a loss, else yes, as transformers decides).")  # fmt: skip
    group_by_length: bool = Field(False, description="Batch rows of similar length together.")
    curriculum_sampling: bool = Field(False, description="Train on rows in data order, not shuffled per epoch.")
    neftune_noise_alpha: float | None = Field(None, gt=0, description="NEFTune: noise on the embeddings in training.")
    loss_watchdog_threshold: float | None = Field(
        None, gt=0, description="Stop training when the logged loss exceeds this for loss_watchdog_patience logs "
        "in a row.",
    )  # fmt: skip
    loss_watchdog_patience: int = Field(3, gt=0, description="Consecutive logged losses above the threshold.")
    reward_model: bool = Field(False, description="Train a reward model (a sequence-classification head, one "
                               "score) on bradley_terry.chat_template pairs: -log sigmoid(chosen - rejected).")  # fmt: skip
    process_reward_model: bool = Field(False, description="Train a process reward model (a token-classification "
                                       "head) on stepwise_supervised rows.")  # fmt: skip
    num_labels: int | None = Field(None, gt=0, description="Labels of the classification head (default 1 for "
                                   "reward_model, 2 for process_reward_model).")  # fmt: skip
    center_rewards_coefficient: float | None = Field(None, ge=0, description="reward_model: add this times the mean "
                                                     "squared reward, to keep rewards centred on 0.")  # fmt: skip
    use_eaft: bool = Field(False, description="EAFT loss: each trained token's cross-entropy weighted by the entropy "
                           "of the model's top-k next-token probabilities (to the power eaft_alpha).")  # fmt: skip
    eaft_alpha: float = Field(1.0, ge=0, description="EAFT: exponent of the entropy weight.")
    eaft_k: int = Field(20, gt=0, description="EAFT: top-k logits the entropy is estimated from.")
    lisa_n_layers: int | None = Field(None, gt=0, description="LISA: train only this many randomly chosen layers at a "
                                      "time (embeddings, head and norms always train); a full fine-tune, one process.")  # fmt: skip
    lisa_step_interval: int = Field(20, gt=0, description="LISA: choose new layers every this many optimizer steps.")
    lisa_layers_attribute: str = Field("model.layers", description="LISA: where the model keeps its layer list.")
    dataloader_num_workers: int | None = Field(
        None, ge=0, description="Data-loading worker processes per rank (default: 2 on GPUs, so batches are "
        "collated ahead of the step; 0 in CPU rehearsal).",
    )  # fmt: skip
    dataloader_pin_memory: bool = Field(True, description="Pin host memory (batches then copy to the GPU "
                                        "asynchronously, non_blocking).")  # fmt: skip
    dataloader_prefetch_factor: int | None = Field(None, gt=0, description="Batches each data-loading worker "
                                                   "prepares ahead (default 2; needs workers).")  # fmt: skip
    profiler_steps: int | None = Field(None, gt=0, description="Record this many steps with torch's profiler "
                                       "(`llmtune train --profile` records 5): a trace under "
                                       "output_dir/llmtune/profile and the GPU's idle fraction.")  # fmt: skip
    profiler_steps_start: int | None = Field(None, ge=0, description="The step after which profiling starts "
                                             "(default 2: after the warm-up steps).")  # fmt: skip
    report_to: list[Literal[REPORT_TARGETS]] | None = Field(None, description="Trackers: tensorboard, wandb, mlflow.")  # type: ignore[valid-type]
    use_tensorboard: bool = Field(False, description="Log to tensorboard (under output_dir/runs).")
    use_mlflow: bool = Field(False, description="Log to mlflow.")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI (default: a local file store).")
    mlflow_experiment_name: str | None = Field(None, description="MLflow experiment.")
    wandb_project: str | None = Field(None, description="Weights & Biases project (enables wandb).")
    wandb_entity: str | None = Field(None, description="W&B entity.")
    wandb_name: str | None = Field(None, description="W&B run name.")
    wandb_run_id: str | None = Field(None, description="W&B run id (to continue a run).")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(None, description="W&B mode.")
    wandb_watch: Literal["false", "gradients", "parameters", "all"] | None = Field(None, description="W&B watch.")
    wandb_log_model: Literal["false", "checkpoint", "end"] | None = Field(None, description="W&B model upload.")

    @field_validator(
        "report_to", "wandb_project", "wandb_entity", "wandb_name", "wandb_run_id", "wandb_mode", "wandb_watch",
        "wandb_log_model", "resume_from_checkpoint", "lr_scheduler_kwargs", "gradient_checkpointing_kwargs",
        mode="before",
    )  # fmt: skip
    @classmethod
    def _training_empty(cls, value):
        value = empty_to_none(value)
        return "false" if value is False else value

    @field_validator("save_strategy", "eval_strategy", mode="before")
    @classmethod
    def _yaml_no(cls, value):
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false

    @field_validator("bf16", mode="before")
    @classmethod
    def _bf16_full(cls, value):
        return True if value == "full" else value  # Axolotl v0.3-v0.4: bf16 with bf16_full_eval (axolotl.py says so)

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_list(cls, value):
        return [value] if isinstance(value, str) else value

    @field_validator("logging_steps", "save_steps", "eval_steps")
    @classmethod
    def _steps_or_fraction(cls, value):
        """As transformers reads them: below 1, a fraction of the total steps; from 1, a whole number of steps."""
        if value is None or value < 1:
            return value
        if value != int(value):
            raise ValueError(f"{value} is neither a whole number of steps nor a fraction of all steps below 1")
        return int(value)

    @field_validator("optimizer", mode="before")
    @classmethod
    def _axolotl_optimizer(cls, value):
        if value in AXOLOTL_OPTIMIZERS:
            raise ValueError(f"'{value}' (an optimizer Axolotl implements itself) is not supported; use one of "
                             f"{', '.join(OPTIMIZERS + OWN_OPTIMIZERS)}")  # fmt: skip
        check_choice(value, "optimizer", OPTIMIZERS + OWN_OPTIMIZERS, OTHER_OPTIMIZERS)
        return value

    @field_validator("lr_scheduler", mode="before")
    @classmethod
    def _scheduler_name(cls, value):
        check_choice(value, "lr_scheduler", LR_SCHEDULERS, OTHER_SCHEDULERS)
        return value

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _offloaded_checkpointing(cls, value):
        return True if value in OFFLOADED_CHECKPOINTING else value  # the offload itself: _axolotl_values

    @model_validator(mode="before")
    @classmethod
    def _axolotl_values(cls, data):
        if not isinstance(data, dict):
            return data
        data = dict(data)
        checkpointing = data.get("gradient_checkpointing")
        if checkpointing in OFFLOADED_CHECKPOINTING and not data.get("activation_offloading"):
            data["activation_offloading"] = "disk" if checkpointing == "offload_disk" else True
        steps = data.get("warmup_steps")
        if isinstance(steps, float) and 0 < steps < 1 and data.get("warmup_ratio") is None:
            data["warmup_ratio"] = data.pop("warmup_steps")
        batch, micro = data.get("batch_size"), data.get("micro_batch_size") or 1
        accumulation = data.get("gradient_accumulation_steps")
        if batch and accumulation:  # Axolotl refuses the pair in every release (check_gas_bsz)
            both = f"batch_size ({batch}) and gradient_accumulation_steps ({accumulation}) are both set"
            rows = micro * accumulation if isinstance(micro, int) and isinstance(accumulation, int) else None
            if rows is not None:
                both += (
                    f" (they {'agree' if rows == batch else 'disagree'}: micro_batch_size {micro} x "
                    f"{accumulation} = {rows} rows per GPU per step{'' if rows == batch else f', not {batch}'})"
                )
            raise ValueError(f"{both}: keep one, as Axolotl refuses the pair (batch_size is rows per step per GPU; "
                             "the accumulation is batch_size / micro_batch_size)")  # fmt: skip
        if accumulation is None and isinstance(batch, int) and isinstance(micro, int):
            if batch < micro:
                raise ValueError(f"batch_size {batch} is below micro_batch_size {micro}; batch_size is rows per "
                                 "device per optimizer step (micro_batch_size x gradient_accumulation_steps)")  # fmt: skip
            # read as the accumulation it gives, as Axolotl does; the resolved recipe keeps that alone, so that it
            # validates again to itself (the worker re-reads it from plan.json)
            data["gradient_accumulation_steps"] = batch // micro
            data.pop("batch_size")
        if data.get("evals_per_epoch") == 0 and data.get("eval_strategy") is None:
            data["eval_strategy"], data["evals_per_epoch"] = "no", None
        return data

    @model_validator(mode="after")
    def _training_rules(self):
        if self.optim_args and self.optimizer in OWN_OPTIMIZERS:
            raise ValueError(f"optim_args with optimizer: {self.optimizer} is not supported: llmtune builds it itself "
                             "(transformers never reads optim_args for it); remove optim_args")  # fmt: skip
        if self.warmup_steps is not None and self.warmup_ratio is not None:
            raise ValueError("warmup_steps and warmup_ratio are both set; use one")
        if said := schedule_conflict(self):
            raise ValueError(said)
        if self.lr_scheduler == "warmup_stable_decay" and "num_decay_steps" not in (self.lr_scheduler_kwargs or {}):
            raise ValueError("lr_scheduler: warmup_stable_decay needs lr_scheduler_kwargs.num_decay_steps (the "
                             "steps of its final decay; transformers has no default and stopped the run at its "
                             "start), e.g. lr_scheduler_kwargs: {num_decay_steps: 100}")  # fmt: skip
        if self.embedding_lr is not None and self.embedding_lr_scale is not None:
            raise ValueError("embedding_lr and embedding_lr_scale are both set; use one (Axolotl took the scale and "
                             "dropped embedding_lr without a word)")  # fmt: skip
        names = [group.name for group in self.lr_groups or []]
        if len(set(names)) < len(names):
            raise ValueError(f"lr_groups: the name {next(n for n in names if names.count(n) > 1)!r} is used twice; "
                             "give each group its own name")  # fmt: skip
        if self.bf16 is True and self.fp16:
            raise ValueError("bf16 and fp16 are both true; choose one precision")
        if self.save_steps is not None and self.saves_per_epoch is not None:
            raise ValueError("save_steps and saves_per_epoch are both set; use one")
        if self.eval_steps is not None and self.evals_per_epoch is not None:
            raise ValueError("eval_steps and evals_per_epoch are both set; use one")
        for kind in ("save", "eval"):  # Axolotl refuses these pairs; the Trainer read the strategy and dropped the rest
            strategy, steps, per_epoch = (
                getattr(self, f"{kind}{key}") for key in ("_strategy", "_steps", "s_per_epoch")
            )
            asked = f"{kind}_steps: {steps:g}" if steps is not None else f"{kind}s_per_epoch: {per_epoch}" if per_epoch \
                else None  # fmt: skip
            if strategy in ("epoch", "no") and asked:
                raise ValueError(f"{kind}_strategy: {strategy} and {asked} disagree (the {kind} steps are read only "
                                 f"with {kind}_strategy: steps); set {kind}_strategy: steps, or remove "
                                 f"{asked.split(':')[0]}")  # fmt: skip
        return self

    @property
    def grouped_rates(self) -> list[str]:
        """The keys that give parameter groups their own learning rates (the Trainer builds those optimizers)."""
        keys = ("loraplus_lr_ratio", "embedding_lr", "embedding_lr_scale", "lr_groups")
        return [key for key in keys if getattr(self, key, None)]

    @property
    def trackers(self) -> list[str]:
        """The tracking backends asked for, from report_to and Axolotl's switches."""
        chosen = [t for t in (self.report_to or []) if t != "none"]
        for flag, name in ((self.use_tensorboard, "tensorboard"), (self.use_mlflow, "mlflow")):
            if flag and name not in chosen:
                chosen.append(name)
        if self.wandb_project and self.wandb_mode != "disabled" and "wandb" not in chosen:
            chosen.append("wandb")
        return chosen


def named_schedule(recipe) -> tuple[str, dict]:
    """transformers' name and kwargs for the schedule: cosine with a non-zero floor is cosine_with_min_lr (Axolotl's
    floored cosine, the same formula); cosine_with_min_lr takes its floor from cosine_min_lr_ratio."""
    name, kwargs, floor = recipe.lr_scheduler, dict(recipe.lr_scheduler_kwargs or {}), recipe.cosine_min_lr_ratio
    if (name == "cosine" and floor) or (name == "cosine_with_min_lr" and floor is not None):
        name, kwargs["min_lr_rate"] = "cosine_with_min_lr", floor
    return name, kwargs


def quadratic_warmup(recipe) -> bool:
    """Axolotl applies lr_quadratic_warmup to lr_scheduler: cosine only (its lr_scheduler_type == "cosine")."""
    return bool(recipe.lr_quadratic_warmup) and recipe.lr_scheduler == "cosine"


def constant_phase(recipe) -> bool:
    """Axolotl's cosine_constant_lr_ratio: on lr_scheduler: cosine, with a floor and a ratio both non-zero (Axolotl
    tests their truth), and not beside the quadratic warm-up, which Axolotl takes first."""
    return bool(getattr(recipe, "cosine_constant_lr_ratio", None) and recipe.cosine_min_lr_ratio) and \
        recipe.lr_scheduler == "cosine" and not quadratic_warmup(recipe)  # fmt: skip


def schedule_conflict(recipe) -> str | None:
    """The line refusing a schedule key that Axolotl v0.18.0's create_scheduler ignores in the recipe, else None."""
    name, floor, kwargs = recipe.lr_scheduler, recipe.cosine_min_lr_ratio, recipe.lr_scheduler_kwargs or {}
    quadratic, jagged = recipe.lr_quadratic_warmup, getattr(recipe, "jagged_restart_steps", None)
    own = "quadratic warm-up" if quadratic else "floored cosine" if name == "cosine" and floor else ""
    return next((said for wrong, said in (
        (quadratic and name != "cosine", f"lr_quadratic_warmup applies to lr_scheduler: cosine only (Axolotl ignores "
                                         f"it with {name}); remove it, or use lr_scheduler: cosine"),
        (quadratic and floor, "lr_quadratic_warmup and cosine_min_lr_ratio are both set: Axolotl's quadratic warm-up "
                              "decays to 0 and drops the floor; remove one"),
        (floor is not None and name not in ("cosine", "cosine_with_min_lr") and not jagged,
         f"cosine_min_lr_ratio floors a cosine schedule (or jagged restarts), and lr_scheduler is {name}; remove it, "
         "or use lr_scheduler: cosine"),
        (recipe.cosine_constant_lr_ratio and not (name == "cosine" and floor), "cosine_constant_lr_ratio holds the "
         "floor of lr_scheduler: cosine with cosine_min_lr_ratio (Axolotl ignores it otherwise); set both, or remove it"),
        (floor is not None and {"min_lr", "min_lr_rate"} & set(kwargs),
         "cosine_min_lr_ratio and lr_scheduler_kwargs' min_lr/min_lr_rate both set the floor; keep one"),
        (kwargs and own, f"lr_scheduler_kwargs ({', '.join(map(str, kwargs))}) with Axolotl's own {own} schedule, "
                         "which takes none (Axolotl ignores them); remove lr_scheduler_kwargs"),
    ) if wrong), None)  # fmt: skip
