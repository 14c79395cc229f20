"""Integration harness: run the real `llmtune` CLI in a subprocess with a timeout, on tiny models."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import make_tiny_model, write_jsonl

ROOT = Path(__file__).resolve().parents[2]


def llmtune(
    *args, timeout: float = 600, env: dict | None = None, cwd: Path | None = None, python_flags: tuple = ()
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *python_flags, "-m", "llmtune", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=full_env, cwd=cwd or ROOT)  # fmt: skip


def split_import_times(stderr: str) -> tuple[set[str], str]:
    """`python -X importtime` lines (this process only: children don't inherit the flag): the top-level packages
    the process imported, and stderr without those lines."""
    rows = [line for line in stderr.splitlines() if line.startswith("import time:")]
    packages = {row.rsplit("|", 1)[-1].strip().split(".")[0] for row in rows[1:]}  # the first row is the header
    return packages, "\n".join(line for line in stderr.splitlines() if not line.startswith("import time:"))


# Lines the user didn't cause, which llmtune silences at their source or filters from the console (the logs keep
# them): library load failures, torch's and transformers' deprecations, DeepSpeed's accelerator line, the Trainer's
# own bar and its dict lines with numbers as strings.
CONSOLE_NOISE = {
    "torchao/bitsandbytes load failures": re.compile(r"Failed to load"),
    "torch _pytree deprecations": re.compile(r"_pytree"),
    "bitsandbytes kernel hub": re.compile(r"kernels-community"),
    "DeepSpeed's accelerator line": re.compile(r"Setting accelerator to CPU"),
    "FutureWarnings": re.compile(r"FutureWarning"),
    "the Trainer's dict lines": re.compile(r"\{'loss': |'train_runtime'"),
    "tqdm bars": re.compile(r"\d+it/s\]|s/it\]"),
    "a dropped warning's source line": re.compile(r"return func\(\*args"),
    "torchrun's rank-less prefix": re.compile(r"\[default\d+\]:"),
    "accelerate's accumulation mismatch": re.compile(r"Gradient accumulation steps mismatch"),
}
STEP_LINE = re.compile(r"\[llmtune\] step \d+/\d+  loss \d+\.\d{4}  lr \d\.\d{3}e[-+]\d\d")


def assert_quiet_console(console: str) -> None:
    """A training run's console: no third-party noise, and the loss printed as a number."""
    found = {
        what: pattern.search(console).group(0) for what, pattern in CONSOLE_NOISE.items() if pattern.search(console)
    }
    assert not found, f"noise on the console: {found}\n{console[-3000:]}"
    assert STEP_LINE.search(console), console[-3000:]


def alpaca_rows(count: int = 24) -> list[dict]:
    words = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light", "table", "music", "paper", "bread"]
    return [{"instruction": f"Repeat the word {w}", "input": "", "output": f"{w} {w} {w}"} for w in words][:count]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny2", layers=2)


@pytest.fixture(scope="session")
def tiny_model_4_layers(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny4", layers=4)


@pytest.fixture
def alpaca_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "alpaca.jsonl", alpaca_rows() * 2)


@pytest.fixture
def make_recipe(tmp_path, tiny_model, alpaca_file):
    def make(name: str = "run", **changes) -> Path:
        recipe = {
            "base_model": str(tiny_model),
            "datasets": [{"path": str(alpaca_file), "type": "alpaca"}],
            "sequence_len": 256,
            "micro_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "num_epochs": 4,
            "learning_rate": 3e-3,
            "lr_scheduler": "constant",
            "optimizer": "adamw_torch",
            "logging_steps": 1,
            "save_strategy": "no",
            "dataset_prepared_path": str(tmp_path / "prepared"),
            "output_dir": str(tmp_path / name),
            **changes,
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        return path

    return make


def read_metrics(recipe_path: Path) -> dict:
    recipe = yaml.safe_load(recipe_path.read_text())
    return json.loads((Path(recipe["output_dir"]) / "metrics.json").read_text())


def losses(metrics: dict) -> list[float]:
    """The run's logged training losses; never empty: the tests compare two runs' lists, and two runs that logged
    nothing would compare equal."""
    found = [entry["loss"] for entry in metrics["log_history"] if "loss" in entry]
    assert found, f"the run logged no training loss in {metrics.get('steps')} steps"
    return found


REPEAT_WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]


def repeat_words_data(root: Path) -> Path:
    """32 alpaca rows: 4 steps of a global batch of 8, with no partial last batch to blur loss parity."""
    rows = [{"instruction": f"Repeat {w}", "output": f"{w} {w}"} for w in REPEAT_WORDS * 4]
    return write_jsonl(root / "data.jsonl", rows)


LORA = {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True}


def make_workspace(tmp_path_factory, name: str, model: Path) -> tuple[Path, Path, Path]:
    """(root, data, model) for a module's runs: a fresh folder with the repeat-words data."""
    root = tmp_path_factory.mktemp(name)
    return root, repeat_words_data(root), model


def write_run_recipe(workspace: tuple, name: str, **changes) -> Path:
    """A tiny recipe in the workspace (output in root/name); `changes` override the defaults."""
    root, data, model = workspace
    recipe = {
        "base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 128,
        "micro_batch_size": 4, "num_epochs": 1, "learning_rate": 1e-3, "lr_scheduler": "linear",
        "save_strategy": "no", "dataset_prepared_path": str(root / "prepared"), "output_dir": str(root / name),
        **changes,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def train_run(workspace: tuple, name: str, processes: int, **changes) -> tuple[dict, Path]:
    """Train a tiny recipe with `llmtune train --num-processes N`; returns metrics.json and the output folder."""
    root = workspace[0]
    path = write_run_recipe(workspace, name, **changes)
    result = llmtune("train", path, "--num-processes", processes, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_quiet_console(result.stdout + result.stderr)
    metrics = read_metrics(path)
    # a loss at every logging step: the tests compare runs step by step, and a run that logged fewer steps would
    # compare on those alone
    every = changes.get("logging_steps", 1)
    logged = [entry["step"] for entry in metrics["log_history"] if "loss" in entry]
    assert logged == [s for s in range(1, metrics["steps"] + 1) if s == 1 or s % every == 0], (logged, metrics["steps"])
    return metrics, root / name


def saved_weights(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (output_dir / "adapter_config.json").exists() else "model.safetensors"
    return load_file(str(output_dir / name))


def train_and_signal(path: Path, ready, processes: int = 2, timeout: float = 600) -> tuple[int, str]:
    """`llmtune train` with steps slowed to 1 s (a test hook); SIGUSR1 once `ready(output so far)` holds.
    Returns the exit code and everything it printed."""
    import signal
    import time

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMTUNE_TEST_STEP_SLEEP": "1"}
    process = subprocess.Popen([sys.executable, "-m", "llmtune", "train", str(path), "--num-processes", str(processes)],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    seen = ""
    try:
        deadline = time.monotonic() + timeout
        while not ready(seen):
            assert time.monotonic() < deadline and process.poll() is None, seen[-3000:]
            seen += process.stdout.readline()
        process.send_signal(signal.SIGUSR1)
        rest, _ = process.communicate(timeout=timeout)
        seen += rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, seen
