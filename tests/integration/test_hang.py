"""Hang triage (issue 38): one rank of two sleeps in its data loader (a test hook); with stall_timeout 6 s, every
rank reports where it is, and the launcher names the rank that is behind with its stack, says what the other waits
in, saves the report and ends the job with exit code 3, within twice the threshold of the stall."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from harness import ROOT, make_workspace, write_run_recipe

pytestmark = pytest.mark.integration
THRESHOLD = 6


def test_a_rank_stalled_in_its_data_loader_is_named_with_its_stack_and_the_job_ends(tmp_path_factory, tiny_model):
    workspace = make_workspace(tmp_path_factory, "hang", tiny_model)
    recipe = write_run_recipe(workspace, "stalled", max_steps=8, logging_steps=1, stall_timeout=THRESHOLD)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMTUNE_TEST_STALL_IN_LOADER": "1:13:600"}  # rank 1, 4th batch
    process = subprocess.Popen([sys.executable, "-m", "llmtune", "train", str(recipe), "--num-processes", "2"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen, stalled_at, named_at = [], None, None
    try:
        for line in process.stdout:
            seen.append(line)
            if "stalls in its data loader" in line and stalled_at is None:
                stalled_at = time.monotonic()
            if line.startswith("error: the run stalled") and named_at is None:
                named_at = time.monotonic()
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = "".join(seen)
    assert process.returncode == 3, text[-4000:]
    assert stalled_at and named_at and named_at - stalled_at < 2 * THRESHOLD, (stalled_at, named_at)
    statement = next(line for line in seen if line.startswith("error: the run stalled"))
    assert "rank 1 (" in statement and "has been in data loading for" in statement and "__getitem__" in statement
    assert "rank 0 waits in " in statement and f"stall_timeout {THRESHOLD} s" in statement, statement
    assert "rank 1 (" in text and "time.sleep(float(seconds))" in text  # the stack of the rank that is behind
    assert "Traceback" not in text and "ChildFailedError" not in text
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    report = (out / "llmtune" / "hang" / "report.txt").read_text()
    assert report.splitlines()[0] == statement.strip()
    assert {p.name for p in (out / "llmtune" / "hang").glob("rank*.json")} == {"rank0.json", "rank1.json"}
    assert "run the same command again" in text
