"""How a rank process ends: `python -m llmtune.train` leaves through its last exit handler with os._exit, so the
interpreter's finalization (where gloo's threads could abort a rank after a complete save) never runs, while the
exit code, buffered output and the handlers trackers register still come through."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys
import llmtune.train.worker as worker

class Held:  # stands for the process group a DDP reducer still holds: finalization would destroy it
    def __del__(self):
        print("finalized", flush=True)

held = Held()

def fake_main(argv):
    atexit.register(lambda: print("tracker handler ran", flush=True))
    print("buffered line", end="")  # a pipe buffers it: only a flush before leaving shows it
    {body}

worker.main = fake_main
sys.argv = ["llmtune.train", "plan.json"]
import runpy
runpy.run_module("llmtune.train", run_name="__main__")
"""


@pytest.mark.parametrize(
    ("body", "code", "in_stderr"),
    [
        ("return 3", 3, None),
        ("raise SystemExit(4)", 4, None),
        ("raise RuntimeError('boom')", 1, "RuntimeError: boom"),
    ],
    ids=["returned", "sys-exit", "exception"],
)
def test_a_rank_keeps_its_exit_code_output_and_exit_handlers(body, code, in_stderr):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(body=body)], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    assert "buffered line" in done.stdout and "tracker handler ran" in done.stdout
    assert "finalized" not in done.stdout  # the interpreter was not torn down
    if in_stderr:
        assert in_stderr in done.stderr  # the traceback of an unexpected error is still printed
    else:
        assert "Traceback" not in done.stderr


def test_no_plan_argument_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "llmtune.train"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "usage: python -m llmtune.train <output_dir>/llmtune/plan.json" in done.stderr
