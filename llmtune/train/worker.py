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
from llmtune.plan.checks import wrap_class_error
from llmtune.recipe import Recipe
from llmtune.recipe.loader import recipe_fingerprint
from llmtune.train.engine.arguments import tracking_env
from llmtune.train.runtime import collectives, distributed, libraries
from llmtune.train.runtime.hooks import write_probe
from llmtune.train.runtime.progress import library_bars_off, log, mark, track
from llmtune.train.runtime.report import merge_reports, peak_rss_bytes, planned_memory, startup, stopped

TEST_HOOKS = ("LLMTUNE_TEST_EXIT_AFTER_STEP", "LLMTUNE_TEST_PAUSE_AFTER_STEP", "LLMTUNE_TEST_STEP_SLEEP")


def _check_rows(marker: dict, dataset, resume: str) -> None:
    """The resume skips the batches already trained by count: data with another number of rows than the checkpoint
    was trained on (the same files, edited) would have it skip and repeat other rows."""
    saved = marker.get("rows_per_epoch")
    if isinstance(saved, int) and dataset is not None and len(dataset) != saved:
        raise UserError(
            f"{Path(resume).name} was trained on {saved} rows per epoch; the data gives {len(dataset)} now (its files "
            "changed since): the resume skips the batches already trained by count, which would skip and repeat "
            "other rows",
            f"restore the data to resume it; to train on the new data from its weights: llmtune merge {resume}, then "
            "base_model: the merged folder, in another output_dir",
        )


def _outcome(recipe, metrics: dict) -> str:
    """The saved line's figures: the losses; online RL's is the mean reward (its loss is near 0 by construction)."""
    from llmtune.recipe.preference import ONLINE_METHODS

    if recipe.rl in ONLINE_METHODS:
        last = (metrics.get("preference") or {}).get("last") or {}
        shown = [f"{name} {metrics_value:.4f}" for name, metrics_value in
                 (("mean reward", last.get("reward")), ("eval mean reward", metrics.get("eval_reward")))
                 if isinstance(metrics_value, int | float)]  # fmt: skip
        return ", ".join(shown) or "no reward logged"
    best = f" (best checkpoint, step {metrics['best_step']})" if "best_step" in metrics else ""
    span = metrics.get("train_loss_steps")
    steps = f" (steps {span[0]}-{span[1]}, since the resume)" if span else ""
    return f"train loss {metrics['train_loss']:.4f}{steps}" + (
        f", eval loss {metrics['eval_loss']:.4f}{best}" if "eval_loss" in metrics else "")  # fmt: skip


def _reference_report(trainer, recipe) -> dict:
    if not recipe.rl:
        return {}
    from llmtune.train.rl.trainers import reference_report

    return reference_report(trainer)


def _save_model(trainer, folder: Path, relora, main: bool) -> None:
    trainer.save_model(str(folder))  # a collective where the model is sharded: every rank calls it
    if main:
        from llmtune.train.checkpoint.final import check_saved_adapter

        check_saved_adapter(folder, trainer.model)
    (folder / "training_args.bin").unlink(missing_ok=True)  # a pickle; plan.json records the same
    if relora is not None and main:  # the Trainer saved the last cycle's adapter: every cycle's, stacked, replaces it
        relora.save_adapter(folder)


def train(recipe: Recipe, plan: dict, rank: distributed.RankInfo) -> dict:
    library_bars_off()
    if plan["cluster"]["device"] == "cuda" and recipe.unfrozen_parameters and not recipe.adapter:
        from llmtune.plan.memory.unfrozen import unfrozen_share

        unfrozen_share(recipe)  # the names, on the meta device, before ZeRO-3's context exists (planned_memory)
    from accelerate import PartialState
    from transformers import set_seed

    from llmtune.train.checkpoint.manager import CheckpointManager, full_state_dict_for_final_save
    from llmtune.train.data.collate import Collator, FlatCollator
    from llmtune.train.data.counts import data_line
    from llmtune.train.data.prepare import prepare_data
    from llmtune.train.data.rows import even_rows
    from llmtune.train.engine.arguments import training_arguments
    from llmtune.train.engine.callbacks import (
        LossWatchdog,
        ProgressLines,
        StepStats,
        StopOnNonFiniteLoss,
        StopOnRequest,
        TestKillAfterSave,
        early_stopping,
        final_evaluation,
    )  # fmt: skip
    from llmtune.train.engine.trainer import LlmtuneTrainer, Rows
    from llmtune.train.model.adapters import attach_adapter, frozen_experts, frozen_linears, parameter_counts
    from llmtune.train.model.load import load_model, load_tokenizer, model_source
    from llmtune.train.objectives.losses import LayerSampling, eaft_for

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
            f"be truncated, {stats['dropped_long_prompt']} with a prompt over max_prompt_len dropped"
            + (f", {stats['truncated_prompt']} cut to its last max_prompt_len tokens" if stats.get("truncated_prompt")
               else ""))  # fmt: skip
    else:
        log(data_line(recipe, stats, plan))
    args = None
    if plan["strategy"] != "pipeline":
        # Built before the model: under ZeRO-3 this registers DeepSpeed's config, so from_pretrained creates the
        # parameters already partitioned (zero3_init_flag) and no rank ever holds the whole model.
        tracking_env(recipe, output_dir)
        from llmtune.recipe.kernels import compile_arguments

        method = {}
        if recipe.rl:
            from llmtune.train.rl.trainers import config_arguments, trl_classes

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
    for frozen in (frozen_experts(model), frozen_linears(model, recipe)) if recipe.adapter else ():
        if frozen:
            log(f"note: {frozen}")
    qat_report, qat_delay = None, None
    if recipe.qat:
        from llmtune.train.model import qat

        qat_report = qat.prepare(model, recipe.qat)
        log(f"{qat_report['scheme']}: {sum(qat_report['modules'].values())} modules fake-quantized")
        if recipe.qat.fake_quant_after_n_steps:
            qat_delay = qat.DelayedFakeQuant(recipe.qat.fake_quant_after_n_steps)
    cp = (plan.get("mesh") or {}).get("context_parallel", 1)
    # the run's one checkpoint manager: where it resumes from (found and read here, once), every checkpoint, the
    # final files
    checkpoints = CheckpointManager(output_dir, plan, recipe)
    resume = checkpoints.resume_point(log)
    marker = checkpoints.prepare_resume(resume, log, model) if resume else {}  # its rows, the world that saved its RNG
    if args is None:
        from llmtune.train.pipeline.run import run_pipeline

        return run_pipeline(recipe, plan, rank, model, data, tokenizer, source, gguf_origin, trainable, total,
                            checkpoints, resume, log)  # fmt: skip
    pad_to = recipe.sequence_len if recipe.pad_to_sequence_len else None
    from llmtune.recipe.batches import SEQUENCE_SPLIT
    from llmtune.train.model.kernels import batch_layout

    batches = batch_layout(recipe, plan, model, log)
    if batches.padding_free:
        collator = FlatCollator(tokenizer.pad_token_id, pad_to)
    elif batches.layout == SEQUENCE_SPLIT:  # DeepSpeed's Ulysses: its data adapter splits each row into cp chunks
        # and gathers a group's batches first, which gloo does only for batches of one shape: there, full rows
        gloo = distributed.backend_of(plan) == "gloo"
        collator = Collator(tokenizer.pad_token_id, recipe.sequence_len if gloo else pad_to, multiple_of=cp,
                            mask=False, positions=True)  # fmt: skip
        # the attention the model now runs (accelerate's name check at construction doesn't list llmtune_varlen)
        args.parallelism_config.sp_handler.sp_attn_implementation = batches.attention or "sdpa"
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
    callbacks = [StopOnNonFiniteLoss(), *early_stopping(recipe, bool(data.eval))]
    callbacks += [TestKillAfterSave()] if any(k in os.environ for k in TEST_HOOKS) else []
    if recipe.rl:
        from llmtune.train.rl.trainers import preference_trainer

        trainer = preference_trainer(recipe, plan, model, args, data, tokenizer, source, callbacks, log)
    else:
        trainer = LlmtuneTrainer(
            model=model, args=args, train_dataset=Rows(data.train), eval_dataset=Rows(even_rows(data.eval, args, plan, tokenizer, bool(recipe.reward_model or recipe.process_reward_model))) if data.eval else None,
            data_collator=collator, processing_class=tokenizer, compute_loss_func=loss_func,
            compute_metrics=metrics_func, callbacks=callbacks,
        )  # fmt: skip
    trainer.plan, trainer.recipe, trainer.checkpoints = plan, recipe, checkpoints
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # its dict lines show numbers as strings; ProgressLines replaces them
    trainer.add_callback(ProgressLines(trainer, plan["data_parallel_size"]))
    if qat_delay:
        trainer.add_callback(qat_delay)
    if cp > 1:  # attention-only models; and what each rank's model really sees of a row (the report checks)
        from llmtune.train.runtime.ranks import SequenceSeen, check_attention_only

        check_attention_only(model)
        seen = SequenceSeen(model)
    lisa = None
    if recipe.lisa_n_layers:
        lisa = LayerSampling(model, recipe.lisa_n_layers, recipe.lisa_step_interval, recipe.lisa_layers_attribute,
                             recipe.seed)  # fmt: skip
        trainer.add_callback(lisa)
    relora = None
    if recipe.relora:  # merges and restarts the LoRA; the LR around restarts is the trainer's scheduler's
        from llmtune.train.objectives.relora import ReLoRA

        relora = ReLoRA(model, recipe, output_dir)
        trainer.add_callback(relora)
    step_stats = StepStats(trainer)
    trainer.add_callback(step_stats)
    if recipe.async_checkpoint:
        trainer.enable_async_checkpoints(on_cuda=plan["cluster"]["device"] == "cuda")
    from llmtune.train.runtime.watchdog import StallWatchdog

    trainer.add_callback(StallWatchdog(output_dir, rank.rank, recipe.stall_timeout))
    sync_watch = None
    if os.environ.get("LLMTUNE_TEST_SYNC_DEBUG") == "1":
        from llmtune.train.engine.callbacks import HostSyncWatch

        sync_watch = HostSyncWatch()
        trainer.add_callback(sync_watch)
    profiler = None
    if recipe.profiler_steps:
        from llmtune.train.runtime.profile import DEFAULT_START, ProfileSteps

        start = recipe.profiler_steps_start if recipe.profiler_steps_start is not None else DEFAULT_START
        profiler = ProfileSteps(output_dir / "llmtune" / "profile", rank.rank, recipe.profiler_steps, start)
        trainer.add_callback(profiler)
    stop = StopOnRequest(plan["config_dir"])
    trainer.add_callback(stop)
    if recipe.loss_watchdog_threshold is not None:
        trainer.add_callback(LossWatchdog(recipe.loss_watchdog_threshold, recipe.loss_watchdog_patience))
    if resume:
        _check_rows(marker, trainer.train_dataset, resume)
        log(f"resuming from {resume}")
        if batches.layout == SEQUENCE_SPLIT:
            from llmtune.train.engine.callbacks import UlyssesResume

            args.ignore_data_skip = True  # (UlyssesResume skips the trained batches instead)
            trainer.add_callback(UlyssesResume(trainer, resume))
        from llmtune.plan.resume import started_from
        from llmtune.plan.resume_checks import weights_only_step

        trainer.saved_world, trainer.rows_before = marker.get("world_size"), marker.get("rows_seen")
        trainer.tokens_before = marker.get("tokens_seen")
        trainer.scheduler_from_step = weights_only_step(resume, marker, plan["strategy"])
        trainer.started_from = started_from(resume, output_dir, marker)
    from llmtune.train.runtime.memory import ModelStateMeter

    meter = ModelStateMeter(trainer.model, lambda: trainer.model_wrapped)
    mark("trainer")  # the Trainer and its callbacks
    started = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    meter.close()
    if stop.stopped_at is not None:
        return stopped(stop.stopped_at)
    seconds = time.time() - started
    metrics = {"train_loss": result.training_loss}
    if resume:  # the Trainer's train loss is the mean over this launch's steps only
        metrics["train_loss_steps"] = [int(marker.get("step") or 0) + 1, trainer.state.global_step]
    if data.eval:
        metrics.update(final_evaluation(trainer))
    steady_tokens, steady_seconds = step_stats.steady()
    # the ranks of a tensor- or context-parallel group each count the rows they split (Ulysses: every row of the
    # group passes through every rank, a chunk at a time), so the sums count each row once per rank of a group
    from llmtune.plan.mesh import ranks_per_batch

    group = ranks_per_batch(plan.get("mesh"))
    tokens, rows, steady_tokens, steady_seconds = collectives.sum_values(
        [trainer.tokens_seen / group, trainer.rows_seen / group, steady_tokens / group, steady_seconds]
    )
    steady_seconds /= rank.world_size  # every rank times the same synchronised steps
    from llmtune.train.runtime.memory import cuda_peaks
    from llmtune.train.runtime.ranks import (
        checkpointing_report,
        engine_report,
        gather,
        local_parameter_numel,
        optimizer_report,
    )

    shards = gather({"rank": rank.rank, "local_parameters": local_parameter_numel(trainer.model),
                     "model_state_bytes": meter.result, "peak_rss_bytes": peak_rss_bytes(),
                     "peak_rss_at_load_bytes": loaded_rss, **cuda_peaks(),
                     **({"sequence_seen": seen.lengths} if cp > 1 else {}),
                     **optimizer_report(trainer.optimizer),
                     "libraries": libraries.imported(), **({"profile": profiler.report} if profiler else {}),
                     **({"host_syncs": sync_watch.syncs, "sync_steps_watched": sync_watch.steps_watched}
                        if sync_watch else {}),
                     "activation_checkpointing": checkpointing_report(trainer.model),
                     **engine_report(trainer), **_reference_report(trainer, recipe)})  # fmt: skip
    trainer._check_finite()
    full_state_dict_for_final_save(trainer)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    metrics.update(
        final_loss=losses[-1] if losses else None, steps=trainer.state.global_step,
        # rows: over the whole run, the resumed checkpoint's included (None when its marker didn't count them)
        rows_seen=trainer.rows_before + round(rows) if trainer.rows_before is not None else None,
        rows_seen_this_run=round(rows), tokens_seen_this_run=round(tokens),
        tokens_seen=trainer.tokens_before + round(tokens) if trainer.tokens_before is not None else None,
        # the whole train() call (engine start, first-step compilation included) and the steps after the warm-up
        tokens_per_second_whole_run=round(tokens / seconds, 2) if seconds else None, train_seconds=round(seconds, 2),
        tokens_per_second_steady=round(steady_tokens / steady_seconds, 2) if steady_seconds else None,
        world_size=rank.world_size, strategy=plan["strategy"], title=plan["title"],
        global_batch_size=plan["global_batch_size"], trainable_parameters=trainable, total_parameters=total,
        packing_efficiency=stats.get("packing_efficiency"), data=stats, ranks=merge_reports(trainer.rank_reports, shards),
        log_history=trainer.state.log_history, recipe_fingerprint=recipe_fingerprint(recipe),
        step_seconds=step_stats.seconds, step_real_tokens=step_stats.real, step_padded_tokens=step_stats.padded,
        step_batch_hashes=step_stats.hashes or None, batches=batches.to_dict(), checkpoints=trainer.checkpoint_times,
        first_step_end_unix=step_stats.first_step_end_unix,
        startup_seconds=startup(step_stats.first_step_end_unix),
        resumed_from=resume, **planned_memory(recipe, plan),
    )  # fmt: skip
    if recipe.rl:
        from llmtune.train.rl.trainers import summary

        metrics["preference"] = summary(recipe, trainer.state.log_history, shards[0])
    if profiler:
        metrics["profile"] = profiler.report
        log(profiler.line())
    if lisa:
        metrics["lisa"] = {"layers": len(lisa.layers), "draws": lisa.history}
    if relora:
        metrics["relora"] = relora.report()
    if qat_report:
        metrics["qat"] = {**qat_report, "fake_quant_from_step": qat_delay.enabled_at if qat_delay else 0}
    if not recipe.rl:
        write_probe(trainer, data.train[0])
    checkpoints.save_final(lambda folder: _save_model(trainer, folder, relora, rank.is_main), tokenizer, metrics,
                           gguf_origin, rank.is_main)  # fmt: skip
    if rank.is_main:
        log(f"saved to {output_dir} ({_outcome(recipe, metrics)})")
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
    try:
        libraries.hide_unused(recipe, plan)
        libraries.ask_cpu_info_once(plan)
        rank = distributed.setup(plan, recipe.ddp_timeout)
        mark("process_group")  # torch imported, the rank's device and process group set
        train(recipe, plan, rank)
    except (UserError, ValueError) as err:
        # No barrier on the way out: the other ranks may be inside a collective and would wait forever.
        # The launcher sees this rank exit and stops the rest.
        user = err if isinstance(err, UserError) else wrap_class_error(err)
        if user is None:
            raise
        print(f"error: {user.one_line()}", file=sys.stderr)
        return EXIT_USER_ERROR
    collectives.teardown()
    return 0  # `python -m llmtune.train` then ends without finalizing the interpreter (see __main__.py)
