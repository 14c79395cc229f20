"""The `llmtune` command line: each command parses flags and calls one function of a room.

Heavy libraries are imported inside the commands that need them, so --help is instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtune import __version__
from llmtune.errors import EXIT_USER_ERROR, UserError

app = typer.Typer(
    name="llmtune",
    help="Fine-tune causal LMs from one Axolotl-style recipe: one process, N GPUs, or many nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

RecipeArg = Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)]
NumProcesses = Annotated[
    Optional[int],
    typer.Option("--num-processes", help="Processes on all machines together (default: all GPUs, or 1 on CPU)."),
]
NumMachines = Annotated[int, typer.Option("--num-machines", help="Machines in the job.")]
MachineRank = Annotated[int, typer.Option("--machine-rank", help="This machine's rank (0 is the main one).")]
MainIp = Annotated[Optional[str], typer.Option("--main-process-ip", help="Address of machine rank 0.")]
MainPort = Annotated[Optional[int], typer.Option("--main-process-port", help="Rendezvous port on machine rank 0.")]
Device = Annotated[
    Optional[str], typer.Option("--device", help="cuda, or cpu to rehearse the same plan on CPU processes (gloo).")
]
Rehearse = Annotated[
    bool, typer.Option("--rehearse", help="Rehearse the plan on CPU processes over gloo (same as --device cpu).")
]
Launcher = Annotated[
    str, typer.Option("--launcher", help="accelerate (torchrun underneath), or deepspeed (DeepSpeed's launcher).")
]
Hostfile = Annotated[
    Optional[Path],
    typer.Option("--hostfile", help="DeepSpeed hostfile (`host slots=N` lines): the machines and their processes."),
]
NoSsh = Annotated[
    bool, typer.Option("--no-ssh", help="deepspeed: start each machine yourself (with --machine-rank), not over ssh.")
]


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmtune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Fine-tune causal LMs from one Axolotl-style recipe."""


def _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse=False,
             launcher: str = "accelerate", hostfile: Path | None = None, no_ssh: bool = False):  # fmt: skip
    from llmtune.plan import make_cluster

    if rehearse:
        if device not in (None, "cpu"):
            raise UserError(f"--rehearse runs on CPU but --device is {device}", "drop one of the two flags")
        device = "cpu"
    return make_cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device,
                        launcher, str(hostfile) if hostfile else None, no_ssh)  # fmt: skip


@app.command()
def validate(
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
) -> None:
    """Check a recipe (keys, values, local files) and that it plans for this cluster."""
    from llmtune.plan import make_plan
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    cluster = _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse,
                       launcher, hostfile, no_ssh)  # fmt: skip
    plan = make_plan(loaded.recipe, cluster)
    for note in loaded.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"{recipe}: valid ({plan.title}, world size {plan.world_size}, global batch {plan.global_batch_size})")


@app.command()
def plan(
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
    write: Annotated[
        Optional[Path],
        typer.Option("--write", help="Also write accelerate_config.yaml, deepspeed.json and plan.json here."),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
) -> None:
    """Show what a run would do: strategy, sizes, generated configs, the command for each machine."""
    import json

    from llmtune.plan import make_plan
    from llmtune.plan.files import plan_files, write_plan_files
    from llmtune.plan.render import print_plan
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    cluster = _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse,
                       launcher, hostfile, no_ssh)  # fmt: skip
    the_plan = make_plan(loaded.recipe, cluster, config_dir=str(write) if write else None)
    files = plan_files(the_plan, loaded.recipe.model_dump(mode="json"), str(recipe), loaded.notes)
    if json_output:
        typer.echo(json.dumps(the_plan.to_dict(), indent=2))
    else:
        print_plan(the_plan, loaded.recipe, files, loaded.notes, recipe_path=str(recipe))
    if write:
        for path in write_plan_files(write, files):
            typer.echo(f"wrote {path}")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
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
) -> None:
    """Fine-tune: validate, plan, write <output_dir>/llmtune/, run the ranks. Launcher flags may follow `--`."""
    from llmtune.launch.runner import free_port, run
    from llmtune.plan import make_plan
    from llmtune.plan.files import plan_files, write_plan_files
    from llmtune.plan.render import summary_lines
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    overrides = {k: v for k, v in {"max_restarts": max_restarts, "rdzv_timeout": rdzv_timeout}.items() if v is not None}
    if overrides:
        loaded.recipe = loaded.recipe.model_copy(update=overrides)
    _check_trackers(loaded.recipe)
    finished = _finished_run(loaded.recipe)
    if finished:
        typer.echo(finished, err=True)
        return
    if main_process_port is None and num_machines == 1 and hostfile is None:
        main_process_port = free_port()  # one machine: any free port will do, and two runs never collide
    cluster = _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse,
                       launcher, hostfile, no_ssh)  # fmt: skip
    the_plan = make_plan(loaded.recipe, cluster)
    fit = None if no_memory_check else _memory_check(loaded.recipe, the_plan, gpu_memory)
    files = plan_files(the_plan, loaded.recipe.model_dump(mode="json"), str(recipe), loaded.notes)
    for key, value in summary_lines(the_plan, loaded.recipe):
        typer.echo(f"{key:>14}  {value}", err=True)
    if fit:
        typer.echo(f"{'memory':>14}  {fit}", err=True)
    for note in [*the_plan.notes, *loaded.notes]:
        typer.echo(f"{'note':>14}  {note}", err=True)
    write_plan_files(Path(the_plan.config_dir), files)
    code = run(the_plan, ctx.args, loaded.recipe.rdzv_timeout)
    if code:
        # 2: a user error the worker already explained; 128+N: stopped by signal N (130 for Ctrl-C); else 1
        raise typer.Exit(code if code == EXIT_USER_ERROR or code > 128 else 1)


TRACKER_MODULES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def _check_trackers(recipe) -> None:
    """A tracker the recipe asks for must be installed: say so before any process starts, not in every rank."""
    import importlib.util

    missing = [name for name in recipe.trackers if importlib.util.find_spec(TRACKER_MODULES[name]) is None]
    if missing:
        raise UserError(f"report_to asks for {', '.join(missing)}, which is not installed",
                        "pip install 'llmtune[trackers]' (or the package itself), or remove it from report_to")  # fmt: skip


def _finished_run(recipe) -> str | None:
    """Rerunning a finished run (same recipe, auto-resume on) trains nothing: say so instead of resuming at the end."""
    import json

    from llmtune.recipe.loader import recipe_fingerprint

    metrics_file = Path(recipe.output_dir) / "metrics.json"
    if not recipe.auto_resume_from_checkpoints or recipe.resume_from_checkpoint or not metrics_file.is_file():
        return None
    try:
        metrics = json.loads(metrics_file.read_text())
    except (OSError, ValueError):
        return None
    if metrics.get("recipe_fingerprint") != recipe_fingerprint(recipe):
        return None
    return (f"{recipe.output_dir} already holds this recipe's finished run ({metrics.get('steps')} steps, final loss "
            f"{metrics.get('final_loss')}); nothing to do. To train again, use another output_dir, remove it, "
            "or set auto_resume_from_checkpoints: false")  # fmt: skip


def _memory_check(recipe, plan, gpu_memory: str | None) -> str | None:
    """On GPUs (or when --gpu-memory is given), refuse a plan the estimate says can't fit."""
    from llmtune.plan.estimate import check_fits, gpu_memory_of_this_machine, parse_size_option
    from llmtune.plan.model_facts import read_model_facts

    if gpu_memory is not None:
        memory = parse_size_option("--gpu-memory", gpu_memory)
    elif plan.cluster.device == "cuda":
        memory = gpu_memory_of_this_machine()
    else:
        return None  # a CPU rehearsal: nothing to check against
    facts = read_model_facts(recipe.base_model_config or recipe.base_model, fetch=True) if memory else None
    if facts is None:
        return None  # unknown GPU size or model shape: the estimate can't judge, so it doesn't block
    return check_fits(recipe, plan, memory, facts)


@app.command()
def preprocess(recipe: RecipeArg) -> None:
    """Tokenize the recipe's datasets into the cache (dataset_prepared_path), with a progress bar."""
    from llmtune.recipe import load_recipe
    from llmtune.train.data.prepare import split_and_pack, tokenize_with_cache
    from llmtune.train.model import load_tokenizer, model_source
    from llmtune.train.progress import track

    loaded = load_recipe(recipe)
    source, _ = model_source(loaded.recipe)
    tokenizer = load_tokenizer(loaded.recipe, source)
    groups, stats = tokenize_with_cache(loaded.recipe, tokenizer, track)
    stats = split_and_pack(loaded.recipe, groups, stats).stats
    where = stats["cache_dir"] or "(no cache: dataset_prepared_path is empty)"
    typer.echo(f"{'cache hit' if stats['cache_hit'] else 'tokenized'}: {where}")
    for key in ("rows", "train_examples", "eval_examples", "train_tokens", "dropped_too_long", "truncated",
                "dropped_no_labels", "packing_efficiency"):  # fmt: skip
        if stats.get(key) is not None:
            typer.echo(f"  {key}: {stats[key]}")


@app.command()
def estimate(
    recipe: RecipeArg,
    gpus_per_machine: Annotated[int, typer.Option("--gpus-per-machine", min=1)] = 1,
    num_machines: NumMachines = 1,
    gpu_memory: Annotated[str, typer.Option("--gpu-memory", help="Memory of one GPU, e.g. 80GB.")] = "80GB",
    cpu_memory: Annotated[
        Optional[str], typer.Option("--cpu-memory", help="CPU memory of one machine, for offload (e.g. 512GB).")
    ] = None,
    interconnect: Annotated[
        str, typer.Option("--interconnect", help="Between machines: fast (InfiniBand/NVLink) or slow (Ethernet).")
    ] = "fast",
    json_output: Annotated[bool, typer.Option("--json", help="Print the estimates as JSON.")] = False,
) -> None:
    """Per-GPU memory under each strategy (ZeRO-paper accounting), what fits, and the recommended strategy."""
    from llmtune.plan.estimate import estimate_recipe, parse_size_option
    from llmtune.plan.render import print_estimate
    from llmtune.recipe import load_recipe

    if interconnect not in ("fast", "slow"):
        raise UserError(f"--interconnect {interconnect!r} is not fast or slow")
    loaded = load_recipe(recipe).recipe
    report = estimate_recipe(
        loaded, gpus_per_machine, num_machines, parse_size_option("--gpu-memory", gpu_memory),
        parse_size_option("--cpu-memory", cpu_memory) if cpu_memory else None, interconnect,
    )  # fmt: skip
    if json_output:
        import json

        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_estimate(report)


def _ask_option(flag: str, help_text: str, kind=str):
    return Annotated[Optional[kind], typer.Option(flag, help=help_text, show_default=False)]


@app.command(name="config")
def config_command(
    output: Annotated[Path, typer.Option("--output", "-o", help="The recipe to write.")] = Path("recipe.yaml"),
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Take the default for every question not given as a flag.")
    ] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite --output if it exists.")] = False,
    base_model: _ask_option("--base-model", "Hub id or local folder.") = None,
    method: _ask_option("--method", "full, lora or qlora.") = None,
    dataset: _ask_option("--dataset", "Local file or hub dataset id.") = None,
    dataset_type: _ask_option("--dataset-type", "alpaca, chat_template, completion, input_output.") = None,
    num_machines: _ask_option("--num-machines", "Machines in the job.", int) = None,
    main_process_ip: _ask_option("--main-process-ip", "Address of machine rank 0.") = None,
    main_process_port: _ask_option("--main-process-port", "Rendezvous port on machine rank 0.", int) = None,
    interconnect: _ask_option("--interconnect", "Between machines: fast or slow.") = None,
    gpus_per_machine: _ask_option("--gpus-per-machine", "GPUs on each machine.", int) = None,
    gpu_ids: _ask_option("--gpu-ids", "GPU ids to use on each machine, comma separated, or all.") = None,
    gpu_memory: _ask_option("--gpu-memory", "Memory of one GPU, e.g. 80GB.") = None,
    mixed_precision: _ask_option("--mixed-precision", "bf16, fp16 or no.") = None,
    sequence_len: _ask_option("--sequence-len", "Tokens per row.", int) = None,
    micro_batch_size: _ask_option("--micro-batch-size", "Rows per GPU per step.", int) = None,
    strategy: _ask_option(
        "--strategy",
        "ddp, zero1, zero2, zero3, zero2_offload, zero3_offload, zero3_nvme, fsdp, "
        "fsdp_hybrid, pipeline (default: the recommended one).",
    ) = None,  # fmt: skip
    nvme_path: _ask_option("--nvme-path", "NVMe folder for zero3_nvme.") = None,
    fsdp_version: _ask_option("--fsdp-version", "1 or 2.", int) = None,
    fsdp_auto_wrap_policy: _ask_option(
        "--fsdp-auto-wrap-policy", "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP."
    ) = None,
    fsdp_state_dict_type: _ask_option("--fsdp-state-dict-type", "FULL_STATE_DICT or SHARDED_STATE_DICT.") = None,
    fsdp_offload_params: _ask_option("--fsdp-offload-params", "Offload FSDP parameters to CPU.", bool) = None,
    pipeline_stages: _ask_option("--pipeline-stages", "Pipeline stages.", int) = None,
    pipeline_schedule: _ask_option("--pipeline-schedule", "gpipe, 1f1b or interleaved_1f1b.") = None,
    output_dir: _ask_option("--output-dir", "Where the run writes its model and checkpoints.") = None,
) -> None:
    """Answer a few questions (those `accelerate config` asks, plus model and data) and get a recipe."""
    from llmtune.wizard import run_config

    given = {k: v for k, v in locals().items() if k not in ("output", "yes", "force")}
    written, commands = run_config(given, output, yes, force)
    typer.echo(f"wrote {written}")
    typer.echo("run it:" if len(commands) == 1 else "run on each machine:")
    for line in commands:
        typer.echo(f"  {line}")


@app.command(name="eval")
def eval_command(
    target: Annotated[Path, typer.Argument(help="A run's output_dir, or a recipe (evaluates its base model).")],
    data: Annotated[Optional[Path], typer.Option("--data", help="Eval file in the recipe's dataset format.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 8,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", min=1)] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", min=1, help="Only the first N examples.")] = None,
    show: Annotated[int, typer.Option("--show", min=0, help="Print N generations.")] = 0,
) -> None:
    """Eval loss, perplexity and exact-match accuracy; writes eval.json."""
    from llmtune.post.evaluate import evaluate

    if data is not None and not data.exists():
        raise UserError(f"--data {data} does not exist")
    results = evaluate(target, data, batch_size, max_new_tokens, limit, show)
    line = f"{results['target']}: eval loss {results['eval_loss']:.4f}, perplexity {results['perplexity']:.2f}"
    if "exact_match" in results:
        line += f", exact match {results['exact_match']:.1%} ({results['exact_match_examples']} examples)"
    typer.echo(line)
    typer.echo(f"wrote {results['written_to']}")


@app.command()
def merge(
    run: Annotated[Path, typer.Argument(help="A run's output_dir.", show_default=False)],
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Where to write (default RUN/merged).")
    ] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="Largest safetensors shard.")] = "5GB",
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="bf16, fp16 or fp32 (default: the recipe's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing output folder.")] = False,
) -> None:
    """Fold a LoRA/QLoRA adapter into its base (or consolidate a full fine-tune) into one HF model folder."""
    from llmtune.post.merge import merge_run
    from llmtune.train.progress import track

    if not run.is_dir():
        raise UserError(f"{run} is not a folder", "pass a run's output_dir")
    result = merge_run(run, output, max_shard_size, dtype, force, track)
    typer.echo(f"merged {result.source}")
    typer.echo(f"wrote {result.output}: {len(result.shards)} shard(s), {result.total_bytes / 1e6:.1f} MB {result.dtype}"
               + (f", {result.merged_modules} LoRA modules folded in" if result.merged_modules else ""))  # fmt: skip


MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate per answer.")]
Temperature = Annotated[float, typer.Option("--temperature", min=0.0, help="0 is greedy; above 0 samples.")]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)]
Seed = Annotated[int, typer.Option("--seed")]
Raw = Annotated[bool, typer.Option("--raw", help="Send prompts as plain text, without the chat template.")]
ModelArg = Annotated[str, typer.Argument(help="A run's output_dir, a merged/HF model folder, or a hub id.")]


@app.command()
def infer(
    target: ModelArg,
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", "-p", help="A prompt (repeatable).")] = None,
    file: Annotated[
        Optional[Path], typer.Option("--file", help="prompts.jsonl (prompt/messages/instruction) or .txt")
    ] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write rows + outputs as JSONL.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1)] = 8,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    raw: Raw = False,
) -> None:
    """Batched generation for prompts given on the command line or in a file."""
    import json

    from llmtune.post.generate import Sampling
    from llmtune.post.generate import infer as run_infer
    from llmtune.train.progress import track

    if prompt and file:
        raise UserError("--prompt and --file both given", "use one of them")
    sampling = Sampling(max_new_tokens, temperature, top_p, seed=seed)
    results = run_infer(target, prompt or [], file, output, sampling, batch_size, raw, track)
    if output is None:
        for row in results:
            typer.echo(json.dumps(row, ensure_ascii=False))
    else:
        typer.echo(f"wrote {len(results)} outputs to {output}")


@app.command()
def chat(
    target: ModelArg,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message.")] = None,
    max_new_tokens: MaxNewTokens = 256,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    raw: Raw = False,
) -> None:
    """Talk to a model in the terminal, streamed, with its chat template (/reset, /exit)."""
    from llmtune.post.generate import Sampling
    from llmtune.post.generate import chat as run_chat

    run_chat(target, Sampling(max_new_tokens, temperature, top_p, seed=seed), system, raw)


@app.command()
def report(run: Annotated[Path, typer.Argument(help="A run's output_dir.", show_default=False)]) -> None:
    """Rebuild RUN/report/: loss curve, throughput, summary."""
    from llmtune.post.report import write_report

    folder = write_report(run)
    typer.echo(f"wrote {folder}: loss.png, throughput.png, summary.md, curves.json")


@app.command()
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
    from llmtune.launch.slurm import SlurmJob, sbatch_script
    from llmtune.launch.slurm import submit as sbatch
    from llmtune.plan import make_plan
    from llmtune.plan.cluster import Cluster
    from llmtune.plan.files import atomic_write
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    job = SlurmJob(nodes, gpus_per_node, partition, time, account, job_name, cpus_per_task, signal_seconds, device)
    job.check()
    # the plan must hold for this cluster shape (batch arithmetic, parallel sizes) before anything is written
    # (the login node's own GPUs don't matter: the cluster is described, not probed)
    make_plan(loaded.recipe, Cluster(nodes * gpus_per_node, nodes, 0, "127.0.0.1", 29500, device or "cuda"))
    output_dir = Path(loaded.recipe.output_dir).resolve()
    script = (output or output_dir / "slurm" / "job.sbatch").resolve()
    text = sbatch_script(recipe.resolve(), output_dir, job, Path.cwd(), [sys.executable, "-m", "llmtune"], script)
    (output_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch writes the job's log there
    script.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(script, text)
    script.chmod(0o755)
    typer.echo(f"wrote {script}")
    if submit:
        job_id, _ = sbatch(script)
        name = job.job_name or f"llmtune-{recipe.stem}"
        typer.echo(f"submitted job {job_id}; log: {output_dir / 'slurm' / f'{name}-{job_id}.out'}; "
                   f"rank logs: {output_dir / 'llmtune' / 'logs'}")  # fmt: skip
    else:
        typer.echo(f"submit with: sbatch {script}")


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    try:
        code = app(standalone_mode=False)  # click returns the exit code here instead of raising Exit
        sys.exit(code if isinstance(code, int) else 0)
    except UserError as err:
        typer.echo(f"error: {err.one_line()}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except typer.Exit as done:
        sys.exit(done.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as err:  # click's errors (bad flags) arrive here in standalone_mode=False
        kinds = {klass.__name__ for klass in type(err).__mro__}
        if "ClickException" not in kinds:
            raise
        err.show()
        sys.exit(EXIT_USER_ERROR if "UsageError" in kinds else err.exit_code)
