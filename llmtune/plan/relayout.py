"""Resuming a checkpoint in another engine layout: a ZeRO run that ran out of memory goes on with the optimizer or
the parameters offloaded, or at another stage, or with another sub-group size, and the reverse.

DeepSpeed loads a ZeRO checkpoint's optimizer partitions only into the layout that wrote them; its universal
checkpoint (one folder per parameter: the fp32 weights and Adam's moments, whole) loads into any ZeRO layout of the
same model. So a DeepSpeed layout change goes through the conversion a change of world size already takes
(llmtune/train/checkpoint/universal.py: `convert`, then `fit_layout` for what the new stage and optimizer owner
read beside the per-parameter files). What can't be carried is refused before launch in one line: FSDP's state
dict formats, NVMe-offloaded optimizer state (DeepSpeed reads it back only into the swap files that wrote it), and
optimizers whose state isn't Adam's moments (DeepSpeed's CPU Adam, which offload uses, continues only those).
The optimizer's owner moves too: a config's optimizer section has DeepSpeed build it (one group, the schedule in its
files); otherwise the Trainer does (its groups, scheduler.pt), offloaded or not.
"""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.plan.checkpoint_layout import read_marker
from llmtune.plan.deepspeed import optimizer_offloaded
from llmtune.plan.resume import check_convertible, replicated_to_zero, resume_checkpoint

ADAM = ("adamw_torch", "adamw_torch_fused", "deepspeed:adam", "deepspeed:adamw")  # whose state is Adam's moments


def optimizer_of(recipe_optimizer: str, deepspeed_config: dict | None) -> str:
    """The optimizer a run steps, as its checkpoint's marker records it: DeepSpeed's own section's type, DeepSpeed's
    CPU AdamW where the optimizer is offloaded (the Trainer builds it over its groups), or the recipe's."""
    section = (deepspeed_config or {}).get("optimizer")
    if section:
        return f"deepspeed:{str(section.get('type', 'adamw')).lower()}"
    return "deepspeed:adamw" if optimizer_offloaded(deepspeed_config) else recipe_optimizer


def engine_layout(deepspeed_config: dict | None, fsdp_section: dict | None) -> dict:
    """What shapes a ZeRO or FSDP checkpoint's saved state beyond the strategy: DeepSpeed's offload devices, ZeRO-3's
    optimizer sub-groups and whether DeepSpeed or the Trainer owns the optimizer and the schedule; FSDP's state dict
    format. The marker records it (trainer.py `_allocation`); a resume whose layout differs fails deep in loading
    unless it is converted (`check_layout`)."""
    if deepspeed_config:
        zero = deepspeed_config.get("zero_optimization") or {}
        layout = {f"{key} device": (zero.get(key) or {}).get("device", "none")
                  for key in ("offload_optimizer", "offload_param")}  # fmt: skip
        if int(zero.get("stage", 0)) == 3:
            layout["sub_group_size"] = zero.get("sub_group_size", DEFAULT_SUB_GROUP)
        layout["optimizer"] = "DeepSpeed's" if "optimizer" in deepspeed_config else "the Trainer's"
        layout["scheduler"] = "DeepSpeed's" if "scheduler" in deepspeed_config else "the Trainer's"
        return layout
    if fsdp_section:
        return {"state_dict_type": fsdp_section.get("fsdp_state_dict_type", "FULL_STATE_DICT")}
    return {}


# DeepSpeed's default sub_group_size (ZeRO-3 steps its optimizer over sub-groups of this many parameters)
DEFAULT_SUB_GROUP = 1_000_000_000


def check_layout(recipe, strategy: str, titles: dict[str, str], deepspeed_config: dict | None,
                 fsdp_section: dict | None) -> str | None:  # fmt: skip
    """The checkpoint to resume was saved in this launch's layout (None), or in another DeepSpeed layout that its
    conversion to the universal checkpoint carries over (the line that says so; the plan sets the engine to load it).
    UserError, with what will work, for what can't be carried over."""
    checkpoint = resume_checkpoint(recipe)
    info = (read_marker(checkpoint) or {}) if checkpoint else {}
    saved, layout = info.get("engine_layout"), engine_layout(deepspeed_config, fsdp_section)
    written = info.get("strategy")
    if replicated_to_zero(written, strategy):
        return _from_replicated(recipe, checkpoint, info, titles.get(written, written), titles.get(strategy, strategy),
                                deepspeed_config)  # fmt: skip
    restaged = bool(written) and written != strategy and written.startswith("zero") and strategy.startswith("zero")
    if not isinstance(saved, dict) or not layout:
        if restaged:  # an older llmtune's marker: who owned the optimizer is unknown
            raise UserError(
                f"{checkpoint.name} was saved by {titles.get(written, written)} with an older llmtune, whose "
                f"checkpoints don't record their engine layout; this launch runs {titles.get(strategy, strategy)}",
                f"resume with the recipe's strategy keys as they were; {_from_weights(checkpoint)}",
            )
        return None
    differ = [f"{key} {saved.get(key)} -> {layout.get(key)}" for key in {**saved, **layout}
              if saved.get(key) != layout.get(key)]  # fmt: skip
    if restaged:
        differ.insert(0, f"{titles.get(written, written)} -> {titles.get(strategy, strategy)}")
    if not differ:
        return None
    why = _not_carried(recipe, info, saved, layout, deepspeed_config)
    if why is None:
        check_convertible(
            checkpoint,
            int(info.get("data_parallel_size") or info.get("world_size") or 1),
            "use the DeepSpeed config it was saved with",
            recipe,
        )
        return (f"{checkpoint.name} was saved with {'; '.join(differ)} (saved -> now): it is converted to "
                "DeepSpeed's universal checkpoint and loaded into this layout, with its optimizer state and "
                "schedule (`llmtune checkpoint reshard` converts it ahead)")  # fmt: skip
    fix = "set fsdp_config.state_dict_type back" if "state_dict_type" in saved else \
        "use the DeepSpeed config it was saved with"  # fmt: skip
    raise UserError(
        f"{checkpoint.name} was saved with {'; '.join(differ)} (saved -> now): {why}",
        f"{fix} to resume it; {_from_weights(checkpoint, ' in the new layout')}",
    )


def _not_carried(recipe, info: dict, saved: dict, layout: dict, deepspeed_config: dict | None) -> str | None:
    """Why the saved engine state can't be converted into this layout; None when it can."""
    if "state_dict_type" in saved or "state_dict_type" in layout:
        return "accelerate reads an FSDP checkpoint only in the state dict format it is told"
    if "nvme" in (*saved.values(), *layout.values()):
        return "DeepSpeed reads NVMe-offloaded optimizer state back only into the swap files that wrote it"
    other = _not_adam(recipe, info, deepspeed_config)
    if other:
        return (f"its conversion carries Adam's moments, and {other} keeps other state (a layout change is converted "
                "for AdamW runs)")  # fmt: skip
    if info.get("optimizer") is None:  # a marker from before llmtune recorded it
        return "the checkpoint's marker doesn't record its optimizer (an older llmtune)"
    return None


def _from_replicated(recipe, checkpoint, info: dict, before: str, now: str, deepspeed_config: dict | None) -> str:
    """A DDP (or one process's) checkpoint resumed under ZeRO: its weights and AdamW's moments are written as
    DeepSpeed's universal checkpoint (llmtune/train/checkpoint/universal.py `from_replicated`); the line that says so,
    or UserError for what that can't carry."""
    why = None
    if recipe.adapter and (recipe.adapter != "lora" or recipe.lora_modules_to_save or recipe.relora
                           or recipe.peft_trainable_token_indices):  # fmt: skip
        why = ("llmtune converts a full fine-tune's or a plain LoRA's state (QLoRA, lora_modules_to_save, trainable "
               "tokens and ReLoRA save other names or state)")  # fmt: skip
    elif recipe.grouped_rates:
        why = f"{recipe.grouped_rates[0]} gives the optimizer groups of its own, which the conversion doesn't map"
    elif not (checkpoint / "optimizer.pt").is_file():
        why = "it holds no optimizer.pt (saved without its optimizer state)"
    elif other := _not_adam(recipe, info, deepspeed_config):
        why = f"its conversion carries AdamW's moments, and {other} keeps other state"
    if why:
        raise UserError(f"{checkpoint.name} was saved by {before}; this launch runs {now}: {why}",
                        f"resume with the recipe's strategy keys as they were; {_from_weights(checkpoint)}")  # fmt: skip
    return (f"{checkpoint.name} was saved by {before}; this launch runs {now}: its weights and AdamW's moments are "
            "written as DeepSpeed's universal checkpoint and loaded with its schedule")  # fmt: skip


def _not_adam(recipe, info: dict, deepspeed_config: dict | None) -> str | None:
    """The optimizer, this launch's or the one the checkpoint's marker records, whose state isn't AdamW's moments
    (the conversions carry only those); None when both are AdamW (or the marker doesn't say)."""
    for which in (optimizer_of(recipe.optimizer, deepspeed_config), info.get("optimizer")):
        if which is not None and which not in ADAM:
            return which.replace("deepspeed:", "DeepSpeed optimizer ")
    return None


def _from_weights(checkpoint, where: str = "") -> str:
    """How to go on from a checkpoint's weights alone where its optimizer state can't be carried over."""
    return (f"to train on from its weights{where}: llmtune merge {checkpoint}, then base_model: the merged folder in a "
            "new output_dir")  # fmt: skip
