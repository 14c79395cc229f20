"""Shared test helpers: run the real CLI in-process, write recipes and data."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

# The tests' own torch (set before it loads OpenMP): threads sleep between parallel regions rather than spin, as the
# plan sets for the ranks of a CPU rehearsal; two pytest workers share two cores
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from recipe_edits import DROP  # noqa: E402

# Seconds each slow module took on the 2-core machine (`--durations`, 2026-11-25). `make test` runs two pytest
# workers, each taking whole files (`-n 2 --dist loadfile`, so a module's shared runs happen once); the longest files
# go first so that the two workers end together instead of one waiting on the last long file.
MODULE_SECONDS = {
    "test_rehearse.py": 720, "test_netns.py": 245, "test_tensor_parallel.py": 180, "test_resume.py": 335,
    "test_distributed.py": 165, "test_post.py": 180, "test_pipeline.py": 145, "test_axolotl_compat.py": 110,
    "test_train_single.py": 85, "test_training_methods.py": 75, "test_slurm.py": 65, "test_preference.py": 200,
}  # fmt: skip


def pytest_collection_modifyitems(session, config, items):
    """Longest modules first (stable within a module); the rest keep their order."""
    order = {name: index for index, name in enumerate(dict.fromkeys(item.path.name for item in items))}
    items.sort(key=lambda item: (-MODULE_SECONDS.get(item.path.name, 0), order[item.path.name]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (CI=true) a skipped integration test fails the run: a green CI with the cross-host, Slurm or real
    GGUF tests skipped would prove nothing. What CI needs for them, .ci/run installs."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI") == "true" and item.get_closest_marker("integration"):
        if item.get_closest_marker("gpu"):
            return  # the GPU tier is deselected in CI; a GPU machine runs it
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped under CI=true, which counts as a failure: {reason}"


class CliResult:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run `llmtune ARGS` through the real entry point; returns exit code and output."""
    from llmtune.cli import main

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["llmtune", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture
def data_file(tmp_path) -> Path:
    from tiny import write_jsonl

    return write_jsonl(tmp_path / "data" / "train.jsonl", [{"instruction": "say hi", "input": "", "output": "hi"}])


@pytest.fixture
def write_recipe(tmp_path, data_file):
    """Write a recipe: a valid base (hub model, local alpaca file) updated with `changes`."""

    def write(changes: dict | None = None, text: str | None = None, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        if text is None:
            recipe = {
                "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                "datasets": [{"path": str(data_file), "type": "alpaca"}],
                "output_dir": str(tmp_path / "out"),
                # (Axolotl's default, last_run_prepared, is a folder in the working directory: the checkout's)
                "dataset_prepared_path": str(tmp_path / "last_run_prepared"),
            }
            for key, value in (changes or {}).items():
                if value is DROP:
                    recipe.pop(key, None)
                else:
                    recipe[key] = value
            text = yaml.safe_dump(recipe, sort_keys=False)
        path.write_text(text)
        return path

    return write

