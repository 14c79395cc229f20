"""Turn torchrun's failure report into one clear statement: which rank died, how, and its last lines.

The launcher's stderr is passed through line by line (rank lines carry a `[rankN]:` prefix). The
elastic agent's own traceback at the end (a Python stack of the launcher, useless to the user) is held
back; from its "Root Cause" section we name the failing rank and show the tail of that rank's log.
"""

from __future__ import annotations

import codecs
import re
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import EXIT_USER_ERROR
from llmtune.launch.hangs import MARK, parse

RANK_LINE = re.compile(r"^\[rank(\d+)\]:")
RANK_PREFIXES = re.compile(r"^(?:\[rank\d+\]: ?)+")  # torchrun's prefix, and torch's own before a rank's traceback
TRACEBACK_LINKS = ("During handling of the above exception", "The above exception was the direct cause")
LOST_CONNECTION = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe")
# gloo, when the other end of a connection goes away: the address is the machine that was lost. Both of gloo's
# forms: "Connection closed by peer [10.0.0.2]:port" and "Read error [10.0.0.2]:port: Connection reset by peer"
LOST_PEER = re.compile(
    r"Connection (?:closed|reset) by peer \[([^\]]+)\]|\[([^\]]+)\]:\d+: Connection (?:closed|reset) by peer"
)


@dataclass
class RootCause:
    rank: int
    local_rank: int
    host: str
    exitcode: int


def records(stream) -> Iterator[tuple[str, bool]]:
    """(text, transient) for each record a stream carries as it arrives: a line, or a progress bar's redraw that
    ended in a carriage return (transient). Binary pipes are decoded as UTF-8; text streams are read as they are."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    read = getattr(stream, "read1", None) or stream.read
    pending = ""
    while True:
        chunk = read(65536)
        if not chunk:
            break
        pending += decoder.decode(chunk) if isinstance(chunk, bytes) else chunk
        held_cr = pending.endswith("\r")  # maybe the first half of a \r\n split between two reads
        parts = SEPARATOR.split(pending[:-1] if held_cr else pending)
        pending = parts.pop() + ("\r" if held_cr else "")
        for text, separator in zip(parts[::2], parts[1::2], strict=True):
            yield text, separator == "\r"
    pending += decoder.decode(b"", final=True)
    if pending:
        yield pending.rstrip("\r"), False


SEPARATOR = re.compile(r"(\r\n|\n|\r)")


class StderrWatcher(threading.Thread):
    """Reads what the launched processes print: each line goes to the log and, filtered, to the console; under
    torchrun (hold_tracebacks) the agent's own traceback is held back for the failure report."""

    def __init__(self, stream, out=None, console=None, log=None, hold_tracebacks: bool = True) -> None:
        super().__init__(daemon=True)
        from llmtune.launch.console import Console

        self.stream = stream
        self.console = console or Console(out or sys.stderr, verbose=True, live=False)
        self.log = log
        self.hold_tracebacks = hold_tracebacks
        self.held: list[str] = []
        self.holding = False
        self.last_error: dict[int, str] = {}
        self.lost_peers: list[str] = []  # addresses gloo lost its connection to, first seen first
        self.tracebacks: dict[int, list[str]] = {}  # a rank's traceback, held until its last line says what it is
        self.stalls = None  # launch/hangs.py's Stalls: the ranks' stall reports (set by the runner)

    def run(self) -> None:
        for text, transient in records(self.stream):
            if transient:
                self.console.feed(text, transient=True)
                continue
            if self.log is not None:
                self.log.write(text + "\n")
                self.log.flush()
            line = text + "\n"
            if self.stalls is not None and MARK in line:  # a rank's stall report: collated, not shown as it is
                found = parse(line)
                if found is not None:
                    self.stalls.add(found)
                    continue
            match = RANK_LINE.match(line)
            user_error = bool(match) and line[match.end() :].startswith("error: ")
            lost = LOST_PEER.search(line)
            peer = lost and (lost.group(1) or lost.group(2))
            if peer and peer not in self.lost_peers:
                self.lost_peers.append(peer)
            if user_error:
                self.last_error[int(match.group(1))] = line[match.end() :].strip()
            if (
                self.hold_tracebacks
                and not self.holding
                and not match
                and line.startswith("Traceback (most recent call last):")
            ):
                self.holding = True
            if self.holding:
                self.held.append(line)
            elif user_error and self.hold_tracebacks:
                pass  # said once, last, by the failure report (it was shown here and repeated there)
            elif not (match and self.hold_tracebacks and self._rank_traceback(int(match.group(1)), line)):
                self.console.feed(text)
            if user_error and self.hold_tracebacks:
                # a rank stopped on a user error: what the other ranks print while the job goes down (broken
                # connections, tracebacks) is a consequence; it is shown only if the error turns out not to be the cause
                self.holding = True
        for lines in self.tracebacks.values():  # cut short: the rank was stopped while printing it
            self.held.extend(lines)
        self.tracebacks.clear()

    def _rank_traceback(self, rank: int, line: str) -> bool:
        """Holds a rank's traceback until its last line. One that ends in a lost connection is a consequence of
        another rank going away (the rank with a user error exited first, and ranks print in any order): it goes to
        the failure report, which shows it only if nothing better explains the failure. Any other is shown."""
        body = RANK_PREFIXES.sub("", line)
        if body.lstrip().startswith("Traceback (most recent call last):"):
            self.tracebacks.setdefault(rank, []).append(line)
            return True
        if rank not in self.tracebacks:
            return False
        self.tracebacks[rank].append(line)
        if body[:1].isspace() or not body.strip() or body.startswith(TRACEBACK_LINKS):
            return True  # inside the traceback: frames, source lines, chained-exception lines
        lines = self.tracebacks.pop(rank)
        if LOST_CONNECTION.search(body):
            self.held.extend(lines)
        else:
            for held in lines:
                self.console.feed(held.rstrip("\n"))
        return True

    def root_cause(self) -> RootCause | None:
        """The rank to blame. torchrun names the first failure it observed, but when one rank is killed (SIGKILL from
        the OOM killer, a segfault) its peers see their gloo/NCCL connection reset and exit with code 1 within the
        same poll; torchrun may then name a peer. A rank killed by a signal is the cause when the named rank exited
        with an error after losing a connection, except a user error (exit code 2, already said in one line) and
        SIGTERM, which is torchrun stopping the ranks that were left."""
        text = "".join(self.held)
        section = text.split("Root Cause (first observed failure):", 1)
        if len(section) < 2:
            return None
        named = _failures(section[1])
        if not named:
            return None
        cause = named[0]
        if cause.exitcode > 0 and cause.exitcode != EXIT_USER_ERROR and self.lost_peers:
            killed = [f for f in _failures(section[0].split("Failures:", 1)[-1])
                      if f.exitcode < 0 and f.exitcode != -signal.SIGTERM]  # fmt: skip
            if killed:
                return killed[0]
        return cause

    def flush_held(self) -> None:
        self.console.out.write("".join(self.held))
        self.console.out.flush()


FAILURE = re.compile(
    r"(?:host\s*:\s*(?P<host>\S+)\s*\n)?\s*rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n"
    r"\s*exitcode\s*:\s*(?P<code>-?\d+)"
)


def _failures(block: str) -> list[RootCause]:
    """Each failure torchrun's report lists in `block` (host, rank, local rank, exit code), in order."""
    return [
        RootCause(int(m["rank"]), int(m["local"]), m["host"] or "?", int(m["code"])) for m in FAILURE.finditer(block)
    ]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def rank_log_tail(log_dir: Path, local_rank: int, lines: int = 12) -> tuple[Path | None, list[str]]:
    """The last lines a local rank printed in torchrun's newest attempt: its stderr log, or its stdout log when it
    wrote nothing to stderr. (None, []) when torchrun kept no log of it."""
    attempts = sorted(log_dir.glob(f"*/attempt_*/{local_rank}"), key=lambda p: p.stat().st_mtime)
    if not attempts:
        return None, []
    for name in ("stderr.log", "stdout.log"):
        path = attempts[-1] / name
        text = path.read_text(errors="replace") if path.is_file() else ""
        shown = [line for line in (part.split("\r")[-1].rstrip() for part in text.splitlines()) if line.strip()]
        if shown:
            return path, shown[-lines:]
    return attempts[-1] / "stderr.log", []


def report(watcher: StderrWatcher, log_dir: Path, out=None, rendezvous: tuple[str, int, float] | None = None,
           local_addresses: set | None = None) -> int:  # fmt: skip
    """After a failed launch: print what happened; returns the exit code llmtune should end with.

    `rendezvous`: (address, machines it needs, seconds) of a c10d rendezvous, to name it when it can't form.
    `local_addresses`: this machine's own addresses, on a job of several machines (None: one machine, where a
    connection closed by a peer is a local rank that failed, whose own error is the story).
    """
    out = out or sys.stderr
    cause = watcher.root_cause()
    held = "".join(watcher.held)
    if cause is None and rendezvous:
        address, machines, seconds = rendezvous
        what = None
        if "RendezvousTimeoutError" in held:
            what = f"the c10d rendezvous at {address} did not gather {machines} machine(s) within {seconds:.0f} s (rdzv_timeout)"
        elif "RendezvousConnectionError" in held:
            what = f"could not reach the c10d rendezvous store at {address} (machine rank 0 hosts it; rdzv_timeout {seconds:.0f} s)"
        if what:
            print(f"error: {what} (hint: start `llmtune train` with the same recipe and flags on every machine, "
                  "and check they reach that address: firewall, --main-process-ip)", file=out)  # fmt: skip
            return 2
    errors = list(dict.fromkeys(watcher.last_error.values()))  # the ranks' user errors, each said once
    if cause is None:
        watcher.flush_held()  # not a failure report we understand: show it as it came
        for message in errors:
            print(message, file=out)
        return 1
    if cause.exitcode == 2 or (errors and cause.exitcode > 0):  # a user error, one line (a peer that lost the
        # erring rank's connection may be the one torchrun named): said once, last
        message = watcher.last_error.get(cause.rank) or (errors[0] if errors else None)
        if message:
            print(message, file=out)
        return 2
    for message in errors:  # said before the failure of a rank killed by a signal
        print(message, file=out)
    path, tail = rank_log_tail(log_dir, cause.local_rank)
    remote = [p for p in watcher.lost_peers if local_addresses is not None and p not in local_addresses]
    if remote and cause.exitcode > 0:  # this machine's rank failed because a rank on another machine went away
        peers = ", ".join(remote)
        print(f"error: lost contact with {peers}: a rank there stopped answering (the machine failed, was stopped or "
              f"lost its network); rank {cause.rank} on this machine stopped", file=out)  # fmt: skip
        print(f"look at the log of the machine at {peers} for the cause", file=out)
        print("to resume from the last complete checkpoint, run the same command again on every machine "
              "(or set rdzv_backend: c10d and max_restarts to wait for a restarted machine)", file=out)  # fmt: skip
        return 1
    print(f"error: rank {cause.rank} (local rank {cause.local_rank} on {cause.host}) {describe_exit(cause.exitcode)}; "
          "the other ranks were stopped", file=out)  # fmt: skip
    if tail:
        print(f"last lines of rank {cause.rank} ({path}):", file=out)
        for line in tail:
            print(f"    {line}", file=out)
    elif path is not None:  # a rank that printed nothing (ranks other than 0 are quiet) was stopped from outside
        print(f"rank {cause.rank} printed nothing before it stopped (its log: {path.parent})", file=out)
    print(next_step(log_dir, cause.exitcode, local_addresses is None), file=out)
    return 1


def _rerun_resumes(output_dir: Path) -> tuple[Path | None, str | None, Path | None, bool]:
    """What a rerun of the launch whose plan output_dir holds resumes, by the rule `llmtune train` applies
    (resume_checkpoint, on the recipe in the plan): (the checkpoint, the recipe's resume_from_checkpoint, the newest
    complete checkpoint in output_dir, whether auto-resume is on)."""
    from types import SimpleNamespace

    from llmtune.plan.checkpoint_layout import last_complete
    from llmtune.plan.resume import resume_checkpoint
    from llmtune.post.consolidate import plan_recipe

    saved = plan_recipe(output_dir)
    named = saved.get("resume_from_checkpoint")
    named = named if isinstance(named, str) and named else None
    auto = saved.get("auto_resume_from_checkpoints", True) is not False
    recipe = SimpleNamespace(output_dir=output_dir, resume_from_checkpoint=named, auto_resume_from_checkpoints=auto)
    try:
        last = last_complete(output_dir)
    except OSError:
        last = None
    return resume_checkpoint(recipe), named, last, auto


def next_step(log_dir: Path, exitcode: int, one_machine: bool) -> str:
    """What to do after a rank failed, true to what a rerun does: the checkpoint it resumes from, or that it starts
    over, by the rule `llmtune train` applies to the plan's recipe (auto_resume_from_checkpoints, a
    resume_from_checkpoint that wins over output_dir's); and for a rank that stopped on an error of its own (not a
    signal), that rerunning only helps once its cause is gone. On several machines the checkpoints may sit on machine
    0's disk, so none is named."""
    if not one_machine or log_dir.parent.name != "llmtune":
        again = "run the same command again: it resumes from the last complete checkpoint, if one was saved"
    else:
        output_dir = log_dir.parent.parent
        resume, named, last, auto = _rerun_resumes(output_dir)
        if resume is not None and named and resume == Path(named):  # the named one, not a checkpoint of its own
            other = last is not None and last.resolve() != resume.resolve()
            besides = f", as resume_from_checkpoint says, not {last.name} in {output_dir}" if other else ""
            again = f"run the same command again: it resumes {named} again{besides}"
            if exitcode > 0:
                return (f"if the error above was a passing fault (network, hardware), {again}; if it came from loading "
                        f"that checkpoint (damaged, or another model's), point resume_from_checkpoint at another "
                        "one or remove it; otherwise fix its cause first: the same command would stop the same way")  # fmt: skip
        elif resume is not None:
            again = f"to resume from the last complete checkpoint, run the same command again ({resume.name})"
        elif last is not None and not auto:
            again = (f"run the same command again: it starts over (auto_resume_from_checkpoints: false; set it to "
                     f"true to resume {last.name})")  # fmt: skip
        else:
            again = f"run the same command again: it starts over (no complete checkpoint in {output_dir} yet)"
    if exitcode > 0:  # the rank raised: the same command meets the same error unless its cause was passing
        return (f"if the error above was a passing fault (network, hardware), {again}; otherwise fix its cause first: "
                "the same command would stop the same way")  # fmt: skip
    return again
