"""Checkpoint stalls: the same training with synchronous and with asynchronous checkpoints (`async_checkpoint: true`),
side by side, interleaved, with repeats.

A synchronous checkpoint stops training for the whole save (the Trainer's: safetensors weights and torch.save of the
optimizer). An asynchronous one stops it for the copy of the states into host memory and the small files; a thread
writes them meanwhile. Each run's metrics.json records every checkpoint's stall and write seconds; the figure that
matters is the stall per checkpoint, async against sync (goal: at most 20% of the synchronous save).

Model: SmolLM2-135M full fine-tune (fp32 states: about 1.6 GB to save; `make demo` fetches it), or with --quick the
tiny test model (its states are kilobytes: the figure then measures fixed costs only). One process on CPU.

    python benchmarks/async_checkpoint.py [--quick] [--repeats 3]
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import ROOT, bench_args, record
from throughput import smollm2_folder, variable_length_rows, write_rows

GOAL = 0.20


def run(model: Path, data: Path, work: Path, asynchronous: bool, steps: int, every: int) -> dict:
    recipe = {
        "base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 64,
        "micro_batch_size": 1, "max_steps": steps, "learning_rate": 1e-5, "lr_scheduler": "constant",
        "save_strategy": "steps", "save_steps": every, "save_total_limit": 2, "logging_steps": 1,
        "async_checkpoint": asynchronous, "dataset_prepared_path": str(work / "prepared"),
        "output_dir": str(work / "out"),
    }  # fmt: skip
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    done = subprocess.run([sys.executable, "-m", "llmtune", "train", str(path)], capture_output=True, text=True,
                          timeout=3600, cwd=ROOT)  # fmt: skip
    if done.returncode:
        sys.exit(f"llmtune failed ({'async' if asynchronous else 'sync'}): {done.stderr.strip().splitlines()[-1]}")
    return json.loads((work / "out" / "metrics.json").read_text())


def main() -> None:
    args = bench_args(repeats=3)
    from tiny import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = None if args.quick else smollm2_folder()
        name = "SmolLM2-135M full"
        if model is None:
            if not args.quick:
                print("(SmolLM2 not fetched: run `make demo` once; measuring the tiny model instead)")
            model, name = make_tiny_model(root / "tiny"), "tiny"
        data = write_rows(root / "data.jsonl", variable_length_rows(256))
        runs: dict[str, list[dict]] = {"sync": [], "async": []}
        for repeat in range(args.repeats):
            order = ("sync", "async") if repeat % 2 == 0 else ("async", "sync")
            for side in order:
                work = root / f"{side}-{repeat}"
                work.mkdir()
                metrics = run(model, data, work, side == "async", steps=12, every=3)
                runs[side].append(metrics)
                stalls = [c["stall_seconds"] for c in metrics["checkpoints"]]
                print(f"  {side} (repeat {repeat + 1}): stalls {', '.join(f'{s:.2f}' for s in stalls)} s; "
                      f"train {metrics['train_seconds']:.1f} s")  # fmt: skip
    sync = [c["stall_seconds"] for m in runs["sync"] for c in m["checkpoints"]]
    stall = [c["stall_seconds"] for m in runs["async"] for c in m["checkpoints"]]
    write = [c["write_seconds"] for m in runs["async"] for c in m["checkpoints"]]
    waited = [c["waited_seconds"] for m in runs["async"] for c in m["checkpoints"]]
    ratio = statistics.median(stall) / statistics.median(sync)
    per_repeat = [statistics.median(c["stall_seconds"] for c in a["checkpoints"])
                  / statistics.median(c["stall_seconds"] for c in s["checkpoints"])
                  for a, s in zip(runs["async"], runs["sync"], strict=True)]  # fmt: skip
    verdict = "met" if max(per_repeat) <= GOAL else "missed" if min(per_repeat) > GOAL else "within the spread"
    print(f"\n{name}, {len(sync)} checkpoints a side over {args.repeats} repeats (interleaved)")
    print(f"  synchronous save (training stopped):  median {statistics.median(sync):.3f} s "
          f"({min(sync):.3f}-{max(sync):.3f})")  # fmt: skip
    print(f"  asynchronous: training stopped for    median {statistics.median(stall):.3f} s "
          f"({min(stall):.3f}-{max(stall):.3f}); written in the background in {statistics.median(write):.3f} s; "
          f"a save waited for the previous write {sum(w > 0 for w in waited)} time(s)")  # fmt: skip
    print(f"  stall async / sync: {ratio:.2f} (per repeat {min(per_repeat):.2f}-{max(per_repeat):.2f}); "
          f"goal <= {GOAL:.2f}: {verdict}")  # fmt: skip
    train = {side: statistics.median(m["train_seconds"] for m in runs[side]) for side in runs}
    print(f"  whole train() call: sync {train['sync']:.1f} s, async {train['async']:.1f} s")
    record("async_checkpoint", {
        "model": name, "checkpoints_per_side": len(sync), "repeats": args.repeats,
        "sync_stall_s": round(statistics.median(sync), 4), "async_stall_s": round(statistics.median(stall), 4),
        "async_write_s": round(statistics.median(write), 4), "ratio": round(ratio, 3),
        "ratio_per_repeat": [round(r, 3) for r in per_repeat], "goal": GOAL, "verdict": verdict,
        "train_s": {k: round(v, 2) for k, v in train.items()},
    })  # fmt: skip


if __name__ == "__main__":
    main()
