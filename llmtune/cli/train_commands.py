"""Commands that prepare or start training: train (and its CPU rehearsal, --rehearse), preprocess, slurm.

Each reads the recipe, makes the plan, and hands it to the launch room (or, for preprocess, to the train room's
data pipeline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtune.cli.options import (
    Device,
    Hostfile,
    Launcher,
    MachineRank,
    MainIp,
    MainPort,
    NoSsh,
    NumMachines,
    NumProcesses,
    RecipeArg,
    Rehearse,
    cluster_from_flags,
)
from llmtune.errors import EXIT_USER_ERROR, UserError


def train(
    ctx: typer.Context,
    recipe: RecipeArg,
    num_processes: NumProcesses = None,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainIp = None,
    main_process_port: MainPort = None,
    device: Device = None,
    rehearse: Rehearse = False,
    launcher: Launcher = "accelerate",
    hostfile: Hostfile = None,
    no_ssh: NoSsh = False,
    gpu_memory: Annotated[
        Optional[str],
        typer.Option("--gpu-memory", help="Check the plan fits GPUs of this size (default on CUDA: measured)."),
    ] = None,
    no_memory_check: Annotated[
        bool, typer.Option("--no-memory-check", help="Launch even if the estimate says it won't fit.")
    ] = False,
    max_restarts: Annotated[
        Optional[int], typer.Option("--max-restarts", min=0, help="Restart the ranks up to N times after a crash.")
    ] = None,
    rdzv_timeout: Annotated[
        Optional[int], typer.Option("--rdzv-timeout", min=1, help="Seconds to wait for every machine to join.")
    ] = None,
    rdzv_endpoint: Annotated[
        Optional[str], typer.Option("--rdzv-endpoint", help="host:port of the etcd server (rdzv_backend: etcd).")
    ] = None,
    preflight: Annotated[
        bool,
        typer.Option(
            "--preflight",
            help="Before launching, run `llmtune doctor`'s quick checks (stack, devices, "
            "storage, ports, collectives' correctness) on every rank; stop if they find a problem.",
        ),
    ] = False,
    profile: Annotated[
        bool,
        typer.Option(
            "--profile",
            help="Trace 5 steps after the warm-up with torch's profiler (OUT/llmtune/profile/) "
            "and print the GPU's idle fraction; the recipe's profiler_steps sets another count.",
        ),
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Show every line the ranks print (the logs under OUT/llmtune/logs/ always have them all).",
        ),
    ] = False,
    shrink: Annotated[
        bool,
        typer.Option(
            "--shrink",
            help="With --rehearse: a shrunken model of the same architecture, the real tokenizer "
            "and data, a stop, a resume and the merge; then a report (`llmtune rehearse`).",
        ),
    ] = False,
) -> None:
    """Fine-tune: validate, plan, write <output_dir>/llmtune/, run the ranks. Launcher flags may follow `--`."""
    if shrink:
        from llmtune.cli.rehearse_cmd import rehearse_from_train

        if not rehearse:
            raise UserError("--shrink is a rehearsal option", "add --rehearse, or run `llmtune rehearse RECIPE`")
        rehearse_from_train(recipe, num_processes, num_machines, machine_rank, main_process_ip, main_process_port,
                            device, launcher, hostfile, no_ssh, list(ctx.args))  # fmt: skip
        return
    from llmtune.train.runtime.progress import mark

    mark("start")  # the command has parsed its flags (Python and the CLI's imports before this are not counted)
    from llmtune.launch.flags import check_cuda_usable, check_inherited_environment, long_options
    from llmtune.launch.net import free_port
    from llmtune.launch.preflight import (
        check_deepspeed_schema,
        check_local_splits,
        check_nvme_offload,
        check_trackers,
        finished_run,
        memory_check,
    )
    from llmtune.launch.runner import check_launcher_flags, run
    from llmtune.plan import make_plan
    from llmtune.plan.files import plan_files, write_plan_files
    from llmtune.plan.render import summary_lines
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    overrides = {k: v for k, v in {"max_restarts": max_restarts, "rdzv_timeout": rdzv_timeout,
                                   "rdzv_endpoint": rdzv_endpoint}.items() if v is not None}  # fmt: skip
    if rdzv_endpoint and loaded.recipe.rdzv_backend != "etcd":
        raise UserError(
            "--rdzv-endpoint is the etcd server of rdzv_backend: etcd",
            "for c10d the rendezvous is --main-process-ip and --main-process-port; for etcd set rdzv_backend: etcd",
        )
    if profile and not loaded.recipe.profiler_steps:
        from llmtune.recipe.training import PROFILE_STEPS

        overrides["profiler_steps"] = PROFILE_STEPS
    if overrides:
        loaded.recipe = loaded.recipe.model_copy(update=overrides)
    check_trackers(loaded.recipe)
    check_local_splits(loaded.recipe)
    ours = long_options(ctx.command)
    check_launcher_flags(list(ctx.args), ours)
    check_inherited_environment()
    if main_process_port is None and num_machines == 1 and hostfile is None:
        main_process_port = free_port()  # one machine: any free port will do, and two runs never collide
    cluster = cluster_from_flags(
        num_processes,
        num_machines,
        machine_rank,
        main_process_ip,
        main_process_port,
        device,
        rehearse,
        launcher,
        hostfile,
        no_ssh,
    )  # fmt: skip (the flags checked before anything)
    finished = finished_run(loaded.recipe)
    if finished:
        typer.echo(finished, err=True)
        return
    the_plan = make_plan(loaded.recipe, cluster, resume=True)
    check_launcher_flags(list(ctx.args), ours, the_plan.commands[cluster.machine_rank])
    check_cuda_usable(cluster.device)  # this machine runs ranks of the plan
    check_nvme_offload(the_plan)
    check_deepspeed_schema(loaded.recipe, the_plan)
    fit = None if no_memory_check else memory_check(loaded.recipe, the_plan, gpu_memory)
    files = plan_files(the_plan, loaded.recipe.model_dump(mode="json"), str(Path(recipe).absolute()), loaded.notes)
    for key, value in summary_lines(the_plan, loaded.recipe):
        typer.echo(f"{key:>14}  {value}", err=True)
    if fit:
        typer.echo(f"{'memory':>14}  {fit}", err=True)
    for note in [*the_plan.notes, *loaded.notes]:
        typer.echo(f"{'note':>14}  {note}", err=True)
    if loaded.recipe.rl in ("grpo", "gdpo") and not cluster.rehearsal:
        from llmtune.recipe.online import generation_mode

        if generation_mode(loaded.recipe) == "server" and cluster.machine_rank == 0:
            from llmtune.launch.vllm_server import wait_for
            from llmtune.train.runtime.progress import log

            wait_for(loaded.recipe, str(recipe), log)
    if preflight:
        from llmtune.doctor.run import run_doctor

        if run_doctor(loaded, cluster, loaded.recipe.rdzv_timeout, json_output=False, quick=True):
            raise UserError("the preflight found a problem (above); nothing was trained",
                            "fix it, then run the same command again (llmtune doctor gives the full checks)")  # fmt: skip
    if cluster.machine_rank == 0 and the_plan.world_size > 1 and the_plan.rdzv_backend != "etcd":
        # machine 0 hosts the rendezvous on this port: refused before anything is written to output_dir
        from llmtune.launch.net import check_port_free

        check_port_free(cluster.main_process_port)
    output_dir = Path(loaded.recipe.output_dir)
    created = not output_dir.exists()
    before = _run_record(Path(the_plan.config_dir), files, output_dir) if not created else None
    write_plan_files(Path(the_plan.config_dir), files)
    code = run(the_plan, ctx.args, loaded.recipe.rdzv_timeout, verbose=verbose)
    if code == EXIT_USER_ERROR and before is not None:
        _restore_record(Path(the_plan.config_dir), output_dir, *before)
    if (
        code == EXIT_USER_ERROR
        and created
        and [p.name for p in output_dir.iterdir()] == ["llmtune"]
        and not any((output_dir / "llmtune" / "logs").glob("*error*"))
    ):  # (a file the error line names stays)
        import shutil  # a user error the ranks found (data, model, template) before saving anything: no run folder

        shutil.rmtree(output_dir, ignore_errors=True)
    if code in (128 + 1, 128 + 2, 128 + 15):  # hang-up, Ctrl-C or SIGTERM: say what is kept and what a rerun does
        from llmtune.plan.checkpoint_layout import last_complete

        kept = last_complete(Path(loaded.recipe.output_dir))
        typer.echo(f"stopped ({ {129: 'SIGHUP', 130: 'Ctrl-C'}.get(code, 'SIGTERM')}); "
                   + (f"{kept.name} is the last complete checkpoint: the same command resumes from it (the steps "
                      "after it are trained again)" if kept else "no checkpoint was complete: the same command "
                      "starts over"), err=True)  # fmt: skip
    if code:
        # 2: a user error the worker already explained; 3: a stalled run, named and stopped (launch/hangs.py);
        # 128+N: stopped by signal N (130 for Ctrl-C); else 1
        raise typer.Exit(code if code in (EXIT_USER_ERROR, 3) or code > 128 else 1)


def preprocess(
    recipe: RecipeArg,
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the first examples as spans of trained (+) and masked (-) tokens.")
    ] = False,
    debug_num_examples: Annotated[
        int, typer.Option("--debug-num-examples", min=1, help="With --debug: how many examples (default 1).")
    ] = 1,
    debug_text_only: Annotated[
        bool, typer.Option("--debug-text-only", help="With --debug: the text of each span, without its token count.")
    ] = False,
) -> None:
    """Tokenize the recipe's datasets into the cache (dataset_prepared_path), with a progress bar; --debug shows
    which tokens each example trains on."""
    import json
    import sys

    from llmtune.recipe import load_recipe
    from llmtune.train.data.counts import dataset_line
    from llmtune.train.data.prepare import split_and_pack, tokenize_with_cache
    from llmtune.train.model.load import load_tokenizer, model_source
    from llmtune.train.runtime.progress import track

    loaded = load_recipe(recipe)
    for note in loaded.notes:
        typer.echo(f"note: {note}", err=True)
    source, _ = model_source(loaded.recipe)
    tokenizer = load_tokenizer(loaded.recipe, source)
    if loaded.recipe.rl:
        from llmtune.train.data.prepare import prepare_data

        prepared = prepare_data(loaded.recipe, tokenizer, track)
        stats = prepared.stats
        typer.echo("checked: every preference row converts and fits (no cache: TRL tokenizes them when training)")
        if debug:  # what TRL is handed: the converted rows
            for position, row in enumerate(list(prepared.train)[:debug_num_examples]):
                typer.echo(f"train row {position + 1} of {len(prepared.train)} (as TRL receives it):")
                typer.echo("  " + json.dumps(row, ensure_ascii=False, default=str))
    else:
        groups, stats = tokenize_with_cache(loaded.recipe, tokenizer, track)
        if debug:  # the tokenized examples in the datasets' order, before shuffling and packing
            from llmtune.train.data.show import label_classes, show_examples

            color = sys.stdout.isatty()
            for name, rows in groups.items():
                for line in show_examples(rows, tokenizer, debug_num_examples, debug_text_only, color,
                                          "eval" if name == "test" else name, label_classes(loaded.recipe)):  # fmt: skip
                    typer.echo(line)
        stats = split_and_pack(loaded.recipe, groups, stats).stats
        if debug and loaded.recipe.dataset_shard_num is not None:
            typer.echo(f"(listed in the datasets' order, before sharding: the run trains shard "
                       f"{loaded.recipe.dataset_shard_idx} of {loaded.recipe.dataset_shard_num}, "
                       f"{stats['train_examples']} examples)")  # fmt: skip
        where = stats["cache_dir"] or "(no cache: dataset_prepared_path is empty)"
        typer.echo(f"{'cache hit' if stats['cache_hit'] else 'tokenized'}: {where}")
    for key in ("rows", "train_examples", "eval_examples", "train_tokens", "dropped_too_long", "truncated",
                "dropped_long_prompt", "dropped_no_labels", "dropped_too_short", "dropped_duplicates",
                "packing_efficiency"):  # fmt: skip
        if stats.get(key) is not None:
            typer.echo(f"  {key}: {stats[key]}")
    for label, counts in (stats.get("per_dataset") or {}).items():
        typer.echo(dataset_line(label, counts, loaded.recipe))


def slurm(
    recipe: RecipeArg,
    nodes: Annotated[int, typer.Option("--nodes", min=1, help="Nodes to allocate (one launcher each).")] = 1,
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", min=1, help="GPUs (processes) per node.")] = 1,
    partition: Annotated[Optional[str], typer.Option("--partition", help="Slurm partition.")] = None,
    time: Annotated[Optional[str], typer.Option("--time", help="Time limit, e.g. 4:00:00.")] = None,
    account: Annotated[Optional[str], typer.Option("--account", help="Slurm account.")] = None,
    job_name: Annotated[Optional[str], typer.Option("--job-name", help="Job name (default llmtune-<recipe>).")] = None,
    cpus_per_task: Annotated[Optional[int], typer.Option("--cpus-per-task", min=1)] = None,
    signal_seconds: Annotated[
        int, typer.Option("--signal-seconds", min=10, help="Requeue this many seconds before the time limit.")
    ] = 300,
    device: Device = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Script path (default OUT/slurm/job.sbatch).")
    ] = None,
    submit: Annotated[
        bool, typer.Option("--submit", help="Submit it with sbatch and print the job id and logs.")
    ] = False,
) -> None:
    """Write an sbatch script that runs the recipe on N nodes (one launcher per node), and optionally submit it."""
    import re
    import shlex

    from llmtune.launch.slurm import SlurmJob, job_name_of, write_job
    from llmtune.launch.slurm import submit as sbatch
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    job = SlurmJob(nodes, gpus_per_node, partition, time, account, job_name, cpus_per_task, signal_seconds, device)
    try:
        script = write_job(recipe, loaded.recipe, job, output)
    except UserError as err:  # the plan's hints name train's --num-processes: here it is nodes x GPUs per node
        wanted = re.search(r"--num-processes (\d+)", err.hint or "")
        if wanted is None:
            raise
        count = int(wanted.group(1))
        shape = (f"--nodes {nodes} --gpus-per-node {count // nodes}" if count % nodes == 0 else
                 f"--nodes and --gpus-per-node that make {count} processes")  # fmt: skip
        raise UserError(err.message, err.hint.replace(wanted.group(0), shape)) from None
    if cpus_per_task is None and device != "cpu":
        typer.echo(f"note: no --cpus-per-task: on a cluster that binds tasks to CPUs without a per-GPU default, the "
                   f"launcher and its {gpus_per_node} ranks (and their data loaders) share one core; pass the cores "
                   "each node gives the job, e.g. --cpus-per-task 64", err=True)  # fmt: skip
    output_dir = Path(loaded.recipe.output_dir).resolve()
    typer.echo(f"wrote {script}")
    if submit:
        job_id, _ = sbatch(script)
        name = job.job_name or job_name_of(Path(recipe))
        typer.echo(f"submitted job {job_id}; log: {output_dir / 'slurm' / f'{name}-{job_id}.out'}; "
                   f"rank logs: {output_dir / 'llmtune' / 'logs'}")  # fmt: skip
    else:
        typer.echo(f"submit with: sbatch {shlex.quote(str(script))}")


def vllm_serve(recipe: RecipeArg) -> None:
    """Start TRL's vLLM server for a GRPO recipe in server mode (its vllm: section), on the GPUs this process sees:
    run it before `llmtune train`, with CUDA_VISIBLE_DEVICES set to GPUs the training doesn't use."""
    from llmtune.launch.vllm_server import serve
    from llmtune.recipe import load_recipe

    code = serve(load_recipe(recipe).recipe, str(recipe))
    if code:
        raise typer.Exit(code)


def _trained(output_dir: Path) -> tuple:
    """What a run leaves when it trained: its checkpoints and its metrics.json (by modification time)."""
    found = sorted(p.name for p in output_dir.glob("checkpoint-*"))
    metrics = output_dir / "metrics.json"
    return found, metrics.stat().st_mtime_ns if metrics.is_file() else None


def _run_record(config_dir: Path, files: dict[str, str], output_dir: Path) -> tuple[dict, tuple]:
    """The plan files a launch is about to overwrite in an existing output_dir (a finished run's record: `eval`
    and `report` read its recipe there), with what the folder holds of training before it."""
    kept = {name: (config_dir / name).read_bytes() if (config_dir / name).is_file() else None for name in files}
    return kept, _trained(output_dir)


def _restore_record(config_dir: Path, output_dir: Path, kept: dict, trained: tuple) -> None:
    """A launch the ranks refused (a user error) before it trained anything: the folder's earlier plan files come
    back, so a finished run beside them keeps the recipe that trained it."""
    if _trained(output_dir) != trained:
        return
    for name, text in kept.items():
        path = config_dir / name
        if text is None:
            path.unlink(missing_ok=True)
        else:
            path.write_bytes(text)
