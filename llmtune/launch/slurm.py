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
    vllm_gpus: int = 0  # GRPO with a vLLM server: the GPUs it takes (vllm.tensor_parallel_size x data_parallel_size)

    @property
    def server_node(self) -> bool:
        """The vLLM server gets the allocation's last node to itself (several nodes), else the first GPUs of the
        one node, the trainers the rest."""
        return self.vllm_gpus > 0 and self.nodes > 1

    @property
    def training_nodes(self) -> int:
        return self.nodes - 1 if self.server_node else self.nodes

    @property
    def training_processes(self) -> int:
        if self.server_node:
            return self.training_nodes * self.gpus_per_node
        return self.nodes * self.gpus_per_node - self.vllm_gpus

    def check(self) -> None:
        if self.device not in (None, "cpu", "cuda", "cuda:gloo"):
            raise UserError(f"--device must be cuda or cpu, not {self.device!r}",
                            "the nodes' GPUs are the default; --device cpu rehearses on their CPUs")  # fmt: skip
        if self.nodes < 1:
            raise UserError(f"--nodes {self.nodes} must be at least 1")
        if self.gpus_per_node < 1:
            raise UserError(f"--gpus-per-node {self.gpus_per_node} must be at least 1",
                            "with --device cpu it is the number of CPU processes per node")  # fmt: skip
        if self.time is not None and not re.fullmatch(r"(\d+-)?\d+(:\d{1,2}){0,2}", self.time):
            raise UserError(f"--time '{self.time}' is not a Slurm time", "write it like 30, 4:00:00 or 1-12:00:00")
        if self.vllm_gpus and self.vllm_gpus > self.gpus_per_node:
            raise UserError(f"the vLLM server takes {self.vllm_gpus} GPUs (vllm.tensor_parallel_size x "
                            f"data_parallel_size), more than --gpus-per-node {self.gpus_per_node}",
                            "ask for more GPUs per node, or a smaller vllm: section")  # fmt: skip
        if self.vllm_gpus and not self.server_node and self.training_processes < 1:
            raise UserError(f"--gpus-per-node {self.gpus_per_node} on 1 node leaves no GPU for training: the vLLM "
                            f"server takes {self.vllm_gpus}",
                            "ask for more GPUs per node, or --nodes 2 to give the server a node of its own")  # fmt: skip
        if self.job_name is not None and not re.fullmatch(r"[\w.+-]+", self.job_name):
            raise UserError(f"--job-name '{self.job_name}' has characters Slurm job names can't hold",
                            "use letters, digits, '.', '_', '+' and '-'")  # fmt: skip


def job_name_of(recipe_path: Path) -> str:
    """The default job name, from the recipe's file name in the characters Slurm job names hold."""
    return "llmtune-" + re.sub(r"[^\w.+-]", "_", recipe_path.stem)


def _directive_value(value: str) -> str:
    """A #SBATCH value: in double quotes where it holds a space (sbatch reads the line's words as a shell would)."""
    return f'"{value}"' if any(c.isspace() for c in value) else value


def sbatch_script(recipe_path: Path, output_dir: Path, job: SlurmJob, workdir: Path, llmtune: list[str],
                  script_path: Path) -> str:  # fmt: skip
    """The sbatch script text (pure: no file is read or written). `llmtune` is how the nodes start llmtune."""
    job.check()
    name = job.job_name or job_name_of(recipe_path)
    processes = job.training_processes
    directives = [
        f"--job-name={name}",
        f"--nodes={job.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={job.gpus_per_node}"] if job.device != "cpu" else []),
        *([f"--cpus-per-task={job.cpus_per_task}"] if job.cpus_per_task else []),
        *([f"--partition={job.partition}"] if job.partition else []),
        *([f"--time={job.time}"] if job.time else []),
        *([f"--account={job.account}"] if job.account else []),
        f"--output={_directive_value(str(output_dir / 'slurm' / '%x-%j.out'))}",
        "--open-mode=append",
        "--requeue",
        f"--signal=B:USR1@{job.signal_seconds}",
    ]
    train = [*llmtune, "train", str(recipe_path), "--num-processes", str(processes),
             "--num-machines", str(job.training_nodes)]  # fmt: skip
    if job.device:
        train += ["--device", job.device]
    launch = " ".join(shlex.quote(part) for part in train)
    python = shlex.quote(llmtune[0]) if "python" in Path(llmtune[0]).name else "python3"
    header = "\n".join(f"#SBATCH {d}" for d in directives)
    server, srun_nodes, visible = _vllm_server(recipe_path, output_dir, job, llmtune)
    # srun of Slurm 22.05 to 23.02 does not take --cpus-per-task from the allocation: each launcher would get one CPU
    srun_nodes += f" --cpus-per-task={job.cpus_per_task}" if job.cpus_per_task else ""
    layout = (f"{job.nodes} node(s) x {job.gpus_per_node} process(es), one llmtune launcher per node"
              if not job.vllm_gpus else f"{processes} training process(es) on {job.training_nodes} node(s), "
              f"one launcher per node; a vLLM server on {job.vllm_gpus} GPU(s) "
              + ("of the last node" if job.server_node else "of the node"))  # fmt: skip
    return f"""#!/bin/bash
# Written by `llmtune slurm`: {layout}.
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

# each node's task: its machine rank is that node's SLURM_NODEID (the command's words pass as arguments, quoted once)
{server}srun{srun_nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c '{visible}exec "$@" --machine-rank "$SLURM_NODEID"' \\
  llmtune {launch} --main-process-ip "$HEAD_ADDR" --main-process-port "$PORT" &
SRUN_PID=$!
wait "$SRUN_PID"
STATUS=$?
# `wait` returns early when USR1 arrives; the trap above then requeues. Otherwise this is the job's result.
exit $STATUS
"""


def _vllm_server(recipe_path: Path, output_dir: Path, job: SlurmJob, llmtune: list[str]) -> tuple[str, str, str]:
    """The script's lines that start GRPO's vLLM server before the trainers (none without one), the trainers' srun
    node options, and what each trainer's shell sets first (the GPUs it may use)."""
    if not job.vllm_gpus:
        return "", "", ""
    serve = " ".join(shlex.quote(part) for part in [*llmtune, "vllm-serve", str(recipe_path)])
    log = shlex.quote(str(output_dir / "slurm" / "vllm-server-$SLURM_JOB_ID.out")).replace("'", '"')
    stop = "trap 'kill $VLLM_PID 2>/dev/null' EXIT  # the server ends with the job\n"
    if job.server_node:
        gpus = ",".join(str(i) for i in range(job.vllm_gpus))
        return (f"""# The vLLM server (GRPO's generation) on the last node, alone; the trainers reach it by its address.
SERVER_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tail -n 1)
SERVER_ADDR=$(scontrol show node "$SERVER_NODE" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p' | head -n 1)
export LLMTUNE_VLLM_SERVER_HOST=${{SERVER_ADDR:-$SERVER_NODE}}
srun --nodes=1 --ntasks=1 --nodelist="$SERVER_NODE" bash -c 'CUDA_VISIBLE_DEVICES={gpus} exec "$@"' vllm {serve} \\
  >{log} 2>&1 &
VLLM_PID=$!
{stop}
""", f' --nodes={job.training_nodes} --exclude="$SERVER_NODE"', "")  # fmt: skip
    server_gpus = ",".join(str(i) for i in range(job.vllm_gpus))
    training_gpus = ",".join(str(i) for i in range(job.vllm_gpus, job.gpus_per_node))
    return (f"""# The vLLM server (GRPO's generation) on GPUs {server_gpus} of this node; the trainers on GPUs {training_gpus}.
# llmtune train waits for it to answer (trl.vllm_server_timeout).
CUDA_VISIBLE_DEVICES={server_gpus} {serve} >{log} 2>&1 &
VLLM_PID=$!
{stop}
""", "", f"CUDA_VISIBLE_DEVICES={training_gpus} ")  # fmt: skip


def write_job(recipe_path: Path, recipe, job: SlurmJob, output: Path | None = None) -> Path:
    """Check the plan holds for the job's cluster, then write its sbatch script (default OUT/slurm/job.sbatch)."""
    import sys

    from llmtune.plan import make_plan
    from llmtune.plan.cluster import Cluster
    from llmtune.plan.files import atomic_write, make_folder
    from llmtune.recipe.online import generation_mode

    if recipe.rl in ("grpo", "gdpo") and job.device != "cpu" and generation_mode(recipe) == "server":
        job.vllm_gpus = recipe.vllm.tensor_parallel_size * recipe.vllm.data_parallel_size if recipe.vllm else 1
    job.check()
    # the plan must hold for this cluster shape (batch arithmetic, parallel sizes) before anything is written
    # (the login node's own GPUs don't matter: the cluster is described, not probed)
    make_plan(recipe, Cluster(job.training_processes, job.training_nodes, 0, "127.0.0.1", 29500, job.device or "cuda"))
    output_dir = Path(recipe.output_dir).resolve()
    script = (output or output_dir / "slurm" / "job.sbatch").resolve()
    text = sbatch_script(recipe_path.resolve(), output_dir, job, Path.cwd(), [sys.executable, "-m", "llmtune"], script)
    make_folder(output_dir / "slurm")  # sbatch writes the job's log there
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
        about_job = any(word in first.lower() for word in ("partition", "account", "time limit", "qos", "gres",
                                                            "node configuration", "invalid"))  # fmt: skip
        raise UserError(f"sbatch refused the job: {first}", "check --partition, --account and --time" if about_job
                        else "sbatch itself failed on this machine: check its Slurm setup (sinfo should answer), or "
                        "submit the written script from a login node")  # fmt: skip
    job_id = done.stdout.strip().split(";")[0]
    return job_id, done.stdout.strip()
