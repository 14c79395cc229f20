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
    launcher = subprocess.Popen([sys.executable, "-m", "llmtune", "train", str(recipe), "--num-processes", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
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
        result = llmtune("train", make_recipe("port"), "--num-processes", "2", "--main-process-port", port, timeout=120)
    assert result.returncode == 2
    assert f"--main-process-port {port} is already in use" in result.stderr
