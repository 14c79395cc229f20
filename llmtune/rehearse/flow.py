"""The rehearsal itself: a copy of the recipe on the shrunken model and sampled data, launched as `llmtune train`
launches it (same plan, same launcher, same worker), stopped after its first step by the stop request SIGUSR1
makes, resumed from that checkpoint to the end, saved, and merged with `llmtune merge`'s function.

Every "machine" of a multi-machine plan is a launcher on 127.0.0.1 (machine 0 in this process, the others in
forked processes), so the lobby, the rendezvous and the cross-machine collectives run as they would.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from llmtune.errors import UserError
from llmtune.rehearse.data import DEFAULT_SAMPLE_ROWS

STEPS = 2  # step 1, then the stop (a checkpoint); the resumed run does step 2 and saves
DEFAULT_SEQUENCE_LEN = 128  # the shrunken run's longest row: logits of a full vocabulary stay small on CPU
# The output layer (hidden x the real vocabulary) is most of a shrunken model's work: at hidden 64 an 8-rank
# rehearsal of a 128k-vocabulary model takes minutes on 2 cores; the real head dimension (--keep-head-dim) costs
# 8x more there (hidden 512 for Llama-3.1-8B's 4 query heads per key/value head of 128).
DEFAULT_HIDDEN = 64
REPORT = "rehearsal.json"


@dataclass
class RehearsalOptions:
    output: Path | None = None  # default: ./rehearsals/<recipe name>
    hidden_size: int | None = None  # None: the fewest heads at the real head dimension (the CLI's default: 64)
    layers: int | None = None  # default: what the plan needs (one per pipeline stage, at least 2)
    sequence_len: int | None = None  # of the shrunken run; default min(recipe's, DEFAULT_SEQUENCE_LEN)
    sample_rows: int = DEFAULT_SAMPLE_ROWS
    stand_in_tokenizer: str | None = None
    stand_in_data: list[str] = field(default_factory=list)
    gpu_memory: str = "80GB"  # the GPUs the full-scale estimate is judged against


@dataclass
class ClusterFlags:
    num_processes: int | None = None
    num_machines: int = 1
    main_process_port: int | None = None
    launcher: str = "accelerate"


def _echo(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _prepare_output(output: Path) -> None:
    """A fresh rehearsal folder; an earlier rehearsal's is replaced, anything else is left alone."""
    from llmtune.plan.files import make_folder, writing

    if output.is_dir() and any(output.iterdir()):
        if not (output / REPORT).exists() and not (output / "run" / "llmtune").exists():
            raise UserError(f"{output} exists and is not a rehearsal folder", "pass --output to another folder")
        with writing(output):
            shutil.rmtree(output)
    make_folder(output)


def cpu_swaps(recipe) -> tuple[dict, list[str]]:
    """GPU-only settings the plan doesn't already turn off on CPU, and what the rehearsal runs in their place (the
    recipe's keys to change, the notes that say so): the rest of the recipe is still rehearsed."""
    changes: dict = {}
    notes: list[str] = []
    if recipe.attn_implementation == "flex_attention":  # torch's FlexAttention has no backward on CPU
        changes.update(attn_implementation="sdpa", flex_attention=False)
        notes.append("attn_implementation: flex_attention runs as sdpa in the CPU rehearsal (FlexAttention has no "
                     "backward on CPU); the GPUs run flex_attention")  # fmt: skip
    return changes, notes


def stand_in_tokens(recipe, choice, model_type: str | None) -> tuple[dict, list[str]]:
    """A stand-in tokenizer that lacks tokens the recipe adds (Llama 3's <|eot_id|> in the fixture's): under an
    adapter that would be refused as rows left frozen, which the real tokenizer (that has them) never meets. The
    rehearsal trains the input embedding and the head whole for them, and says so."""
    from llmtune.plan.memory.facts import embedding_modules_of
    from llmtune.plan.vocabulary import new_tokens, wanted_tokens

    if choice.real or not recipe.adapter or not wanted_tokens(recipe):
        return {}, []
    from transformers import AutoTokenizer

    new = new_tokens(recipe, set(AutoTokenizer.from_pretrained(choice.location).get_vocab()))
    modules = list(embedding_modules_of(model_type))
    saved = list(recipe.lora_modules_to_save or [])
    if not new or all(module in saved for module in modules):
        return {}, []
    tokens = ", ".join(dict.fromkeys(token for _, token in new))
    return {"lora_modules_to_save": list(dict.fromkeys([*saved, *modules]))}, [
        f"the stand-in tokenizer lacks {tokens}, which the recipe adds: the rehearsal trains {' and '.join(modules)} "
        "whole for them (the real run checks its own tokenizer, which may hold them)"]  # fmt: skip


def rehearsal_mapping(recipe, model_dir: Path, tokenizer: str, sources, output: Path, sequence_len: int) -> dict:
    """The recipe the ranks run: the original with the shrunken model, the sampled data, a short run."""
    # what the recipe set, no more: the plan's notes and checks read which keys a recipe sets (FSDP1 keys, bf16)
    data = recipe.model_dump(mode="json", exclude_unset=True)
    groups: dict[str, list] = {"datasets": [], "test_datasets": []}
    for source in sources:
        groups[source.label.split("[")[0]].append(source.spec)
    shorter = sequence_len < recipe.sequence_len
    data.update(
        base_model=str(model_dir), base_model_config=None, revision_of_model=None, tokenizer_config=tokenizer,
        datasets=groups["datasets"], test_datasets=groups["test_datasets"] or None, sequence_len=sequence_len,
        max_steps=STEPS, output_dir=str(output / "run"), dataset_prepared_path=str(output / "prepared"),
        resume_from_checkpoint=None, auto_resume_from_checkpoints=True, streaming=False,
    )  # fmt: skip
    if shorter:
        data["excess_length_strategy"] = "truncate"
    data.update(cpu_swaps(recipe)[0])
    if recipe.trackers:  # nothing of the rehearsal reaches a tracking server
        data.update(wandb_mode="offline", mlflow_tracking_uri=None)
    return {key: value for key, value in data.items() if key in type(recipe).model_fields}


def _stop_after_first_step(config_dir: Path) -> None:
    """Ask the ranks to checkpoint and stop after their first step, as `kill -USR1` does: the launcher clears an
    old request when it starts, so the request is made again right after that."""
    from llmtune.train.checkpoint.folders import STOP_FILE

    stop = config_dir / STOP_FILE
    stop.parent.mkdir(parents=True, exist_ok=True)
    stop.touch()

    def again() -> None:
        deadline = time.monotonic() + 900
        while stop.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        stop.touch()

    threading.Thread(target=again, daemon=True).start()


def _machine(plan, extra: list[str], timeout: float) -> None:
    from llmtune.launch.runner import run

    os._exit(run(plan, extra, timeout))


def launch(plans: list, extra: list[str], timeout: float) -> int:
    """Every machine's launcher: machine 0 here, the others forked; the first failure's exit code."""
    from llmtune.launch.runner import run

    context = multiprocessing.get_context("fork")
    others = [context.Process(target=_machine, args=(plan, extra, timeout), daemon=True) for plan in plans[1:]]
    for process in others:
        process.start()
    code = run(plans[0], extra, timeout)
    for process in others:
        process.join(timeout=None if code == 0 else 60)
        if process.is_alive():
            process.terminate()
            process.join()
        code = code or process.exitcode or 0
    return code


def _clusters(flags: ClusterFlags) -> list:
    """One CPU cluster per machine rank, all on 127.0.0.1, validated as `llmtune train` validates its flags."""
    from llmtune.launch.net import free_port
    from llmtune.plan import make_cluster

    port = flags.main_process_port or free_port()
    processes = flags.num_processes or flags.num_machines  # without the flag: one process per machine, as on CPU
    return [make_cluster(processes, flags.num_machines, rank, "127.0.0.1", port, "cpu", flags.launcher)
            for rank in range(flags.num_machines)]  # fmt: skip


def _gpu_plan(recipe, cluster):
    """The plan as the GPUs will run it (precision, kernels), whatever this machine has."""
    from dataclasses import replace

    from llmtune.plan import make_plan

    return make_plan(recipe, replace(cluster, device="cuda", backend="nccl"))


@dataclass
class _Model:
    full: object  # plan.shrink.FullConfig
    shrunk: object  # plan.shrink.Shrunk
    tokenizer_choice: object  # rehearse.model.TokenizerChoice
    tokenizer: object
    folder: Path
    notes: list[str]  # sizes the recipe's keys raised (lisa_n_layers, qat's groups), the stand-in's tokens
    recipe_changes: dict  # what the rehearsal's recipe changes for the stand-in tokenizer (stand_in_tokens)


def _shrunken_model(recipe, gpu_plan, options: RehearsalOptions, online: bool, echo) -> _Model:
    from llmtune.plan.shrink import KBIT_CPU_BLOCK, layers_needed
    from llmtune.rehearse import model as rehearsal_model

    full, gguf_tokenizer = rehearsal_model.full_config(recipe, online)
    pipeline = gpu_plan.pipeline
    needed = layers_needed(pipeline.stages, pipeline.virtual_stages) if pipeline else layers_needed()
    # a k-bit base evaluated on CPU runs bitsandbytes' packed kernel, which needs widths in blocks of 64
    evaluates = recipe.val_set_size or recipe.test_datasets
    multiple = KBIT_CPU_BLOCK if (recipe.load_in_4bit or recipe.load_in_8bit) and evaluates else 1
    split = (gpu_plan.mesh or {}).get("context_parallel", 1) if recipe.deepspeed is not None else 1  # Ulysses
    shrunk, notes = rehearsal_model.shrink_for(recipe, full.config, needed, options.hidden_size, options.layers,
                                               multiple, split)  # fmt: skip
    choice = rehearsal_model.choose_tokenizer(recipe, gguf_tokenizer, options.stand_in_tokenizer, online)
    changes, said = stand_in_tokens(recipe, choice, full.config.get("model_type"))
    notes = [*notes, *said]
    tokenizer = rehearsal_model.load_rehearsal_tokenizer(recipe.model_copy(update=changes), choice)
    echo(f"[llmtune] rehearsal: {recipe.base_model} shrunk ({', '.join(shrunk.changes)}); {choice.note}")
    folder = rehearsal_model.materialise(shrunk.config, recipe.base_model, tokenizer)
    return _Model(full, shrunk, choice, tokenizer, folder, notes, changes)


def _unfrozen_in_shrunk(mapping: dict, shrunk, recipe) -> tuple[dict, list[str]]:
    """unfrozen_parameters entries that name layers the shrunken model doesn't have (Spectrum's and Axolotl's
    lists name layers by number) are left out of the rehearsal, said; the real plan checked them on the real model
    where its names could be read (an entry matching nothing there was refused)."""
    from llmtune.plan.memory.unfrozen import parameter_names, unmatched_patterns
    from llmtune.recipe import Recipe

    if not mapping.get("unfrozen_parameters") or mapping.get("adapter"):
        return mapping, []
    unmatched, _ = unmatched_patterns(Recipe.model_validate(mapping))
    if not unmatched:
        return mapping, []
    kept = [p for p in mapping["unfrozen_parameters"] if p not in unmatched]
    layers = shrunk.shrunk.num_layers
    if not kept:
        raise UserError(f"unfrozen_parameters: none of its entries matches a parameter of the {layers}-layer model "
                        "the rehearsal trains (they name layers by number)", "rehearse with --layers covering the "
                        "layers they name, or add an entry the small model has (^lm_head.weight$)")  # fmt: skip
    real = ("the GPU run trains them" if parameter_names(recipe) else "the real model's names couldn't be read here, "
            "so whether they match there is not checked")  # fmt: skip
    return {**mapping, "unfrozen_parameters": kept}, [
        f"unfrozen_parameters: {', '.join(unmatched)} match no parameter of the {layers}-layer rehearsal model (they "
        f"name layers it doesn't have): left out of the rehearsal; {real}"]  # fmt: skip


def _stop_then_resume(plans: list, rehearsal, extra: list[str], timings: dict, echo) -> tuple[int, Path | None]:
    """Run 1 stops after its first step (a checkpoint); run 2, the same command, resumes from it and finishes."""
    from llmtune.train.checkpoint.folders import last_complete

    run_dir = Path(rehearsal.output_dir)
    mark = time.monotonic()
    echo("[llmtune] rehearsal run 1: the ranks stop after step 1 and save a checkpoint (as `kill -USR1` asks)")
    _stop_after_first_step(Path(plans[0].config_dir))
    code = launch(plans, extra, rehearsal.rdzv_timeout)
    timings["run_until_stop_s"] = time.monotonic() - mark
    if code:
        return code, None
    checkpoint = last_complete(run_dir)
    if checkpoint is None or (run_dir / "metrics.json").exists():
        raise RuntimeError(f"the first rehearsal run did not stop at a checkpoint ({run_dir})")
    mark = time.monotonic()
    echo(f"[llmtune] rehearsal run 2: the same command, resumed from {checkpoint.name}")
    code = launch(plans, extra, rehearsal.rdzv_timeout)
    timings["run_resumed_s"] = time.monotonic() - mark
    return code, checkpoint


def rehearse_recipe(recipe_path: Path, flags: ClusterFlags, options: RehearsalOptions,
                    extra_launcher_args: list[str] | None = None, echo: Callable[[str], None] = _echo) -> tuple[int, dict]:  # fmt: skip
    """Rehearse the recipe; returns (exit code, report). User errors raise UserError, as in `llmtune train`."""
    from llmtune.launch.preflight import check_trackers
    from llmtune.plan import make_plan
    from llmtune.plan.files import plan_files, write_plan_files
    from llmtune.plan.render import summary_lines
    from llmtune.post.merge import merge_run
    from llmtune.recipe import Recipe, load_recipe
    from llmtune.rehearse import data as rehearsal_data
    from llmtune.rehearse.model import hub_reachable
    from llmtune.rehearse.report import build_report, failed_checks, print_report
    from llmtune.train.runtime.progress import track

    started = time.monotonic()
    timings: dict[str, float] = {}
    loaded = load_recipe(recipe_path)
    # the rehearsal's recipe is written elsewhere: the original's own Python files (GRPO's rewards) stay where it is
    os.environ["LLMTUNE_RECIPE_DIR"] = str(Path(recipe_path).resolve().parent)
    recipe = loaded.recipe
    stand_ins = rehearsal_data.parse_stand_ins(options.stand_in_data)
    clusters = _clusters(flags)
    gpu_plan = _gpu_plan(recipe, clusters[0])  # the real plan: its sizes and checks, as on GPUs
    make_plan(recipe, clusters[0])  # and what CPU processes refuse, before anything is built
    output = Path(options.output or Path("rehearsals") / recipe_path.stem).resolve()
    _prepare_output(output)
    notes: list[str] = []
    online = hub_reachable()
    if not online:
        os.environ["HF_HUB_OFFLINE"] = "1"  # the libraries would retry the Hub for a minute per file
        notes.append("offline: the Hub is unreachable, so only local files and the HF cache were used")
    notes += cpu_swaps(recipe)[1]
    model = _shrunken_model(recipe, gpu_plan, options, online, echo)
    notes += model.notes
    timings["model_and_tokenizer_s"] = time.monotonic() - started

    mark = time.monotonic()
    sources = rehearsal_data.gather_sources(recipe, options.sample_rows, output / "data", stand_ins)
    checked = rehearsal_data.check_data(recipe, model.tokenizer, sources, options.sample_rows, output / "checked")
    timings["data_check_s"] = time.monotonic() - mark
    sequence_len = options.sequence_len or min(recipe.sequence_len, DEFAULT_SEQUENCE_LEN)
    mapping = rehearsal_mapping(recipe, model.folder, model.tokenizer_choice.location, sources, output, sequence_len)
    mapping.update(model.recipe_changes)
    mapping, said = _unfrozen_in_shrunk(mapping, model.shrunk, recipe)
    notes += said
    (output / "recipe.yaml").write_text(yaml.safe_dump(mapping, sort_keys=False))
    rehearsal = Recipe.model_validate(mapping)
    check_trackers(rehearsal)
    plans = [make_plan(rehearsal, cluster) for cluster in clusters]
    for key, value in summary_lines(plans[0], rehearsal):
        echo(f"{key:>14}  {value}")
    for note in [*plans[0].notes, *loaded.notes, *checked.notes, *notes]:
        echo(f"{'note':>14}  {note}")
    files = plan_files(plans[0], rehearsal.model_dump(mode="json"), str(output / "recipe.yaml"), loaded.notes)
    write_plan_files(Path(plans[0].config_dir), files)

    code, checkpoint = _stop_then_resume(plans, rehearsal, extra_launcher_args or [], timings, echo)
    if code:
        return code, {}
    mark = time.monotonic()
    merged = merge_run(Path(rehearsal.output_dir), force=True, progress=track)
    timings["merge_s"] = time.monotonic() - mark
    timings["total_s"] = time.monotonic() - started
    metrics = json.loads((Path(rehearsal.output_dir) / "metrics.json").read_text())
    report = build_report(recipe=recipe, rehearsal=rehearsal, plan=plans[0], gpu_plan=gpu_plan, shrunk=model.shrunk,
                          full=model.full, tokenizer=model.tokenizer_choice, data=checked, metrics=metrics,
                          checkpoint_dir=checkpoint, merged=merged, timings=timings, notes=notes, options=options)  # fmt: skip
    report["failed_checks"] = failed = failed_checks(report)
    (output / REPORT).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_report(report, echo)
    echo(f"[llmtune] rehearsal report: {output / REPORT}")
    for line in failed:
        echo(f"error: rehearsal check failed: {line}")
    return (1 if failed else 0), report
