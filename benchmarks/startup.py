"""Start-up: wall time of `llmtune --help`, `validate` and `plan` against `python -c pass` (target <= 0.5 s)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import ROOT, record, time_command

TARGET_SECONDS = 0.5


def main() -> None:
    import os
    import subprocess

    recipe = ROOT / "recipes" / "zero3-offload.yaml"
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "llmtune")], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "llmtune --help": [sys.executable, "-m", "llmtune", "--help"],
            "llmtune validate": [sys.executable, "-m", "llmtune", "validate", str(recipe)],
            "llmtune plan --num-processes 8": [
                sys.executable, "-m", "llmtune", "plan", str(recipe), "--num-processes", "8", "--write", str(Path(tmp) / "p"),
            ],  # fmt: skip
            "accelerate --help (reference)": [sys.executable, "-m", "accelerate.commands.accelerate_cli", "--help"],
        }
        rows = {name: time_command(argv, cwd=ROOT, env=env) for name, argv in commands.items()}
    base = rows["python -c pass"]
    print(f"{'command':34} {'median s':>9} {'vs python':>10} {'target':>8}")
    for name, seconds in rows.items():
        verdict = "" if name.startswith(("python", "accelerate")) else ("ok" if seconds <= TARGET_SECONDS else "MISSED")
        print(f"{name:34} {seconds:9.3f} {seconds / base:9.1f}x {verdict:>8}")
    first_step = time_to_first_step()
    print(f"\ntime to the first optimizer step: llmtune train {first_step['llmtune']:.1f} s, the plain script started "
          f"with python {first_step['plain']:.1f} s: {first_step['ratio']:.2f}x (target <= 1.1x)")
    record("startup", {**{name: round(s, 4) for name, s in rows.items()}, "first_step": first_step})


def time_to_first_step(repeats: int = 3) -> dict:
    """Wall time from the command to the end of the first optimizer step (median of runs, tiny model, 1 process)."""
    import json
    import os
    import statistics
    import subprocess
    import time

    import yaml

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from throughput import variable_length_rows, write_rows
    from tiny import make_tiny_model

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    samples: dict[str, list[float]] = {"llmtune": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = make_tiny_model(root / "tiny"), write_rows(root / "data.jsonl", variable_length_rows(64))
        for attempt in range(repeats):
            out = root / f"run{attempt}"
            # each attempt tokenizes afresh, as the plain script does every time (no cache hit to flatter llmtune)
            recipe = {"base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 256,
                      "micro_batch_size": 4, "max_steps": 2, "save_strategy": "no", "output_dir": str(out),
                      "dataset_prepared_path": str(root / f"prepared{attempt}")}  # fmt: skip
            path = root / f"run{attempt}.yaml"
            path.write_text(yaml.safe_dump(recipe))
            start = time.time()
            subprocess.run([sys.executable, "-m", "llmtune", "train", str(path)], check=True, capture_output=True, env=env)
            samples["llmtune"].append(json.loads((out / "metrics.json").read_text())["first_step_end_unix"] - start)
            plain = root / f"plain{attempt}.json"
            start = time.time()
            # started as llmtune starts its single process: python on the script, no launcher in between
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plain_trainer.py"), str(model), str(data),
                            str(plain), "--steps", "2"], check=True, capture_output=True, env=env)  # fmt: skip
            samples["plain"].append(json.loads(plain.read_text())["first_step_end_unix"] - start)
    result = {name: round(statistics.median(values), 3) for name, values in samples.items()}
    result["ratio"] = round(result["llmtune"] / result["plain"], 3)
    return result


if __name__ == "__main__":
    main()
