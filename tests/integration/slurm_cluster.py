"""A real two-node Slurm cluster on this host, for tests: munged, slurmctld and two slurmd (n1, n2).

Both nodes are 127.0.0.1 with their own slurmd port. Everything lives in one temporary folder; every
daemon is started by us and stopped by PID, even when the test fails.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")


def available() -> str | None:
    """None when the Slurm and munge programs are installed, else what is missing."""
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    return f"not installed: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)" if missing else None


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus: int = 2):
        self.root, self.nodes, self.cpus = root, nodes, cpus
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def start(self) -> SlurmCluster:
        root = self.root
        for folder in ("state", "log", "run", "munge"):
            (root / folder).mkdir(parents=True, exist_ok=True)
        (root / "munge").chmod(0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.socket = root / "munge" / "munge.socket"
        self._spawn([_program("munged"), "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
                     f"--log-file={root / 'log' / 'munged.log'}", f"--pid-file={root / 'run' / 'munged.pid'}",
                     f"--seed-file={root / 'munge' / 'seed'}"], "munged")  # fmt: skip
        self._wait(lambda: self.socket.exists(), "munged socket")
        host = socket.gethostname()
        ctld_port = _free_port()
        node_ports = [_free_port() for _ in self.nodes]
        lines = [
            "ClusterName=llmtune-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            # cred_expire: a job credential's lifetime, which is also how long Slurm holds a requeued job before it
            # may start again (default 120 s); 15 s keeps the requeue test's wait short without racing the revocation
            f"AuthType=auth/munge\nAuthInfo=socket={self.socket},cred_expire=15\nCredType=cred/munge",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'state'}/slurmd-%n",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            # the main scheduling pass (default every 60 s) is what starts a requeued job once its hold ends
            "SchedulerParameters=sched_interval=2",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=10",
            "MinJobAge=300",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            *[f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={host} Port={port} CPUs={self.cpus} State=UNKNOWN"
              for name, port in zip(self.nodes, node_ports, strict=True)],
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]  # fmt: skip
        (root / "slurm.conf").write_text("\n".join(lines) + "\n")
        for name in self.nodes:
            (root / "state" / f"slurmd-{name}").mkdir(exist_ok=True)
        self._spawn([_program("slurmctld"), "-D", "-i", "-f", str(root / "slurm.conf")], "slurmctld")
        self._wait(lambda: self._ok(["scontrol", "ping"]), "slurmctld")
        for name in self.nodes:
            self._spawn([_program("slurmd"), "-D", "-N", name, "-f", str(root / "slurm.conf")], f"slurmd-{name}")
        self._wait(lambda: self._idle_nodes() == len(self.nodes), "both slurmd idle", timeout=60)
        return self

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "w")  # noqa: SIM115 - kept open for the daemon's life
        self.processes.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                               start_new_session=True))  # fmt: skip

    def _ok(self, argv: list[str]) -> bool:
        return subprocess.run(argv, env=self.env, capture_output=True, timeout=30).returncode == 0

    def _idle_nodes(self) -> int:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True,
                             timeout=30).stdout  # fmt: skip
        return sum(1 for line in out.splitlines() if line.split()[-1] in ("idle", "idle*") and "*" not in line)

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.processes):
                break
            if ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"slurm test cluster: {what} not ready; logs:\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)

    def wait_job(self, job_id: str, timeout: float = 900, start_requeued: bool = False) -> str:
        """The job's final state (COMPLETED, FAILED, ...).

        start_requeued: Slurm holds a requeued job until a begin time about two minutes on (Reason=BeginTime),
        which on a real cluster is the queue's business; here it would only add two idle minutes, so the held job
        is made eligible at once (`scontrol update StartTime=now`), as a free node would take it."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            fields = dict(word.split("=", 1) for word in self.run("scontrol", "show", "job", job_id).stdout.split()
                          if "=" in word)  # fmt: skip
            state = fields.get("JobState", state)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"):
                return state
            if start_requeued and state == "PENDING" and fields.get("Reason") == "BeginTime" and fields.get("Restarts", "0") != "0":
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
            time.sleep(1 if start_requeued else 2)
        self.run("scancel", job_id)
        return f"TIMEOUT(waited {timeout} s, last {state})"

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 15
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
