"""The GPU tier: `make test-gpu` on a machine with a CUDA device; every test here is skipped without one.

Each test runs the real `llmtune` CLI on a recipe, on the GPU, and asserts on what the run did. At the end the
outcome of every test (with commit, device and library versions) is written to tests/gpu/last-run.md, to be
recorded in RESULTS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integration"))

from harness import alpaca_file, make_recipe, tiny_model  # noqa: E402,F401

_outcomes: list[tuple[str, str, float]] = []


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if Path(str(item.fspath)).resolve().is_relative_to(HERE)]
    if not mine:
        return
    skip = None if cuda_devices() else pytest.mark.skip(reason="no CUDA device: the GPU tier runs on a GPU machine")
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if skip is not None:
            item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if Path(str(item.fspath)).resolve().is_relative_to(HERE) and (report.when == "call" or report.outcome != "passed"):
        if report.when == "call" or report.skipped or report.failed:
            _outcomes.append((item.nodeid.split("::", 1)[-1], report.outcome, report.duration))


def pytest_sessionfinish(session, exitstatus):
    if not _outcomes or not cuda_devices():
        return
    import accelerate
    import peft
    import torch
    import transformers

    try:
        import deepspeed

        ds = deepspeed.__version__
    except ImportError:
        ds = "not installed"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    lines = [
        f"# GPU tier run, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
        f"- commit {commit.strip() or 'unknown'}; {torch.cuda.get_device_name(0)} x {cuda_devices()}",
        f"- torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
        f"accelerate {accelerate.__version__}, deepspeed {ds}, peft {peft.__version__}",
        "",
        "| test | outcome | seconds |",
        "| --- | --- | --- |",
        *[f"| {name} | {outcome} | {seconds:.1f} |" for name, outcome, seconds in _outcomes],
        "",
    ]
    # LLMTUNE_GPU_RUN_FILE: where to write it instead (several pytest groups sharing one GPU at once)
    target = Path(os.environ.get("LLMTUNE_GPU_RUN_FILE") or HERE / "last-run.md")
    target.write_text("\n".join(lines))
