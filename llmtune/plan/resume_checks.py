"""What a resume can't take from a changed recipe or a damaged checkpoint, checked when the run is planned.

The Trainer resumes whatever it finds and says nothing: a checkpoint missing its optimizer state restarts the
optimizer and the schedule; a changed learning_rate is overwritten by the scheduler state it loads; another seed or
other data makes its skip over the batches already trained skip other rows; an adapter of another shape fails deep in
loading. Each is one line here, or a note that says what the resume does. The marker llmtune writes with each
checkpoint (llmtune/train/engine/trainer.py `_allocation`) records the files it holds and the keys compared here;
for a checkpoint without them (an older llmtune, or another tool's), the run's plan.json beside it says what trained
it, where there is one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.checkpoint_layout import (
    MARKER,
    complete_checkpoints,
    files_in,
    incomplete_checkpoints,
    read_marker,
)
from llmtune.plan.resume import resume_checkpoint, start_over

SCHEDULE_KEYS = ("learning_rate", "lr_scheduler", "lr_scheduler_kwargs", "warmup_steps", "warmup_ratio",
                 "cosine_min_lr_ratio", "cosine_constant_lr_ratio")  # fmt: skip


# what the optimizer state a resume loads holds of its own: torch's load_state_dict restores each param group's
# settings (weight decay, betas, epsilon) and the scheduler state each group's base rate, over the recipe's
OPTIMIZER_KEYS = ("optimizer", "optim_args", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                  "loraplus_lr_ratio", "loraplus_lr_embedding", "embedding_lr", "embedding_lr_scale", "lr_groups")  # fmt: skip

MIXING_KEYS = ("shuffle_before_merging_datasets", "dataset_shard_num", "dataset_shard_idx", "dataloader_drop_last")


def data_key(recipe) -> str:
    """The datasets as the recipe names them (type, split, fields..., and the path: a local one by its file or
    folder name, so that the same data on another mount or from another working folder is the same)."""
    specs = []
    for spec in recipe.datasets:
        values = spec.model_dump(mode="json", exclude_defaults=True)
        if isinstance(values.get("path"), str) and Path(values["path"]).is_absolute():
            values["path"] = Path(values["path"]).name
        specs.append(values)
    # which of the rows, and in which batches: in the key only when set (so a recipe without them keys as before)
    drawn = {key: getattr(recipe, key, None) for key in MIXING_KEYS}
    drawn = {key: value for key, value in drawn.items() if value not in (None, False)}
    payload = {"datasets": specs, "drawn": drawn} if drawn else specs
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def marker_keys(recipe) -> dict:
    """What a checkpoint's marker records of the recipe that trained it, for the checks of a later resume."""
    return {"schedule": {key: getattr(recipe, key, None) for key in SCHEDULE_KEYS},
            "optimizer_settings": optimizer_settings(recipe), "data_key": data_key(recipe),
            "data_seed": _data_seed(recipe), "base_model": _model_key(recipe)}  # fmt: skip


def _model_key(recipe) -> str:
    """The base model by its last name (a hub id and its download in a local folder are the same model), with the
    revision asked for."""
    name = Path(str(recipe.base_model).rstrip("/")).name
    return f"{name}@{recipe.revision_of_model}" if getattr(recipe, "revision_of_model", None) else name


def _data_seed(recipe) -> int:
    return recipe.data_seed if recipe.data_seed is not None else recipe.seed


def check_resume(recipe) -> list[str]:
    """Notes on what resuming does with the recipe as it is now; UserError where the resume would go wrong."""
    checkpoint = resume_checkpoint(recipe)
    if checkpoint is None:
        _refuse_unmarked(recipe)
        return []
    if not checkpoint.is_dir():
        return []
    marker = read_marker(checkpoint) or {}
    _check_files(checkpoint, marker)
    _check_adapter(recipe, checkpoint)
    return _check_recipe(recipe, checkpoint, marker)


def _refuse_unmarked(recipe) -> None:
    """checkpoint-N folders without llmtune's marker (the HF Trainer's, Axolotl's): llmtune writes a checkpoint into
    a staging folder and renames it into place marked, so these are not its own interrupted saves. Starting over
    would overwrite them."""
    output_dir = Path(recipe.output_dir)
    try:
        if not recipe.auto_resume_from_checkpoints or not output_dir.is_dir():
            return
        found = incomplete_checkpoints(output_dir)  # by step
        if not found or complete_checkpoints(output_dir):
            return
    except OSError:  # a name no file system takes: the run reports the path itself
        return
    if found:
        newest = found[-1]
        raise UserError(
            f"{output_dir} holds {', '.join(p.name for p in found[:3])}{' ...' if len(found) > 3 else ''} without "
            f"llmtune's completion marker ({MARKER}): saved by another tool (or an older llmtune), and starting over "
            "here would overwrite them",
            f"to resume one: resume_from_checkpoint: {newest}; to start over, another output_dir",
        )


def _check_files(checkpoint: Path, marker: dict) -> None:
    """Every file the checkpoint was saved with is still there (the marker lists them); without a list, the
    Trainer's own state at least (it can't resume without it)."""
    listed = marker.get("files")
    have = set(files_in(checkpoint))
    if isinstance(listed, list):
        missing = sorted(set(listed) - have)
    elif marker.get("format") == "pipeline" or "trainer_state.json" in have:  # (a pipeline's: stage-K.pt)
        missing = []
    else:
        missing = ["trainer_state.json"]
    parent = checkpoint.parent
    if missing and listed is None and (parent / "trainer_state.json").is_file():  # a folder inside a checkpoint
        raise UserError(f"{checkpoint.name} is a folder inside the checkpoint {parent.name} (DeepSpeed's or FSDP's "
                        "state), not a checkpoint itself", f"set resume_from_checkpoint: {parent}")  # fmt: skip
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        what = (" (the optimizer's or the schedule's state: the Trainer would restart them without a word)"
                if any("optim" in name or "scheduler" in name for name in missing) else "")  # fmt: skip
        raise UserError(
            f"{checkpoint.name} lacks {shown}, which it was saved with{what}",
            f"copy them back into {checkpoint}, or resume an earlier checkpoint (resume_from_checkpoint: ...), or "
            f"start over in another output_dir",
        )


def _check_adapter(recipe, checkpoint: Path) -> None:
    """The adapter the checkpoint holds is the one the recipe builds: kind, rank, alpha, DoRA, rsLoRA, and the
    modules when the recipe lists them. A mismatch fails deep in loading, or (alpha) changes the model silently."""
    from llmtune.recipe.paths import check_checkpoint_kind

    check_checkpoint_kind(checkpoint, recipe.adapter, None)
    try:
        config = json.loads((checkpoint / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return
    if not recipe.adapter or not isinstance(config, dict) or recipe.lora_model_dir:
        return  # (an adapter loaded from lora_model_dir has that folder's shape, whatever lora_r and the rest say)
    wanted = {"r": recipe.lora_r, "lora_alpha": recipe.lora_alpha, "use_dora": recipe.peft_use_dora,
              "use_rslora": recipe.peft_use_rslora}  # fmt: skip
    names = {"r": "lora_r", "lora_alpha": "lora_alpha", "use_dora": "peft_use_dora", "use_rslora": "peft_use_rslora"}
    differ = [f"{names[k]} {config[k]} -> {v}" for k, v in wanted.items() if k in config and config[k] != v]
    targets = recipe.lora_target_modules
    if isinstance(targets, list) and not recipe.lora_target_linear and isinstance(config.get("target_modules"), list):
        if set(targets) != set(config["target_modules"]):
            differ.append(f"lora_target_modules {sorted(config['target_modules'])} -> {sorted(targets)}")
    if differ:
        raise UserError(
            f"{checkpoint.name} holds an adapter that the recipe no longer builds ({'; '.join(differ)}): a checkpoint "
            "resumes with the adapter it saved",
            f"set them back to resume it; to train the changed recipe from the start: {start_over(recipe)}",
        )


def _check_recipe(recipe, checkpoint: Path, marker: dict) -> list[str]:
    """The data and its order as they were (the resume skips the batches already trained, by count); the schedule's
    keys: what the resume does with a change."""
    saved = _saved_keys(checkpoint, marker)
    if not saved:
        return []
    model = saved.get("base_model")
    if model is not None and model != _model_key(recipe):
        raise UserError(
            f"{checkpoint.name} was trained from base_model {model}, and the recipe now names {_model_key(recipe)}: "
            f"the resume would load the checkpoint's {'adapter onto the other model' if recipe.adapter else 'weights'}"
            ", not train the model named",
            f"set base_model back to resume it; to train the changed recipe from the start: {start_over(recipe)}",
        )
    changed = [what for what, key, now in (("datasets (or shard, merge order, drop_last)", "data_key", data_key(recipe)),
                                           ("seed (the data order)", "data_seed", _data_seed(recipe)))
               if saved.get(key) is not None and saved[key] != now]  # fmt: skip
    if changed:
        raise UserError(
            f"{checkpoint.name} was trained with other {' and '.join(changed)}: the resume skips the batches already "
            "trained by count, which would skip and repeat other rows",
            f"set them back to resume it; to train the changed recipe from the start: {start_over(recipe)} (its "
            f"weights as a start: llmtune merge {checkpoint}, then base_model: the merged folder)",
        )
    notes = _optimizer_changes(recipe, checkpoint, saved.get("optimizer_settings") or {})
    schedule = saved.get("schedule") or {}
    changed = {k: (schedule[k], getattr(recipe, k, None)) for k in SCHEDULE_KEYS
               if k in schedule and schedule[k] != getattr(recipe, k, None)}  # fmt: skip
    if "learning_rate" in changed:
        before, now = changed.pop("learning_rate")
        notes.append(f"learning_rate {before} -> {now} since {checkpoint.name}: the resume keeps {before}, the rate "
                     "its scheduler state holds (the Trainer loads it over the recipe's); to train the changed "
                     f"recipe from the start: {start_over(recipe)}")  # fmt: skip
    if changed:
        shown = "; ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
        notes.append(f"{shown} since {checkpoint.name}: the new schedule takes over at the step the checkpoint "
                     "reached (its rate there, not a continuation of the saved one)")  # fmt: skip
    return notes


def optimizer_settings(recipe) -> dict:
    """The recipe's OPTIMIZER_KEYS as a marker holds them (JSON: lr_groups as mappings)."""
    return json.loads(json.dumps({key: getattr(recipe, key, None) for key in OPTIMIZER_KEYS},
                                 default=lambda value: value.model_dump(mode="json")))  # fmt: skip


def _optimizer_changes(recipe, checkpoint: Path, saved: dict) -> list[str]:
    """Another optimizer than the checkpoint's: refused (its state is another optimizer's: the Trainer failed mid-run
    on a missing key). Its settings changed: a note that the resume keeps the checkpoint's (the loaded state holds
    them; the log's per-group rates are the recipe's, not what steps)."""
    if weights_only(checkpoint):
        return []  # no optimizer state saved (save_only_model): a fresh one takes the recipe's settings
    now = optimizer_settings(recipe)
    changed = {k: (saved[k], now[k]) for k in OPTIMIZER_KEYS if k in saved and saved[k] != now[k]}
    if "optimizer" in changed:
        before, now = changed["optimizer"]
        raise UserError(f"{checkpoint.name} holds the state of optimizer {before}, and the recipe now names {now}: "
                        "the resume would load one optimizer's state into another",
                        f"set optimizer: {before} to resume it; to train on with {now}: llmtune merge {checkpoint}, "
                        f"then base_model: the merged folder in a new output_dir; or from the start: "
                        f"{start_over(recipe)}")  # fmt: skip
    if not changed:
        return []
    shown = "; ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items())
    return [f"{shown} since {checkpoint.name}: the resume keeps the checkpoint's (the optimizer state it loads holds "
            f"its own settings and each group's rate); to train with the new values from the start: "
            f"{start_over(recipe)}"]  # fmt: skip


def _saved_keys(checkpoint: Path, marker: dict) -> dict:
    """The marker's record of the recipe, else the recipe in the run's plan.json beside the checkpoint."""
    if "data_key" in marker:
        return marker
    try:
        payload = json.loads((checkpoint.parent / "llmtune" / "plan.json").read_text())
        from llmtune.recipe import Recipe

        return marker_keys(Recipe.model_validate(payload["recipe"]))
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def weights_only(checkpoint: Path) -> bool:
    """A checkpoint saved with save_only_model: no optimizer or scheduler state of any engine beside the weights."""
    return not any(next(checkpoint.glob(pattern), None) for pattern in
                   ("scheduler.pt", "optimizer*", "global_step*", "pytorch_model_fsdp*", "dcp_state", "*.distcp"))  # fmt: skip


def check_weights_only(recipe, strategy: str, title: str) -> str | None:
    """Resuming a weights-only checkpoint (save_only_model): one process or DDP continue its weights, step and
    learning-rate schedule with a fresh optimizer state (said in the plan); ZeRO and FSDP resume from their engine's
    own state, which isn't there: refused in one line, not every rank's traceback after loading."""
    checkpoint = resume_checkpoint(recipe)
    if checkpoint is None or not checkpoint.is_dir() or strategy in ("tp", "pipeline") or not weights_only(checkpoint):
        return None
    if strategy in ("single", "ddp"):
        return (f"resuming {checkpoint.name}, saved with save_only_model: its weights, step and learning-rate "
                "schedule go on; the optimizer's state (AdamW's moments) starts afresh, as none was saved")  # fmt: skip
    raise UserError(f"{checkpoint.name} holds the weights only (saved with save_only_model): {title} resumes from "
                    "its engine's own optimizer and model state, which wasn't saved",
                    f"{start_over(recipe)} to train from the start; to train on from these weights, use them as "
                    f"base_model in a new run (llmtune merge {checkpoint} first for an adapter)")  # fmt: skip


def weights_only_step(resume, marker: dict, strategy: str) -> int:
    """The step a weights-only checkpoint one process or DDP resumes was saved at (its schedule goes on from
    there); 0 for any other checkpoint."""
    if strategy not in ("single", "ddp") or not weights_only(Path(resume)):
        return 0
    return int(marker.get("step") or 0)
