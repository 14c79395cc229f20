"""`llmtune doctor`: check the cluster a recipe will run on, with the same flags as `llmtune train`."""

from __future__ import annotations

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
from llmtune.errors import EXIT_USER_ERROR


def doctor(
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
    rdzv_endpoint: Annotated[
        Optional[str], typer.Option("--rdzv-endpoint", help="host:port of the etcd server (rdzv_backend: etcd).")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the verdict and every report as JSON.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show every line the ranks print.")] = False,
) -> None:
    """Check the machines before a run: stack, GPUs, storage, network, clocks and the collectives, each rank as the
    run would start it. Exit 0 when healthy; 2 with one line per problem."""
    from llmtune.doctor.run import run_doctor
    from llmtune.launch.net import free_port
    from llmtune.recipe import load_recipe

    loaded = load_recipe(recipe)
    if rdzv_endpoint:
        loaded.recipe = loaded.recipe.model_copy(update={"rdzv_endpoint": rdzv_endpoint})
    if main_process_port is None and num_machines == 1 and hostfile is None:
        main_process_port = free_port()
    cluster = cluster_from_flags(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device,
                                 rehearse, launcher, hostfile, no_ssh)  # fmt: skip
    code = run_doctor(loaded, cluster, loaded.recipe.rdzv_timeout, json_output, verbose)
    if code:
        raise typer.Exit(EXIT_USER_ERROR if code == 2 else code)
