"""Memory: peak RSS of each rank for 2-rank CPU rehearsals under DDP, ZeRO-2, ZeRO-3 and FSDP2, and the ratio
to DDP (the sharding shows as a ratio below 1); the peak once the model is loaded (ZeRO-3 creates it already
partitioned) and over the whole run. Also the model-state bytes each rank held (measured at the optimizer step)
next to `llmtune estimate`'s figure.

    python benchmarks/memory.py [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import bench_args, record
from throughput import smollm2_folder, variable_length_rows, write_rows

STRATEGIES = {
    "DDP": {},
    "ZeRO-2": {"deepspeed": "zero2"},
    "ZeRO-3": {"deepspeed": "zero3"},
    "FSDP2": {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}},
}
ESTIMATE_ROW = {"DDP": "single / DDP", "ZeRO-2": "ZeRO-2", "ZeRO-3": "ZeRO-3", "FSDP2": "FSDP full shard"}


def run(model: Path, data: Path, work: Path, changes: dict) -> dict:
    recipe = {"base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 256,
              "micro_batch_size": 2, "max_steps": 3, "learning_rate": 1e-5, "save_strategy": "no",
              "dataset_prepared_path": str(work.parent / "prepared"), "output_dir": str(work), **changes}  # fmt: skip
    path = work.parent / f"{work.name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    subprocess.run([sys.executable, "-m", "llmtune", "train", str(path), "--num-processes", "2"], check=True,
                   capture_output=True, timeout=3600)  # fmt: skip
    return json.loads((work / "metrics.json").read_text())


def main() -> None:
    args = bench_args()
    from tiny import make_tiny_model

    from llmtune.plan.memory.facts import read_model_facts
    from llmtune.plan.memory.peak import estimate
    from llmtune.recipe import Recipe

    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_rows(root / "data.jsonl", variable_length_rows(64))
        models = [("tiny", make_tiny_model(root / "tiny"))]
        smol = None if args.quick else smollm2_folder()
        if smol is not None:
            models.append(("SmolLM2-135M", smol))
        print(f"{'model':14} {'strategy':8} {'RSS at load MB':>15} {'peak RSS/rank MB':>17} {'vs DDP':>7} "
              f"{'states held MB':>15} {'estimate MB':>12}")  # fmt: skip
        for model_name, model in models:
            ddp_rss = None
            for name, changes in STRATEGIES.items():
                work = root / f"{model_name}-{name}"
                metrics = run(model, data, work, changes)
                ranks = metrics["ranks"]
                rss = max(r["peak_rss_bytes"] for r in ranks)
                at_load = max(r["peak_rss_at_load_bytes"] for r in ranks)
                ddp_rss = ddp_rss or rss
                held = max(sum((r["model_state_bytes"] or {}).values()) for r in ranks)
                plan = json.loads((work / "llmtune" / "plan.json").read_text())
                recipe = Recipe.model_validate(plan["recipe"])
                row = {e.strategy: e for e in estimate(recipe, read_model_facts(str(model)), 2, 2, mixed=False)}[ESTIMATE_ROW[name]]
                expected = row.model_states + row.step_copy
                print(f"{model_name:14} {name:8} {at_load / 2**20:15.0f} {rss / 2**20:17.0f} {rss / ddp_rss:7.2f} {held / 2**20:15.1f} {expected / 2**20:12.1f}")
                results[f"{model_name} {name}"] = {"rss_at_load_mb": round(at_load / 2**20, 1), "peak_rss_mb": round(rss / 2**20, 1), "vs_ddp": round(rss / ddp_rss, 3),
                                                   "states_held_mb": round(held / 2**20, 2), "estimate_mb": round(expected / 2**20, 2)}  # fmt: skip
    record("memory", results)


if __name__ == "__main__":
    main()
