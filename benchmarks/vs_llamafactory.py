"""End to end against LLaMA-Factory: wall time of the same tiny LoRA fine-tune, llmtune vs LLaMA-Factory (target <= 0.75x).

Both sides: same model, same alpaca rows, same optimizer steps (max_steps), micro-batch, sequence length, LoRA rank /
alpha / targets (every linear layer but the head, dropout 0), lr, constant schedule, no gradient checkpointing; one
process, CPU, fp32, offline; rows all fit in sequence_len (none dropped or truncated on either side);
each run starts with a clean output dir and NO dataset cache (fresh dataset_prepared_path / HF_DATASETS_CACHE), and ends
by saving the adapter. Runs interleave (llmtune, LF, llmtune, LF, ...). Wall time is from starting the command
(`python -m llmtune train recipe.yaml` vs LLaMA-Factory's `cli.main()` with `train config.yaml`) to process exit.
Time to the first optimizer step: llmtune's metrics.json `first_step_end_unix`; for LF a TrainerCallback added by
the `-c` wrapper that starts LF's CLI (it only wraps run_exp, which LF's `train` command imports anyway).

Prompt format: LF `template: alpaca` -- the same Alpaca prompt text llmtune uses for `type: alpaca` rows (LF joins
instruction and input into one user turn; the rows here have no input, so the text matches up to special tokens).

LLaMA-Factory is never a dependency of llmtune: it lives in its own venv (default benchmarks/.venv-llamafactory, made on
first use by ensure_llamafactory_venv(), 1.5 GB). Run: `cd benchmarks && python3 vs_llamafactory.py --repeats 3`
(--model PATH for any local HF folder, e.g. SmolLM2-135M; --lf-venv PATH; --steps/--rows to change the work).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from common import ROOT, record

TARGET = 0.75
DEFAULT_VENV = ROOT / "benchmarks" / ".venv-llamafactory"
# The smallest install of LLaMA-Factory's LoRA SFT path on torch 2.13.0 CPU (seen to work, 2026-11):
# torch==2.13.0 is the CPU wheel on local disk. llamafactory is installed --no-deps: its metadata also wants gradio,
# torchvision, torchdata, av, matplotlib, modelscope, fastapi, ... which `train` never imports; PyPI's torchvision
# and torchaudio are CUDA builds that don't load beside CPU torch. data/mm_plugin.py imports torchaudio at module level
# (used only for audio inputs), so torchaudio is installed --no-deps and its compiled ops (linked to libc10_cuda.so)
# are deleted: torchaudio then imports as a pure-Python package (its own fallback for a missing lib/, "pex" layout).
LF_TORCH = "torch==2.13.0"
LF_NO_DEPS = ["llamafactory==0.9.5", "torchaudio==2.11.0"]
LF_DEPS = ["transformers==5.6.0", "peft==0.18.1", "accelerate==1.11.0", "datasets==4.0.0", "trl==0.24.0",
           "omegaconf==2.4.0", "tokenizers==0.22.2", "huggingface-hub==1.33.0"]  # fmt: skip
LF_HOOK = """import os, sys, time, transformers
from llamafactory.train import tuner
class FirstStep(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            open(os.environ["BENCH_FIRST_STEP"], "w").write(repr(time.time()))
run_exp = tuner.run_exp
tuner.run_exp = lambda args=None, callbacks=None: run_exp(args, [*(callbacks or []), FirstStep()])
from llamafactory.cli import main
sys.argv[0] = "llamafactory-cli"
main()
"""


def ensure_llamafactory_venv(venv: Path = DEFAULT_VENV) -> Path:
    """The venv's python, after creating the venv and installing LLaMA-Factory into it if that isn't done yet."""
    python = venv / "bin" / "python"
    smoke = [str(python), "-c", "import torchaudio, llamafactory.train.tuner"]
    if python.exists() and subprocess.run(smoke, capture_output=True, timeout=300).returncode == 0:
        return python
    print(f"setting up LLaMA-Factory in {venv} (once: 1.5 GB, a few minutes)")
    pip = [str(python), "-m", "pip", "install", "-qq"]
    # llamafactory last: pip then finds none of its (unneeded) dependencies missing to complain about
    steps = [[sys.executable, "-m", "venv", str(venv)], [*pip, LF_TORCH], [*pip, *LF_DEPS],
             [*pip, "--no-deps", *LF_NO_DEPS]]  # fmt: skip
    for argv in steps:
        print("  $", " ".join(argv[2:] if argv[0] == str(python) else argv))
        subprocess.run(argv, check=True, timeout=1800)
    site = Path(subprocess.check_output([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())  # fmt: skip
    for lib in (site / "torchaudio" / "lib").glob("*.so"):
        print(f"  $ rm {lib}  (CUDA-linked torchaudio op, unused for text)")
        lib.unlink()
    subprocess.run(smoke, check=True, timeout=300)
    return python


def run_llmtune(work: Path, tag: str, model: Path, data: Path, a, env: dict) -> tuple[float, float | None]:
    out = work / f"llmtune-{tag}"
    recipe = {"base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}],
              "sequence_len": a.seq_len, "micro_batch_size": a.micro_batch, "gradient_accumulation_steps": 1,
              "max_steps": a.steps, "learning_rate": 3e-3, "lr_scheduler": "constant", "optimizer": "adamw_torch",
              "adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target_linear": True,
              "logging_steps": 1, "save_strategy": "no", "output_dir": str(out),
              "dataset_prepared_path": str(work / f"prepared-{tag}")}  # fmt: skip
    path = work / f"llmtune-{tag}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    start = time.time()
    run("llmtune", [sys.executable, "-m", "llmtune", "train", str(path)], env, work / f"llmtune-{tag}.log")
    wall = time.time() - start
    assert (out / "adapter_model.safetensors").exists(), f"llmtune saved no adapter in {out}"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == a.steps and metrics["data"]["train_rows"] == a.rows, "llmtune ran other steps or rows"
    first = metrics.get("first_step_end_unix")
    PHASES.append(metrics.get("startup_seconds") or {})
    return wall, first - start if first else None


PHASES: list[dict] = []  # llmtune's own start-up phases (metrics.json startup_seconds), one dict per run


def run_llamafactory(work: Path, tag: str, python: Path, model: Path, a, env: dict) -> tuple[float, float | None]:
    out, marker = work / f"lf-{tag}", work / f"lf-{tag}.first-step"
    config = {"model_name_or_path": str(model), "stage": "sft", "do_train": True, "finetuning_type": "lora",
              "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0, "lora_target": "all",
              "dataset": "bench_alpaca", "dataset_dir": str(work / "lf-data"), "template": "alpaca",
              "cutoff_len": a.seq_len, "overwrite_cache": True, "per_device_train_batch_size": a.micro_batch,
              "gradient_accumulation_steps": 1, "max_steps": a.steps, "learning_rate": 3e-3,
              "lr_scheduler_type": "constant", "optim": "adamw_torch", "logging_steps": 1, "save_strategy": "no",
              "disable_gradient_checkpointing": True,  # LF's default is on; llmtune's (gradient_checkpointing) off
              "output_dir": str(out), "report_to": "none", "plot_loss": False, "seed": 42}  # fmt: skip
    path = work / f"lf-{tag}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    start = time.time()
    run("LLaMA-Factory", [str(python), "-c", LF_HOOK, "train", str(path)], {**env, "BENCH_FIRST_STEP": str(marker)},
        work / f"lf-{tag}.log")  # fmt: skip
    wall = time.time() - start
    assert (out / "adapter_model.safetensors").exists(), f"LLaMA-Factory saved no adapter in {out}"
    steps = json.loads((out / "trainer_state.json").read_text())["global_step"]
    assert steps == a.steps, f"LLaMA-Factory ran {steps} steps, not {a.steps}"
    return wall, float(marker.read_text()) - start if marker.exists() else None


def fitting_rows(model: Path, count: int, seq_len: int) -> list[dict]:
    """Alpaca rows that fit in seq_len with room to spare: llmtune drops longer rows, LF truncates them."""
    from throughput import variable_length_rows
    from transformers import AutoTokenizer

    from llmtune.train.data.formats import ALPACA_NO_INPUT

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    length = lambda row: len(tokenizer(ALPACA_NO_INPUT.format(**row) + row["output"])["input_ids"])  # noqa: E731
    rows = [row for row in variable_length_rows(count * 10) if length(row) + 16 <= seq_len][:count]
    if len(rows) < count:
        sys.exit(f"only {len(rows)} of {count * 10} rows fit in sequence_len {seq_len}: raise --seq-len")
    return rows


def run(name: str, argv: list[str], env: dict, log: Path) -> None:
    with log.open("w") as f:
        done = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800, cwd=log.parent)
    if done.returncode:
        sys.exit(f"{name} failed (exit {done.returncode}); its output:\n{log.read_text()[-4000:]}")


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each side")
    parser.add_argument("--model", type=Path, help="a local HF model folder (default: the tiny 2-layer test model)")
    parser.add_argument("--lf-venv", type=Path, default=DEFAULT_VENV, help="LLaMA-Factory's own venv (made if missing)")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps on each side")
    parser.add_argument("--rows", type=int, default=64, help="alpaca rows in the data file")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, outputs) and print its path")
    a = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    python = ensure_llamafactory_venv(a.lf_venv)
    from throughput import write_rows
    from tiny import make_tiny_model

    work = Path(tempfile.mkdtemp(prefix="vs-lf-"))
    model = a.model.resolve() if a.model else make_tiny_model(work / "tiny", layers=2)
    rows = fitting_rows(model, a.rows, a.seq_len)
    data = write_rows(work / "alpaca.jsonl", rows)
    (work / "lf-data").mkdir()
    write_rows(work / "lf-data" / "alpaca.jsonl", rows)
    (work / "lf-data" / "dataset_info.json").write_text(json.dumps({"bench_alpaca": {"file_name": "alpaca.jsonl",
        "formatting": "alpaca", "columns": {"prompt": "instruction", "query": "input", "response": "output"}}}))  # fmt: skip
    print(f"model {model.name}, {a.rows} alpaca rows, {a.steps} steps x micro-batch {a.micro_batch}, sequence_len "
          f"{a.seq_len}, LoRA r=8 alpha=16 all linear but head, CPU fp32, 1 process; no dataset cache on either side; "
          f"LF template: alpaca; {a.repeats} interleaved repeats")  # fmt: skip
    samples: dict[str, list[tuple[float, float | None]]] = {"llmtune": [], "LLaMA-Factory": []}
    for i in range(a.repeats):
        for side in samples:
            cache = work / f"hf-datasets-{'lf' if side == 'LLaMA-Factory' else 'llmtune'}-{i}"
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   "HF_DATASETS_CACHE": str(cache), "DISABLE_VERSION_CHECK": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
            if side == "llmtune":
                sample = run_llmtune(work, str(i), model, data, a, env)
            else:
                sample = run_llamafactory(work, str(i), python, model, a, env)
            samples[side].append(sample)
            first = f", first step {sample[1]:.1f} s" if sample[1] is not None else ""
            print(f"  run {i + 1}/{a.repeats} {side:14} {sample[0]:6.1f} s{first}", flush=True)

    table = {}
    print(f"\n{'side':14} {'median s':>9} {'min':>7} {'max':>7} {'first step s':>13}")
    for side, runs in samples.items():
        walls, firsts = [w for w, _ in runs], [f for _, f in runs if f is not None]
        row = {"median_s": round(statistics.median(walls), 3), "min_s": round(min(walls), 3),
               "max_s": round(max(walls), 3), "walls_s": [round(w, 3) for w in walls],
               "first_step_s": round(statistics.median(firsts), 3) if firsts else None}  # fmt: skip
        table[side] = row
        first = f"{row['first_step_s']:13.2f}" if firsts else f"{'-':>13}"
        print(f"{side:14} {row['median_s']:9.2f} {row['min_s']:7.2f} {row['max_s']:7.2f} {first}")
    phases = {name: round(statistics.median(run.get(name, 0.0) for run in PHASES), 3) for name in PHASES[0]}
    if phases:
        print("llmtune's start-up, median seconds per phase:", ", ".join(f"{k} {v:.2f}" for k, v in phases.items()))
    table["llmtune"]["startup_phases_s"] = phases
    ratio = table["llmtune"]["median_s"] / table["LLaMA-Factory"]["median_s"]
    verdict = "ok" if ratio <= TARGET else "MISSED"
    print(f"\nllmtune / LLaMA-Factory: {ratio:.2f}x wall time (target <= {TARGET}x): {verdict}")
    record("vs_llamafactory", {**table, "ratio": round(ratio, 3), "model": model.name, "steps": a.steps,
                               "rows": a.rows, "micro_batch": a.micro_batch, "sequence_len": a.seq_len})  # fmt: skip
    if a.keep:
        print(f"work folder kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
