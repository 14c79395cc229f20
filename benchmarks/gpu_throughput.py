"""GPU throughput of the fast path: llmtune with and without its kernels against the plain HF Trainer.

Sides (each a fresh process, since Liger patches modules process-wide), run interleaved `--repeats` times:
  llmtune            no kernel keys (sdpa)
  llmtune fast       liger rope, rms_norm, glu, fused linear cross-entropy; flash_attention when flash_attn imports;
                     torch_compile with --compile
  plain              benchmarks/plain_trainer.py's script, on the GPU in bf16
  plain + liger      the same with TrainingArguments(use_liger_kernel=True)
  llmtune fast+pack  (--packing) the fast path over packed rows: other batches, so compare its real tokens/s only
All but the last see the same padded batches in the same order (checked). Each step's time is its fastest over the
repeats. Reported: median step time after warm-up, real (non-padding) tokens/s, MFU = 6 * N * real tokens/s over a
bf16 matmul peak measured in this run (before, between and after the sides; the best), and peak CUDA memory.
Appends to benchmarks/results.json.

    python benchmarks/gpu_throughput.py [--model LOCAL_HF_FOLDER] [--steps 30] [--batch 8] [--seq 1024] [--compile]

Without --model, a random Llama (~0.4B, vocabulary 32k) is written with the test tokenizer: no download needed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import ROOT, record

sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
SIDES = ("llmtune", "llmtune fast", "plain", "plain + liger")
FAST_KEYS = {"liger_rope": True, "liger_rms_norm": True, "liger_glu_activation": True,
             "liger_fused_linear_cross_entropy": True}  # fmt: skip


def matmul_peak(size: int = 8192, repeats: int = 20) -> float:
    """Best measured bf16 FLOP/s of a square matmul on this GPU."""
    import torch

    a, b = (torch.randn(size, size, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(repeats):
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * size**3 / best


def random_llama(path: Path) -> Path:
    """A random ~0.4B Llama with the fixture tokenizer (its ids fit in the larger vocabulary)."""
    import torch
    from tiny import load_tokenizer, tiny_llama_config
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(32768, layers=24, hidden=1024, heads=16, kv_heads=8, intermediate=2816,
                               max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(path))
    load_tokenizer().save_pretrained(str(path))
    return path


def long_rows(count: int, seed: int = 0) -> list[dict]:
    """Alpaca rows with long-tailed lengths (log-normal word counts), long enough to keep a GPU busy."""
    rng = random.Random(seed)
    words = "the model learns to answer short questions with long and sometimes very long explanations".split()

    def text(mean: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(rng.lognormvariate(mean, 0.8)))))

    return [{"instruction": text(3.0), "input": "", "output": text(5.5)} for _ in range(count)]


def run_llmtune(model: Path, data: Path, work: Path, args, fast: bool, packing: bool = False) -> dict:
    recipe = {
        "base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": args.seq,
        "micro_batch_size": args.batch, "max_steps": args.steps, "learning_rate": 2e-5, "lr_scheduler": "constant",
        "optimizer": "adamw_torch_fused", "save_strategy": "no", "logging_steps": 1, "sample_packing": packing,
        "bf16": True, "tf32": True, "dataset_prepared_path": str(work / "prepared"), "output_dir": str(work / "out"),
        # the plain script truncates and keeps the file's order, so both see the same batches in the same order
        "train_on_inputs": True, "excess_length_strategy": "truncate", "shuffle_merged_datasets": False,
    }  # fmt: skip
    if fast:
        recipe.update(FAST_KEYS, flash_attention=flash_attn_importable(), torch_compile=args.compile)
    path = work / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    argv = [sys.executable, "-m", "llmtune", "train", str(path), "--num-processes", "1", "--no-memory-check"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        sys.exit(f"llmtune failed ({'fast' if fast else 'no kernels'}): {last_line(done.stderr)}")
    metrics = json.loads((work / "out" / "metrics.json").read_text())
    rank0 = (metrics.get("ranks") or [{}])[0]
    return {"step_seconds": metrics["step_seconds"], "real_tokens": metrics["step_real_tokens"],
            "padded_tokens": metrics["step_padded_tokens"], "parameters": metrics["total_parameters"],
            "peak_bytes": rank0.get("cuda_max_allocated_bytes")}  # fmt: skip


def run_plain(model: Path, data: Path, work: Path, args, liger: bool) -> dict:
    out = work / "plain.json"
    argv = [sys.executable, __file__, "--plain-run", str(model), str(data), str(out), "--steps", str(args.steps),
            "--batch", str(args.batch), "--seq", str(args.seq)] + (["--liger"] if liger else [])  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if done.returncode:
        sys.exit(f"plain Trainer failed (use_liger_kernel={liger}): {last_line(done.stderr)}")
    return json.loads(out.read_text())


def plain_run(model: str, data: str, out: str, steps: int, batch: int, seq: int, liger: bool) -> None:
    """benchmarks/plain_trainer.py's script on the GPU: bf16 autocast over fp32 weights, sdpa, fused AdamW."""
    import torch
    from datasets import Dataset
    from plain_trainer import PROMPT, CountingCollator, Timer
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    rows = [json.loads(line) for line in open(data)]
    texts = [PROMPT.format(instruction=r["instruction"]) + r["output"] + tokenizer.eos_token for r in rows]
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=seq), batched=True, remove_columns=["text"]
    )
    network = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    network.config.use_cache = False
    timer, collator = Timer(), CountingCollator(tokenizer, mlm=False)
    training = TrainingArguments(
        output_dir=out + ".run", per_device_train_batch_size=batch, max_steps=steps, learning_rate=2e-5,
        lr_scheduler_type="constant", optim="adamw_torch_fused", bf16=True, tf32=True, save_strategy="no",
        report_to=[], logging_steps=1, seed=42, dataloader_num_workers=0, use_liger_kernel=liger,
    )  # fmt: skip
    Trainer(model=network, args=training, train_dataset=dataset, data_collator=collator, callbacks=[timer]).train()
    with open(out, "w") as handle:
        json.dump({"step_seconds": timer.seconds, "real_tokens": collator.real[: len(timer.seconds)],
                   "padded_tokens": collator.padded[: len(timer.seconds)],
                   "parameters": sum(p.numel() for p in network.parameters()),
                   "peak_bytes": torch.cuda.max_memory_allocated()}, handle)  # fmt: skip


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def summarize(runs: list[dict], warmup: int) -> dict:
    """Fastest time of each step over the repeats; median step and real tokens/s after the warm-up."""
    steps = [min(times) for times in zip(*(r["step_seconds"] for r in runs), strict=True)][warmup:]
    real = runs[0]["real_tokens"][warmup : warmup + len(steps)]
    peaks = [r["peak_bytes"] for r in runs if r.get("peak_bytes")]
    return {"step_s": statistics.median(steps), "tokens_per_s": sum(real) / sum(steps),
            "peak_gib": max(peaks) / 2**30 if peaks else None, "parameters": runs[0]["parameters"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, help="a local HF model folder (default: a random ~0.4B Llama)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also torch_compile on the llmtune fast side")
    parser.add_argument("--packing", action="store_true", help="add llmtune fast over packed rows")
    parser.add_argument("--plain-run", nargs=3, metavar=("MODEL", "DATA", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--liger", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.plain_run:
        plain_run(*args.plain_run, args.steps, args.batch, args.seq, args.liger)
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit(
            "gpu_throughput: no CUDA device visible; run it on a GPU machine (benchmarks/throughput.py is the CPU one)"
        )
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        sys.exit("gpu_throughput: liger-kernel is not installed: pip install 'llmtune[kernels]'")
    sides = list(SIDES) + (["llmtune fast+pack"] if args.packing else [])
    peaks = [matmul_peak()]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = args.model or random_llama(root / "model")
        data = root / "data.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in long_rows(args.steps * args.batch * 2)))
        for repeat in range(args.repeats):
            for side in sides:
                work = root / f"{side.replace(' ', '_')}-{repeat}"
                work.mkdir()
                if side.startswith("llmtune"):
                    result = run_llmtune(model, data, work, args, fast="fast" in side, packing=side.endswith("pack"))
                else:
                    result = run_plain(model, data, work, args, liger="liger" in side)
                runs[side].append(result)
                print(
                    f"  {side} (repeat {repeat + 1}): {statistics.median(result['step_seconds'][args.warmup :]):.3f} s/step"
                )
            peaks.append(matmul_peak())
    reference = runs["plain"][0]["padded_tokens"][: args.steps]
    for side in SIDES:
        assert runs[side][0]["padded_tokens"][: args.steps] == reference, f"{side}: not the same batches as plain"
    peak = max(peaks)
    rows: dict = {"device": torch.cuda.get_device_name(), "matmul_tflops_bf16": round(peak / 1e12, 1),
                  "flash_attn": flash_attn_importable(), "compile": args.compile, "steps": args.steps,
                  "batch": args.batch, "seq": args.seq, "repeats": args.repeats}  # fmt: skip
    print(f"\n{rows['device']}: bf16 matmul peak {peak / 1e12:.0f} TFLOP/s (best of {len(peaks)})")
    print(f"{'side':20} {'s/step':>8} {'real tok/s':>11} {'vs plain':>9} {'MFU':>6} {'peak GiB':>9}")
    plain_tps = summarize(runs["plain"], args.warmup)["tokens_per_s"]
    for side in sides:
        s = summarize(runs[side], args.warmup)
        mfu = 6 * s["parameters"] * s["tokens_per_s"] / peak
        gib = f"{s['peak_gib']:.1f}" if s["peak_gib"] is not None else "-"
        print(f"{side:20} {s['step_s']:8.3f} {s['tokens_per_s']:11.0f} {s['tokens_per_s'] / plain_tps:9.2f} "
              f"{mfu:6.1%} {gib:>9}")  # fmt: skip
        rows[side] = {"step_s": round(s["step_s"], 4), "real_tokens_per_s": round(s["tokens_per_s"], 1),
                      "vs_plain": round(s["tokens_per_s"] / plain_tps, 3), "mfu": round(mfu, 4),
                      "peak_gib": round(s["peak_gib"], 2) if s["peak_gib"] is not None else None}  # fmt: skip
    record("gpu_throughput", rows)


if __name__ == "__main__":
    main()
