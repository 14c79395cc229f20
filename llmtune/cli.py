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


def _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse=False):
    from llmtune.plan import make_cluster

    if rehearse:
        if device not in (None, "cpu"):
            raise UserError(f"--rehearse runs on CPU but --device is {device}", "drop one of the two flags")
        device = "cpu"
    return make_cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device)


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
) -> None:
    """Check a recipe (keys, values, local files) and that it plans for this cluster."""
    from llmtune.plan import make_plan
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    cluster = _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse)
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
    cluster = _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse)
    the_plan = make_plan(loaded.recipe, cluster, config_dir=str(write) if write else None)
    files = plan_files(the_plan, loaded.recipe.model_dump(mode="json"), str(recipe), loaded.notes)
    if json_output:
        typer.echo(json.dumps(the_plan.to_dict(), indent=2))
    else:
        print_plan(the_plan, loaded.recipe, files, loaded.notes)
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
) -> None:
    """Fine-tune: validate, plan, write <output_dir>/llmtune/, run the ranks. Launcher flags may follow `--`."""
    from llmtune.launch.runner import free_port, run
    from llmtune.plan import make_plan
    from llmtune.plan.files import plan_files, write_plan_files
    from llmtune.plan.render import summary_lines
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    if main_process_port is None and num_machines == 1:
        main_process_port = free_port()  # one machine: any free port will do, and two runs never collide
    cluster = _cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device, rehearse)
    the_plan = make_plan(loaded.recipe, cluster)
    files = plan_files(the_plan, loaded.recipe.model_dump(mode="json"), str(recipe), loaded.notes)
    for key, value in summary_lines(the_plan, loaded.recipe):
        typer.echo(f"{key:>14}  {value}", err=True)
    for note in [*the_plan.notes, *loaded.notes]:
        typer.echo(f"{'note':>14}  {note}", err=True)
    write_plan_files(Path(the_plan.config_dir), files)
    code = run(the_plan, ctx.args)
    if code:
        # 2: a user error the worker already explained; 128+N: stopped by signal N (130 for Ctrl-C); else 1
        raise typer.Exit(code if code == EXIT_USER_ERROR or code > 128 else 1)


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
) -> None:
    """Per-GPU memory under each strategy (ZeRO-paper accounting), what fits, and the recommended strategy."""
    from rich.console import Console
    from rich.table import Table

    from llmtune.plan.estimate import GB, parse_size, recommend
    from llmtune.plan.estimate import estimate as estimate_memory
    from llmtune.plan.model_facts import read_model_facts
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe).recipe
    facts = read_model_facts(loaded.base_model_config or loaded.base_model)
    if facts is None:
        raise UserError(f"can't read the config of {loaded.base_model} offline",
                        "point base_model_config at a local config.json")  # fmt: skip
    try:
        memory = parse_size(gpu_memory)
    except ValueError:
        raise UserError(f"--gpu-memory {gpu_memory!r} is not a size", "write e.g. 80GB or 24GiB") from None
    world = gpus_per_machine * num_machines
    stages = loaded.pipeline_parallel_size
    rows = estimate_memory(loaded, facts, world // stages if stages > 1 else world, gpus_per_machine, stages)
    table = Table(title=f"{loaded.base_model}: {facts.total_params() / 1e9:.2f}B parameters, "
                        f"{num_machines} x {gpus_per_machine} GPUs of {memory / GB:.0f} GB")  # fmt: skip
    for column in ("strategy (GB per GPU)", "params", "grads", "optim", "activ", "other", "total", "fits", "CPU"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in rows:
        cells = [row.params, row.grads, row.optimizer, row.activations, row.overhead, row.total]
        table.add_row(row.strategy, *(f"{c / GB:.1f}" for c in cells), "yes" if row.total <= memory else "no",
                      f"{row.cpu / GB:.1f}" if row.cpu else ("NVMe" if row.nvme else ""))  # fmt: skip
    console = Console()
    console.print(table)
    choice = recommend(rows, memory)
    if choice is None:
        console.print(
            "[red]nothing fits[/]: use more GPUs, a smaller micro_batch_size, gradient_checkpointing, or LoRA"
        )
    else:
        console.print(f"[bold]recommended:[/] {choice[0].strategy} ({choice[1]})")


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
