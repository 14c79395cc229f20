"""Start-up: wall time of `llmtune --help`, `validate` and `plan` against `python -c pass` (target <= 0.5 s)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from common import ROOT, record, time_command

TARGET_SECONDS = 0.5


def main() -> None:
    recipe = ROOT / "recipes" / "zero3-offload.yaml"
    with tempfile.TemporaryDirectory() as tmp:
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "llmtune --help": [sys.executable, "-m", "llmtune", "--help"],
            "llmtune validate": [sys.executable, "-m", "llmtune", "validate", str(recipe)],
            "llmtune plan --num-processes 8": [
                sys.executable, "-m", "llmtune", "plan", str(recipe), "--num-processes", "8", "--write", str(Path(tmp) / "p"),
            ],  # fmt: skip
        }
        rows = {name: time_command(argv, cwd=ROOT) for name, argv in commands.items()}
    base = rows["python -c pass"]
    print(f"{'command':34} {'median s':>9} {'vs python':>10} {'target':>8}")
    for name, seconds in rows.items():
        verdict = "" if name.startswith("python") else ("ok" if seconds <= TARGET_SECONDS else "MISSED")
        print(f"{name:34} {seconds:9.3f} {seconds / base:9.1f}x {verdict:>8}")
    record("startup", {name: round(s, 4) for name, s in rows.items()})


if __name__ == "__main__":
    main()
