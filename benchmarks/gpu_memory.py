"""GPU memory: `llmtune estimate` beside the peaks torch.cuda measured, per configuration (issue 17).

Builds a Llama-shaped model with random weights from a config (no download; cached under --work), trains a few
steps through `llmtune train` (llmtune's own path: recipe, plan, launcher, worker; the worker records
torch.cuda.max_memory_allocated/reserved per rank in metrics.json), and prints the estimate's row for that
strategy next to the measurement. Every row is appended to benchmarks/results.json.

Each row keeps three measured quantities apart, each beside the estimate's term that predicts it:
- allocated (max_memory_allocated) against the estimate's allocated peak;
- reserved (max_memory_reserved) against allocated peak + the allocator's reserve;
- the CUDA context, which lives outside the allocator, against the estimate's context. The total is compared with
  reserved + context. The context is read from nvidia-smi as a difference: the device's memory in use during the
  run minus what was in use before it (other processes) minus the rank's reserved peak (`rank_context_bytes`), and
  once for this process alone (`cuda_context_bytes`). Reading total - free instead counts every other process on
  the GPU: the 2026-11-23 rows, run beside the GPU test groups, recorded 0.72-13 GB that way.

    python benchmarks/gpu_memory.py --shape 1b --method full --strategy single --layout packed
    python benchmarks/gpu_memory.py --shape 1b 8b --method full lora qlora --strategy single zero2 zero3 \\
        zero3_offload fsdp2 --checkpointing off on --layout packed padded      # the calibration matrix
    python benchmarks/gpu_memory.py --estimate-only ...                          # no GPU: the estimates alone

Without a CUDA device (and without --estimate-only) it prints one line and exits 2: nothing was measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from common import ROOT, record

GB = 1e9
# hidden, layers, heads, kv heads, intermediate, tied embeddings: Llama-3.2-1B and Llama-3.1-8B
SHAPES = {"1b": (2048, 16, 32, 8, 8192, True), "8b": (4096, 32, 32, 8, 14336, False)}
METHODS = {
    "full": {},
    "lora": {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
    "qlora": {"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True},
}
# strategy: (recipe keys, the estimate's row)
STRATEGIES = {
    "single": ({}, "single / DDP"),
    "zero2": ({"deepspeed": "zero2"}, "ZeRO-2"),
    "zero3": ({"deepspeed": "zero3"}, "ZeRO-3"),
    "zero3_offload": ({"deepspeed": "zero3_offload"}, "ZeRO-3 + CPU offload"),
    "fsdp2": ({"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}, "FSDP full shard"),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", nargs="+", default=["1b"], choices=list(SHAPES))
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary (default SmolLM2's, as in issue 17)")
    parser.add_argument("--method", nargs="+", default=["full"], choices=list(METHODS))
    parser.add_argument("--strategy", nargs="+", default=["single"], choices=list(STRATEGIES))
    parser.add_argument("--checkpointing", nargs="+", default=["off"], choices=["off", "on"])
    parser.add_argument("--layout", nargs="+", default=["packed"], choices=["packed", "padded"])
    parser.add_argument("--sequence-len", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (the peak comes from step 2 on)")
    parser.add_argument("--optimizer", default="adamw_torch")
    parser.add_argument("--attention", default=None, help="attn_implementation (default: the model's, sdpa)")
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "llmtune-gpu-memory")
    parser.add_argument("--estimate-only", action="store_true", help="print the estimates; measure nothing")
    return parser.parse_args()


def cuda_or_exit(estimate_only: bool) -> None:
    if estimate_only:
        return
    import torch

    if not torch.cuda.is_available():
        print("gpu_memory.py: no CUDA device visible (torch.cuda.is_available() is False); nothing measured")
        sys.exit(2)


def model_folder(work: Path, shape: str, vocab: int, build: bool) -> Path:
    """A LlamaForCausalLM of the shape with random bf16 weights and the fixture tokenizer, built once."""
    hidden, layers, heads, kv_heads, intermediate, tied = SHAPES[shape]
    folder = work / f"llama-{shape}-vocab{vocab}"
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": intermediate, "vocab_size": vocab, "tie_word_embeddings": tied,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    if (folder / "model.safetensors.index.json").exists() or (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    if not build:  # the estimate needs only the config
        (folder / "config.json").write_text(json.dumps(config))
        return folder
    import torch
    from tiny import load_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU: an 8B model in seconds, 16 GB on disk
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(folder, max_shard_size="5GB")
    load_tokenizer().save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return folder


def write_rows(path: Path, layout: str, seq: int, count: int, vocab: int) -> Path:
    """Pre-tokenized rows. Packed: rows of any length fill every row to seq. Padded: lengths vary from batch to
    batch, and every eighth row is seq long so that some batch reaches the full shape the estimate assumes."""
    rng = random.Random(0)
    with path.open("w") as out:
        for index in range(count):
            length = seq if layout == "padded" and index % 8 == 0 else rng.randint(seq // 8, seq)
            out.write(json.dumps({"input_ids": [rng.randrange(3, vocab) for _ in range(length)]}) + "\n")
    return path


def configuration(args, shape: str, method: str, strategy: str, checkpointing: str, layout: str) -> dict:
    return {"shape": shape, "vocab": args.vocab, "method": method, "strategy": strategy, "checkpointing": checkpointing,
            "layout": layout, "sequence_len": args.sequence_len, "micro_batch_size": args.micro_batch,
            "optimizer": args.optimizer, "attention": args.attention or "sdpa", "processes": args.num_processes}  # fmt: skip


def recipe_for(args, config: dict, model: Path, data: Path, out: Path) -> dict:
    recipe = {"base_model": str(model), "datasets": [{"path": str(data), "type": "pretokenized"}], "bf16": True,
              "sequence_len": args.sequence_len, "micro_batch_size": args.micro_batch, "max_steps": args.steps,
              "optimizer": args.optimizer, "learning_rate": 1e-5, "save_strategy": "no", "logging_steps": 1,
              "sample_packing": config["layout"] == "packed", "gradient_checkpointing": config["checkpointing"] == "on",
              "output_dir": str(out), "dataset_prepared_path": str(out.parent / "prepared"),
              **METHODS[config["method"]], **STRATEGIES[config["strategy"]][0]}  # fmt: skip
    if args.attention:
        recipe["attn_implementation"] = args.attention
    return recipe


def estimated(recipe_path: Path, model: Path, strategy: str, processes: int, gpu_memory: float):
    from llmtune.plan.memory.facts import read_model_facts
    from llmtune.plan.memory.fit import estimate_recipe
    from llmtune.recipe import load_recipe

    recipe = load_recipe(recipe_path).recipe
    report = estimate_recipe(recipe, processes, 1, gpu_memory, facts=read_model_facts(str(model)))
    return report.row(STRATEGIES[strategy][1])


def measured(recipe_path: Path, out: Path, processes: int) -> dict:
    """Train through the CLI; the largest rank's CUDA peaks, or why there are none."""
    command = [sys.executable, "-m", "llmtune", "train", str(recipe_path), "--device", "cuda", "--no-memory-check",
               "--num-processes", str(processes)]  # fmt: skip
    with DevicePeak() as device:
        done = subprocess.run(command, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {last[:300]}"}
    ranks = [
        r for r in json.loads((out / "metrics.json").read_text()).get("ranks", []) if "cuda_max_reserved_bytes" in r
    ]
    for saved in [*out.glob("*.safetensors"), *out.glob("checkpoint-*"), *out.glob("pytorch_model*")]:
        shutil.rmtree(saved) if saved.is_dir() else saved.unlink()  # a 1B/8B matrix would fill the disk
    if not ranks:
        return {"error": "metrics.json has no cuda_max_*_bytes (a worker without CUDA peak recording)"}
    result = {"measured_allocated_bytes": max(r["cuda_max_allocated_bytes"] for r in ranks),
              "measured_reserved_bytes": max(r["cuda_max_reserved_bytes"] for r in ranks),
              "gpu_in_use_before_bytes": device.before, "run_device_peak_bytes": device.gained()}  # fmt: skip
    if processes == 1 and device.gained():  # one rank on the GPU: what it added beyond its reserved peak
        result["rank_context_bytes"] = device.gained() - result["measured_reserved_bytes"]
    return result


def gpu_index() -> str:
    """The GPU the runs use, as nvidia-smi numbers it (the first of CUDA_VISIBLE_DEVICES)."""
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()


def device_memory_used() -> int | None:
    """Memory in use on the GPU by every process (nvidia-smi, which makes no CUDA context), in bytes."""
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu_index()]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.split()[0]) * 2**20)  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def cuda_context_bytes(before: int | None) -> int | None:
    """This process's CUDA context after one matmul: what the device gained since `before` (read before torch
    touched the GPU), less what the caching allocator reserved. Other processes count only if they grew meanwhile."""
    import torch

    torch.ones(256, 256, device="cuda") @ torch.ones(256, 256, device="cuda")
    torch.cuda.synchronize()
    after = device_memory_used()
    if before is None or after is None:
        return None
    return after - before - torch.cuda.memory_reserved()


class DevicePeak:
    """The most memory in use on the GPU while a run lasts, sampled by `nvidia-smi -lms` every 200 ms. The
    reserved peak stays reserved until the rank exits (no empty_cache in the Trainer's loop), so a sample lands on
    it; a run that shares the GPU with a process that grows meanwhile reads too high."""

    def __enter__(self):
        import threading

        self.before, self.peak = device_memory_used(), 0
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu_index(), "-lms",
                 "200"]  # fmt: skip
        self.poll = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self):
        for line in self.poll.stdout:
            try:
                self.peak = max(self.peak, int(float(line.strip()) * 2**20))
            except ValueError:
                pass

    def __exit__(self, *exc):
        self.poll.terminate()
        self.poll.wait(timeout=30)
        self.reader.join(timeout=5)

    def gained(self) -> int | None:
        """Bytes the run added on the GPU at its peak: its ranks' reserved memory, contexts and NCCL buffers."""
        return self.peak - self.before if self.before is not None and self.peak else None


def device_name(estimate_only: bool) -> tuple[str, float]:
    if estimate_only:
        return "none (estimate only)", 80e9
    import torch

    properties = torch.cuda.get_device_properties(0)
    return properties.name, float(properties.total_memory)


def commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return (found.stdout.strip() or "uncommitted") + ("+changes" if dirty else "")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.3f}" if a and b else "-"


def main() -> None:
    args = parse_args()
    before = None if args.estimate_only else device_memory_used()  # before this process makes its CUDA context
    cuda_or_exit(args.estimate_only)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    device, gpu_memory = device_name(args.estimate_only)
    context = None if args.estimate_only else cuda_context_bytes(before)
    rows, version = [], commit()
    print(f"device {device}, {gpu_memory / GB:.1f} GB; CUDA context of this process "
          f"{context / GB:.2f} GB" if context else f"device {device}")  # fmt: skip
    print(
        "est resv = allocated + reserve, against max_memory_reserved; est total (context included) against "
        "reserved + the rank's context (this process's where the rank's could not be read)"
    )
    print(f"{'configuration':58} {'est alloc':>9} {'meas alloc':>10} {'ratio':>6} {'est resv':>9} {'meas resv':>9} "
          f"{'ratio':>6} {'est total':>9} {'resv+ctx':>9} {'ratio':>6}")  # fmt: skip
    for combo in itertools.product(args.shape, args.method, args.strategy, args.checkpointing, args.layout):
        config = configuration(args, *combo)
        if config["method"] == "qlora" and config["strategy"].startswith("zero3"):
            print(f"{' '.join(combo):58} skipped: QLoRA with ZeRO-3 is refused by the recipe")
            continue
        label = "-".join(combo)
        out = args.work / "runs" / label
        out.parent.mkdir(parents=True, exist_ok=True)
        model = model_folder(args.work, config["shape"], args.vocab, build=not args.estimate_only)
        rows_needed = args.micro_batch * args.num_processes * args.steps * 8 + 64
        data = write_rows(args.work / f"rows-{config['layout']}-{args.sequence_len}.jsonl", config["layout"],
                          args.sequence_len, rows_needed, min(args.vocab, 1000))  # fmt: skip
        recipe_path = out.parent / f"{label}.yaml"
        recipe_path.write_text(yaml.safe_dump(recipe_for(args, config, model, data, out)))
        row = estimated(recipe_path, model, config["strategy"], args.num_processes, gpu_memory)
        result = {"configuration": config, "recipe_keys": {**METHODS[config["method"]], **STRATEGIES[config["strategy"]][0]},
                  "estimate_row": STRATEGIES[config["strategy"]][1], "estimate_bytes": row.total, "estimate_allocated_bytes": row.allocated,
                  "estimate_reserved_bytes": row.total - row.overhead, "estimate_context_bytes": row.overhead,
                  "estimate_peak_at": row.peak_at, "device": device, "commit": version,
                  "cuda_context_bytes": context}  # fmt: skip
        if not args.estimate_only:
            result.update(measured(recipe_path, out, args.num_processes))
        alloc, resv = result.get("measured_allocated_bytes"), result.get("measured_reserved_bytes")
        rank_context = result.get("rank_context_bytes") or context
        whole = resv + rank_context if resv and rank_context else None
        gb = lambda value: f"{value / GB:9.1f}" if value else f"{'-':>9}"  # noqa: E731
        print(f"{' '.join(combo):58} {gb(row.allocated)} {gb(alloc):>10} {ratio(row.allocated, alloc):>6} "
              f"{gb(row.total - row.overhead)} {gb(resv)} {ratio(row.total - row.overhead, resv):>6} "
              f"{gb(row.total)} {gb(whole)} {ratio(row.total, whole):>6}"
              + (f"  {result['error']}" if "error" in result else ""))  # fmt: skip
        rows.append(result)
        with (args.work / "rows.jsonl").open("a") as log:  # a matrix cut off by a time limit keeps its rows
            log.write(json.dumps(result) + "\n")
    if rows and not args.estimate_only:
        record("gpu_memory", {"rows": rows})


if __name__ == "__main__":
    main()
