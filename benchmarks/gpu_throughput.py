"""GPU throughput: llmtune against the plain HF Trainer, arm by arm, with repeats that survive a time limit (issue 36).

Arms (each run is a fresh process; Liger patches modules process-wide):
  plain             the plain Trainer over padded batches (DataCollatorForLanguageModeling); PEFT for LoRA/QLoRA
  plain_flat        the same with transformers' DataCollatorWithFlattening (rows concatenated, position_ids)
  plain_liger_flat  use_liger_kernel=True plus flattening: the best a plain Trainer user gets
  llmtune           llmtune at its defaults: padding-free batches on a varlen kernel, fused AdamW, 2 loader workers
  llmtune_packed    sample_packing: true (other batches: compared by real tokens/s only)
  llmtune_liger     (only when asked) llmtune's Liger keys on top of its defaults
Methods: full (fp32 master weights, bf16 autocast), lora and qlora (r 16, alpha 32, every linear; the base in bf16,
QLoRA's in NF4). Slices by default: 1b full, 1b lora, 1b qlora, 8b lora.

Every arm sees the same rows in the same order, checked by hash: llmtune writes `step_batch_hashes` with
LLMTUNE_BATCH_HASHES=1 (sha256 over each row's real token ids as int64 bytes + b"|", first 16 hex), and the plain
arms hash their features the same way. Packed arms see packed rows and are left out of that check. The check
costs llmtune a device-to-host copy of each batch's ids (a sync) per step; the plain arms hash on the host in their
collator: if anything, that favours the plain arms.

Repeats run in rotating order (repeat r starts at arm r mod n). Each arm x repeat is written to
`<results>/<device>/<size>-<method>-<arm>-r<repeat>.json` as soon as it ends; a rerun skips what is there, so the
benchmark can span several time-limited calls (`--deadline`/`--budget`: no run starts that its estimate says would
not end in time; exit 3 then means "rerun to continue"). `--report` prints the table from what is there.

Reported per arm: the median step time over the repeats (each repeat's median after the warm-up) with the min-max
of those medians, real (non-padding) tokens/s, peak CUDA memory, and MFU over a bf16 matmul peak measured in this
run (best of measurements before, between and after the arms). MFU counts useful work only, the same for every
arm: per real token 6N (full) or 4N + 6N_trainable (LoRA/QLoRA), plus causal attention per row (or packed
example) of length L: 3 * 2 * 2 * L(L+1)/2 * layers * heads * head_dim.

    python benchmarks/gpu_throughput.py                                  # the default slices, 3 repeats
    python benchmarks/gpu_throughput.py --sizes 1b --methods full --arms plain llmtune --budget 500
    python benchmarks/gpu_throughput.py --report                         # the table from the results folder

Models: `.gpu/make_model.py` (random weights in real shapes, .gpu/tok's vocabulary) builds them under --models;
`--model FOLDER` uses yours. Without CUDA it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

LIGER_KEYS = {"liger_rope": True, "liger_rms_norm": True, "liger_glu_activation": True,
              "liger_fused_linear_cross_entropy": True}  # fmt: skip
LORA = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target_linear": True}
METHOD_KEYS = {"full": {}, "lora": {"adapter": "lora", **LORA},
               "qlora": {"adapter": "qlora", "load_in_4bit": True, **LORA}}  # fmt: skip


@dataclass(frozen=True)
class Arm:
    label: str
    plain: bool
    collator: str = "padded"  # plain arms: "padded" or "flat"
    liger: bool = False
    packed: bool = False
    keys: dict = field(default_factory=dict)  # llmtune arms: recipe keys on top of the defaults


ARMS = {
    "plain": Arm("plain Trainer, padded", plain=True),
    "plain_flat": Arm("plain Trainer + DataCollatorWithFlattening", plain=True, collator="flat"),
    "plain_liger_flat": Arm("plain Trainer + Liger + flattening", plain=True, collator="flat", liger=True),
    "llmtune": Arm("llmtune defaults", plain=False),
    "llmtune_packed": Arm("llmtune, sample_packing", plain=False, packed=True, keys={"sample_packing": True}),
    "llmtune_liger": Arm("llmtune + Liger keys", plain=False, liger=True, keys=LIGER_KEYS),
}
PLAIN_ARMS = ("plain", "plain_flat", "plain_liger_flat")
METHOD_ARMS = {"full": ["plain", "plain_flat", "plain_liger_flat", "llmtune", "llmtune_packed"],
               "lora": ["plain", "llmtune"], "qlora": ["plain", "llmtune"]}  # fmt: skip
# size: (make_model.py's shape, micro-batch, sequence length, seconds one arm run takes, seconds to build the model)
SIZES = {
    "135m": ("smol135", 8, 1024, 30, 10),
    "1b": ("llama1b", 8, 1024, 50, 30),
    "8b": ("llama8b", 4, 1024, 100, 120),
    "tiny": (None, 4, 256, 30, 5),
}  # tiny: the 2-layer test model, for --cpu-rehearsal
DEFAULT_SLICES = [("1b", "full"), ("1b", "lora"), ("1b", "qlora"), ("8b", "lora")]
# shapes as .gpu/make_model.py builds them, for machines without it
SHAPES = {
    "smol135": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, tie_word_embeddings=True),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, tie_word_embeddings=True),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, tie_word_embeddings=False),
}  # fmt: skip
GOALS = {"default_vs_plain": (2.0, 1.5), "default_vs_best_plain": (1.25, None), "packed_mfu_1b": (0.50, 0.45),
         "adapter_vs_peft": (1.3, None)}  # fmt: skip
INCOMPLETE = 3  # exit status: stopped for time, rerun to continue


# ---- pure arithmetic (no torch) -------------------------------------------------------------------------------


def rotation(arms: list[str], repeat: int) -> list[str]:
    """Repeat r runs the arms starting at arm r mod n, so no arm always runs first (or right after another)."""
    if not arms:
        return []
    start = repeat % len(arms)
    return arms[start:] + arms[:start]


def row_hash(rows: list[list[int]]) -> str:
    """llmtune's batch hash: sha256 over each row's token ids as int64 bytes followed by b"|", first 16 hex."""
    import hashlib
    from array import array

    digest = hashlib.sha256()
    for ids in rows:
        digest.update(array("q", ids).tobytes() + b"|")
    return digest.hexdigest()[:16]


def llama_parameters(config: dict) -> int:
    """Parameters of a Llama-shaped model from its config.json (what 4-bit packing hides from numel())."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
    per_layer = attention + 3 * h * i + 2 * h  # gate, up, down; two norms
    embeddings = config["vocab_size"] * h * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + layers * per_layer + h


def attention_shape(config: dict) -> tuple[int, int, int]:
    """(layers, query heads, head_dim)."""
    heads = config["num_attention_heads"]
    return config["num_hidden_layers"], heads, config.get("head_dim") or config["hidden_size"] // heads


def attention_flops(lengths: list[int], layers: int, heads: int, head_dim: int) -> float:
    """Causal attention's training FLOPs over rows (or packed examples) of these lengths: forward + backward (3) x
    two matmuls (QK^T, AV) x 2 FLOPs per multiply-add x L(L+1)/2 query-key pairs x layers x heads x head_dim."""
    return float(sum(3 * 2 * 2 * length * (length + 1) // 2 for length in lengths) * layers * heads * head_dim)


def flops_per_token(method: str, base_parameters: int, trainable: int) -> float:
    """Matmul training FLOPs per token: 6N for a full fine-tune; 4N frozen (forward and the input gradients) plus
    6N for the adapters' own weights."""
    if method == "full":
        return 6.0 * base_parameters
    return 4.0 * base_parameters + 6.0 * trainable


def repeat_figures(result: dict, warmup: int, step_attention: list[float]) -> dict:
    """One repeat after the warm-up: median step seconds, real tokens/s, and the useful FLOPs it did."""
    seconds = result["step_seconds"][warmup:]
    real = result["real_tokens"][warmup : warmup + len(seconds)]
    attention = step_attention[warmup : warmup + len(seconds)]
    per_token = flops_per_token(result["method"], result["base_parameters"], result["trainable_parameters"])
    flops = per_token * sum(real) + sum(attention)
    return {"step_s": statistics.median(seconds), "tokens_per_s": sum(real) / sum(seconds),
            "flops_per_s": flops / sum(seconds)}  # fmt: skip


def summarize(repeats: list[dict], peak: float | None) -> dict:
    """Median over the repeats, and the spread (min-max) of the per-repeat medians."""
    steps = [r["step_s"] for r in repeats]
    tps = [r["tokens_per_s"] for r in repeats]
    mfu = [r["flops_per_s"] / peak for r in repeats] if peak else []
    return {"repeats": len(repeats), "step_s": statistics.median(steps), "step_min": min(steps), "step_max": max(steps),
            "tokens_per_s": statistics.median(tps), "tokens_min": min(tps), "tokens_max": max(tps),
            "tokens_each": tps, "mfu": statistics.median(mfu) if mfu else None}  # fmt: skip


def check_rows(results: list[dict], steps: int) -> dict[str, str | None]:
    """Per result key: None when its batches are the reference's, step for step (every non-packed arm sees the same
    rows); otherwise why it is refused. Packed arms are left out (None) and compared by real tokens/s only."""
    unpacked = [r for r in results if not ARMS[r["arm"]].packed]
    if not unpacked:
        return {r["key"]: None for r in results}
    order = list(ARMS)
    reference = min(unpacked, key=lambda r: (order.index(r["arm"]), r["repeat"], r["method"]))
    ref = (reference.get("batch_hashes") or [])[:steps]
    verdicts: dict[str, str | None] = {}
    for r in results:
        if ARMS[r["arm"]].packed:
            verdicts[r["key"]] = None
            continue
        mine = (r.get("batch_hashes") or [])[:steps]
        if not mine or not ref:
            verdicts[r["key"]] = "no batch hashes recorded: rows not checked, comparison refused"
        elif mine != ref:
            step = next(
                (i for i, (a, b) in enumerate(zip(mine, ref, strict=False)) if a != b), min(len(mine), len(ref))
            )
            verdicts[r["key"]] = f"other batches than {reference['key']} from step {step + 1}: comparison refused"
        else:
            verdicts[r["key"]] = None
    return verdicts


def verdict(value: float | None, goal: float, floor: float | None = None, spread: tuple | None = None) -> str:
    """'met' / 'missed' against a goal (and its floor), and whether the repeats straddle the goal."""
    if value is None:
        return "not measured"
    if value >= goal:
        word = "met"
    elif floor is not None and value >= floor:
        word = f"missed (floor {floor:g} met)"
    else:
        word = "missed" + (f" (floor {floor:g} missed too)" if floor is not None else "")
    if spread and spread[0] < goal <= spread[1]:
        word += ", within the spread of the repeats"
    return word


def goal_lines(slices: dict[str, dict]) -> list[dict]:
    """The issue's goals, for each slice where both sides were measured (refused arms give no ratio)."""
    lines = []

    def ratio(arms: dict, a: str, b: str) -> tuple[float, tuple[float, float]] | None:
        if a not in arms or b not in arms or arms[a].get("refused") or arms[b].get("refused"):
            return None
        pairs = [x / y for x, y in zip(arms[a]["tokens_each"], arms[b]["tokens_each"], strict=False)]
        return arms[a]["tokens_per_s"] / arms[b]["tokens_per_s"], (min(pairs), max(pairs)) if pairs else None

    def add(name, measured, goal, floor, unit="x"):
        value, spread = measured if measured else (None, None)
        lines.append({"goal": name, "value": value, "target": goal, "floor": floor, "unit": unit, "spread": spread,
                      "verdict": verdict(value, goal, floor, spread)})  # fmt: skip

    for name, arms in slices.items():
        size, method = name.split()
        if method == "full":
            goal, floor = GOALS["default_vs_plain"]
            if "plain" in arms:
                add(f"{name}: llmtune / plain padded", ratio(arms, "llmtune", "plain"), goal, floor)
            plains = [a for a in PLAIN_ARMS if a in arms and not arms[a].get("refused")]
            if plains:
                best = max(plains, key=lambda a: arms[a]["tokens_per_s"])
                goal, floor = GOALS["default_vs_best_plain"]
                add(f"{name}: llmtune / best plain arm ({best})", ratio(arms, "llmtune", best), goal, floor)
            if size == "1b" and "llmtune_packed" in arms:
                goal, floor = GOALS["packed_mfu_1b"]
                mfu = arms["llmtune_packed"].get("mfu")
                add(f"{name}: MFU of llmtune packed", (mfu, None) if mfu is not None else None, goal, floor, "MFU")
        elif "plain" in arms:
            goal, floor = GOALS["adapter_vs_peft"]
            add(f"{name}: llmtune {method} / plain PEFT", ratio(arms, "llmtune", "plain"), goal, floor)
    return lines


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def result_name(size: str, method: str, arm: str, repeat: int) -> str:
    return f"{size}-{method}-{arm}-r{repeat}"


def schedule(slices: list[tuple[str, str]], arms_of: dict[str, list[str]], repeats: int) -> list[tuple]:
    """Every (size, method, arm, repeat) in the order they run: slice by slice, repeats in rotating arm order."""
    order = []
    for size, method in slices:
        for repeat in range(repeats):
            order += [(size, method, arm, repeat) for arm in rotation(arms_of[method], repeat)]
    return order


# ---- the runs (GPU) ---------------------------------------------------------------------------------------------


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
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / best


def alpaca_rows(count: int, seed: int = 0) -> list[dict]:
    """Alpaca rows with long-tailed lengths, as ../shared/gpu/make_data.py writes them."""
    rng = random.Random(seed)
    words = ("the model learns to answer short questions with long and sometimes very long explanations about "
             "physics history cooking music gardening software networks and the weather in many places").split()  # fmt: skip

    def text(mean: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, int(rng.lognormvariate(mean, 0.9)))))

    return [{"instruction": text(3.0), "input": "", "output": text(4.6)} for _ in range(count)]


def tokenizer_folder(models: Path) -> Path:
    """.gpu/tok (SmolLM2's 49,152-token vocabulary) when fetched; else the test fixture tokenizer, saved once."""
    real = ROOT / ".gpu" / "tok"
    if real.is_dir():
        return real
    folder = models / "fixture-tok"
    if not (folder / "tokenizer_config.json").exists():
        sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
        from tiny import load_tokenizer

        load_tokenizer().save_pretrained(str(folder))
    print(f"  (no .gpu/tok: the fixture tokenizer stands in; its vocabulary is not a real model's: {folder})")
    return folder


def model_folder(size: str, models: Path) -> Path:
    """The random model of this size, built once (.gpu/make_model.py, or the same shapes here)."""
    folder = models / size
    if (folder / ".complete").exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    if SIZES[size][0] is None:
        sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
        from tiny import make_tiny_model

        make_tiny_model(folder, layers=2)
        (folder / ".complete").write_text("")
        return folder
    shape, tok = SIZES[size][0], tokenizer_folder(models)
    maker = ROOT / ".gpu" / "make_model.py"
    argv = [sys.executable, str(maker) if maker.exists() else __file__] + ([] if maker.exists() else ["--build-model"])
    print(f"  building the {size} model ({shape}) in {folder}", flush=True)
    done = subprocess.run([*argv, shape, str(tok), str(folder)], capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"building the {size} model failed: {last_line(done.stderr)}")
    (folder / ".complete").write_text("")
    return folder


def build_model(shape: str, tok: str, out: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tok)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, rope_theta=100000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def dataset_lengths(model: Path, data: Path, seq: int) -> list[int]:
    """Every row's length as the plain script tokenizes it (llmtune's alpaca rows are the same tokens: hash-checked)."""
    from plain_trainer import PROMPT
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rows = [json.loads(line) for line in data.open()]
    texts = [PROMPT.format(instruction=r["instruction"]) + r["output"] + tokenizer.eos_token for r in rows]
    return [len(ids) for ids in tokenizer(texts, truncation=True, max_length=seq)["input_ids"]]


def run_llmtune(spec: dict, work: Path, timeout: float) -> dict:
    arm = ARMS[spec["arm"]]
    recipe = {
        "base_model": spec["model"], "datasets": [{"path": spec["data"], "type": "alpaca"}],
        "sequence_len": spec["seq"], "micro_batch_size": spec["batch"], "max_steps": spec["steps"],
        "learning_rate": 2e-5, "lr_scheduler": "constant", "save_strategy": "no", "logging_steps": 10,
        "bf16": not spec["cpu"], "tf32": not spec["cpu"], "dataset_prepared_path": spec["prepared"], "output_dir": str(work / "out"),
        # the plain script truncates and keeps the file's order, so both see the same rows in the same order
        "train_on_inputs": True, "excess_length_strategy": "truncate", "shuffle_merged_datasets": False,
        **METHOD_KEYS[spec["method"]], **arm.keys,
    }  # fmt: skip
    path = work / "recipe.yaml"
    path.write_text(json.dumps(recipe))  # YAML is a superset of JSON
    argv = [sys.executable, "-m", "llmtune", "train", str(path), "--num-processes", "1", "--device", "cpu" if spec["cpu"] else "cuda",
            "--no-memory-check"]  # fmt: skip
    env = {**os.environ, "LLMTUNE_BATCH_HASHES": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if done.returncode:
        return {"error": f"llmtune exited {done.returncode}: {last_line(done.stderr)}"}
    metrics = json.loads((work / "out" / "metrics.json").read_text())
    rank0 = (metrics.get("ranks") or [{}])[0]
    return {"step_seconds": metrics["step_seconds"], "real_tokens": metrics["step_real_tokens"],
            "padded_tokens": metrics["step_padded_tokens"], "batch_hashes": metrics.get("step_batch_hashes"),
            "trainable_parameters": metrics["trainable_parameters"], "peak_bytes": rank0.get("cuda_max_allocated_bytes"),
            "batches": metrics.get("batches"), "optimizer": rank0.get("optimizer_class")}  # fmt: skip


def run_plain(spec: dict, work: Path, timeout: float) -> dict:
    (work / "spec.json").write_text(json.dumps({**spec, "out": str(work / "plain.json")}))
    done = subprocess.run([sys.executable, __file__, "--plain-run", str(work / "spec.json")], capture_output=True,
                          text=True, timeout=timeout, cwd=HERE)  # fmt: skip
    if done.returncode:
        return {"error": f"plain Trainer exited {done.returncode}: {last_line(done.stderr)}"}
    return json.loads((work / "plain.json").read_text())


def plain_run(spec_path: str) -> None:
    """The plain Trainer script on the GPU: what a user writes with transformers, peft and (one arm) Liger."""
    import torch
    from datasets import Dataset
    from plain_trainer import PROMPT, Timer
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForLanguageModeling,
        DataCollatorWithFlattening,
        Trainer,
        TrainingArguments,
    )

    spec = json.loads(Path(spec_path).read_text())
    arm, method = ARMS[spec["arm"]], spec["method"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    rows = [json.loads(line) for line in open(spec["data"])]
    texts = [PROMPT.format(instruction=r["instruction"]) + r["output"] + tokenizer.eos_token for r in rows]
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=spec["seq"]), batched=True, remove_columns=["text"]
    )
    kwargs: dict = {"dtype": torch.float32 if method == "full" or spec["cpu"] else torch.bfloat16}
    if method == "qlora":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_use_double_quant=True,
                                                           bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
        kwargs["device_map"] = {"": 0}
    network = AutoModelForCausalLM.from_pretrained(spec["model"], **kwargs)
    network.config.use_cache = False
    if method != "full":
        from peft import LoraConfig, get_peft_model

        network = get_peft_model(network, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                     target_modules="all-linear", task_type="CAUSAL_LM"))  # fmt: skip
    inner = (
        DataCollatorWithFlattening()
        if arm.collator == "flat"
        else DataCollatorForLanguageModeling(tokenizer, mlm=False)
    )
    collator = Recording(inner)
    timer = Timer()
    training = TrainingArguments(
        output_dir=spec["out"] + ".run", per_device_train_batch_size=spec["batch"], max_steps=spec["steps"],
        learning_rate=2e-5, lr_scheduler_type="constant", save_strategy="no", report_to=[], logging_steps=10, seed=42,
        dataloader_num_workers=0, use_liger_kernel=arm.liger,
        **({"use_cpu": True, "optim": "adamw_torch"} if spec["cpu"] else {"optim": "adamw_torch_fused", "bf16": True, "tf32": True}),
    )  # fmt: skip
    Trainer(model=network, args=training, train_dataset=dataset, data_collator=collator, callbacks=[timer]).train()
    steps = len(timer.seconds)
    with open(spec["out"], "w") as handle:
        json.dump({"step_seconds": timer.seconds, "real_tokens": collator.real[:steps],
                   "padded_tokens": collator.padded[:steps], "batch_hashes": collator.hashes[:steps],
                   "row_lengths": collator.lengths[:steps],
                   "trainable_parameters": sum(p.numel() for p in network.parameters() if p.requires_grad),
                   "peak_bytes": None if spec["cpu"] else torch.cuda.max_memory_allocated()}, handle)  # fmt: skip


class Recording:
    """Wraps a collator: per micro-batch its real and computed tokens, its rows' lengths and llmtune's row hash."""

    def __init__(self, inner):
        self.inner = inner
        self.real, self.padded, self.hashes, self.lengths = [], [], [], []

    def __call__(self, features, return_tensors=None):
        rows = [list(f["input_ids"]) for f in features]
        batch = self.inner(features)
        self.real.append(sum(len(r) for r in rows))
        self.padded.append(int(batch["input_ids"].numel()))
        self.hashes.append(row_hash(rows))
        self.lengths.append([len(r) for r in rows])
        return batch


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:400] if lines else "(no output)"


def importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def missing_for(arm: str, method: str) -> str | None:
    """Why this arm can't run here (a package missing), or None."""
    if ARMS[arm].liger and not importable("liger_kernel"):
        return "liger-kernel not installed"
    if method != "full" and ARMS[arm].plain and not importable("peft"):
        return "peft not installed"
    if method == "qlora" and not importable("bitsandbytes"):
        return "bitsandbytes not installed"
    return None


# ---- the results folder -----------------------------------------------------------------------------------------


def load_results(folder: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(folder.glob("*-r*.json")):
        try:
            found[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a file cut short by a kill: run again
    return found


def run_config(args, size: str) -> dict:
    """What a result must share with this invocation to count (otherwise it is run again)."""
    _, batch, seq, _, _ = SIZES[size]
    return {"steps": args.steps, "batch": args.batch or batch, "seq": args.seq or seq, "rows": args.rows,
            "model": str(args.model) if args.model else size}  # fmt: skip


def estimate_seconds(size: str, method: str, arm: str, results: dict[str, dict], built: bool) -> float:
    """One run's wall time: the longest earlier run of this arm, else the size's default; plus building the model."""
    walls = [r["wall_seconds"] for r in results.values()
             if (r["size"], r["method"], r["arm"]) == (size, method, arm) and "wall_seconds" in r]  # fmt: skip
    return (max(walls) if walls else SIZES[size][3]) + (0 if built else SIZES[size][4])


def run_benchmark(args, slices, arms_of, folder: Path) -> int:
    import torch

    device = "cpu rehearsal" if args.cpu_rehearsal else torch.cuda.get_device_name()
    folder.mkdir(parents=True, exist_ok=True)
    peaks_file = folder / "peaks.json"
    peaks = json.loads(peaks_file.read_text()) if peaks_file.exists() else []

    def measure_peak():
        if args.cpu_rehearsal:  # the plumbing only: no MFU
            return
        peaks.append(round(matmul_peak() / 1e12, 2))
        peaks_file.write_text(json.dumps(peaks))

    measure_peak()
    results = load_results(folder)
    todo = []
    for size, method, arm, repeat in schedule(slices, arms_of, args.repeats):
        name, config = result_name(size, method, arm, repeat), run_config(args, size)
        old = results.get(name)
        if old and old.get("config") == config and (not old.get("error") or not args.retry_failed):
            continue
        todo.append((size, method, arm, repeat))
    print(f"{device}: {len(todo)} run(s) to do, results in {folder}", flush=True)
    models = args.models
    models.mkdir(parents=True, exist_ok=True)
    data = folder / f"data-{args.rows}.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in alpaca_rows(args.rows)))
    with tempfile.TemporaryDirectory(prefix="gpu-throughput-") as tmp:
        for index, (size, method, arm, repeat) in enumerate(todo):
            built = bool(args.model) or (models / size / ".complete").exists()
            need = estimate_seconds(size, method, arm, results, built)
            left = args.deadline - time.time() if args.deadline else None
            if left is not None and left < need:
                rest = sum(estimate_seconds(*t[:3], results, True) for t in todo[index:])
                print(
                    f"stopping for time: {left:.0f} s left, the next run needs about {need:.0f} s; "
                    f"{len(todo) - index} run(s) left (about {rest:.0f} s): rerun to continue",
                    flush=True,
                )
                return INCOMPLETE
            name = result_name(size, method, arm, repeat)
            why = missing_for(arm, method)
            if why:  # recorded, so reruns skip it (--retry-failed tries again once it is installed)
                results[name] = {"key": name, "size": size, "method": method, "arm": arm, "repeat": repeat,
                                 "device": device, "config": run_config(args, size), "error": f"not run: {why}"}  # fmt: skip
                (folder / f"{name}.json").write_text(json.dumps(results[name]))
                print(f"  {name}: not run ({why})", flush=True)
                continue
            model = args.model or model_folder(size, models)
            config = json.loads((Path(model) / "config.json").read_text())
            lengths_file = folder / f"lengths-{size}-{run_config(args, size)['seq']}.json"
            if not lengths_file.exists():
                lengths_file.write_text(json.dumps(dataset_lengths(Path(model), data, run_config(args, size)["seq"])))
            spec = {**run_config(args, size), "model": str(model), "data": str(data), "arm": arm, "method": method,
                    "prepared": str(Path(tmp) / f"prepared-{size}"), "cpu": args.cpu_rehearsal}  # fmt: skip
            work = Path(tmp) / name
            work.mkdir()
            began = time.time()
            timeout = (args.deadline - began + 15) if args.deadline else 3600
            try:
                runner = run_plain if ARMS[arm].plain else run_llmtune
                outcome = runner(spec, work, timeout)
            except subprocess.TimeoutExpired:
                print(f"  {name}: cut off at the deadline; not recorded (rerun to continue)", flush=True)
                return INCOMPLETE
            finally:
                shutil.rmtree(work, ignore_errors=True)  # a full fine-tune's saved weights are gigabytes
            result = {"key": name, "size": size, "method": method, "arm": arm, "repeat": repeat, "device": device,
                      "config": run_config(args, size), "model_config": config,
                      "base_parameters": llama_parameters(config), "wall_seconds": round(time.time() - began, 1),
                      "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **outcome}  # fmt: skip
            (folder / f"{name}.json").write_text(json.dumps(result))
            results[name] = result
            shown = result.get("error") or f"{statistics.median(result['step_seconds'][args.warmup :]):.3f} s/step"
            print(f"  {name}: {shown} ({result['wall_seconds']:.0f} s)", flush=True)
            measure_peak()
    return 0


# ---- the report -------------------------------------------------------------------------------------------------


def lengths_by_hash(results: list[dict]) -> dict[str, list[int]]:
    """Batch hash -> its rows' lengths: the plain arms record them, and llmtune's unpacked batches share the hashes."""
    found: dict[str, list[int]] = {}
    for r in results:
        found.update(zip(r.get("batch_hashes") or [], r.get("row_lengths") or [], strict=False))
    return found


def slice_summary(results: list[dict], warmup: int, steps: int, peak: float | None, lengths: list[int] | None,
                  lengths_of: dict[str, list[int]] | None = None) -> dict:  # fmt: skip
    """Per arm of one slice: the figures over its repeats, the rows check and the note on how attention was counted."""
    rows_ok = check_rows(results, steps)
    lengths_of = lengths_of if lengths_of is not None else lengths_by_hash(results)
    arms: dict[str, dict] = {}
    for arm in ARMS:
        mine = sorted((r for r in results if r["arm"] == arm), key=lambda r: r["repeat"])
        if not mine:
            continue
        layers, heads, head_dim = attention_shape(mine[0]["model_config"])
        figures, note = [], "attention per row"
        for r in mine:
            hashes = r.get("batch_hashes") or []
            known = (
                not ARMS[arm].packed and len(hashes) >= len(r["step_seconds"]) and all(h in lengths_of for h in hashes)
            )
            if known:
                attention = [attention_flops(lengths_of[h], layers, heads, head_dim) for h in hashes]
            elif lengths:  # packed rows: the data's expected attention per real token
                per_token = attention_flops(lengths, layers, heads, head_dim) / sum(lengths)
                attention, note = [per_token * n for n in r["real_tokens"]], "attention from the data's lengths"
            else:
                attention, note = [0.0] * len(r["step_seconds"]), "attention not counted (no lengths)"
            figures.append(repeat_figures(r, warmup, attention))
        summary = summarize(figures, peak)
        peaks = [r["peak_bytes"] for r in mine if r.get("peak_bytes")]
        refused = next((rows_ok[r["key"]] for r in mine if rows_ok.get(r["key"])), None)
        summary.update(peak_gib=max(peaks) / 2**30 if peaks else None, refused=refused, attention=note,
                       rows="packed: other batches, compared by real tokens/s only" if ARMS[arm].packed
                       else refused or "same rows as the reference (hash)")  # fmt: skip
        arms[arm] = summary
    return arms


def report(args, slices, arms_of, root: Path, record_it: bool) -> int:
    folders = (
        [root / args.device]
        if args.device
        else sorted(p for p in root.iterdir() if p.is_dir())
        if root.exists()
        else []
    )
    if not folders:
        print(f"no results under {root}")
        return 1
    complete = True
    for folder in folders:
        peaks = json.loads((folder / "peaks.json").read_text()) if (folder / "peaks.json").exists() else []
        peak = max(peaks) * 1e12 if peaks else None
        results = [r for r in load_results(folder).values() if not r.get("error")]
        failed = [r for r in load_results(folder).values() if r.get("error")]
        device = (results or failed or [{"device": folder.name}])[0]["device"]
        shown = (
            f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s (best of {len(peaks)})" if peak else "no matmul peak: no MFU"
        )
        print(f"\n## {device}: {shown}")
        table: dict = {"device": device, "matmul_tflops_bf16": round(peak / 1e12, 1) if peak else None,
                       "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup, "slices": {}}  # fmt: skip
        summaries = {}
        for size, method in slices:
            config = run_config(args, size)
            mine = [r for r in results if (r["size"], r["method"]) == (size, method) and r.get("config") == config]
            wanted = {(a, k) for a in arms_of[method] for k in range(args.repeats)}
            have = {(r["arm"], r["repeat"]) for r in mine + failed if (r["size"], r["method"]) == (size, method)}
            complete &= wanted <= have
            if not mine:
                continue
            lengths_file = folder / f"lengths-{size}-{config['seq']}.json"
            lengths = json.loads(lengths_file.read_text()) if lengths_file.exists() else None
            same_rows = lengths_by_hash([r for r in results if r["size"] == size and r.get("config") == config])
            arms = slice_summary(mine, args.warmup, args.steps, peak, lengths, same_rows)
            name = f"{size} {method}"
            summaries[name] = arms
            base = arms.get("plain", {}).get("tokens_per_s")
            print(f"\n### {name}: micro-batch {config['batch']} x sequence {config['seq']}, {config['steps']} steps "
                  f"({args.warmup} warm-up), {len(wanted - have)} of {len(wanted)} runs missing\n")  # fmt: skip
            print("| arm | s/step (min-max over repeats) | real tok/s | vs plain | MFU | peak GiB | rows |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for arm, s in arms.items():
                vs = f"{s['tokens_per_s'] / base:.2f}x" if base and not s["refused"] else "-"
                mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "-"
                gib = f"{s['peak_gib']:.1f}" if s["peak_gib"] is not None else "-"
                print(f"| {arm} ({s['repeats']}) | {s['step_s']:.3f} ({s['step_min']:.3f}-{s['step_max']:.3f}) | "
                      f"{s['tokens_per_s']:,.0f} | {vs} | {mfu} | {gib} | {s['rows']}; {s['attention']} |")  # fmt: skip
            for r in failed:
                if (r["size"], r["method"]) == (size, method):
                    print(f"| {r['arm']} r{r['repeat']} | failed: {r['error']} | | | | | |")
            table["slices"][name] = {arm: {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()
                                           if k != "tokens_each"} for arm, s in arms.items()}  # fmt: skip
        goals = goal_lines(summaries)
        if goals:
            print("\nGoals (issue 36):")
        for g in goals:
            shown = "-" if g["value"] is None else f"{g['value']:.1%}" if g["unit"] == "MFU" else f"{g['value']:.2f}x"
            target = f"{g['target']:.0%}" if g["unit"] == "MFU" else f"{g['target']:g}x"
            spread = f" (repeats {g['spread'][0]:.2f}-{g['spread'][1]:.2f}x)" if g["spread"] else ""
            print(f"- {g['goal']}: {shown}{spread}; goal >= {target}: {g['verdict']}")
        table["goals"] = goals
        if record_it and summaries:
            from common import record

            record("gpu_throughput", table)
    if not complete:
        print("\n(incomplete: some arm x repeat results are missing; rerun the benchmark to fill them in)")
    return 0 if complete else INCOMPLETE


# ---- command line -----------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), help="default: 1b (full, lora, qlora) and 8b (lora)")
    parser.add_argument("--methods", nargs="+", choices=list(METHOD_KEYS))
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), help="default: per method (full: five; adapters: 2)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of every figure")
    parser.add_argument("--batch", type=int, help="micro-batch (default per size: 8; 8b: 4)")
    parser.add_argument("--seq", type=int, help="sequence_len (default 1024)")
    parser.add_argument("--rows", type=int, default=2000, help="rows of generated Alpaca data")
    parser.add_argument("--model", type=Path, help="a local HF Llama folder instead of a built random one (one size)")
    parser.add_argument("--models", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "llmtune-gpu-models")
    parser.add_argument("--results", type=Path, default=ROOT / ".gpu-proof" / "bench")
    parser.add_argument("--deadline", type=float, help="Unix time after which no run may still be going")
    parser.add_argument("--budget", type=float, help="seconds from now (sets --deadline)")
    parser.add_argument("--retry-failed", action="store_true", help="run again the arms whose result is an error")
    parser.add_argument("--report", action="store_true", help="print the table from the results folder; run nothing")
    parser.add_argument("--device", help="--report: one device folder (default: every one)")
    parser.add_argument(
        "--record",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="append to benchmarks/results.json (default: after a complete run, not with --report)",
    )
    parser.add_argument("--list", action="store_true", help="print the runs in order; run nothing")
    parser.add_argument("--cpu-rehearsal", action="store_true",
                        help="the tiny model on CPU in fp32 (full and lora): checks hashes, files and the report; "
                        "its figures mean nothing")  # fmt: skip
    parser.add_argument("--plain-run", help=argparse.SUPPRESS)
    parser.add_argument("--build-model", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.budget is not None:
        args.deadline = time.time() + args.budget
    return args


def plan_slices(args) -> tuple[list[tuple[str, str]], dict[str, list[str]]]:
    if args.sizes or args.methods or args.cpu_rehearsal:
        sizes = args.sizes or (["tiny"] if args.cpu_rehearsal else ["1b"])
        default = [[m for z, m in DEFAULT_SLICES if z == s] or ["full", "lora"] for s in sizes]
        slices = [(s, m) for s, methods in zip(sizes, default, strict=True) for m in (args.methods or methods)]
    else:
        slices = list(DEFAULT_SLICES)
    if args.model and len({s for s, _ in slices}) > 1:
        sys.exit("gpu_throughput: --model stands for one size; pick it with --sizes")
    arms_of = {m: list(args.arms) if args.arms else list(METHOD_ARMS[m]) for m in METHOD_KEYS}
    return slices, arms_of


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.plain_run:
        plain_run(args.plain_run)
        return 0
    if args.build_model:
        build_model(*args.build_model)
        return 0
    slices, arms_of = plan_slices(args)
    if args.list:
        for size, method, arm, repeat in schedule(slices, arms_of, args.repeats):
            print(result_name(size, method, arm, repeat))
        return 0
    if args.report:
        return report(args, slices, arms_of, args.results, record_it=bool(args.record))
    import torch

    if args.cpu_rehearsal:
        status = run_benchmark(args, slices, arms_of, args.results / device_slug("cpu rehearsal"))
        args.device = device_slug("cpu rehearsal")
        return status or report(args, slices, arms_of, args.results, record_it=False)
    if not torch.cuda.is_available():
        print("gpu_throughput: no CUDA device visible; nothing measured (benchmarks/throughput.py is the CPU one)",
              file=sys.stderr)  # fmt: skip
        return 2
    folder = args.results / device_slug(torch.cuda.get_device_name())
    status = run_benchmark(args, slices, arms_of, folder)
    args.device = folder.name
    report_status = report(args, slices, arms_of, args.results, record_it=args.record is not False and status == 0)
    return status or report_status


if __name__ == "__main__":
    sys.exit(main())
