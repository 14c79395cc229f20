"""Training throughput: `llmtune train` against a plain HF Trainer script, and against this CPU's matmul peak.

Same model, data, sequence length, micro-batch and steps; both pad each batch (no packing here).
The two run interleaved (llmtune, plain, llmtune, plain, ...) `--repeats` times. This VM's step times vary up to
2x from one run to the next, so each step's time is its fastest over the repeats (both see the same batch at
each step), and the spread of the per-pair ratios is printed beside it. Reports the median step time after
warm-up, real (non-padding) tokens/s, the ratio llmtune / plain, and model FLOPs utilisation against the
measured matmul peak:
  full fine-tune: 6 * N * tokens processed per step
  LoRA:           4 * N * tokens (forward 2N, backward through the frozen weights 2N, no weight gradients)
                  + 6 * N_lora * tokens
Models: the tiny 2-layer test model, and SmolLM2-135M-Instruct from the demo's GGUF file (make demo fetches it).

    python benchmarks/throughput.py [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import ROOT, bench_args, record

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
GGUF = ROOT / ".demo" / "SmolLM2-135M-Instruct.Q4_1.gguf"
WARMUP = 2


def matmul_peak(dtype_name: str, size: int = 2048, repeats: int = 10) -> float:
    """Measured FLOP/s of a square matmul on this CPU (all threads)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    for _ in range(3):
        a @ b
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        samples.append(time.perf_counter() - start)
    return 2 * size**3 / min(samples)  # the best run: the peak this CPU reaches


def variable_length_rows(count: int, seed: int = 0) -> list[dict]:
    """Alpaca rows with long-tailed lengths (log-normal word counts), like real instruction data."""
    import random

    rng = random.Random(seed)
    words = "the model learns to answer short questions with long and sometimes very long explanations".split()

    def text(mean: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(rng.lognormvariate(mean, 0.9)))))

    return [{"instruction": text(2.5), "input": "", "output": text(3.3)} for _ in range(count)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def smollm2_folder() -> Path | None:
    if not GGUF.exists():
        return None
    from llmtune.train.model.gguf import materialize_gguf

    return materialize_gguf(GGUF, ROOT / ".demo" / "cache" / "gguf")  # the demo has already converted it


def run_llmtune(model: Path, data: Path, work: Path, steps: int, batch: int, seq: int, lora: bool, **extra) -> dict:
    recipe = {
        "base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": seq,
        "micro_batch_size": batch, "max_steps": steps, "learning_rate": 2e-5, "lr_scheduler": "constant",
        "optimizer": "adamw_torch_fused", "save_strategy": "no", "logging_steps": 1, "sample_packing": False,
        "dataset_prepared_path": str(work / "prepared"), "output_dir": str(work / "out"), "train_on_inputs": True,
        # the plain script truncates and keeps the file's order, so both see the same batches in the same order
        "excess_length_strategy": "truncate", "shuffle_merged_datasets": False,
        **({"adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_target_linear": True} if lora else {}), **extra,
    }  # fmt: skip
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "LLMTUNE_BATCH_HASHES": "1"}  # each step's rows hashed, to compare with the plain script's
    subprocess.run([sys.executable, "-m", "llmtune", "train", str(path)], check=True, capture_output=True, timeout=3600,
                   env=env)  # fmt: skip
    return json.loads((work / "out" / "metrics.json").read_text())


def run_plain(model: Path, data: Path, work: Path, steps: int, batch: int, seq: int, lora: bool) -> dict:
    out = work / "plain.json"
    argv = [sys.executable, str(ROOT / "benchmarks" / "plain_trainer.py"), str(model), str(data), str(out),
            "--steps", str(steps), "--batch", str(batch), "--seq", str(seq)] + (["--lora"] if lora else [])  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True, timeout=3600)
    return json.loads(out.read_text())


def summarize(step_seconds: list[float], real_tokens: list[int]) -> tuple[float, float]:
    """Median step time and real tokens/s over the steps after warm-up."""
    steps, tokens = step_seconds[WARMUP:], real_tokens[WARMUP : len(step_seconds)]
    return statistics.median(steps), sum(tokens) / sum(steps)


def fastest_steps(runs: list[list[float]]) -> list[float]:
    """Each step's fastest time over repeated runs of the same batches."""
    return [min(times) for times in zip(*runs, strict=True)]


def main() -> None:
    args = bench_args(repeats=4)
    from tiny import make_tiny_model

    # This VM's matmul speed varies from minute to minute: the peak is the best of measurements taken before,
    # between and after the runs, and every MFU is computed against it at the end.
    peaks = {"float32": [matmul_peak("float32")], "bfloat16": [matmul_peak("bfloat16")]}
    rows: dict = {}
    measured = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = write_rows(root / "data.jsonl", variable_length_rows(512))
        cases = [("tiny full", make_tiny_model(root / "tiny"), False, 30, 8)]
        smol = None if args.quick else smollm2_folder()
        if smol is not None:
            cases += [("SmolLM2-135M full", smol, False, 10, 4), ("SmolLM2-135M LoRA", smol, True, 10, 4)]
        elif not args.quick:
            print("(SmolLM2 skipped: run `make demo` once to fetch its GGUF file)")
        for name, model, lora, steps, batch in cases:
            seq, llm_runs, plain_runs, pair_ratios = 256, [], [], []
            for repeat in range(args.repeats):
                work = root / name.replace(" ", "-") / str(repeat)
                (work / "l").mkdir(parents=True)
                (work / "p").mkdir(parents=True)
                metrics = run_llmtune(model, data, work / "l", steps, batch, seq, lora)
                plain = run_plain(model, data, work / "p", steps, batch, seq, lora)
                assert metrics["step_batch_hashes"][:steps] == plain["batch_hashes"][:steps], "not the same batches"
                llm_runs.append(metrics["step_seconds"])
                plain_runs.append(plain["step_seconds"])
                pair_ratios.append(summarize(plain["step_seconds"], plain["real_tokens"])[0]
                                   / summarize(metrics["step_seconds"], metrics["step_real_tokens"])[0])  # fmt: skip
                peaks["float32"].append(matmul_peak("float32"))
            measured.append((name, lora, steps, metrics, plain, fastest_steps(llm_runs), fastest_steps(plain_runs), pair_ratios))
    peak = {dtype: max(values) for dtype, values in peaks.items()}
    print(f"matmul peak of this CPU: fp32 {peak['float32'] / 1e9:.1f} GFLOP/s (best of {len(peaks['float32'])}; "
          f"lowest {min(peaks['float32']) / 1e9:.1f}), bf16 {peak['bfloat16'] / 1e9:.1f} GFLOP/s")
    rows["matmul_gflops"] = {k: round(v / 1e9, 2) for k, v in peak.items()}
    rows["matmul_gflops_fp32_all"] = [round(v / 1e9, 1) for v in peaks["float32"]]
    print(f"\n{'case':20} {'llmtune s/step':>15} {'plain s/step':>13} {'llmtune tok/s':>14} {'plain tok/s':>12} "
          f"{'ratio':>6} {'per repeat':>10} {'MFU llmtune':>12} {'MFU plain':>10}")  # fmt: skip
    for name, lora, steps, metrics, plain, l_seconds, p_seconds, pair_ratios in measured:
        l_step, l_tps = summarize(l_seconds, metrics["step_real_tokens"])
        p_step, p_tps = summarize(p_seconds, plain["real_tokens"])
        total, trainable = metrics["total_parameters"], metrics["trainable_parameters"]
        frozen = total - trainable if lora else 0
        flops_per_token = (4 * frozen + 6 * trainable) if lora else 6 * total
        # MFU: model FLOPs of the tokens each run computed (its padding included: llmtune's padding-free batches
        # compute none) over its measured time
        mfu_l = flops_per_token * sum(metrics["step_padded_tokens"][WARMUP:steps]) / sum(l_seconds[WARMUP:]) / peak["float32"]
        mfu_p = flops_per_token * sum(plain["padded_tokens"][WARMUP:steps]) / sum(p_seconds[WARMUP:]) / peak["float32"]
        ratio = l_tps / p_tps
        spread = f"{min(pair_ratios):.2f}-{max(pair_ratios):.2f}"
        # an effect is claimed only when every repeat agrees on its side of 1.0
        verdict = "faster" if min(pair_ratios) > 1 else "slower" if max(pair_ratios) < 1 else "within the spread"
        print(f"{name:20} {l_step:15.3f} {p_step:13.3f} {l_tps:14.0f} {p_tps:12.0f} {ratio:6.2f} {spread:>10} "
              f"{mfu_l:12.1%} {mfu_p:10.1%}  {verdict}")  # fmt: skip
        rows[name] = {"llmtune_step_s": round(l_step, 4), "plain_step_s": round(p_step, 4),
                      "llmtune_tokens_per_s": round(l_tps, 1), "plain_tokens_per_s": round(p_tps, 1),
                      "ratio": round(ratio, 3), "ratio_per_repeat": [round(r, 3) for r in pair_ratios],
                      "repeats": len(pair_ratios), "mfu_llmtune": round(mfu_l, 4), "mfu_plain": round(mfu_p, 4),
                      "verdict": verdict}  # fmt: skip
    record("throughput", rows)


if __name__ == "__main__":
    main()
