"""Run this machine's command of a plan and supervise it.

The command is an argument list (never a shell string). The launcher and its ranks run in
their own process group, so Ctrl-C or SIGTERM stops every rank and leaves no orphan.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from llmtune.errors import UserError
from llmtune.plan.planner import Plan


def executable_command(command: list[str], extra_launcher_args: list[str] | None = None) -> list[str]:
    """The plan's printable command with this interpreter in place of `python` / `accelerate`."""
    if command[:2] == ["accelerate", "launch"]:
        module_at = command.index("-m")
        return [sys.executable, "-m", "accelerate.commands.launch", *command[2:module_at],
                *(extra_launcher_args or []), *command[module_at:]]  # fmt: skip
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    return list(command)


def free_port() -> int:
    """A port nothing listens on now: single-machine runs need no fixed rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Fail before launching when the rendezvous port is taken (instead of a hang or a cryptic error)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        bind_port(probe, port)


def bind_port(sock: socket.socket, port: int) -> None:
    """Bind to the rendezvous port on every interface, or say clearly that it is taken."""
    try:
        sock.bind(("", port))
    except OSError:
        raise UserError(f"--main-process-port {port} is already in use on this machine",
                        "choose another port, or stop the process holding it") from None  # fmt: skip


def _log(message: str) -> None:
    print(f"[llmtune] {message}", file=sys.stderr, flush=True)


def run(plan: Plan, extra_launcher_args: list[str] | None = None, rdzv_timeout: float = 600) -> int:
    """Start this machine's command and wait; returns its exit code."""
    from llmtune.launch import lobby

    cluster = plan.cluster
    if cluster.num_machines > 1:  # every machine checks in first: a missing one is named, not waited on forever
        if cluster.machine_rank == 0:
            lobby.gather(plan, rdzv_timeout, _log)
        else:
            lobby.join(plan, rdzv_timeout, _log)
    elif plan.world_size > 1:
        check_port_free(cluster.main_process_ip, cluster.main_process_port)
    command = plan.commands[cluster.machine_rank]
    argv = executable_command(command, extra_launcher_args)
    env = {**os.environ, **plan.env}
    if command[:2] != ["accelerate", "launch"]:
        return supervise(subprocess.Popen(argv, env=env, start_new_session=True))
    from llmtune.launch.failures import StderrWatcher, report

    process = subprocess.Popen(argv, env=env, start_new_session=True, stderr=subprocess.PIPE, text=True,
                               errors="replace", bufsize=1)  # fmt: skip
    watcher = StderrWatcher(process.stderr)
    watcher.start()
    code = supervise(process)
    watcher.join(timeout=10)
    if code == 0 or code > 128:  # success, or stopped by Ctrl-C/SIGTERM
        return code
    return report(watcher, Path(plan.config_dir) / "logs")


def supervise(process: subprocess.Popen, grace: float = 10.0) -> int:
    """Wait for the launched group; on SIGINT/SIGTERM stop all of it (SIGTERM, then SIGKILL after `grace`).

    The signal handler only sends signals: waiting inside it would re-enter Popen.wait and deadlock.
    """
    stop_requested: list[tuple[int, float]] = []

    def on_signal(signum, _frame):
        stop_requested.append((signum, time.monotonic()))
        _signal_group(process, signal.SIGTERM)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while True:
            try:
                code = process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop_requested and time.monotonic() - stop_requested[0][1] > grace:
                    _signal_group(process, signal.SIGKILL)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if process.poll() is None:
            _signal_group(process, signal.SIGKILL)
            process.wait()
        _signal_group(process, signal.SIGKILL)  # ranks left behind by a launcher that died first
    if stop_requested:
        return 128 + stop_requested[0][0]
    return code


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
