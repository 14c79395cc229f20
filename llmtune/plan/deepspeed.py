"""The DeepSpeed JSON, with every value resolved from the recipe (no "auto" is left, but train_batch_size under
context parallelism: accelerate sets it when DeepSpeed starts, see build_deepspeed_config).

The batch keys always satisfy train_batch_size = micro x accumulation x data-parallel size,
so DeepSpeed's batch assertion can't fire. A user's own JSON may leave values "auto" (they
are filled here) but may not contradict the recipe: that is an error naming both keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.plan.memory.buffers import MAX_LIVE_PARAMETERS
from llmtune.plan.memory.facts import ModelFacts
from llmtune.recipe.paths import on_disk, preset_for_axolotl_file


@dataclass(frozen=True)
class ZeroPreset:
    stage: int
    offload_optimizer: str | None = None  # "cpu" or "nvme"
    offload_param: str | None = None


PRESETS = {
    "zero1": ZeroPreset(1),
    "zero2": ZeroPreset(2),
    "zero3": ZeroPreset(3),
    "zero2_offload": ZeroPreset(2, offload_optimizer="cpu"),
    "zero3_offload": ZeroPreset(3, offload_optimizer="cpu", offload_param="cpu"),
    "zero3_offload_params": ZeroPreset(3, offload_param="cpu"),
    "zero3_nvme": ZeroPreset(3, offload_optimizer="nvme", offload_param="nvme"),
}
# Axolotl ships deepspeed_configs/<name>.json; recipes name those files. They mean these presets.
DEFAULT_BUCKET = 500_000_000
AXOLOTL_SUB_GROUP = 0  # what Axolotl's zero3*.json files set


# DeepSpeed's ZeRO fields and the stage3_ aliases it reads them by (deepspeed/runtime/zero/config.py): a file may
# use either spelling
ZERO3_ALIASES = {name: f"stage3_{name}" for name in (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters",
    "max_reuse_distance", "gather_16bit_weights_on_model_save", "module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "allgather_sequential")}  # fmt: skip
GATHER_SPELLINGS = (
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
)  # the last one deprecated, still read


def load_user_config(value: str | dict) -> tuple[dict, str | None]:
    """The recipe's deepspeed value as (config mapping, preset name or None)."""
    if isinstance(value, dict):
        return dict(value), None
    preset = value if value in PRESETS else preset_for_axolotl_file(value)
    if preset:
        return {}, preset
    path = on_disk(value, "deepspeed")
    if path is None or not path.is_file():
        raise UserError(f"deepspeed: '{value}' is neither a preset nor a JSON file", f"presets: {', '.join(PRESETS)}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"deepspeed: {path} line {err.lineno}: invalid JSON ({err.msg})") from None
    if not isinstance(config, dict):
        raise UserError(f"deepspeed: {path} must hold a JSON object")
    return config, None


def _offload(device: str, nvme_path: str | None, buffer_count: int) -> dict:
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": buffer_count}


def _preset_zero(preset: ZeroPreset, recipe, facts: ModelFacts | None, data_parallel: int = 1) -> dict:
    hidden = facts.hidden_size if facts else None
    bucket = hidden * hidden if hidden else DEFAULT_BUCKET
    zero: dict[str, Any] = {
        "stage": preset.stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
    }
    if preset.stage < 3:
        zero.update(allgather_bucket_size=bucket, reduce_scatter=True)
    else:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * bucket),
            stage3_param_persistence_threshold=10 * hidden if hidden else 100_000,
            stage3_max_live_parameters=MAX_LIVE_PARAMETERS,
            stage3_max_reuse_distance=1_000_000_000,
            stage3_gather_16bit_weights_on_model_save=True,
            sub_group_size=1_000_000_000,
        )
    nvme = recipe.offload_nvme_path
    if (preset.offload_optimizer == "nvme" or preset.offload_param == "nvme") and not nvme:
        raise UserError("deepspeed: zero3_nvme needs offload_nvme_path", "set offload_nvme_path: /local_nvme/llmtune")
    if preset.offload_optimizer:
        zero["offload_optimizer"] = _offload(preset.offload_optimizer, nvme, 4)
    if preset.offload_param:
        zero["offload_param"] = _offload(preset.offload_param, nvme, 5)
        if preset.offload_param == "nvme" and facts is not None:
            # each swap buffer must hold one parameter's partition (DeepSpeed asserts it at model init): its
            # default, 1e8 elements, is less than the embedding's share of a 70B model on 8 GPUs (1.3e8)
            largest = -(-facts.largest_tensor_params() // max(1, data_parallel))
            zero["offload_param"]["buffer_size"] = max(NVME_BUFFER, largest)
    return zero


NVME_BUFFER = 100_000_000  # DeepSpeed's offload_param.buffer_size default (elements)


def build_deepspeed_config(
    recipe,
    data_parallel_size: int,
    precision: str,
    facts: ModelFacts | None,
    rehearsal: bool = False,
    accumulation: int | None = None,
) -> tuple[dict, list[str]]:
    """The resolved DeepSpeed config and notes about what was filled or replaced. `accumulation`: a resume's on
    another world size (it keeps the checkpoint's global batch), else the recipe's."""
    user, preset_name = load_user_config(recipe.deepspeed)
    user = _check_sections(user, recipe)
    notes: list[str] = []
    if rehearsal:  # CPU processes run fp32: a file's own bf16/fp16 (Axolotl's zero3_bf16*.json) as the recipe's
        for key in ("bf16", "fp16"):
            if isinstance(user.get(key), dict) and user[key].get("enabled") not in (None, "auto", False):
                user = {**user, key: {**user[key], "enabled": "auto"}}
                notes.append(f"CPU rehearsal: the deepspeed config's {key}.enabled becomes fp32 (the GPU run "
                             f"keeps {key})")  # fmt: skip
    micro, accumulation = recipe.micro_batch_size, accumulation or recipe.gradient_accumulation_steps
    resolved: dict[str, Any] = {
        "train_batch_size": micro * accumulation * data_parallel_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": recipe.max_grad_norm,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
    }
    config = dict(user)
    resumed = accumulation != recipe.gradient_accumulation_steps  # another world's resume keeps its global batch
    for key, value in resolved.items():
        config[key] = _merge(key, config.get(key), value, recipe.deepspeed, resumed)
    if preset_name:
        config["zero_optimization"] = _preset_zero(PRESETS[preset_name], recipe, facts, data_parallel_size)
        if preset_name != recipe.deepspeed:  # Axolotl's shipped file, named by its path in Axolotl's repository
            kept = ""
            if PRESETS[preset_name].stage == 3:  # the file's optimizer sub-groups (one per parameter), as on disk:
                # a checkpoint saved with the file resumes with the stand-in and back (the layout check compares it);
                # and its prefetch limits, 0 (DeepSpeed's defaults are 1e9)
                config["zero_optimization"].update(sub_group_size=AXOLOTL_SUB_GROUP, stage3_max_live_parameters=0,
                                                   stage3_max_reuse_distance=0)  # fmt: skip
                kept = (
                    f", with the file's sub_group_size {AXOLOTL_SUB_GROUP}, max_live_parameters 0, max_reuse_distance 0"
                )
            if "cpuoffload" in Path(str(recipe.deepspeed)).stem:  # its top-level keys: torch's optimizer may step
                config.update(zero_force_ds_cpu_optimizer=False, zero_allow_untested_optimizer=True)
                kept += ", zero_force_ds_cpu_optimizer false"
            notes.append(f"deepspeed: {recipe.deepspeed} is Axolotl's own file, not on disk here: llmtune's "
                         f"{preset_name} preset stands for it{kept} (a file at that path would be read instead)")  # fmt: skip
    else:
        zero = _user_zero(config, recipe)
        if int(zero.get("stage") or 0) < 3 and (zero.get("offload_param") or {}).get("device", "none") != "none":
            del zero["offload_param"]
            notes.append(f"deepspeed: offload_param works at ZeRO stage 3 only (DeepSpeed ignores it at stage "
                         f"{zero.get('stage')}); left out, so the plan and the estimate keep the parameters on the GPU")  # fmt: skip
        auto_zero = _preset_zero(ZeroPreset(int(zero.get("stage", 0)) or 1), recipe, facts)
        for key, value in list(zero.items()):
            if value == "auto":
                zero[key] = auto_zero.get(ZERO3_ALIASES.get(key, key), DEFAULT_BUCKET)
        # DeepSpeed reads the field by its name or its stage3_ alias (and the old fp16 spelling): whichever the file
        # uses is the setting, and adding the other spelling beside it would make DeepSpeed refuse the section
        gather = next((key for key in GATHER_SPELLINGS if key in zero), None)
        if int(zero.get("stage") or 0) == 3 and gather is None:  # DeepSpeed's default is false: no model file
            zero[GATHER_SPELLINGS[0]] = True
            notes.append(f"deepspeed: {GATHER_SPELLINGS[0]} set true (not in the file; DeepSpeed's default, false, "
                         "saves the final model as ZeRO shards only, with no model file)")  # fmt: skip
        elif int(zero.get("stage") or 0) == 3 and zero.get(gather) is False:
            notes.append(f"deepspeed: {gather} is false: the final model is saved as ZeRO-3 shards (global_step*) "
                         "with no model file (DeepSpeed's zero_to_fp32.py beside them rebuilds one); set it true for "
                         "a model file")  # fmt: skip
        config["zero_optimization"] = zero
    if config.get("fp16", {}).get("enabled"):
        config["fp16"] = {"loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                          "hysteresis": 2, "min_loss_scale": 1, **config["fp16"]}  # fmt: skip
    if int((config.get("zero_optimization") or {}).get("stage") or 0) == 3 and recipe.peft_trainable_token_indices:
        # peft 0.21 gathers the rows under ZeRO-3 on a CUDA device it hard-codes (the CPU ranks stop there, measured)
        # and its forward reads the embedding's weight outside the module DeepSpeed gathers: never run, not offered
        raise UserError("peft_trainable_token_indices with ZeRO-3: peft gathers the rows under ZeRO-3 on a CUDA device "
                        "it hard-codes, so llmtune can't rehearse it, and it has not run here", "use ZeRO-2 or "
                        "fsdp_version: 2 (both trained and merged here), or lora_modules_to_save: [embed_tokens, "
                        "lm_head]")  # fmt: skip
    _resolve_optimizer(config, recipe, notes)
    if "scheduler" in config:
        del config["scheduler"]
        notes.append(f"deepspeed scheduler replaced by lr_scheduler: {recipe.lr_scheduler} from the recipe")
    config.setdefault("steps_per_print", 1_000_000)
    config.setdefault("wall_clock_breakdown", False)
    config["zero_allow_untested_optimizer"] = True
    _reject_auto(config)
    if recipe.context_parallel_size > 1:
        # Ulysses: transformers checks train_batch_size against micro x accumulation x world, then accelerate sets it
        # to micro x accumulation x data-parallel groups; only "auto" passes both (the one "auto" llmtune writes)
        config["train_batch_size"] = "auto"
        zero = config.get("zero_optimization") or {}
        if int(zero.get("stage", 0)) == 3 and zero.get("reduce_scatter") is False:
            # llmtune scales Ulysses' loss to what DeepSpeed divides the summed gradients by (train/engine/trainer.py);
            # ZeRO-3 without reduce-scatter divides some buckets by the data-parallel groups and others by every rank
            raise UserError("deepspeed: zero_optimization.reduce_scatter: false with ZeRO-3 and context parallelism: "
                            "DeepSpeed then averages gradient buckets over different rank counts (by bucket size), "
                            "which no loss scaling can undo", "remove reduce_scatter (DeepSpeed's default is true)")  # fmt: skip
        notes.append(f"deepspeed: train_batch_size is auto under context parallelism: accelerate sets it to "
                     f"{resolved['train_batch_size']} (micro x accumulation x the {data_parallel_size} data-parallel "
                     "groups) when DeepSpeed starts")  # fmt: skip
    return config, notes


def _where(recipe) -> str:
    return (
        "the inline deepspeed mapping" if isinstance(recipe.deepspeed, dict) else f"deepspeed file {recipe.deepspeed}"
    )


def _check_sections(config: dict, recipe) -> dict:
    """The sections DeepSpeed reads as JSON objects: a bare value there is one line naming it, not a traceback.
    null is a section left out, and "auto" for bf16/fp16 the recipe's precision (both filled from the recipe)."""
    config = {k: v for k, v in config.items() if not (k in ("zero_optimization", "optimizer") and v is None)}
    for key in ("zero_optimization", "optimizer", "bf16", "fp16"):
        if key in ("bf16", "fp16") and config.get(key) in (None, "auto"):
            continue
        if key in config and not isinstance(config[key], dict):
            shown = "{enabled: " + json.dumps(config[key]) + "}" if key in ("bf16", "fp16") else "a JSON object"
            raise UserError(f"{_where(recipe)}: {key} is {json.dumps(config[key])}, and DeepSpeed reads it as a JSON "
                            "object", f"write it as {shown}")  # fmt: skip
    return config


def _user_zero(config: dict, recipe) -> dict:
    """A user's zero_optimization, checked for the shapes DeepSpeed reads (one line naming the key, not a traceback
    here or an error on every rank at start-up); NVMe offload gets the recipe's offload_nvme_path where it has none."""
    where, zero = _where(recipe), dict(config.get("zero_optimization") or {"stage": 0})
    if isinstance(zero.get("stage"), str) and zero["stage"].strip().isdigit():
        zero["stage"] = int(zero["stage"])  # DeepSpeed reads "3" as 3, transformers' is_zero3() doesn't
    if zero.get("stage", 0) not in (0, 1, 2, 3):
        raise UserError(f"{where}: zero_optimization.stage is {json.dumps(zero['stage'])}", "use 0, 1, 2 or 3")
    for key in ("offload_optimizer", "offload_param"):
        offload = zero.get(key)
        if offload is None:
            continue
        if not isinstance(offload, dict) or offload.get("device", "none") not in ("none", "cpu", "nvme"):
            raise UserError(f"{where}: zero_optimization.{key} is {json.dumps(offload)}",
                            'write it as {"device": "cpu"} (or "nvme" with "nvme_path", or "none")')  # fmt: skip
        ignored = key == "offload_param" and zero.get("stage", 0) < 3  # left out below, as DeepSpeed ignores it
        if offload.get("device") == "nvme" and not offload.get("nvme_path") and not ignored:
            if not recipe.offload_nvme_path:
                raise UserError(f"{where}: zero_optimization.{key} offloads to NVMe without an nvme_path",
                                "set offload_nvme_path in the recipe, or nvme_path in the JSON")  # fmt: skip
            zero[key] = {**offload, "nvme_path": recipe.offload_nvme_path}
    return zero


# Where the recipe's value of each DeepSpeed key comes from, for the line that says they disagree
FROM_RECIPE = {
    "train_batch_size": "micro_batch_size x gradient_accumulation_steps x data-parallel processes",
    "train_micro_batch_size_per_gpu": "micro_batch_size", "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm (default 1.0)", "bf16.enabled": "the recipe's precision",
    "fp16.enabled": "the recipe's precision", "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "adam_beta1, adam_beta2", "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
}  # fmt: skip
RESUME_SET = ("train_batch_size", "gradient_accumulation_steps")  # what a resume on another world size sets


def _merge(key: str, user_value: Any, recipe_value: Any, source: Any, resumed: bool = False) -> Any:
    if user_value is None or user_value == "auto":
        return recipe_value
    if isinstance(recipe_value, dict) and isinstance(user_value, dict):
        merged = {**user_value}
        for sub, value in recipe_value.items():
            merged[sub] = _merge(f"{key}.{sub}", user_value.get(sub), value, source, resumed)
        return merged
    if user_value != recipe_value:
        where = "the inline deepspeed mapping" if isinstance(source, dict) else f"deepspeed file {source}"
        if resumed and key in RESUME_SET:  # the recipe isn't what sets it: the checkpoint's global batch is
            raise UserError(
                f"{where} sets {key} = {user_value!r}, and resuming the checkpoint on this world size needs "
                f"{recipe_value!r} (the gradient accumulation that keeps the global batch it trained with)",
                f'set {key} to "auto" in the JSON (llmtune fills it), or resume on the world size that saved it',
            )  # fmt: skip
        origin = FROM_RECIPE.get(key)
        raise UserError(
            f"{where} sets {key} = {user_value!r} but the recipe implies {recipe_value!r}"
            + (f" (from {origin})" if origin else ""),
            f'set it to "auto" in the JSON (llmtune fills it from the recipe) or change '
            f"{origin.split(' (')[0] if origin else 'the recipe'}",
        )
    return user_value


def optimizer_offloaded(config: dict | None) -> bool:
    """Whether a DeepSpeed config offloads the optimizer (to CPU or NVMe): DeepSpeed then steps it with its own CPU
    Adam, which the Trainer builds over its parameter groups unless the config has an optimizer section."""
    offload = ((config or {}).get("zero_optimization") or {}).get("offload_optimizer") or {}
    return bool(offload) and offload.get("device", "none") != "none"


def _resolve_optimizer(config: dict, recipe, notes: list[str]) -> None:
    """Offloaded optimizer states need DeepSpeed's own CPU Adam. Without an optimizer section the Trainer builds
    torch's AdamW over its parameter groups (weight decay not on biases and norms; LoRA+'s and lr_groups' rates), and
    accelerate hands DeepSpeed the CPU Adam of those groups, decoupled weight decay as AdamW's (its
    map_pytorch_optim_to_deepspeed). A config's own optimizer section DeepSpeed builds over one group of every
    parameter."""
    params = {
        "lr": recipe.learning_rate, "betas": [recipe.adam_beta1, recipe.adam_beta2],
        "eps": recipe.adam_epsilon, "weight_decay": recipe.weight_decay,
    }  # fmt: skip
    grouped = recipe.grouped_rates
    source = recipe.deepspeed if isinstance(recipe.deepspeed, str) else "the inline mapping"
    if "optimizer" in config:
        if grouped:
            raise UserError(f"{grouped[0]} needs the Trainer to build the optimizer, and deepspeed: {source} has its "
                            "own optimizer section, which DeepSpeed builds over one group of parameters: "
                            f"{grouped[0]} would be ignored", f"remove the optimizer section, or remove {grouped[0]}")  # fmt: skip
        user = config["optimizer"]
        config["optimizer"] = {
            "type": user.get("type", "AdamW"),
            "params": _merge("optimizer.params", user.get("params") or {}, params, recipe.deepspeed),
        }
    elif optimizer_offloaded(config):
        if not recipe.optimizer.startswith("adamw"):
            stage = config["zero_optimization"].get("stage", 2)
            raise UserError(
                f"optimizer: {recipe.optimizer} can't run with the optimizer offload of deepspeed: {source} "
                "(DeepSpeed steps offloaded optimizer states with its own CPU Adam and refuses other optimizers)",
                f"use optimizer: adamw_torch (DeepSpeed's CPU Adam runs it), or deepspeed: zero{stage} (no offload)",
            )
        instead = "" if recipe.optimizer in ("adamw_torch", "adamw_torch_fused", "adamw_hf") else \
            f" (instead of {recipe.optimizer}: fp32 states, on the CPU)"  # fmt: skip
        who = "torch's AdamW (zero_force_ds_cpu_optimizer: false; DeepSpeed's CPU Adam, faster, without the key)" \
            if config.get("zero_force_ds_cpu_optimizer") is False else "DeepSpeed's CPU AdamW"  # fmt: skip
        notes.append(f"optimizer offload: {who} runs the optimizer step{instead}, over the Trainer's parameter groups "
                     "(no weight decay on biases and norms)")  # fmt: skip


def _reject_auto(config: Any, path: str = "") -> None:
    if isinstance(config, dict):
        for key, value in config.items():
            _reject_auto(value, f"{path}.{key}" if path else key)
    elif config == "auto":
        raise UserError(f'deepspeed: {path} is "auto" and llmtune can\'t resolve it', "give it a value")
