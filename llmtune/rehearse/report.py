"""What a rehearsal tells about the GPU run: the sizes and batch arithmetic, the data at full scale, whether the
ranks saw distinct data, memory per rank (measured on the shrunken model beside the estimate of the same
shape, then the estimate of the real one), the checkpoint's layout and size at full scale, and what the GPU run
does that the rehearsal could not.

Memory: `llmtune estimate`'s formulas (plan/memory/) are checked against what each rank really held
(metrics.json ranks[].model_state_bytes) on the shrunken model, in fp32 as the rehearsal runs; the same formulas
then give the real model's figure in the recipe's precision. Agreement within MEMORY_TOLERANCE is the check.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

MEMORY_TOLERANCE = 0.10  # what tests/integration/test_distributed.py requires of the estimate on 2 ranks
# estimate rows whose model states are the same bytes as the row named, held on the CPU instead of the GPU
SAME_STATES = {"ZeRO-2 + CPU offload": "ZeRO-2", "ZeRO-3 + CPU offload": "ZeRO-3", "ZeRO-3 + NVMe offload": "ZeRO-3"}
GB = 1e9


def _gb(value: float | None) -> str:
    return "?" if value is None else f"{value / GB:.2f} GB" if value >= 0.1 * GB else f"{value / 1e6:.1f} MB"


def parallel_sizes(plan) -> dict:
    stages = plan.pipeline.stages if plan.pipeline else 1
    accumulation = "micro-batches" if plan.pipeline else "accumulation"
    return {"strategy": plan.title, "world_size": plan.world_size, "num_machines": plan.cluster.num_machines,
            "processes_per_machine": plan.cluster.processes_per_machine, "data_parallel_size": plan.data_parallel_size,
            "pipeline_stages": stages, "micro_batch_size": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.gradient_accumulation_steps, "global_batch_size": plan.global_batch_size,
            "global_batch": f"{plan.global_batch_size} = micro {plan.micro_batch_size} x {accumulation} "
                            f"{plan.gradient_accumulation_steps} x data-parallel {plan.data_parallel_size}"}  # fmt: skip


def full_scale_data(recipe, plan, data) -> dict:
    """The sampled rows' numbers at the recipe's sequence_len, and the full run's steps and tokens from them."""
    from llmtune.train.engine.arguments import steps_per_epoch

    stats = data.stats
    train_sources = [s for s in data.sources if s.label.startswith("datasets")]
    sampled = sum(s.rows_sampled for s in train_sources)
    totals = [None if s.stand_in else s.rows_total for s in train_sources]  # a stand-in says nothing of the size
    total = None if None in totals else sum(totals)
    rows = stats.get("train_rows") or stats.get("train_examples") or 0
    full_rows = round(rows * total / sampled) if total is not None and sampled else None
    sizes = {"micro_batch_size": plan.micro_batch_size, "data_parallel_size": plan.data_parallel_size,
             "gradient_accumulation_steps": plan.gradient_accumulation_steps}  # fmt: skip
    per_epoch = steps_per_epoch(full_rows, sizes, recipe.dataloader_drop_last) if full_rows else None
    rows_per_step = plan.micro_batch_size * plan.data_parallel_size * plan.gradient_accumulation_steps
    per_thousand = round(1000 * rows / sampled / rows_per_step, 2) if sampled else None
    total_steps = recipe.max_steps or (math.ceil(per_epoch * recipe.num_epochs) if per_epoch else None)
    fixed = recipe.sample_packing or recipe.pad_to_sequence_len
    # preference and GRPO rows are tokenized by TRL's trainer, after this check: their tokens are not counted here
    mean_tokens = stats["train_tokens"] / rows if rows and "train_tokens" in stats else None
    return {
        "sources": [
            {
                "label": s.label,
                "path": s.path,
                "rows_total": s.rows_total,
                "rows_sampled": s.rows_sampled,
                "stand_in": s.stand_in,
            }
            for s in data.sources
        ],
        "sampled": data.sampled,
        "sequence_len": recipe.sequence_len,
        "checked_at_real_sequence_len": stats,
        "train_rows_full": full_rows,
        "steps_per_epoch": per_epoch,
        "total_steps": total_steps,
        "steps_per_1000_source_rows": per_thousand,
        "token_slots_per_step": plan.global_batch_size * recipe.sequence_len if fixed else None,
        "real_tokens_per_step": None if mean_tokens is None else round(plan.global_batch_size * mean_tokens),
        "stand_in": any(s.stand_in for s in data.sources),
    }


def distinct_data(metrics: dict, mesh: dict | None = None) -> dict:
    """Whether each data-parallel group read its own first batch: the consecutive ranks of a tensor- or
    context-parallel group split one batch, so a run of N ranks in groups of G has N / G distinct first batches."""
    batches = [r.get("first_batch") for r in metrics.get("ranks", []) if r.get("first_batch")]
    if not batches:
        return {"checked": False, "why": "this strategy's loop does not fingerprint first batches (pipeline)"}
    from llmtune.plan.mesh import ranks_per_batch

    group = ranks_per_batch(mesh)
    return {"checked": True, "ranks": len(batches), "distinct_first_batches": len(set(batches)),
            "ranks_per_batch": group, "ok": len(set(batches)) == len(batches) // group}  # fmt: skip


def memory(recipe, rehearsal, plan, shrunk, gpu_memory: float, metrics: dict) -> dict:
    """Measured model states per rank vs the estimate for the shrunken shape (fp32), and the full-scale figures."""
    from llmtune.plan.memory.buffers import FIT_FRACTION
    from llmtune.plan.memory.fit import estimate_recipe, row_for_plan

    cluster = plan.cluster
    name = row_for_plan(plan)
    same = SAME_STATES.get(name, name)
    small = estimate_recipe(rehearsal, cluster.processes_per_machine, cluster.num_machines, gpu_memory,
                            facts=shrunk.shrunk, mixed=False)  # fmt: skip
    full = estimate_recipe(recipe, cluster.processes_per_machine, cluster.num_machines, gpu_memory, facts=shrunk.full)
    expected_row, full_same, full_row = small.row(same), full.row(same), full.row(name)
    expected = expected_row.model_states + expected_row.step_copy
    measured = [sum(r["model_state_bytes"].values()) for r in metrics.get("ranks", []) if r.get("model_state_bytes")]
    result = {"estimate_row": name, "tolerance": MEMORY_TOLERANCE, "shrunk_estimate_bytes": expected,
              "measured_bytes_per_rank": measured,
              "full_model_states_per_rank_bytes": full_same.model_states + full_same.step_copy,
              "full_gpu_total_per_rank_bytes": full_row.total, "full_gpu_allocated_per_rank_bytes": full_row.allocated,
              "full_cpu_offload_per_machine_bytes": full_row.cpu, "full_nvme_per_machine_bytes": full_row.nvme,
              "gpu_memory_bytes": gpu_memory, "fits": full.fits(full_row), "fit_fraction": FIT_FRACTION,
              "recommended": full.choice[0].strategy if full.choice else None}  # fmt: skip
    if not measured:
        result.update(checked=False, why="this strategy's loop does not measure model states (pipeline)")
    elif plan.strategy == "zero1":
        result.update(checked=False, why="ZeRO-1's full gradients live only during backward, where the step-time "
                                         "measurement can't see them")  # fmt: skip
    else:
        ratio = max(measured) / expected if expected else float("inf")
        result.update(checked=True, ratio=ratio, ok=abs(ratio - 1) <= MEMORY_TOLERANCE,
                      full_scaled_measurement_bytes=ratio * result["full_model_states_per_rank_bytes"])  # fmt: skip
    return result


_RANKED = [(re.compile(r"pp_rank_\d+"), "pp_rank_{r}"), (re.compile(r"__\d+_\d+\.distcp$"), "__{r}_0.distcp"),
           (re.compile(r"rng_state_\d+"), "rng_state_{r}"), (re.compile(r"global_step\d+"), "global_step{N}"),
           (re.compile(r"^stage-\d+\.pt$"), "stage-{s}.pt")]  # fmt: skip


def _kind(relative: str) -> str:
    lowered = relative.lower()
    if "optim" in lowered:
        return "optimizer"
    # pipeline stages: a stage's trained weights and their optimizer states in one file, both scale alike
    weights = (".safetensors", ".distcp", "model_states.pt")
    if lowered.endswith(weights) or re.search(r"pytorch_model.*\.bin$|^stage-\d+\.pt$", lowered):
        return "weights"
    return "other"


def checkpoint(recipe, plan, shrunk, folder: Path, trainable: int, total: int) -> dict:
    """The checkpoint's files (rank numbers folded into {r}) and their size at full scale: weights scale with the
    parameters they hold (in 16 bits where DeepSpeed keeps them so), optimizer states with the trainable ones."""
    from llmtune.plan.memory.compute import is_mixed
    from llmtune.plan.memory.states import trainable_parameters

    full_trainable = trainable_parameters(recipe, shrunk.full)
    basis = (full_trainable / trainable) if recipe.adapter else (shrunk.full.total_params() / total)
    sixteen = plan.strategy.startswith("zero") and is_mixed(recipe)
    scale = {"weights": basis * (0.5 if sixteen else 1.0), "optimizer": full_trainable / trainable, "other": 1.0}
    groups: dict[str, dict] = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = str(path.relative_to(folder))
        pattern = relative
        for regex, replacement in _RANKED:
            pattern = regex.sub(replacement, pattern)
        group = groups.setdefault(pattern, {"files": 0, "bytes": 0, "kind": _kind(relative)})
        group["files"] += 1
        group["bytes"] += path.stat().st_size
    measured = sum(g["bytes"] for g in groups.values())
    full = sum(g["bytes"] * scale[g["kind"]] for g in groups.values())
    return {"folder": folder.name, "layout": groups, "rehearsal_bytes": measured, "full_scale_bytes": full,
            "scaling": {k: round(v, 2) for k, v in scale.items()}}  # fmt: skip


def kept_checkpoint(recipe, plan, shrunk, stopped_at: Path, run_dir: Path, metrics: dict) -> dict:
    """The checkpoint the rehearsal stopped at, or, where save_total_limit rotated it away during the resumed run,
    the last one kept (said in `rotated`)."""
    from llmtune.plan.checkpoint_layout import last_complete

    folder = stopped_at if stopped_at.is_dir() else last_complete(run_dir)
    sizes = (metrics["trainable_parameters"], metrics["total_parameters"])
    found = checkpoint(recipe, plan, shrunk, folder, *sizes) if folder is not None else \
        {"folder": None, "layout": {}, "rehearsal_bytes": 0, "full_scale_bytes": 0}  # fmt: skip
    if folder != stopped_at:
        found["rotated"] = stopped_at.name
    return found


def differences(recipe, rehearsal, plan, gpu_plan, shrunk, tokenizer, data) -> tuple[list[str], list[str]]:
    """(what the GPU run does differently, what the rehearsal could not check)."""
    different = [
        f"precision: the GPU run computes in {gpu_plan.precision}; the rehearsal ran fp32",
        f"collectives: NCCL on GPUs; gloo here ({plan.world_size} CPU processes"
        + (f", {plan.cluster.num_machines} launchers on 127.0.0.1)" if plan.cluster.num_machines > 1 else ")"),
        f"model: {shrunk.full.num_layers} layers, hidden {shrunk.full.hidden_size}, "
        f"{shrunk.full.total_params() / 1e9:.2f}B parameters on GPUs; rehearsed with "
        f"{', '.join(shrunk.changes)} ({shrunk.shrunk.total_params() / 1e6:.1f}M, random weights)",
    ]
    if gpu_plan.kernels.get("summary"):
        different.append(f"kernels: {gpu_plan.kernels['summary']} on GPUs; off in the rehearsal")
    if plan.strategy.startswith("zero"):
        different.append("DeepSpeed: CUDA accelerator and pinned-memory offload on GPUs; its CPU accelerator here")
    if rehearsal.sequence_len < recipe.sequence_len:
        different.append(f"sequence_len: {recipe.sequence_len} on GPUs; the shrunken run packed/truncated rows to "
                         f"{rehearsal.sequence_len} (the data itself was checked at {recipe.sequence_len})")  # fmt: skip
    if recipe.load_in_4bit or recipe.load_in_8bit:
        different.append("quantized base: bitsandbytes' CUDA kernels on GPUs; its CPU path here")
    unchecked = ["activation, logits and allocator memory at full size (only model states are measured here; "
                 "the estimate's GPU terms are calibrated on an H100, see docs/estimate.md)",
                 "speed: step time and throughput on CPU say nothing about the GPUs",
                 "failures only NCCL or CUDA shows (a collective on a CPU tensor, out-of-memory)"]  # fmt: skip
    if not tokenizer.real:
        unchecked.append(f"the real tokenizer: {tokenizer.note}")
    unchecked += [n for n in data.notes]
    if data.sampled:
        unchecked.append("rows past the sample (the first rows of each source were read)")
    return different, unchecked


def build_report(*, recipe, rehearsal, plan, gpu_plan, shrunk, full, tokenizer, data, metrics, checkpoint_dir,
                 merged, timings, notes, options) -> dict:  # fmt: skip
    from llmtune.plan.memory.table import parse_size_option

    gpu_memory = parse_size_option("--gpu-memory", options.gpu_memory)
    logged = [e for e in metrics.get("log_history", []) if "loss" in e]  # the steps logging_steps logged
    losses, loss_steps = [e["loss"] for e in logged], [e.get("step") for e in logged]
    run_dir = Path(rehearsal.output_dir)
    different, unchecked = differences(recipe, rehearsal, plan, gpu_plan, shrunk, tokenizer, data)
    return {
        "recipe": recipe.base_model,
        "parallel": parallel_sizes(gpu_plan),
        "model": {
            "config_from": full.source,
            "full": vars(shrunk.full),
            "shrunk": vars(shrunk.shrunk),
            "changes": shrunk.changes,
            "full_parameters": shrunk.full.total_params(),
            "shrunk_parameters": shrunk.shrunk.total_params(),
            "folder": rehearsal.base_model,
        },  # fmt: skip
        "tokenizer": {"location": tokenizer.location, "real": tokenizer.real, "note": tokenizer.note},
        "data": full_scale_data(recipe, gpu_plan, data),
        "ranks": distinct_data(metrics, plan.mesh),
        "memory": memory(recipe, rehearsal, plan, shrunk, gpu_memory, metrics),
        "checkpoint": kept_checkpoint(recipe, plan, shrunk, checkpoint_dir, run_dir, metrics),
        "run": {
            "steps": metrics.get("steps"),
            "stopped_after_step": int(checkpoint_dir.name.rsplit("-", 1)[-1]),
            "resumed_from": metrics.get("resumed_from"),
            "losses": losses,
            "loss_steps": loss_steps,
            "logging_steps": recipe.logging_steps,
            "final_loss": losses[-1] if losses else metrics.get("final_loss"),
            "final_loss_step": loss_steps[-1] if losses else None,
            "train_loss": metrics.get("train_loss"),
            "train_loss_steps": metrics.get("train_loss_steps"),
            "merged": str(merged.output),
            "merged_bytes": merged.total_bytes,
            "merged_shards": len(merged.shards),
            "output": str(Path(rehearsal.output_dir)),
        },  # fmt: skip
        "gpu_run_differs": different,
        "not_checked": unchecked,
        "notes": notes,
        "timings_s": timings,
    }


def _other_drops(stats: dict) -> str:
    """min_sample_len's and dataset_exact_deduplication's drops, where there were any."""
    shown = [f"{stats[key]} {words}" for key, words in (("dropped_too_short", "shorter than min_sample_len"),
             ("dropped_duplicates", "duplicates")) if stats.get(key)]  # fmt: skip
    return "".join(f", {phrase}" for phrase in shown)


def _fit(mem: dict) -> str:
    """Fits or not, against the limit `llmtune train`'s check applies (a fraction of the GPU's memory)."""
    fraction = mem.get("fit_fraction", 1.0)
    limit = f"{fraction:.0%} of that, {_gb(fraction * mem['gpu_memory_bytes'])}"
    if mem["fits"]:
        return f"fits {_gb(mem['gpu_memory_bytes'])} GPUs (under {limit}, as llmtune train checks)"
    return f"does NOT fit {_gb(mem['gpu_memory_bytes'])} GPUs (llmtune train refuses above {limit})"


def _losses(run: dict) -> str:
    """The losses logged, at their steps (logging_steps may skip some), and the train loss the run printed."""
    steps = [s for s in run.get("loss_steps") or [] if s is not None]
    at = f" at step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else ""
    logged = ", ".join(f"{x:.3f}" for x in run["losses"])
    text = f"losses {logged}{at}" if logged else "no loss logged"
    if run.get("logging_steps", 1) > 1:
        text += f" (logging_steps {run['logging_steps']:g})"
    span = run.get("train_loss_steps")
    if run.get("train_loss") is not None and span:
        where = f"step {span[0]}" if span[0] == span[-1] else f"steps {span[0]}-{span[-1]}"
        text += f"; train loss {run['train_loss']:.3f} over {where} (the resumed run)"
    return text


def report_lines(report: dict) -> list[tuple[str, str]]:
    par, data, ranks, mem, ckpt, run = (report[k] for k in ("parallel", "data", "ranks", "memory", "checkpoint", "run"))
    lines = [("world", f"{par['world_size']} = {par['num_machines']} machine(s) x {par['processes_per_machine']}; "
                       f"data parallel {par['data_parallel_size']}, pipeline stages {par['pipeline_stages']}"),
             ("global batch", par["global_batch"])]  # fmt: skip
    per_epoch = data["steps_per_epoch"]
    unknown = " (the dataset's size is unknown" + (": STAND-IN data)" if data["stand_in"] else ")")
    lines.append(("full run", f"{per_epoch or '?'} steps per epoch, {data['total_steps'] or '?'} steps in all"
                              f"{'' if per_epoch else unknown}; {data['steps_per_1000_source_rows']} steps per 1,000 "
                              "rows of data"))  # fmt: skip
    slots = f"{data['token_slots_per_step']:,} token slots, " if data["token_slots_per_step"] else ""
    real = data["real_tokens_per_step"]
    lines.append(("tokens/step", f"{slots}~{real:,} real tokens" if real is not None else
                                 f"{slots}real tokens unknown (TRL's trainer tokenizes these rows itself)"))  # fmt: skip
    stats = data["checked_at_real_sequence_len"]
    sample = "a sample: the first rows of each source" if data["sampled"] else "every row"
    packing = f", packing efficiency {stats['packing_efficiency']:.1%}" if stats.get("packing_efficiency") else ""
    lines.append(("data", f"{stats['rows']} rows read ({sample}) at sequence_len {data['sequence_len']}: "
                          f"{stats['train_examples']} train / {stats['eval_examples']} eval examples, "
                          f"{stats['dropped_too_long']} too long, {stats['dropped_no_labels']} without trained "
                          f"tokens{_other_drops(stats)}{packing}"))  # fmt: skip
    if ranks["checked"]:
        split = ranks.get("ranks_per_batch", 1)
        each = f" (each split by {split} ranks)" if split > 1 else ""
        lines.append(("ranks", f"{ranks['distinct_first_batches']} distinct first batches of {ranks['ranks']} ranks{each}"
                               + ("" if ranks["ok"] else ": SOME RANKS SAW THE SAME DATA")))  # fmt: skip
    if mem.get("checked"):
        verdict = "agree" if mem["ok"] else "DISAGREE"
        lines.append(("model states", f"measured {_gb(max(mem['measured_bytes_per_rank']))} per rank vs estimate "
                                      f"{_gb(mem['shrunk_estimate_bytes'])} for the shrunken model ({mem['ratio']:.3f}x: "
                                      f"{verdict} within {mem['tolerance']:.0%})"))  # fmt: skip
    offload = mem["full_cpu_offload_per_machine_bytes"]
    where = " (in CPU memory: offloaded)" if offload else ""
    lines.append(("full scale", f"{mem['estimate_row']}: model states {_gb(mem['full_model_states_per_rank_bytes'])} "
                                f"per rank{where}; estimated GPU total {_gb(mem['full_gpu_total_per_rank_bytes'])} per GPU"
                                + (f", CPU offload {_gb(offload)} per machine" if offload else "")
                                + f"; {_fit(mem)}"))  # fmt: skip
    layout = ", ".join(f"{name}{' x' + str(g['files']) if g['files'] > 1 else ''}"
                       for name, g in ckpt["layout"].items() if g["kind"] != "other")  # fmt: skip
    rotated = f"{ckpt['rotated']} rotated away (save_total_limit); " if ckpt.get("rotated") else ""
    lines.append(("checkpoint", f"{rotated}{ckpt['folder']} kept: {layout}; {_gb(ckpt['rehearsal_bytes'])} here, "
                                f"~{_gb(ckpt['full_scale_bytes'])} at full scale" if ckpt["folder"] else
                                f"{rotated}none kept"))  # fmt: skip
    lines.append(("run", f"{run['steps']} steps, stopped after step {run['stopped_after_step']} and resumed; "
                         f"{_losses(run)}; merged {_gb(run['merged_bytes'])}"))  # fmt: skip
    lines += [("gpu differs", text) for text in report["gpu_run_differs"]]
    lines += [("not checked", text) for text in report["not_checked"]]
    lines.append(("time", ", ".join(f"{k.removesuffix('_s')} {v:.0f} s" for k, v in report["timings_s"].items())))
    return lines


def print_report(report: dict, echo: Callable[[str], None]) -> None:
    echo("rehearsal report")
    for key, value in report_lines(report):
        echo(f"{key:>14}  {value}")


def failed_checks(report: dict) -> list[str]:
    """What the rehearsal checked and found wrong, one line each; the rehearsal exits 1 when there is any."""
    failed = []
    ranks, mem = report["ranks"], report["memory"]
    if ranks.get("checked") and not ranks["ok"]:
        split, distinct = ranks.get("ranks_per_batch", 1), ranks["distinct_first_batches"]
        expected = ranks["ranks"] // split
        failed.append(f"{ranks['ranks']} ranks saw {distinct} distinct first batches where {expected} were expected"
                      + (f" (one per group of {split} ranks that split a batch)" if split > 1 else "") + ": "
                      + ("some data-parallel ranks trained on the same rows, so they would repeat work instead of "
                         "splitting it" if distinct < expected else "ranks that share one batch read different rows"))  # fmt: skip
    if mem.get("checked") and not mem["ok"]:
        scaled, low = _gb(mem["full_scaled_measurement_bytes"]), mem["ratio"] > 1
        failed.append(f"the ranks held {mem['ratio']:.2f}x the model states the estimate gives this recipe: its "
                      f"full-scale figures are {'low' if low else 'high'} (scaled by the measurement, {scaled} per "
                      "rank of model states), so " + ("a GPU run it says fits may run out of memory; plan with the "
                      "scaled figure" if low else "it may recommend more GPUs or offload than the run needs"))  # fmt: skip
    return failed
