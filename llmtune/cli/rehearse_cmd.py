"""`llmtune rehearse RECIPE` (and `llmtune train RECIPE --rehearse --shrink`): the recipe's plan and world size
on CPU processes, with a shrunken model of the same architecture, the real tokenizer and data; then a report.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtune.cli.options import MachineRank, MainIp, MainPort, NumMachines, NumProcesses, RecipeArg
from llmtune.errors import EXIT_USER_ERROR, UserError

Output = Annotated[
    Optional[Path], typer.Option("--output", "-o", help="Rehearsal folder (default ./rehearsals/<recipe name>).")
]
HiddenSize = Annotated[
    Optional[int],
    typer.Option("--hidden-size", min=2, help="Hidden size of the shrunken model, about (default 64: the GQA ratio "
                                              "kept, the head dimension shrunk to fit).")]  # fmt: skip
KeepHeadDim = Annotated[
    bool,
    typer.Option("--keep-head-dim", help="Keep the real head dimension (hidden = fewest heads x head dim; slower)."),
]
Layers = Annotated[
    Optional[int], typer.Option("--layers", min=1, help="Layers of the shrunken model (default: what the plan needs).")
]
SequenceLen = Annotated[
    Optional[int],
    typer.Option("--sequence-len", min=8, help="Longest row of the shrunken run (default min(recipe, 128))."),
]
SampleRows = Annotated[int, typer.Option("--sample-rows", min=1, help="Rows read from each dataset.")]
StandInTokenizer = Annotated[
    Optional[Path],
    typer.Option("--stand-in-tokenizer", help="A tokenizer folder to use when the recipe's is not available offline."),
]
StandInData = Annotated[
    Optional[list[str]],
    typer.Option(
        "--stand-in-data",
        help="datasets[N]=FILE (or FILE for all): a local file of the same format for a "
        "dataset that can't be loaded offline (repeatable).",
    ),
]
GpuMemory = Annotated[str, typer.Option("--gpu-memory", help="GPU size the full-scale estimate is judged against.")]


def rehearse(
    ctx: typer.Context,
    recipe: RecipeArg,
    num_processes: NumProcesses = None,
    num_machines: NumMachines = 1,
    machine_rank: MachineRank = 0,
    main_process_ip: MainIp = None,
    main_process_port: MainPort = None,
    launcher: Annotated[
        str, typer.Option("--launcher", help="accelerate (torchrun underneath), or deepspeed.")
    ] = "accelerate",
    output: Output = None,
    hidden_size: HiddenSize = None,
    keep_head_dim: KeepHeadDim = False,
    layers: Layers = None,
    sequence_len: SequenceLen = None,
    sample_rows: SampleRows = 1000,
    stand_in_tokenizer: StandInTokenizer = None,
    stand_in_data: StandInData = None,
    gpu_memory: GpuMemory = "80GB",
) -> None:
    """Rehearse a recipe at its real world size on CPU, on a shrunken model: a checkpoint, a resume, the merge,
    and what the GPUs will see."""
    from llmtune.launch.flags import long_options
    from llmtune.launch.runner import check_launcher_flags

    ours = long_options(ctx.command)
    check_launcher_flags(list(ctx.args), ours, name="llmtune rehearse")  # before the shrunken model is built
    run_rehearsal(recipe, num_processes, num_machines, machine_rank, main_process_ip, main_process_port, launcher,
                  output, hidden_size, keep_head_dim, layers, sequence_len, sample_rows, stand_in_tokenizer,
                  stand_in_data, gpu_memory, list(ctx.args))  # fmt: skip


def rehearse_from_train(recipe: Path, num_processes, num_machines, machine_rank, main_process_ip, main_process_port,
                        device, launcher, hostfile, no_ssh, extra_args: list[str]) -> None:  # fmt: skip
    """`llmtune train RECIPE --rehearse --shrink ...`: this command, with train's cluster flags; the rehearsal's own
    options (--stand-in-data, --output, ...) arrive among train's extra arguments and are parsed here."""
    if device not in (None, "cpu"):
        raise UserError(f"--shrink rehearses on CPU but --device is {device}", "drop --device")
    if hostfile is not None or no_ssh:
        raise UserError("--shrink runs every machine on this one: --hostfile and --no-ssh don't apply",
                        "give --num-machines and --num-processes instead")  # fmt: skip
    args = [str(recipe), "--num-machines", str(num_machines), "--machine-rank", str(machine_rank),
            "--launcher", launcher]  # fmt: skip
    for flag, value in (("--num-processes", num_processes), ("--main-process-ip", main_process_ip),
                        ("--main-process-port", main_process_port)):  # fmt: skip
        if value is not None:
            args += [flag, str(value)]
    typer.main.get_command(command_app()).main([*args, *extra_args], prog_name="llmtune train", standalone_mode=False)


def command_app() -> typer.Typer:
    """This command alone, as a Typer app."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(rehearse)
    return app


def run_rehearsal(recipe: Path, num_processes=None, num_machines=1, machine_rank=0, main_process_ip=None,
                  main_process_port=None, launcher="accelerate", output=None, hidden_size=None, keep_head_dim=False,
                  layers=None, sequence_len=None, sample_rows=1000, stand_in_tokenizer=None, stand_in_data=None,
                  gpu_memory="80GB", extra_args=None) -> None:  # fmt: skip
    """What both `rehearse` and `train --rehearse --shrink` call."""
    from llmtune.rehearse import RehearsalOptions, rehearse_recipe
    from llmtune.rehearse.flow import DEFAULT_HIDDEN, ClusterFlags

    if machine_rank != 0:
        raise UserError(f"--machine-rank {machine_rank}: a rehearsal runs every machine on this one",
                        "drop --machine-rank; --num-machines N starts N launchers on 127.0.0.1")  # fmt: skip
    if keep_head_dim and hidden_size is not None:
        raise UserError("--keep-head-dim and --hidden-size both set the hidden size", "choose one")
    if main_process_ip not in (None, "127.0.0.1", "localhost"):
        typer.echo(f"{'note':>14}  --main-process-ip {main_process_ip}: the rehearsal's machines are all on "
                   "127.0.0.1", err=True)  # fmt: skip
    options = RehearsalOptions(
        output=output, hidden_size=None if keep_head_dim else hidden_size or DEFAULT_HIDDEN, layers=layers,
        sequence_len=sequence_len, sample_rows=sample_rows,
        stand_in_tokenizer=str(stand_in_tokenizer) if stand_in_tokenizer else None,
        stand_in_data=list(stand_in_data or []), gpu_memory=gpu_memory,
    )  # fmt: skip
    flags = ClusterFlags(num_processes, num_machines, main_process_port, launcher)
    code, _ = rehearse_recipe(recipe, flags, options, extra_args)
    if code:
        # as `llmtune train`: 2, a user error the worker already explained; 128+N, stopped by signal N; else 1
        raise typer.Exit(code if code == EXIT_USER_ERROR or code > 128 else 1)
