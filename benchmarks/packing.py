"""Packing: effective (non-padding) tokens/s with sample_packing against padding each batch, on rows with
long-tailed lengths; and the padding waste of each. Target: >= 2x.

    python benchmarks/packing.py [--quick]
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import bench_args, record
from throughput import WARMUP, run_llmtune, smollm2_folder, variable_length_rows, write_rows


def effective(metrics: dict) -> tuple[float, float]:
    seconds = sum(metrics["step_seconds"][WARMUP:])
    real = sum(metrics["step_real_tokens"][WARMUP:])
    padded = sum(metrics["step_padded_tokens"][WARMUP:])
    return real / seconds, 1 - real / padded


def main() -> None:
    args = bench_args()
    from tiny import make_tiny_model

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_rows(root / "data.jsonl", variable_length_rows(2000))
        smol = None if args.quick else smollm2_folder()
        model, name, steps = (smol, "SmolLM2-135M LoRA", 8) if smol else (make_tiny_model(root / "tiny", layers=4, hidden=256, intermediate=512), "tiny-4x256 LoRA", 20)
        print(f"{'':10} {'real tok/s':>11} {'padding waste':>14}")
        for packing in (False, True):
            work = root / f"pack-{packing}"
            work.mkdir()
            metrics = run_llmtune(model, data, work, steps, 4, 512, True, sample_packing=packing)
            speed, waste = effective(metrics)
            label = "packed" if packing else "padded"
            rows[label] = {"real_tokens_per_s": round(speed, 1), "padding_waste": round(waste, 4)}
            print(f"{label:10} {speed:11.0f} {waste:14.1%}")
    ratio = rows["packed"]["real_tokens_per_s"] / rows["padded"]["real_tokens_per_s"]
    # If step time were proportional to the tokens processed, removing the padding could gain at most this much:
    bound = (1 - rows["packed"]["padding_waste"]) / (1 - rows["padded"]["padding_waste"])
    rows["model"], rows["ratio"], rows["bound"] = name, round(ratio, 3), round(bound, 3)
    print(f"packed / padded effective tokens/s: {ratio:.2f}x (target >= 2x) on {name}; the padding waste bounds the "
          f"gain at {bound:.2f}x, so packing reaches {ratio / bound:.0%} of what this data allows")
    record("packing", rows)


if __name__ == "__main__":
    main()
