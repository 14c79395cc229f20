"""The launcher's supervision: Ctrl-C stops every rank, and a taken port is reported before anything starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import llmtune

pytestmark = pytest.mark.integration


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_ctrl_c_leaves_no_rank_behind(make_recipe):
    recipe = make_recipe("sigint", num_epochs=200)
    plan_file = str(recipe.parent / "sigint" / "llmtune" / "plan.json")
    said = (recipe.parent / "sigint.stderr").open("w+")
    launcher = subprocess.Popen([sys.executable, "-m", "llmtune", "train", str(recipe), "--num-processes", "2"],
                                stdout=subprocess.DEVNULL, stderr=said)  # fmt: skip
    try:
        deadline = time.time() + 180
        while len(processes_mentioning(plan_file)) < 3 and time.time() < deadline:  # accelerate + 2 ranks
            time.sleep(0.5)
        ranks = processes_mentioning(plan_file)
        assert len(ranks) >= 3, "the ranks never started"
        time.sleep(3)
        launcher.send_signal(signal.SIGINT)
        assert launcher.wait(timeout=60) == 128 + signal.SIGINT
        deadline = time.time() + 20
        while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists()], "ranks survived Ctrl-C"
        said.seek(0)
        last = said.read().strip().splitlines()[-1]  # what is kept, and what the same command does next
        assert last.startswith("stopped (Ctrl-C); ") and "the same command" in last, last
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for pid in processes_mentioning(plan_file):
            os.kill(pid, signal.SIGKILL)


def test_port_in_use_is_reported_before_launch(make_recipe):
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        recipe = make_recipe("port")
        result = llmtune("train", recipe, "--num-processes", "2", "--main-process-port", port, timeout=120)
        # machine 0 of two: the check-in would listen there (it wrote the plan files first)
        machines = llmtune("train", recipe, "--num-processes", "2", "--num-machines", "2", "--machine-rank", "0",
                           "--main-process-ip", "127.0.0.1", "--main-process-port", port, timeout=120)  # fmt: skip
    for done in (result, machines):
        assert done.returncode == 2
        assert f"--main-process-port {port} is already in use" in done.stderr
    assert not (recipe.parent / "port").exists()  # nothing written for a run that never started


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _machine(recipe: Path, rank: int, port: int, processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "llmtune", "train", str(recipe), "--num-machines", "2", "--num-processes",
            str(processes), "--machine-rank", str(rank), "--main-process-ip", "127.0.0.1", "--main-process-port", str(port)]  # fmt: skip


@pytest.mark.parametrize("present", [0, 1], ids=["machine-1-never-starts", "machine-0-never-starts"])
def test_a_missing_machine_is_named_within_the_rendezvous_timeout(make_recipe, present):
    recipe = make_recipe(f"alone-{present}", rdzv_timeout=8)
    started = time.monotonic()
    result = subprocess.run(_machine(recipe, present, _free_port()), capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    assert elapsed < 8 + 15, f"took {elapsed:.0f} s with an 8 s rendezvous timeout"
    last = result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
    if present == 0:
        assert last.startswith("error: machine rank(s) 1 of 2 did not join within 8 s"), last
    else:
        assert last.startswith("error: could not reach machine rank 0 at 127.0.0.1:"), last


def test_machines_started_with_different_flags_are_stopped_before_training(make_recipe):
    recipe = make_recipe("mismatch", rdzv_timeout=60)
    port = _free_port()
    first = subprocess.Popen(_machine(recipe, 0, port, processes=2), stderr=subprocess.PIPE, text=True)
    second = subprocess.Popen(_machine(recipe, 1, port, processes=4), stderr=subprocess.PIPE, text=True)
    try:
        errors = [first.communicate(timeout=120)[1], second.communicate(timeout=120)[1]]
    finally:
        for launcher in (first, second):
            if launcher.poll() is None:
                launcher.kill()
    assert [first.returncode, second.returncode] == [2, 2], errors
    assert "machine rank 1 (127.0.0.1) plans world_size 4 (machine 0: 2)" in errors[0]
    assert "machine rank 0 stopped the launch" in errors[1]
