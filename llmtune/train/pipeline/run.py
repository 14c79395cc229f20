"""A pipeline run of one rank, from the loop to metrics.json and the one consolidated model folder, saved through
the checkpoint manager."""

from __future__ import annotations

from pathlib import Path


def run_pipeline(
    recipe,
    plan,
    rank,
    model,
    data,
    tokenizer,
    source,
    gguf_origin,
    trainable,
    total,
    checkpoints,
    resume: str | None,
    log,
) -> dict:
    """The pipeline run of a rank, from the loop to metrics.json and the one consolidated model folder."""
    from llmtune.recipe.loader import recipe_fingerprint
    from llmtune.train.model.adapters import attach_adapter
    from llmtune.train.model.load import load_model
    from llmtune.train.pipeline.loop import gather_state_dict, train_pipeline
    from llmtune.train.runtime import libraries
    from llmtune.train.runtime.memory import cuda_peaks
    from llmtune.train.runtime.ranks import gather, local_parameter_numel
    from llmtune.train.runtime.report import planned_memory, stopped

    output_dir = Path(recipe.output_dir)
    result = train_pipeline(recipe, plan, model, data, tokenizer, log, checkpoints, resume)
    if "stopped_at" in result:
        return stopped(result["stopped_at"])
    grid = result["grid"]
    reports = gather({"rank": rank.rank, "stage": grid.stage, "replica": grid.replica, "schedule": result["schedule"],
                      "stage_indices": result["stage_indices"], "layer_indices": result["layer_indices"],
                      "local_parameters": local_parameter_numel(result["stage_module"]), "world_size": rank.world_size,
                      "libraries": libraries.imported(), **cuda_peaks()})  # fmt: skip
    state = gather_state_dict(result)
    history = result["history"]
    metrics = {
        "train_loss": sum(e["loss"] for e in history) / len(history), "final_loss": history[-1]["loss"],
        "steps": result["steps"], "rows_seen": result["rows_seen"],
        "rows_seen_this_run": result["rows_seen_this_run"], "tokens_seen_this_run": result["tokens_seen"],
        "tokens_seen": None if result["resumed_from"] else result["tokens_seen"],  # the checkpoint doesn't count them
        "resumed_from": result["resumed_from"], "steps_run": result["steps_run"],
        "tokens_per_second_whole_run": round(result["tokens_seen"] / result["seconds"], 2),
        "train_seconds": round(result["seconds"], 2),
        "world_size": rank.world_size, "strategy": "pipeline", "title": plan["title"],
        "global_batch_size": plan["global_batch_size"], "trainable_parameters": trainable, "total_parameters": total,
        "pipeline": {**plan["pipeline"], "layer_bounds": result["layers"]}, "packing_efficiency": data.stats.get("packing_efficiency"),
        "data": data.stats, "ranks": reports, "log_history": history, "recipe_fingerprint": recipe_fingerprint(recipe),
        **planned_memory(recipe, plan),
    }  # fmt: skip

    def write_model(folder: Path) -> None:
        """One consolidated HF folder, by the first rank: a fresh model (or base + adapter) takes every stage's
        trained weights."""
        if not rank.is_main:
            return
        fresh = attach_adapter(
            load_model(recipe, source, tokenizer, plan["precision"], device=plan["cluster"]["device"]), recipe
        )
        missing = set(dict(fresh.named_parameters())) - set(state)
        if missing:
            raise RuntimeError(f"pipeline save: no stage held {sorted(missing)[:3]}")
        fresh.load_state_dict(state, strict=False)
        fresh.save_pretrained(str(folder))

    checkpoints.save_final(write_model, tokenizer, metrics, gguf_origin, rank.is_main)
    if rank.is_main:
        log(f"saved to {output_dir} (final loss {metrics['final_loss']:.4f})")
    return metrics
