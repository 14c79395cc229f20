"""CPU rehearsal: OpenMP threads that spin between parallel regions (the library default) against threads that sleep
(`OMP_WAIT_POLICY=PASSIVE`, what the plan sets for a CPU rehearsal's ranks unless OMP_WAIT_POLICY or
GOMP_SPINCOUNT is set; the default arm sets GOMP_SPINCOUNT to libgomp's default, 300000).

Two single-process runs of the tiny model at once, each with two OpenMP threads, on the same cores (what two people,
or `make test`'s two workers, do on a 2-core machine); each arm's pair runs `--repeats` times, the arms alternating.
Prints the median wall time of a pair and the CPU seconds the pair used (user + system), with min-max, and the
ratios. Appends to benchmarks/results.json.

    python benchmarks/rehearsal_threads.py --repeats 3
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import bench_args, record

STEPS = 30


def pair(folder: Path, policy: str | None, index: int) -> tuple[float, float]:
    """(wall, CPU seconds) of two runs started together."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    else:  # libgomp's default when OMP_WAIT_POLICY is unset (the plan leaves a tuned spin count alone)
        env["GOMP_SPINCOUNT"] = "300000"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    runs = []
    for side in (0, 1):
        recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
        recipe["output_dir"] = str(folder / f"out-{policy}-{index}-{side}")
        path = folder / f"recipe-{side}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        runs.append(subprocess.Popen([sys.executable, "-m", "llmtune", "train", str(path)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))  # fmt: skip
    for run in runs:
        _, err = run.communicate(timeout=600)
        if run.returncode:
            sys.exit(f"a run failed: {err.strip().splitlines()[-1]}")
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    args = bench_args(repeats=3)
    from tiny import make_tiny_model, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = make_tiny_model(folder / "model")
        rows = [{"instruction": f"Repeat word {i}", "input": "", "output": f"word {i} " * 6} for i in range(64)]
        data = write_jsonl(folder / "rows.jsonl", rows)
        (folder / "recipe.yaml").write_text(yaml.safe_dump({
            "base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 128,
            "micro_batch_size": 4, "max_steps": STEPS, "learning_rate": 1e-3, "save_strategy": "no",
            "output_dir": str(folder / "out"),
        }))  # fmt: skip
        arms = {"spinning (default)": None, "PASSIVE": "PASSIVE"}
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
        pair(folder, "PASSIVE", -1)  # warm-up: bytecode and page cache
        for index in range(args.repeats):
            order = list(arms.items()) if index % 2 == 0 else list(arms.items())[::-1]
            for name, policy in order:
                samples[name].append(pair(folder, policy, index))
    print(f"two {STEPS}-step runs at once, {os.cpu_count()} CPUs, {args.repeats} repeats each")
    print(f"{'OMP_WAIT_POLICY':20} {'wall s (min-max)':>22} {'CPU s (min-max)':>22}")
    medians = {}
    for name, values in samples.items():
        walls, cpus = [w for w, _ in values], [c for _, c in values]
        medians[name] = (statistics.median(walls), statistics.median(cpus))
        print(f"{name:20} {medians[name][0]:8.1f} ({min(walls):.1f}-{max(walls):.1f}) "
              f"{medians[name][1]:10.1f} ({min(cpus):.1f}-{max(cpus):.1f})")  # fmt: skip
    (spin_wall, spin_cpu), (passive_wall, passive_cpu) = medians.values()
    print(f"PASSIVE / spinning: wall {passive_wall / spin_wall:.2f}x, CPU {passive_cpu / spin_cpu:.2f}x")
    record("rehearsal_threads", {name: {"wall_s": [round(w, 2) for w, _ in v], "cpu_s": [round(c, 2) for _, c in v]}
                                 for name, v in samples.items()})  # fmt: skip


if __name__ == "__main__":
    main()
