"""The launched process dies with llmtune's launcher, however the launcher dies (kill -9 leaves no handler to run),
and nothing of Python runs between fork and exec (no preexec_fn: its at-fork hooks printed tracebacks)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from llmtune.launch.runner import dies_with_launcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's parent-death signal")

LAUNCHER = textwrap.dedent(
    """
    import logging, subprocess, sys
    from llmtune.launch.runner import dies_with_launcher
    logging.getLogger("x").warning("logging imported and in use, as in the launcher")
    child = subprocess.Popen(dies_with_launcher([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    print(child.pid, flush=True)
    print(child.stdout.readline().decode().strip(), flush=True)
    child.wait()
    """
)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_the_launched_process_gets_sigterm_when_the_launcher_is_killed():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        child = int(launcher.stdout.readline())
        assert launcher.stdout.readline().decode().strip() == "up"  # the command itself runs, in the same process
        assert alive(child)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the launched process outlived its launcher"
        assert b"Traceback" not in launcher.stderr.read()
    finally:
        launcher.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass


def test_a_command_that_cant_start_is_one_line():
    result = subprocess.run(dies_with_launcher(["/nonexistent/launcher"]), capture_output=True, text=True, timeout=30)
    assert result.returncode == 127
    assert result.stderr.strip() == "error: can't start /nonexistent/launcher: No such file or directory"
