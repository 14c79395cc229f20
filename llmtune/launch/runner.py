"""Run this machine's command of a plan and supervise it.

The command is an argument list (never a shell string). The launcher and its ranks run in
their own process group, so Ctrl-C or SIGTERM stops every rank and leaves no orphan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from llmtune.launch import lobby
from llmtune.launch.net import check_port_free, local_address_towards
from llmtune.plan.planner import Plan
from llmtune.train.checkpoint.folders import STOP_FILE


def executable_command(command: list[str], extra_launcher_args: list[str] | None = None) -> list[str]:
    """The plan's printable command with this interpreter in place of `python` / `accelerate`."""
    if command[:2] == ["accelerate", "launch"]:
        module_at = command.index("-m")
        return [sys.executable, "-m", "accelerate.commands.launch", *command[2:module_at],
                *(extra_launcher_args or []), *command[module_at:]]  # fmt: skip
    if command[0] == "python":
        return [sys.executable, *command[1:]]
    if command[0] == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", *command[1:]]
    return list(command)


def _log(message: str) -> None:
    print(f"[llmtune] {message}", file=sys.stderr, flush=True)


def run(
    plan: Plan, extra_launcher_args: list[str] | None = None, rdzv_timeout: float = 600, verbose: bool = False
) -> int:
    """Start this machine's command and wait; returns its exit code."""
    cluster = plan.cluster
    stop_file = Path(plan.config_dir) / STOP_FILE
    if cluster.machine_rank == 0:  # a request of an earlier run (e.g. before a requeue) is done with; only machine 0
        stop_file.unlink(missing_ok=True)  # clears it: on shared storage a late machine must not drop a pending one
    previous_usr1 = signal.signal(signal.SIGUSR1, lambda *_: _request_stop(stop_file))  # also while machines gather
    try:
        return _run(plan, extra_launcher_args, rdzv_timeout, verbose)
    finally:
        signal.signal(signal.SIGUSR1, previous_usr1)


def _request_stop(stop_file: Path) -> None:
    try:
        stop_file.parent.mkdir(parents=True, exist_ok=True)
        stop_file.touch()
    except OSError as err:
        _log(f"SIGUSR1: could not write {stop_file} ({err.strerror}); the run goes on")
        return
    _log("SIGUSR1: the ranks save a checkpoint after this step and stop (run the same command to resume)")


def _run(plan: Plan, extra_launcher_args: list[str] | None, rdzv_timeout: float, verbose: bool) -> int:
    cluster = plan.cluster
    checked_in: dict[str, str] = {}  # what the check-in tells this machine's ranks (own disk, machine rank, address)
    etcd_run = None  # (endpoint, job, generation) of an etcd rendezvous
    if cluster.launcher == "deepspeed" and cluster.ssh and cluster.num_machines > 1:
        from llmtune.launch.remote import check_ssh_hosts

        check_ssh_hosts(cluster.hosts, _log)  # DeepSpeed starts every machine over ssh: each must answer first
    elif cluster.num_machines > 1 and plan.rdzv_backend == "c10d":
        # torchrun's elastic rendezvous gathers the machines itself (in any order, and again after a restart)
        _log(f"c10d rendezvous at {cluster.main_process_ip}:{cluster.main_process_port}: waiting up to "
             f"{rdzv_timeout:.0f} s for {cluster.num_machines} machines")  # fmt: skip
        if cluster.machine_rank == 0:
            check_port_free(cluster.main_process_port)
        # the address the other machines reach this one at (the ranks' store may live here): torch would take the
        # host name, which on many clusters resolves to another interface. torchrun reads PET_LOCAL_ADDR.
        local = local_address_towards(cluster.main_process_ip)
        if local:  # unknown (e.g. machine 0's name doesn't resolve yet): torch's own guess, not a wrong address
            os.environ.setdefault("PET_LOCAL_ADDR", local)
    elif cluster.num_machines > 1 and plan.rdzv_backend == "etcd":
        # the rendezvous lives in etcd: checked before anything starts, and this launch's id agreed through it
        from llmtune.launch import etcd

        endpoint = _etcd_endpoint(plan)
        version = etcd.check(endpoint, timeout=min(rdzv_timeout, 10))
        job = plan.commands[cluster.machine_rank][plan.commands[cluster.machine_rank].index("--rdzv_id") + 1]
        generation = etcd.generation(endpoint, job)
        etcd_run = (endpoint, job, generation)
        _log(f"etcd rendezvous at {endpoint} (etcd {version}, run {job}-{generation}): waiting up to "
             f"{rdzv_timeout:.0f} s for {plan.min_machines or cluster.num_machines} to {cluster.num_machines} machines")  # fmt: skip
        local = local_address_towards(endpoint.rpartition(":")[0])
        if local:  # the address the other machines reach this one at, if its ranks host the store
            os.environ.setdefault("PET_LOCAL_ADDR", local)
    elif cluster.num_machines > 1:  # every machine checks in first: a missing one is named, not waited on forever
        if cluster.machine_rank == 0:
            checked_in = lobby.gather(plan, rdzv_timeout, _log)
        else:
            checked_in = lobby.join(plan, rdzv_timeout, _log)
    elif plan.world_size > 1:
        check_port_free(cluster.main_process_port)
    command = plan.commands[cluster.machine_rank]
    if etcd_run:
        command = etcd.with_rdzv_id(command, str(etcd_run[2]))
    argv = executable_command(command, extra_launcher_args)
    from llmtune.train.runtime.progress import TIMELINE_ENV, launcher_marks, mark

    mark("plan")  # the recipe read, the plan made and written: the ranks start now
    # PYTHONUNBUFFERED: lines as printed
    env = {**os.environ, **plan.env, **checked_in, "PYTHONUNBUFFERED": "1", TIMELINE_ENV: launcher_marks()}
    torchrun = command[:2] == ["accelerate", "launch"] or command[:3] == ["python", "-m", "torch.distributed.run"]
    from llmtune.launch.console import Console
    from llmtune.launch.failures import StderrWatcher, report

    log_dir = Path(plan.config_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    console = Console(verbose=verbose)
    training_report = _Report(plan) if cluster.machine_rank == 0 else None
    # every rank of this machine, unfiltered, in the order printed; appended, so a resumed run keeps the first's
    with open(log_dir / f"machine-{cluster.machine_rank}.log", "a", encoding="utf-8") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(argv)}\n")
        process = subprocess.Popen(dies_with_launcher(argv), env=env, start_new_session=True, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT)  # fmt: skip
        watcher = StderrWatcher(
            process.stdout, console=console, log=log, hold_tracebacks=torchrun and "--standalone" not in command
        )
        from llmtune.launch.hangs import EXIT_STALLED, Stalls, summary, write_report

        watcher.stalls = Stalls(cluster.processes_per_machine)
        watcher.start()
        code = supervise(process, stop_when=watcher.stalls.due)
        watcher.join(timeout=10)
    if watcher.stalls.reports:  # a stalled run: named and ended here, not by NCCL's timeout half an hour later
        console.close()
        lines = summary(watcher.stalls.reports)
        write_report(plan.config_dir, lines)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        if etcd_run:
            etcd.mark_ended(*etcd_run)
        return EXIT_STALLED
    if etcd_run:  # this launch's rendezvous is closed now: a rerun of the command takes the next generation
        etcd.mark_ended(*etcd_run)
    console.close()
    if training_report is not None:
        training_report.finish(code == 0)
    if not watcher.hold_tracebacks or code == 0 or code > 128:  # not torchrun's report; success; a signal
        for message in dict.fromkeys(watcher.last_error.values()) if watcher.hold_tracebacks and code else ():
            print(message, file=sys.stderr, flush=True)  # a rank's user error, held for the report
        return code
    rendezvous = None
    if plan.rdzv_backend == "c10d":
        address = f"{cluster.main_process_ip}:{cluster.main_process_port}"
        rendezvous = (address, plan.min_machines or cluster.num_machines, rdzv_timeout)
    here = {local_address_towards(cluster.main_process_ip), *(["127.0.0.1", "::1"])}
    if cluster.machine_rank == 0:
        here.add(cluster.main_process_ip)
    lost_ok = cluster.num_machines > 1  # a lost peer is another machine only when there are several
    return report(watcher, log_dir, rendezvous=rendezvous, local_addresses=here if lost_ok else None)  # fmt: skip


def _etcd_endpoint(plan: Plan) -> str:
    command = plan.commands[plan.cluster.machine_rank]
    return command[command.index("--rdzv_endpoint") + 1]


class _Report:
    """The run's training report (post.report), drawn here on machine 0 rather than by rank 0 before it exits (0.8 s
    of a tiny LoRA run on 2 cores): the plotting library is imported in a thread while the ranks run (this process
    only waits then), and the report is drawn as soon as rank 0 has written metrics.json, while the ranks finish."""

    def __init__(self, plan: Plan) -> None:
        self.output_dir = Path(plan.config_dir).parent
        self.started = time.time()
        self.stop = threading.Event()
        self.result: str | None = None
        self.thread = threading.Thread(target=self._draw, daemon=True)
        self.thread.start()

    def _metrics_written(self) -> bool:
        metrics = self.output_dir / "metrics.json"  # written atomically, last of the run's files but the weights'
        return metrics.exists() and metrics.stat().st_mtime >= self.started

    def _draw(self) -> None:
        try:
            from llmtune.post.report import prepare_plotting, write_report

            prepare_plotting()
            while not self._metrics_written():
                if self.stop.wait(0.05):
                    return
            self.result = f"report: {write_report(self.output_dir)}"
        except Exception as err:  # noqa: BLE001 - the trained model is saved; a plotting failure must not fail the run
            self.result = (f"WARNING: the training report could not be written ({type(err).__name__}: {err}); "
                           f"rebuild it with `llmtune report {self.output_dir}`")  # fmt: skip

    def finish(self, succeeded: bool) -> None:
        """After the ranks: say where the report is (a run that stopped early or failed has none)."""
        if not (succeeded and self._metrics_written()):
            self.stop.set()
            return
        self.thread.join()
        if self.result:
            _log(self.result)


def dies_with_launcher(argv: list[str]) -> list[str]:
    """`argv` started through llmtune.launch.parent_death: it gets SIGTERM when this launcher dies, however it dies."""
    return [sys.executable, "-m", "llmtune.launch.parent_death", str(os.getpid()), *argv]


def supervise(process: subprocess.Popen, grace: float = 10.0, stop_when=None) -> int:
    """Wait for the launched group; on SIGINT/SIGTERM/SIGHUP (a closed terminal) stop all of it (SIGTERM, then SIGKILL after `grace`); the same
    when `stop_when()` says so (a stalled run). (SIGUSR1, a request to checkpoint and stop, is handled by `run` for
    the whole launch.)

    The signal handler only sends signals: waiting inside it would re-enter Popen.wait and deadlock.
    """
    stop_requested: list[tuple[int, float]] = []

    def on_signal(signum, _frame):
        stop_requested.append((signum, time.monotonic()))
        _signal_group(process, signal.SIGTERM)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while True:
            try:
                code = process.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if stop_when is not None and not stop_requested and stop_when():
                    stop_requested.append((signal.SIGTERM, time.monotonic()))
                    _signal_group(process, signal.SIGTERM)
                    grace = min(grace, 3.0)  # stalled ranks won't finish anything: don't wait on them
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


def check_launcher_flags(
    extra: list[str], ours: list[str], command: list[str] | None = None, name: str = "llmtune train"
) -> None:
    """Flags `llmtune train` doesn't know go to `accelerate launch`, and only there: a flag neither knows, one llmtune
    sets itself from its own option, or any flag where the plan runs no accelerate launcher (one process runs python
    directly; a hostfile, DeepSpeed's launcher) is refused in one line, instead of being dropped (a mistyped
    `--num_processes 2` trained one process) or failing inside the launcher. `command`: the plan's, once known."""
    import difflib

    from llmtune.errors import UserError
    from llmtune.launch.flags import planned_flag, stray_word

    flags = [arg.split("=", 1)[0] for arg in extra if (arg.startswith("--") and arg != "--") or arg in ("-m", "-t")]
    if not extra:
        return
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    for flag in flags:
        refused = planned_flag(flag)
        if refused is not None:
            raise refused
        twin = "--" + flag[2:].replace("_", "-")
        if twin in ours:
            raise UserError(f"{flag} is llmtune's {twin} (llmtune sets accelerate's from it)", f"use {twin}")
        if not _accelerate_takes(parser, flag):
            close = difflib.get_close_matches(twin, ours, n=1)
            raise UserError(f"{flag} is an option of neither {name} nor accelerate launch",
                            f"did you mean {close[0]}?" if close else f"see {name} --help")  # fmt: skip
    stray = stray_word(extra)
    if stray is not None:
        raise UserError(f"unexpected argument {stray!r}: {name} takes one recipe, and other words would reach "
                        "accelerate launch as a script to run", "pass one recipe; launcher flags start with --")  # fmt: skip
    if command is not None and command[:2] != ["accelerate", "launch"]:
        shown = ", ".join(flags) or " ".join(extra)
        raise UserError(f"{shown}: launcher flags, but this plan runs {command[0]} directly (no accelerate launch "
                        "to pass them to)", "remove them")  # fmt: skip


def _accelerate_takes(parser, flag: str) -> bool:
    """Whether accelerate launch's own parser reads `flag` (asked by parsing it: its help hides options by what
    sys.argv holds). A value it refuses (a choice) still means it knows the flag."""
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            _, unknown = parser.parse_known_args([flag, "value", "script.py"])
    except SystemExit:
        return True
    return flag not in unknown
