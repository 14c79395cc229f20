"""`llmtune slurm`: an sbatch script that runs one llmtune launcher per node.

The script runs on the allocation's first node. It takes the head node's address from Slurm itself
(`scontrol show node` -> NodeAddr, so node names need not resolve in DNS), picks a free port there, and
starts `llmtune train` once per node with `srun`, the machine rank being SLURM_NODEID. Every node runs
the same plan, so the machine check-in (launch/lobby.py) catches a node started differently.

Preemption and time limits: Slurm sends USR1 to the script `--signal` seconds before the limit; the
script asks the ranks to save a checkpoint after their current step and stop (the stop-requested file
the ranks look for after every step), requeues the job, and the requeued job resumes from that
checkpoint (auto_resume_from_checkpoints). No step is lost to the requeue.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError

NCCL_KNOBS = """\
# NCCL settings many clusters need (uncomment what yours does):
# export NCCL_DEBUG=INFO                # log what NCCL picks: interfaces, transports, topology
# export NCCL_SOCKET_IFNAME=ib0         # the network interface the nodes reach each other on
# export NCCL_IB_DISABLE=1              # no InfiniBand: use TCP sockets
# export NCCL_IB_HCA=mlx5               # which InfiniBand adapters to use
# export NCCL_P2P_DISABLE=1             # GPUs without peer-to-peer access within a node
# export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective ends the job instead of hanging it
"""


@dataclass
class SlurmJob:
    nodes: int
    gpus_per_node: int
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    job_name: str | None = None
    cpus_per_task: int | None = None
    signal_seconds: int = 300
    device: str | None = None  # "cpu": rehearse on the nodes' CPUs (no --gpus-per-node)

    def check(self) -> None:
        if self.nodes < 1:
            raise UserError(f"--nodes {self.nodes} must be at least 1")
        if self.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node {self.gpus_per_node} must be at least 1",
                            "with --device cpu it is the number of CPU processes per node")  # fmt: skip
        if self.time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", self.time):
            raise UserError(f"--time '{self.time}' is not a Slurm time", "write it like 30, 4:00:00 or 1-12:00:00")
        if self.job_name is not None and not re.fullmatch(r"[\w.+-]+", self.job_name):
            raise UserError(f"--job-name '{self.job_name}' has characters Slurm job names can't hold",
                            "use letters, digits, '.', '_', '+' and '-'")  # fmt: skip


def sbatch_script(recipe_path: Path, output_dir: Path, job: SlurmJob, workdir: Path, llmtune: list[str],
                  script_path: Path) -> str:  # fmt: skip
    """The sbatch script text (pure: no file is read or written). `llmtune` is how the nodes start llmtune."""
    job.check()
    name = job.job_name or f"llmtune-{recipe_path.stem}"
    processes = job.nodes * job.gpus_per_node
    directives = [
        f"--job-name={name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.device != "cpu" else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--time={job.time}"] if job.time else []),
        *([f"--account={job.account}"] if job.account else []),
        f"--output={output_dir / 'slurm' / '%x-%j.out'}",
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{job.signal_seconds}",
    ]
    train = [*llmtune, "train", str(recipe_path), "--num-processes", str(processes),
             "--num-machines", str(job.nodes)]  # fmt: skip
    if job.device:
        train += ["--device", job.device]
    launch = " ".join(shlex.quote(part) for part in train)
    python = shlex.quote(llmtune[0]) if "python" in Path(llmtune[0]).name else "python3"
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    return f"""#!/bin/bash
# Written by `llmtune slurm`: {job.nodes} node(s) x {job.gpus_per_node} process(es), one llmtune launcher per node.
# Submit with: sbatch {shlex.quote(str(script_path))}   (or `llmtune slurm ... --submit`)
# output_dir must be on storage every node sees: {output_dir}
{header}
set -uo pipefail
cd {shlex.quote(str(workdir))}
export PYTHONUNBUFFERED=1

{NCCL_KNOBS}
# The head node is the allocation's first host; its address comes from Slurm (NodeAddr), not from DNS.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)
HEAD_ADDR=${{HEAD_ADDR:-$HEAD_NODE}}
# A free port on the head node: this script runs there.
PORT=$({python} -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
echo "llmtune: job $SLURM_JOB_ID (restart ${{SLURM_RESTART_COUNT:-0}}) on $SLURM_JOB_NODELIST, head $HEAD_NODE = $HEAD_ADDR:$PORT"

# Near the time limit (or on preemption notice) Slurm sends USR1 to this script: the ranks are asked to save a
# checkpoint after their current step and stop, then the job is requeued and resumes from that checkpoint.
STOP_FILE={shlex.quote(str(output_dir / "llmtune" / "stop-requested"))}
requeue() {{
  echo "llmtune: USR1 received: checkpoint after this step, stop, and requeue job $SLURM_JOB_ID"
  touch "$STOP_FILE"
  for _ in $(seq {max(10, job.signal_seconds - 60)}); do kill -0 "$SRUN_PID" 2>/dev/null || break; sleep 1; done
  kill -TERM "$SRUN_PID" 2>/dev/null  # still running this close to the limit: stop it (the last checkpoint stays)
  wait "$SRUN_PID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}}
trap requeue USR1

srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \\
  "exec {launch} --machine-rank \\$SLURM_NODEID --main-process-ip $HEAD_ADDR --main-process-port $PORT" &
SRUN_PID=$!
wait "$SRUN_PID"
STATUS=$?
# `wait` returns early when USR1 arrives; the trap above then requeues. Otherwise this is the job's result.
exit $STATUS
"""


def write_job(recipe_path: Path, recipe, job: SlurmJob, output: Path | None = None) -> Path:
    """Check the plan holds for the job's cluster, then write its sbatch script (default OUT/slurm/job.sbatch)."""
    import sys

    from llmtune.plan import make_plan
    from llmtune.plan.cluster import Cluster
    from llmtune.plan.files import atomic_write

    job.check()
    # the plan must hold for this cluster shape (batch arithmetic, parallel sizes) before anything is written
    # (the login node's own GPUs don't matter: the cluster is described, not probed)
    make_plan(recipe, Cluster(job.nodes * job.gpus_per_node, job.nodes, 0, "127.0.0.1", 29500, job.device or "cuda"))
    output_dir = Path(recipe.output_dir).resolve()
    script = (output or output_dir / "slurm" / "job.sbatch").resolve()
    text = sbatch_script(recipe_path.resolve(), output_dir, job, Path.cwd(), [sys.executable, "-m", "llmtune"], script)
    (output_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch writes the job's log there
    script.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(script, text)
    script.chmod(0o755)
    return script


def submit(script: Path) -> tuple[str, str]:
    """sbatch the script; (job id, sbatch's own line)."""
    import shutil
    import subprocess

    if shutil.which("sbatch") is None:
        raise UserError("sbatch is not on PATH", f"run this on a Slurm login node, or submit {script} there")
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"sbatch refused the job: {first}", "check --partition, --account and --time")
    job_id = done.stdout.strip().split(";")[0]
    return job_id, done.stdout.strip()
