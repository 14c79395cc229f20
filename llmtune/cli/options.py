"""Option types shared by several commands, and the cluster the cluster flags describe."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtune.errors import UserError

RecipeArg = Annotated[Path, typer.Argument(help="The recipe YAML file.", show_default=False)]
RunArg = Annotated[Path, typer.Argument(help="A run's output_dir.", show_default=False)]

# where a run happens (validate, plan, train)
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

# generation (infer, chat)
ModelArg = Annotated[str, typer.Argument(help="A run's output_dir, a merged/HF model folder, or a hub id.")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", min=1, help="Tokens to generate per answer.")]
Temperature = Annotated[float, typer.Option("--temperature", min=0.0, help="0 is greedy; above 0 samples.")]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0)]
Seed = Annotated[int, typer.Option("--seed")]
Raw = Annotated[bool, typer.Option("--raw", help="Send prompts as plain text, without the chat template.")]
BatchSize = Annotated[int, typer.Option("--batch-size", min=1)]


def cluster_flags_given(num_processes, num_machines, machine_rank, main_process_ip, main_process_port,
                        hostfile) -> bool:  # fmt: skip
    """Whether the flags describe a cluster (its size or its machines), not only the device or the launcher."""
    return (num_processes is not None or num_machines != 1 or machine_rank != 0 or main_process_ip is not None
            or main_process_port is not None or hostfile is not None)  # fmt: skip


def cluster_from_flags(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device,
                       rehearse=False, launcher: str = "accelerate", hostfile: Path | None = None,
                       no_ssh: bool = False):  # fmt: skip
    """The Cluster the flags describe (unset ones default to this machine: its GPUs, or one CPU process)."""
    from llmtune.plan import make_cluster

    if rehearse:
        if device not in (None, "cpu"):
            raise UserError(f"--rehearse runs on CPU but --device is {device}", "drop one of the two flags")
        device = "cpu"
    return make_cluster(num_processes, num_machines, machine_rank, main_process_ip, main_process_port, device,
                        launcher, str(hostfile) if hostfile else None, no_ssh)  # fmt: skip
