"""The per-rank worker: `python -m llmtune.train <output_dir>/llmtune/plan.json`.

Every strategy runs this same code in each rank; the plan says what the rank is part of.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from llmtune.errors import EXIT_USER_ERROR, UserError
from llmtune.recipe import Recipe
from llmtune.recipe.loader import recipe_fingerprint
from llmtune.train import collectives, distributed, libraries
from llmtune.train.progress import log, mark, startup_seconds, track

TEST_HOOKS = ("LLMTUNE_TEST_EXIT_AFTER_STEP", "LLMTUNE_TEST_PAUSE_AFTER_STEP", "LLMTUNE_TEST_STEP_SLEEP")


def _tracking_env(recipe, output_dir: Path) -> None:
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


def _train_pipeline(recipe, plan, rank, model, data, tokenizer, source, gguf_origin, trainable, total) -> dict:
    from llmtune.train.adapters import attach_adapter
    from llmtune.train.memory import cuda_peaks
    from llmtune.train.model import load_model
    from llmtune.train.pipeline import gather_state_dict, train_pipeline
    from llmtune.train.ranks import gather, local_parameter_numel
    from llmtune.train.save import write_run_files

    output_dir = Path(recipe.output_dir)
    result = train_pipeline(recipe, plan, model, data, tokenizer, log)
    if "stopped_at" in result:
        return _stopped(result["stopped_at"])
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
        "rows_seen_this_run": result["rows_seen_this_run"], "tokens_seen": result["tokens_seen"],
        "resumed_from": result["resumed_from"], "steps_run": result["steps_run"],
        "tokens_per_second_whole_run": round(result["tokens_seen"] / result["seconds"], 2),
        "train_seconds": round(result["seconds"], 2),
        "world_size": rank.world_size, "strategy": "pipeline", "title": plan["title"],
        "global_batch_size": plan["global_batch_size"], "trainable_parameters": trainable, "total_parameters": total,
        "pipeline": {**plan["pipeline"], "layer_bounds": result["layers"]}, "packing_efficiency": data.stats.get("packing_efficiency"),
        "data": data.stats, "ranks": reports, "log_history": history, "recipe_fingerprint": recipe_fingerprint(recipe),
        **_planned_memory(recipe, plan),
    }  # fmt: skip
    if rank.is_main:
        # One consolidated HF folder: a fresh model (or base + adapter) takes every stage's trained weights.
        fresh = attach_adapter(
            load_model(recipe, source, tokenizer, plan["precision"], device=plan["cluster"]["device"]), recipe
        )
        missing = set(dict(fresh.named_parameters())) - set(state)
        if missing:
            raise RuntimeError(f"pipeline save: no stage held {sorted(missing)[:3]}")
        fresh.load_state_dict(state, strict=False)
        fresh.save_pretrained(str(output_dir))
        tokenizer.save_pretrained(str(output_dir))
        write_run_files(output_dir, recipe, plan, metrics, gguf_origin)
        log(f"saved to {output_dir} (final loss {metrics['final_loss']:.4f})")
    return metrics


def _stopped(step: int) -> dict:
    """Stopped on request: a checkpoint of this step is saved; the run is not finished (no final model, no metrics)."""
    log(f"stopped on request after step {step}; checkpoint-{step} is saved: run the same command to resume from it")
    return {"stopped_at": step}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _full_state_dict_for_final_save(trainer) -> None:
    """Checkpoints may be sharded, but the final model must be one HF folder: the Trainer saves nothing otherwise."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is not None and "SHARDED" in str(plugin.state_dict_type):
        plugin.set_state_dict_type("FULL_STATE_DICT")


def _planned_memory(recipe, plan: dict) -> dict:
    """On GPUs, the estimate of this plan's per-GPU memory, recorded beside the measured CUDA peaks."""
    if plan["cluster"]["device"] != "cuda":
        return {}
    from types import SimpleNamespace

    import torch

    from llmtune.plan.estimate import estimate_recipe, row_for_plan

    cluster, strategy = plan["cluster"], plan["strategy"]
    view = SimpleNamespace(strategy=strategy, offload=plan["offload"], accelerate_config=plan["accelerate_config"],
                           zero_stage=int(strategy[-1]) if strategy.startswith("zero") else 0)  # fmt: skip
    try:
        report = estimate_recipe(recipe, cluster["num_processes"] // cluster["num_machines"], cluster["num_machines"],
                                 torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)  # fmt: skip
        row = report.row(row_for_plan(view))
    except UserError:  # a model shape the estimate doesn't know: nothing to compare with
        return {}
    return {"estimate_total_bytes": int(row.total), "estimate_allocated_bytes": int(row.allocated)}


def _startup(first_step_end: float | None) -> dict[str, float]:
    """Seconds per phase from `llmtune train` to the end of the first optimizer step (engine start included)."""
    if first_step_end:
        mark("first_step", first_step_end)
    return startup_seconds()


def _merge_reports(first_batches: list[dict] | None, shards: list[dict]) -> list[dict]:
    by_rank = {r["rank"]: dict(r) for r in first_batches or []}
    for shard in shards:
        by_rank.setdefault(shard["rank"], {"rank": shard["rank"]}).update(shard)
    return [by_rank[r] for r in sorted(by_rank)]


def _write_probe(trainer, row: dict) -> None:
    """For tests: logits of the in-memory model at the end of training on the first row (LLMTUNE_PROBE_FILE)."""
    target = os.environ.get("LLMTUNE_PROBE_FILE")
    if not target:
        return
    import torch
    from safetensors.torch import save_file

    model = trainer.model
    model.eval()
    ids = torch.tensor([row["input_ids"]], device=trainer.args.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
    if int(os.environ.get("RANK", 0)) == 0:
        save_file({"input_ids": ids.cpu(), "logits": logits.contiguous()}, target)


def _library_bars_off() -> None:
    """transformers' own bars (loading and writing weights) are off: llmtune reports those phases itself. Hub
    downloads keep theirs, unless the user turned them off (HF_HUB_DISABLE_PROGRESS_BARS)."""
    import huggingface_hub.utils as hub
    from transformers.utils import logging as transformers_logging

    downloads = not hub.are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # turns the hub's off too
    if downloads:
        hub.enable_progress_bars()


def _resume_on_this_allocation(trainer, plan: dict, state, checkpoint: Path) -> None:
    """What the checkpoint's marker says the resumed run needs: the rows it had trained, the world size that saved
    its RNG states; and, for a ZeRO checkpoint on another data-parallel size (the plan said so), its conversion to
    DeepSpeed's universal checkpoint, by the first rank, before the engine loads it."""
    from llmtune.train.checkpoints import read_marker

    info = read_marker(checkpoint) or {}
    trainer.saved_world = info.get("world_size")
    trainer.rows_before = info.get("rows_seen")
    if (plan.get("deepspeed_config") or {}).get("checkpoint", {}).get("load_universal"):
        if state.is_main_process:
            from llmtune.train.universal import convert

            convert(checkpoint, log)
        state.wait_for_everyone()


def _reference_report(trainer, recipe) -> dict:
    if not recipe.rl:
        return {}
    from llmtune.train.rl import reference_report

    return reference_report(trainer)


def _preference_trainer(recipe, plan, model, args, data, tokenizer, source, callbacks):
    """TRL's trainer for the method (llmtune's in front); a full fine-tune's frozen reference loaded as the model
    was, so the strategy places it alike (ZeRO-3 partitions it as it loads; TRL prepares it for the engine)."""
    from llmtune.train.model import load_model
    from llmtune.train.rl import build_trainer, freeze, needs_reference_copy

    reference = None
    if needs_reference_copy(recipe):
        reference = freeze(load_model(recipe, source, tokenizer, plan["precision"], device=plan["cluster"]["device"],
                                      frozen=True))  # fmt: skip
        log(f"reference model: a frozen copy of the starting weights ({plan['strategy']})")
    elif recipe.rl in ("dpo", "ipo", "kto"):
        log("reference model: " + ("log-probs precomputed before training" if recipe.precompute_ref_log_probs else
                                   "the base model with the adapter switched off"
                                   if not recipe.lora_model_dir else "the starting adapter, copied and frozen"))  # fmt: skip
    elif recipe.rl in ("grpo", "gdpo"):
        beta = (recipe.trl or {}).get("beta", recipe.rl_beta)
        log("reference model: " + ("none (beta 0, TRL's default: no KL term)" if not beta else "the base model with the adapter "
                                   "switched off" if recipe.adapter else "a frozen copy TRL loads and places"))  # fmt: skip
    try:
        return build_trainer(recipe, model, reference, args, data, tokenizer, callbacks)
    except ValueError as err:  # TRL refuses a combination when it builds the trainer (e.g. a LoRA on lm_head)
        raise UserError(
            f"rl: {recipe.rl}: TRL refuses this setup: {str(err).splitlines()[0]}", "change the key it names"
        ) from None


def _batches(recipe: Recipe, plan: dict, model):
    """The plan's batch layout on this rank: padding-free batches where the loaded model's attention takes them
    (the model is switched to the varlen kernel), padded rows elsewhere; said in one line."""
    from llmtune.recipe.batches import PADDED, Batches
    from llmtune.train import varlen
    from llmtune.train.kernels import kernels_for

    batches = kernels_for(recipe, plan["precision"], plan["cluster"]["device"]).batches
    if batches.padding_free and not varlen.apply(model, batches.attention):
        why = varlen.unsupported(model)
        if recipe.batch_flattening is True:
            raise UserError(f"batch_flattening: true can't run with this model: {why}", "remove batch_flattening")
        batches = Batches(PADDED, reason=why)
    log(f"batches: {batches.describe()}")
    return batches


def train(recipe: Recipe, plan: dict, rank: distributed.RankInfo) -> dict:
    _library_bars_off()
    from accelerate import PartialState
    from transformers import set_seed

    from llmtune.train.adapters import attach_adapter, parameter_counts
    from llmtune.train.arguments import training_arguments
    from llmtune.train.callbacks import (
        LossWatchdog,
        ProgressLines,
        StepStats,
        StopOnNonFiniteLoss,
        StopOnRequest,
        TestKillAfterSave,
    )  # fmt: skip
    from llmtune.train.checkpoints import clear_staging, resume_point
    from llmtune.train.data.collate import Collator, FlatCollator
    from llmtune.train.data.prepare import prepare_data
    from llmtune.train.model import load_model, load_tokenizer, model_source
    from llmtune.train.objectives import LayerSampling, eaft_for
    from llmtune.train.save import write_run_files
    from llmtune.train.trainer import LlmtuneTrainer, Rows

    output_dir = Path(recipe.output_dir)
    state = PartialState()
    set_seed(recipe.seed)
    with state.main_process_first():
        source, gguf_origin = model_source(recipe)
        tokenizer = load_tokenizer(recipe, source)
        data = prepare_data(recipe, tokenizer, track)  # rl: preference rows as TRL's strings
    stats = data.stats
    mark("data")  # tokenizer, transformers, the data read and tokenized (or the cache read)
    if recipe.rl in ("grpo", "gdpo"):
        log(f"data: {stats['train_examples']} train / {stats['eval_examples']} eval prompts (read; TRL generates "
            f"their completions); {stats['dropped_too_long']} longer than sequence_len minus the completion budget "
            "dropped")  # fmt: skip
    elif recipe.rl:
        log(f"data: {stats['train_examples']} train / {stats['eval_examples']} eval preference rows (read; TRL "
            f"tokenizes them); {stats['dropped_too_long']} longer than sequence_len dropped, {stats['truncated']} to "
            f"be truncated, {stats['dropped_long_prompt']} with a prompt over max_prompt_len dropped")  # fmt: skip
    else:
        log(f"data: {stats['train_examples']} train / {stats['eval_examples']} eval examples "
            f"({'cache hit' if stats['cache_hit'] else 'tokenized'}; {stats['dropped_too_long']} longer than "
            f"sequence_len {'truncated' if recipe.excess_length_strategy == 'truncate' else 'dropped'}, "
            f"{stats['dropped_no_labels']} without trained tokens)" + (f", packing efficiency {stats['packing_efficiency']:.1%}" if recipe.sample_packing else ""))  # fmt: skip
    args = None
    if plan["strategy"] != "pipeline":
        # Built before the model: under ZeRO-3 this registers DeepSpeed's config, so from_pretrained creates the
        # parameters already partitioned (zero3_init_flag) and no rank ever holds the whole model.
        _tracking_env(recipe, output_dir)
        from llmtune.recipe.kernels import compile_arguments

        method = {}
        if recipe.rl:
            from llmtune.train.rl import config_arguments, trl_classes

            method = {"config_class": trl_classes(recipe.rl)[0],
                      **config_arguments(recipe, plan["cluster"]["device"],
                                         (plan.get("kernels") or {}).get("vllm_share"))}  # fmt: skip
        try:
            args = training_arguments(recipe, plan, len(data.train), data.eval is not None, **rank.training_kwargs,
                                      **compile_arguments(recipe, plan["cluster"]["device"]), **method)  # fmt: skip
        except ValueError as err:  # TRL's config refuses a combination (e.g. GRPO's batch vs num_generations)
            if not recipe.rl:
                raise
            raise UserError(
                f"rl: {recipe.rl}: TRL refuses these settings: {str(err).splitlines()[0]}",
                "change the keys it names (trl: section, micro_batch_size, gradient_accumulation_steps)",
            ) from None
    loading = time.time()
    model = attach_adapter(
        load_model(recipe, source, tokenizer, plan["precision"], device=plan["cluster"]["device"],
                   mesh=plan.get("mesh") if plan["strategy"] == "tp" else None), recipe,
    )  # fmt: skip
    loaded_rss = peak_rss_bytes()  # the peak so far: loading the model (and, under ZeRO-3, partitioning it)
    mark("model")  # TrainingArguments (the engine's config), the model built, loaded and adapted
    trainable, total = parameter_counts(model)
    log(
        f"model: {type(model).__name__}, trainable {trainable:,} of {total:,} parameters ({trainable / total:.2%}); "
        f"loaded in {time.time() - loading:.1f} s"
    )
    qat_report, qat_delay = None, None
    if recipe.qat:
        from llmtune.train import qat

        qat_report = qat.prepare(model, recipe.qat)
        log(f"{qat_report['scheme']}: {sum(qat_report['modules'].values())} modules fake-quantized")
        if recipe.qat.fake_quant_after_n_steps:
            qat_delay = qat.DelayedFakeQuant(recipe.qat.fake_quant_after_n_steps)
    cp = (plan.get("mesh") or {}).get("context_parallel", 1)
    if args is None:
        return _train_pipeline(recipe, plan, rank, model, data, tokenizer, source, gguf_origin, trainable, total)
    pad_to = recipe.sequence_len if recipe.pad_to_sequence_len else None
    batches = _batches(recipe, plan, model)
    if batches.padding_free:
        collator = FlatCollator(tokenizer.pad_token_id, pad_to)
    else:
        collator = Collator(tokenizer.pad_token_id, pad_to, multiple_of=2 * cp if cp > 1 else 1, mask=cp == 1)
    loss_func, metrics_func = eaft_for(recipe), None
    if recipe.reward_model or recipe.process_reward_model:
        from llmtune.train.data.reward import PairCollator, pairwise_loss, reward_metrics

        metrics_func = reward_metrics if data.eval else None
        if recipe.reward_model:
            collator, loss_func = (
                PairCollator(tokenizer.pad_token_id, pad_to),
                pairwise_loss(recipe.center_rewards_coefficient),
            )
    callbacks = [StopOnNonFiniteLoss()] + ([TestKillAfterSave()] if any(k in os.environ for k in TEST_HOOKS) else [])
    if recipe.rl:
        trainer = _preference_trainer(recipe, plan, model, args, data, tokenizer, source, callbacks)
    else:
        trainer = LlmtuneTrainer(
            model=model, args=args, train_dataset=Rows(data.train), eval_dataset=Rows(data.eval) if data.eval else None,
            data_collator=collator, processing_class=tokenizer, compute_loss_func=loss_func,
            compute_metrics=metrics_func, callbacks=callbacks,
        )  # fmt: skip
    trainer.plan, trainer.recipe = plan, recipe
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its dict lines show numbers as strings; ProgressLines replaces them
    trainer.add_callback(ProgressLines(trainer, plan["data_parallel_size"]))
    if qat_delay:
        trainer.add_callback(qat_delay)
    if cp > 1:  # attention-only models; and what each rank's model really sees of a row (the report checks)
        from llmtune.train.ranks import SequenceSeen, check_attention_only

        check_attention_only(model)
        seen = SequenceSeen(model)
    lisa = None
    if recipe.lisa_n_layers:
        lisa = LayerSampling(model, recipe.lisa_n_layers, recipe.lisa_step_interval, recipe.lisa_layers_attribute,
                             recipe.seed)  # fmt: skip
        trainer.add_callback(lisa)
    relora = None
    if recipe.relora:  # merges and restarts the LoRA; the LR around restarts is the trainer's scheduler's
        from llmtune.train.relora import ReLoRA

        relora = ReLoRA(model, recipe, output_dir)
        trainer.add_callback(relora)
    step_stats = StepStats(trainer)
    trainer.add_callback(step_stats)
    if recipe.async_checkpoint:
        trainer.enable_async_checkpoints(on_cuda=plan["cluster"]["device"] == "cuda")
    from llmtune.train.watchdog import StallWatchdog

    trainer.add_callback(StallWatchdog(output_dir, rank.rank, recipe.stall_timeout))
    sync_watch = None
    if os.environ.get("LLMTUNE_TEST_SYNC_DEBUG") == "1":
        from llmtune.train.callbacks import HostSyncWatch

        sync_watch = HostSyncWatch()
        trainer.add_callback(sync_watch)
    profiler = None
    if recipe.profiler_steps:
        from llmtune.train.profile import DEFAULT_START, ProfileSteps

        start = recipe.profiler_steps_start if recipe.profiler_steps_start is not None else DEFAULT_START
        profiler = ProfileSteps(output_dir / "llmtune" / "profile", rank.rank, recipe.profiler_steps, start)
        trainer.add_callback(profiler)
    stop = StopOnRequest(plan["config_dir"])
    trainer.add_callback(stop)
    if recipe.loss_watchdog_threshold is not None:
        trainer.add_callback(LossWatchdog(recipe.loss_watchdog_threshold, recipe.loss_watchdog_patience))
    if state.is_local_main_process:
        clear_staging(output_dir)  # whatever a killed save left half-written
    state.wait_for_everyone()
    weights_only = plan["strategy"] == "tp" and recipe.save_only_model  # TP snapshots can't resume
    resume = resume_point(recipe, log) if not weights_only else None
    if resume:
        log(f"resuming from {resume}")
        _resume_on_this_allocation(trainer, plan, state, Path(resume))
    from llmtune.train.memory import ModelStateMeter

    meter = ModelStateMeter(trainer.model, lambda: trainer.model_wrapped)
    mark("trainer")  # the Trainer and its callbacks
    started = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    meter.close()
    if stop.stopped_at is not None:
        return _stopped(stop.stopped_at)
    seconds = time.time() - started
    metrics = {"train_loss": result.training_loss}
    if data.eval:
        metrics.update(trainer.evaluate())
    steady_tokens, steady_seconds = step_stats.steady()
    tokens, rows, steady_tokens, steady_seconds = collectives.sum_values(
        [trainer.tokens_seen, trainer.rows_seen, steady_tokens, steady_seconds]
    )
    steady_seconds /= rank.world_size  # every rank times the same synchronised steps
    from llmtune.train.memory import cuda_peaks
    from llmtune.train.ranks import engine_report, gather, local_parameter_numel

    shards = gather({"rank": rank.rank, "local_parameters": local_parameter_numel(trainer.model),
                     "model_state_bytes": meter.result, "peak_rss_bytes": peak_rss_bytes(),
                     "peak_rss_at_load_bytes": loaded_rss, **cuda_peaks(),
                     **({"sequence_seen": seen.lengths} if cp > 1 else {}),
                     "optimizer_class": type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__,
                     "optimizer_fused": bool(getattr(getattr(trainer.optimizer, "optimizer", trainer.optimizer),
                                                     "defaults", {}).get("fused")),
                     "libraries": libraries.imported(), **({"profile": profiler.report} if profiler else {}),
                     **({"host_syncs": sync_watch.syncs, "sync_steps_watched": sync_watch.steps_watched}
                        if sync_watch else {}),
                     **engine_report(trainer), **_reference_report(trainer, recipe)})  # fmt: skip
    trainer._check_finite()
    _full_state_dict_for_final_save(trainer)
    trainer.save_model(str(output_dir))
    (output_dir / "training_args.bin").unlink(missing_ok=True)  # a pickle; plan.json records the same
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    metrics.update(
        final_loss=losses[-1] if losses else None, steps=trainer.state.global_step,
        # rows: over the whole run, the resumed checkpoint's included (None when its marker didn't count them)
        rows_seen=trainer.rows_before + int(rows) if trainer.rows_before is not None else None,
        rows_seen_this_run=int(rows), tokens_seen=int(tokens),
        # the whole train() call (engine start, first-step compilation included) and the steps after the warm-up
        tokens_per_second_whole_run=round(tokens / seconds, 2) if seconds else None, train_seconds=round(seconds, 2),
        tokens_per_second_steady=round(steady_tokens / steady_seconds, 2) if steady_seconds else None,
        world_size=rank.world_size, strategy=plan["strategy"], title=plan["title"],
        global_batch_size=plan["global_batch_size"], trainable_parameters=trainable, total_parameters=total,
        packing_efficiency=stats.get("packing_efficiency"), data=stats, ranks=_merge_reports(trainer.rank_reports, shards),
        log_history=trainer.state.log_history, recipe_fingerprint=recipe_fingerprint(recipe),
        step_seconds=step_stats.seconds, step_real_tokens=step_stats.real, step_padded_tokens=step_stats.padded,
        step_batch_hashes=step_stats.hashes or None, batches=batches.to_dict(), checkpoints=trainer.checkpoint_times,
        first_step_end_unix=step_stats.first_step_end_unix,
        startup_seconds=_startup(step_stats.first_step_end_unix),
        resumed_from=resume, **_planned_memory(recipe, plan),
    )  # fmt: skip
    if recipe.rl:
        from llmtune.train.rl import summary

        metrics["preference"] = summary(recipe, trainer.state.log_history, shards[0])
    if profiler:
        metrics["profile"] = profiler.report
        log(profiler.line())
    if lisa:
        metrics["lisa"] = {"layers": len(lisa.layers), "draws": lisa.history}
    if relora:
        metrics["relora"] = relora.report()
        if rank.is_main:  # the Trainer saved the last cycle's adapter: every cycle's, stacked, replaces it
            relora.save_adapter(output_dir)
    if qat_report:
        metrics["qat"] = {**qat_report, "fake_quant_from_step": qat_delay.enabled_at if qat_delay else 0}
    if not recipe.rl:
        _write_probe(trainer, data.train[0])
    if rank.is_main:
        tokenizer.save_pretrained(str(output_dir))
        write_run_files(output_dir, recipe, plan, metrics, gguf_origin)
        log(f"saved to {output_dir} (train loss {metrics['train_loss']:.4f}"
            + (f", eval loss {metrics['eval_loss']:.4f})" if "eval_loss" in metrics else ")"))  # fmt: skip
    return metrics


def main(argv: list[str]) -> int:
    mark("launch")  # this rank started: Python and llmtune's light imports
    if len(argv) != 1:
        print("usage: python -m llmtune.train <output_dir>/llmtune/plan.json", file=sys.stderr)
        return EXIT_USER_ERROR
    payload = json.loads(Path(argv[0]).read_text())
    recipe = Recipe.model_validate(payload["recipe"])
    if payload.get("recipe_path"):  # where the recipe's own Python files are (GRPO's rewards and transforms)
        os.environ.setdefault("LLMTUNE_RECIPE_DIR", str(Path(payload["recipe_path"]).resolve().parent))
    plan = payload["plan"]
    libraries.hide_unused(recipe, plan)
    try:
        rank = distributed.setup(plan, recipe.ddp_timeout)
        mark("process_group")  # torch imported, the rank's device and process group set
        train(recipe, plan, rank)
    except UserError as err:
        # No barrier on the way out: the other ranks may be inside a collective and would wait forever.
        # The launcher sees this rank exit and stops the rest.
        print(f"error: {err.one_line()}", file=sys.stderr)
        return EXIT_USER_ERROR
    collectives.teardown()
    return 0  # `python -m llmtune.train` then ends without finalizing the interpreter (see __main__.py)
