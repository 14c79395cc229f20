"""One process: full, LoRA and QLoRA fine-tunes learn, save, and reload to the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from harness import STEP_LINE, assert_quiet_console, llmtune, losses, read_metrics, saved_weights, split_import_times

pytestmark = pytest.mark.integration


def reload_logits(output_dir: Path, probe: Path, four_bit: bool = False):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    saved = load_file(str(probe))
    if (output_dir / "adapter_config.json").exists():
        from peft import PeftModel

        base_name = json.loads((output_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)  # fmt: skip
        kwargs = {"quantization_config": quant, "device_map": {"": "cpu"}} if four_bit else {}
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32, **kwargs)
        model = PeftModel.from_pretrained(base, str(output_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(output_dir))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits.float()
    return logits, saved["logits"]


@pytest.mark.parametrize(
    ("method", "changes"),
    [
        ("full", {}),
        ("lora", {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True, "learning_rate": 1e-2}),
        # padded rows, as asked: the padding-free default is not the only path that trains and saves
        ("qlora", {"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16,
                   "lora_target_linear": True, "learning_rate": 1e-2, "batch_flattening": False}),
    ],
)  # fmt: skip
def test_single_process_training_learns_and_saves(make_recipe, tmp_path, method, changes):
    recipe = make_recipe(method, **changes)
    probe = tmp_path / "probe.safetensors"
    # the LoRA run's launcher (the CLI process) is timed import by import: what it imported is listed on its stderr
    flags = ("-X", "importtime") if method == "lora" else ()
    profile = ("--profile",) if method == "full" else ()  # 5 steps traced after the 2 warm-up steps
    result = llmtune("train", recipe, *profile, env={"LLMTUNE_PROBE_FILE": str(probe)}, timeout=900,
                     python_flags=flags)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    cli_imports, stderr = split_import_times(result.stderr)
    if flags:  # the launcher plans, starts the rank and draws the report: no torch, no optional library
        assert "llmtune" in cli_imports and "matplotlib" in cli_imports, sorted(cli_imports)
        heavy = {"torch", "transformers", "accelerate", "deepspeed", "torchao", "bitsandbytes", "liger_kernel",
                 "datasets", "peft"}  # fmt: skip
        assert not cli_imports & heavy, sorted(cli_imports & heavy)
    metrics = read_metrics(recipe)
    history = losses(metrics)
    assert metrics["world_size"] == 1 and metrics["strategy"] == "single"
    assert len(history) == metrics["steps"] > 5
    # throughput named for what it covers: every real token of the 4 epochs, over the whole train() call and over
    # the steps after the warm-up
    real, seconds = metrics["step_real_tokens"], metrics["step_seconds"]
    assert metrics["tokens_seen"] == sum(real) == 4 * metrics["data"]["train_tokens"] > 0
    assert metrics["tokens_per_second_whole_run"] == pytest.approx(metrics["tokens_seen"] / metrics["train_seconds"],
                                                                    rel=0.01)  # fmt: skip
    from llmtune.train.engine.callbacks import StepStats

    warm = StepStats.WARMUP_STEPS
    assert metrics["tokens_per_second_steady"] == pytest.approx(sum(real[warm:]) / sum(seconds[warm:]), rel=1e-3)
    # the loss falls on a small repeated set
    assert sum(history[-3:]) / 3 < history[0] - 0.5, history
    # padding-free by default: every token computed is a real one; padded rows (asked for) compute padding
    padded = metrics["step_padded_tokens"]
    if method == "qlora":
        assert metrics["batches"]["layout"] == "padded" and sum(padded) > sum(real), metrics["batches"]
    else:
        assert metrics["batches"]["layout"] == "padding-free" and metrics["batches"]["kernel"] == "sdpa_per_row"
        assert padded == real
    if profile:  # the trace is torch's Chrome trace; on the CPU there is no GPU to be idle, and it says so
        report = metrics["profile"]
        assert report["steps"] == [3, 7] and report["gpu_idle"] is None and report["seconds"] > 0, report
        events = json.loads(Path(report["trace"]).read_text())["traceEvents"]
        assert any("aten::mm" in str(event.get("name")) for event in events)
        assert "profile: steps 3-7 took" in result.stderr and "no GPU here" in result.stderr
    output_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    weights = "adapter_model.safetensors" if method != "full" else "model.safetensors"
    assert (output_dir / weights).stat().st_size > 0
    assert (output_dir / "tokenizer.json").exists() and (output_dir / "README.md").exists()
    assert not (output_dir / "training_args.bin").exists()
    plan = json.loads((output_dir / "llmtune" / "plan.json").read_text())
    assert plan["plan"]["strategy"] == "single"
    # the rank imported only the optional libraries its plan uses (read from its sys.modules after training)
    assert metrics["ranks"][0]["libraries"].keys() == ({"bitsandbytes"} if method == "qlora" else set())
    # the console shows what the user caused, the loss as a number; the log keeps every line the rank printed
    console = result.stdout + stderr
    assert_quiet_console(console)
    log = (output_dir / "llmtune" / "logs" / "machine-0.log").read_text().splitlines()
    shown = [line for line in console.splitlines() if line.startswith("[llmtune]") and "report:" not in line]
    assert shown and set(shown) <= set(log) and len(log) > len(shown)
    assert len([line for line in log if STEP_LINE.match(line)]) == metrics["steps"]  # logging_steps 1
    assert all(isinstance(entry["loss"], float) for entry in metrics["log_history"] if "loss" in entry)
    reloaded, in_memory = reload_logits(output_dir, probe, four_bit=method == "qlora")
    assert (reloaded - in_memory).abs().max().item() < 1e-4


def test_preprocess_then_cache_hit(make_recipe):
    recipe = make_recipe("prep")
    first = llmtune("preprocess", recipe)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("tokenized")
    second = llmtune("preprocess", recipe)
    assert second.returncode == 0 and second.stdout.startswith("cache hit")


@pytest.mark.parametrize("processes", ["1", "2"])
def test_bad_row_is_one_line_exit_2(make_recipe, tmp_path, processes):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": ["b"]}\n')
    recipe = make_recipe("bad", datasets=[{"path": str(bad), "type": "alpaca"}])
    result = llmtune("train", recipe, "--num-processes", processes)
    assert result.returncode == 2
    assert "bad.jsonl line 2: field 'output' should be str" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr and "ChildFailedError" not in result.stderr
    # the launch made the output folder for its plan; the ranks stopped before saving anything: it is gone
    assert not Path(yaml.safe_load(recipe.read_text())["output_dir"]).exists()
    if processes == "2":
        return
    # the same refusal in a folder that holds another run: that run's record (the recipe eval and report read)
    # stays as it was; it was overwritten by the refused recipe's
    out = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    (out / "llmtune").mkdir(parents=True)
    for name in ("plan.json", "recipe.resolved.yaml"):
        (out / "llmtune" / name).write_text(f"the earlier run's {name}")
    (out / "metrics.json").write_text("{}")
    again = make_recipe("bad", datasets=[{"path": str(bad), "type": "alpaca"}], auto_resume_from_checkpoints=False)
    result = llmtune("train", again, "--num-processes", processes)
    assert result.returncode == 2 and "bad.jsonl line 2" in result.stderr
    assert {p.name: p.read_text() for p in (out / "llmtune").glob("*.*") if p.is_file()} == {
        "plan.json": "the earlier run's plan.json", "recipe.resolved.yaml": "the earlier run's recipe.resolved.yaml"}


def chat_rows(count: int) -> list[dict]:
    words = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]
    return [{"conversations": [{"from": "human", "value": f"Say {w} twice"}, {"from": "gpt", "value": f"{w} {w}"}]}
            for w in (words * count)[:count]]  # fmt: skip


def test_qlora_on_chat_data_with_the_tokenizers_template(make_recipe, tmp_path):
    from tiny import write_jsonl

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    recipe = make_recipe(
        "qlora-chat", adapter="qlora", load_in_4bit=True, lora_r=8, lora_target_linear=True, learning_rate=1e-2,
        chat_template="tokenizer_default", num_epochs=2, val_set_size=0.25,
        datasets=[{"path": str(data), "type": "chat_template", "field_messages": "conversations",
                   "message_property_mappings": {"role": "from", "content": "value"}}],
    )  # fmt: skip
    result = llmtune("train", recipe, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(recipe)
    assert metrics["data"]["train_examples"] == 12 and metrics["data"]["eval_examples"] == 4
    history = losses(metrics)
    # 6 steps: the loss falls (6.23 -> 5.88 here), and the held-out rows' too (6.06, from a random model's ln 512)
    assert history[-1] < history[0] - 0.2 and metrics["eval_loss"] < history[0] - 0.1, (history, metrics["eval_loss"])
    output_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    lora_b = [t for name, t in saved_weights(output_dir).items() if "lora_B" in name]
    assert lora_b and any(t.abs().max() > 0 for t in lora_b)  # B starts at zero: the saved adapter is the trained one


def test_packed_full_fine_tune_on_plain_text(make_recipe, tmp_path):
    from tiny import write_jsonl

    texts = [{"text": " ".join(["the cat sat on the mat"] * (1 + i % 5))} for i in range(40)]
    data = write_jsonl(tmp_path / "text.jsonl", texts)
    recipe = make_recipe("packed", sample_packing=True, sequence_len=128, micro_batch_size=2, num_epochs=2,
                         datasets=[{"path": str(data), "type": "completion"}])  # fmt: skip
    result = llmtune("train", recipe, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(recipe)
    # 40 short documents fit in far fewer 128-token rows, most of each row real tokens
    assert metrics["data"]["train_rows"] < 40 / 2
    assert metrics["packing_efficiency"] > 0.8
    history = losses(metrics)
    assert history[-1] < history[0] - 1.0, history
    output_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    assert (output_dir / "model.safetensors").stat().st_size > 0


SECRETS = {"HF_TOKEN": "hf_llmtuneFakeToken0123456789", "HUGGING_FACE_HUB_TOKEN": "hf_llmtuneOtherFake987",
           "WANDB_API_KEY": "llmtune0fake0wandb0key0000000000000000000", "MLFLOW_TRACKING_PASSWORD": "llmtune-fake-pw"}  # fmt: skip


def test_secrets_never_reach_a_file_or_log(make_recipe):
    recipe = make_recipe("secrets", num_epochs=2, save_strategy="steps", save_steps=2, val_set_size=0.25)
    result = llmtune("train", recipe, env=SECRETS, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    output_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    files = [p for p in output_dir.rglob("*") if p.is_file()]
    assert any(p.name == "trainer_state.json" for p in files) and any(p.name == "plan.json" for p in files)
    for value in SECRETS.values():
        assert value not in result.stdout + result.stderr
        leaked = [str(p) for p in files if value.encode() in p.read_bytes()]
        assert not leaked, f"{value[:8]}... written to {leaked}"


def test_a_nan_loss_stops_with_the_step_and_saves_nothing_broken(make_recipe):
    import torch
    from safetensors.torch import load_file

    recipe = make_recipe("nan", learning_rate=1e9, max_grad_norm=0, save_strategy="steps", save_steps=1, num_epochs=3)
    result = llmtune("train", recipe, timeout=900)
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert "became NaN or inf by step" in last and "lower learning_rate" in last, last
    assert "Traceback" not in result.stderr
    output_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    assert not (output_dir / "model.safetensors").exists() and not (output_dir / "metrics.json").exists()
    for checkpoint in output_dir.glob("checkpoint-*"):  # whatever was saved before is finite
        weights = load_file(str(checkpoint / "model.safetensors"))
        assert all(torch.isfinite(t).all() for t in weights.values()), checkpoint


def test_disk_full_during_a_save_keeps_the_last_checkpoint(make_recipe, tmp_path):
    import subprocess

    small = tmp_path / "small-disk"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4M", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"can't mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        # each checkpoint of the tiny model is ~1.7 MB (weights + Adam states): the third can't fit in 4 MB
        recipe = make_recipe("full-disk", output_dir=str(small / "out"), save_strategy="steps", save_steps=1,
                             num_epochs=3)  # fmt: skip
        result = llmtune("train", recipe, timeout=900)
        assert result.returncode == 2, result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert "disk full while writing checkpoint-" in last and "is intact and resume will start from it" in last
        assert "Traceback" not in result.stderr
        done = sorted((small / "out").glob("checkpoint-*"))
        assert done and all((c / "llmtune-complete.json").is_file() for c in done)
        assert not any((small / "out" / ".checkpoint-staging").glob("*"))
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def test_resuming_with_a_longer_max_steps_follows_the_new_schedule_and_the_end_of_a_run_is_refused(make_recipe,
                                                                                                     alpaca_file):
    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True, "lr_scheduler": "linear",
            "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-3}  # fmt: skip
    recipe = make_recipe("longer", max_steps=4, **lora)
    assert llmtune("train", recipe, timeout=600).returncode == 0
    saved_rate = [e["learning_rate"] for e in read_metrics(recipe)["log_history"] if "loss" in e]
    recipe = make_recipe("longer", max_steps=6, **lora)
    result = llmtune("train", recipe, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert ("resuming checkpoint-4 at step 4 with max_steps 4 -> 6: the learning-rate schedule (linear) is rebuilt "
            "for the new length, and goes on from step 5 at its rate there") in result.stderr
    rates = {e["step"]: e["learning_rate"] for e in read_metrics(recipe)["log_history"] if "loss" in e}
    # linear over 6 steps from 1e-3 (no warm-up), from step 5 on (step 5 ran at the 4-step schedule's end, 0, before)
    assert [rates[step] for step in (1, 2, 3, 4)] == saved_rate and saved_rate[-1] == pytest.approx(1e-3 / 4)
    assert rates[5] == pytest.approx(1e-3 * (6 - 4) / 6) and rates[6] == pytest.approx(1e-3 * (6 - 5) / 6)
    # the finished run with a key changed would resume at its end: refused, nothing written
    before = sorted(p.name for p in (recipe.parent / "longer").iterdir())
    changed = make_recipe("longer", max_steps=6, **{**lora, "learning_rate": 2e-3})
    refused = llmtune("train", changed, timeout=600)
    assert refused.returncode == 2 and "checkpoint-6 is at step 6, and max_steps is 6 (the end of its run, which finished;" in (
        refused.stderr.strip().splitlines()[-1]
    )
    assert sorted(p.name for p in (recipe.parent / "longer").iterdir()) == before
    # the data file edited since (fewer rows): the resume's skip by count would skip other rows; refused by the rank
    rows = alpaca_file.read_text().splitlines()
    alpaca_file.write_text("\n".join(rows[:-8]) + "\n")
    edited = llmtune("train", make_recipe("longer", max_steps=8, **lora), timeout=600)
    assert edited.returncode == 2, edited.stderr[-3000:]
    assert f"checkpoint-6 was trained on {len(rows)} rows per epoch; the data gives {len(rows) - 8} now" in edited.stderr
    assert "Traceback" not in edited.stderr
    # the data back, but another base model (another size): one line, not torch's size-mismatch traceback
    from tiny import make_tiny_model

    alpaca_file.write_text("\n".join(rows) + "\n")
    name = Path(yaml.safe_load(changed.read_text())["base_model"]).name  # (make_recipe rewrites the one file)
    wide = make_tiny_model(alpaca_file.parent / "wide", hidden=32, heads=2, kv_heads=1, intermediate=64)
    other = llmtune("train", make_recipe("longer", max_steps=8, base_model=str(wide), **lora), timeout=600)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "checkpoint-6 was trained from base_model " in other.stderr and "now names wide" in other.stderr
    # the same name in another folder (a download replaced by another model): the rank's size check says it
    same_name = make_tiny_model(alpaca_file.parent / "elsewhere" / name, hidden=32, heads=2, kv_heads=1,
                                intermediate=64)  # fmt: skip
    other = llmtune("train", make_recipe("longer", max_steps=8, base_model=str(same_name), **lora), timeout=600)
    assert other.returncode == 2 and "Traceback" not in other.stderr, other.stderr[-3000:]
    assert "checkpoint-6 holds weights of another model than base_model (" in other.stderr


def test_a_run_killed_after_its_last_checkpoint_writes_its_final_model_when_rerun(make_recipe):
    recipe = make_recipe("ended", num_epochs=1, adapter="lora", lora_r=4, lora_alpha=8, lora_target_linear=True,
                         save_strategy="epoch")  # fmt: skip
    assert llmtune("train", recipe, timeout=600).returncode == 0
    out, steps = recipe.parent / "ended", read_metrics(recipe)["steps"]
    assert (out / f"checkpoint-{steps}").is_dir()
    for name in ("metrics.json", "adapter_model.safetensors"):  # killed before its final save
        (out / name).unlink()
    again = llmtune("train", recipe, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming checkpoint-{steps}, the run's last step ({steps}): no step is trained" in again.stderr
    assert read_metrics(recipe)["steps"] == steps and (out / "adapter_model.safetensors").is_file()
    assert not STEP_LINE.search(again.stderr)  # no step ran


def test_early_stopping_stops_and_saves_the_best_checkpoint(make_recipe):
    """early_stopping_patience stops the run after that many evaluations without a better eval loss, and the saved
    weights are the best checkpoint's (transformers' load_best_model_at_end, through llmtune's checkpoints): a
    learning rate far too high makes the eval loss climb after its best."""
    import torch

    recipe = make_recipe("early", adapter="lora", lora_r=8, lora_alpha=16, lora_target_linear=True,
                         learning_rate=0.05, max_steps=12, val_set_size=0.25, eval_steps=1, save_steps=1,
                         save_strategy="steps", early_stopping_patience=1)  # fmt: skip
    result = llmtune("train", recipe, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(recipe)
    evals = {entry["step"]: entry["eval_loss"] for entry in metrics["log_history"] if "eval_loss" in entry}
    best = min(evals, key=evals.get)
    last = max(evals)
    assert metrics["steps"] == last < 12 and last == best + 1, evals  # stopped at the first eval that got worse
    assert metrics["eval_loss"] == evals[best] and metrics["best_step"] == best
    assert f"early stopping at step {last} of 12" in result.stderr and f"step {best})" in result.stderr
    output_dir = Path(yaml.safe_load(recipe.read_text())["output_dir"])
    saved = saved_weights(output_dir)
    for step, same in ((best, True), (last, False)):
        kept = saved_weights(output_dir / f"checkpoint-{step}")
        assert all(torch.equal(saved[k], kept[k]) for k in saved) is same, step
