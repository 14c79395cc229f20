"""Shared by the benchmark scripts: timing whole commands, and the results log."""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"


def time_command(argv: list[str], repeats: int = 7, cwd: Path | None = None, env: dict | None = None) -> float:
    """Median wall time of a command, after one warm-up run (seconds)."""
    subprocess.run(argv, cwd=cwd, capture_output=True, check=True, timeout=120, env=env)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, cwd=cwd, capture_output=True, check=True, timeout=120, env=env)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def record(name: str, rows: dict) -> None:
    """Append one benchmark's figures with the commit, date and machine."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    entry = {
        "benchmark": name,
        "commit": commit.strip() or "uncommitted",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} cpus={__import__('os').cpu_count()}".strip(),
        "results": rows,
    }
    history = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    history.append(entry)
    RESULTS.write_text(json.dumps(history, indent=2) + "\n")


def bench_args(repeats: int | None = None):
    """--quick (tiny model only), --repeats, offline hub, and the test fixtures (tiny model builder) importable."""
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny model only")
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help="interleaved runs of each side")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    return parser.parse_args()
