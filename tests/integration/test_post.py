"""After training: merge (from every strategy's save, and from sharded checkpoints), infer, chat, eval, report."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from harness import LORA, llmtune, make_workspace, train_run
from tiny import make_tiny_model, write_jsonl

pytestmark = pytest.mark.integration

# the DDP and FSDP2 runs train two embedding rows beside LoRA (peft's trainable tokens): ' is' and '.', in every prompt
TOKEN_ROWS = [17, 264]
ROWS = {"peft_trainable_token_indices": {"embed_tokens": TOKEN_ROWS, "lm_head": TOKEN_ROWS}}
STRATEGIES = {
    "single": (1, {}),
    "ddp": (2, ROWS),
    "zero3": (2, {"deepspeed": "zero3"}),
    "fsdp2": (2, {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}, **ROWS}),
}
PIPELINE = (2, {"pipeline_parallel_size": 2, "pipeline_microbatches": 2, "pipeline_schedule": "1f1b"})
PROBE = [[1, 17, 42, 99, 5, 23, 64, 8]]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory, "post", make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=2))


@pytest.fixture(scope="module")
def lora_runs(workspace) -> dict[str, Path]:
    runs = {}
    for name, (processes, changes) in STRATEGIES.items():
        saves = {"save_strategy": "steps", "save_steps": 2} if name == "single" else {}  # a checkpoint to eval
        # val_set_size 4: one eval batch (micro_batch_size 4), where the Trainer's mean of batch means is the
        # per-token mean llmtune eval computes
        _, runs[name] = train_run(workspace, f"lora-{name}", processes, **LORA, **changes, **saves, val_set_size=4,
                                  eval_strategy="steps", eval_steps=1, logging_steps=1)  # fmt: skip
    _, runs["pipeline"] = train_run(workspace, "lora-pipeline", PIPELINE[0], **LORA, **PIPELINE[1])
    return runs


def logits(model) -> object:
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(PROBE)).logits


@pytest.mark.parametrize("strategy", [*STRATEGIES, "pipeline"])
def test_merged_lora_equals_base_plus_adapter(lora_runs, workspace, strategy):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = lora_runs[strategy]
    result = llmtune("merge", run, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    merged_dir = run / "merged"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)  # plain transformers, no peft
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workspace[2]), str(run))
    base = AutoModelForCausalLM.from_pretrained(workspace[2])
    merged_logits, reference_logits = logits(merged), logits(reference)
    assert torch.allclose(merged_logits, reference_logits, atol=1e-5), (merged_logits - reference_logits).abs().max()
    assert not torch.allclose(logits(base), reference_logits, atol=1e-4)  # the adapter really changed the model
    # a standard HF folder: config, generation config, tokenizer + chat template, model card, provenance
    for name in ("config.json", "tokenizer_config.json", "README.md", "llmtune/plan.json"):
        assert (merged_dir / name).exists(), name
    assert "merged" in (merged_dir / "README.md").read_text()
    weights = load_file(str(merged_dir / "model.safetensors"))
    assert not any("lora" in key for key in weights)
    base_weights = load_file(str(workspace[2] / "model.safetensors"))
    assert set(weights) == set(base_weights)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # LoRA leaves the embeddings as they were...
        rows = TOKEN_ROWS if "peft_trainable_token_indices" in STRATEGIES.get(strategy, (0, {}))[1] else []
        others = [i for i in range(base_weights[name].shape[0]) if i not in rows]
        assert torch.equal(weights[name][others], base_weights[name][others].to(weights[name].dtype)), name
        if rows:  # ...but the rows peft_trainable_token_indices named, which trained on both ranks
            assert not torch.allclose(weights[name][TOKEN_ROWS], base_weights[name][TOKEN_ROWS], atol=1e-6), name


def test_merge_shards_with_a_correct_index(lora_runs, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "sharded"
    result = llmtune("merge", lora_runs["single"], "--output", out, "--max-shard-size", "100KB", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(p.name for p in out.glob("model-*.safetensors"))
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as handle:
            keys = set(handle.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == name}
            sizes = [handle.get_tensor(k).numel() * handle.get_tensor(k).element_size() for k in keys]
            total += sum(sizes)
            assert sum(sizes) <= 100_000 or len(keys) == 1  # a bigger tensor gets a shard of its own
    assert index["metadata"]["total_size"] == total
    # nothing half-written, and an existing output needs --force
    assert not list(tmp_path.glob(".sharded.merging-*"))
    again = llmtune("merge", lora_runs["single"], "--output", out, timeout=300)
    assert again.returncode == 2 and "already exists" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.parametrize("strategy", ["zero3", "fsdp2"])
def test_full_finetune_consolidated_from_sharded_checkpoint(workspace, strategy, tmp_path):
    """The final save is missing: merge consolidates the newest complete checkpoint's shards."""
    import torch
    from safetensors.torch import load_file

    processes, changes = STRATEGIES[strategy]
    changes = {key: value for key, value in changes.items() if key not in ROWS}  # (token rows: beside LoRA only)
    _, run = train_run(workspace, f"full-{strategy}", processes, **changes, save_strategy="steps", save_steps=2)
    final = load_file(str(run / "model.safetensors"))
    broken = tmp_path / "no-final-save"
    shutil.copytree(run, broken)
    (broken / "model.safetensors").unlink()
    checkpoint = broken / "checkpoint-4"
    if strategy == "zero3":
        # DeepSpeed also wrote the gathered 16-bit weights into the checkpoint; without them only the partitions remain
        (checkpoint / "model.safetensors").unlink()
        assert sorted(p.name for p in checkpoint.glob("global_step4/*model_states.pt")) == [
            "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]  # fmt: skip
    else:
        assert len(list(checkpoint.glob("pytorch_model_fsdp_0/*.distcp"))) == 2  # one shard file per rank
    result = llmtune("merge", broken, "--output", tmp_path / "out", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    how = {"zero3": "consolidated from its DeepSpeed ZeRO partitions", "fsdp2": "consolidated from its FSDP sharded"}
    assert f"checkpoint-4, {how[strategy]}" in result.stdout  # the path that ran
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(merged) == set(final)
    for key, tensor in final.items():
        assert torch.allclose(merged[key].float(), tensor.float(), atol=1e-6), key


def test_merge_peak_memory_stays_near_one_shard(tmp_path):
    """Merge a model of ~150 MB in 8 MB shards in a fresh process: its RSS grows by far less than one model copy."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path / "base", layers=8, hidden=512, intermediate=2048)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.save_pretrained(model_dir, max_shard_size="8MB")
    for stale in [model_dir / "model.safetensors"]:
        stale.unlink(missing_ok=len(list(model_dir.glob("model-*.safetensors"))) == 0)
    size = sum(p.stat().st_size for p in model_dir.glob("model-*.safetensors"))
    assert len(list(model_dir.glob("model-*.safetensors"))) >= 5
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", init_lora_weights=False))
    run = tmp_path / "run"
    peft_model.save_pretrained(run)
    (run / "llmtune").mkdir()
    recipe = {"base_model": str(model_dir), "datasets": [{"path": "x.jsonl", "type": "alpaca"}], "adapter": "lora",
              "output_dir": str(run)}  # fmt: skip
    (run / "llmtune" / "plan.json").write_text(json.dumps({"recipe": recipe, "plan": {"precision": "fp32", "title": "t", "world_size": 1}}))
    # current RSS sampled every 2 ms while the merge runs (ru_maxrss would only show the import peak)
    script = (
        "import json, os, sys, threading, time\n"
        "from pathlib import Path\n"
        "import torch, safetensors.torch, peft, transformers\n"
        "from llmtune.post.merge import merge_run\n"
        "import llmtune.recipe, llmtune.train.checkpoint.folders, llmtune.train.model.load  # imports are not the merge\n"
        "torch.randn(1024, 8) @ torch.randn(8, 256)  # nor the one-time set-up of the matmul library (~15 MB)\n"
        "page = os.sysconf('SC_PAGE_SIZE')\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * page\n"
        "peak, done = [0], threading.Event()\n"
        "def watch():\n"
        "    while not done.is_set():\n"
        "        peak[0] = max(peak[0], rss()); time.sleep(0.002)\n"
        "before = rss(); thread = threading.Thread(target=watch); thread.start()\n"
        "merge_run(Path(sys.argv[1]), Path(sys.argv[2]), '8MB')\n"
        "done.set(); thread.join()\n"
        "print(json.dumps({'growth': max(peak[0], rss()) - before}))\n"
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", script, str(run), str(tmp_path / "merged")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    growth = json.loads(done.stdout.strip().splitlines()[-1])["growth"]
    print(f"model {size / 1e6:.1f} MB, merge RSS growth {growth / 1e6:.1f} MB")
    # measured ~48 MB for 128 MB: the pending output shard and its serialized bytes, the open base shard, the fp32
    # working copies of the largest weight, allocator slack. Loading + merge_and_unload + saving holds >= 2x size.
    assert 0 < growth < 0.5 * size, (growth, size)
    assert len(list((tmp_path / "merged").glob("model-*.safetensors"))) >= 5


def test_infer_over_a_file_gives_one_output_per_prompt(lora_runs, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": "Repeat apple", "id": 1},
        {"messages": [{"role": "user", "content": "Repeat river"}, {"role": "assistant", "content": "river river"}], "id": 2},
        {"instruction": "Repeat stone", "input": "", "id": 3},
    ])  # fmt: skip
    out = tmp_path / "out.jsonl"
    result = llmtune("infer", lora_runs["single"], "--file", prompts, "--output", out, "--max-new-tokens", "6",
                     "--batch-size", "2", timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [1, 2, 3] and all(isinstance(r["output"], str) for r in rows)
    # greedy generation is deterministic and independent of batching: the merged model says the same
    merged = llmtune("merge", lora_runs["single"], "--output", tmp_path / "m", timeout=300)
    assert merged.returncode == 0, merged.stderr[-2000:]
    again = llmtune("infer", tmp_path / "m", "--file", prompts, "--output", tmp_path / "o2.jsonl",
                    "--max-new-tokens", "6", "--batch-size", "3", timeout=300)  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert [json.loads(line)["output"] for line in (tmp_path / "o2.jsonl").read_text().splitlines()] == [r["output"] for r in rows]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"text": "no prompt field"}])
    failed = llmtune("infer", lora_runs["single"], "--file", bad, timeout=120)
    assert failed.returncode == 2 and "bad.jsonl line 2" in failed.stderr and "Traceback" not in failed.stderr


def test_chat_in_a_terminal_answers_and_exits(lora_runs):
    import pexpect  # a dev dependency: without it this fails, not skips (a skip would leave chat unproven)

    child = pexpect.spawn(sys.executable, ["-m", "llmtune", "chat", str(lora_runs["single"]), "--max-new-tokens", "5"],
                          encoding="utf-8", timeout=180)  # fmt: skip
    try:
        child.expect("you> ")
        child.sendline("Repeat apple")
        child.expect("model> ")
        child.expect("you> ")  # the streamed answer ended and it asks again
        child.sendline("/reset")
        child.expect("conversation cleared")
        child.expect("you> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_eval_matches_the_trainers_eval_loss(lora_runs, tmp_path):
    run = lora_runs["single"]
    metrics = json.loads((run / "metrics.json").read_text())
    result = llmtune("eval", run, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    written = json.loads((run / "eval.json").read_text())
    assert written["eval_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-3)
    assert written["perplexity"] == pytest.approx(2.718281828 ** written["eval_loss"], rel=1e-6)
    assert written["eval_tokens"] > written["examples"] > 0  # the loss says over what it is a mean
    assert f"(per token, {written['eval_tokens']} tokens of {written['examples']} rows)" in result.stdout
    from llmtune.launch.console import noise

    # llmtune's own process: the libraries' import-time noise (torchao, bitsandbytes, peft) is filtered where it starts
    assert not [line for line in result.stderr.splitlines() if noise(line)], result.stderr[-3000:]
    # one checkpoint of the run: its own weights, measured as the trainer measured them at that step
    checkpoint = run / "checkpoint-2"
    at_step = {entry["step"]: entry["eval_loss"] for entry in metrics["log_history"] if "eval_loss" in entry}
    assert at_step[2] != pytest.approx(metrics["eval_loss"], rel=1e-3)  # the checkpoint is another model
    result = llmtune("eval", checkpoint, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((run / "eval-checkpoint-2.json").read_text())["eval_loss"] == pytest.approx(at_step[2], rel=1e-3)
    # the adapter alone, as another tool leaves it (no recipe beside it, no tokenizer): the recipe says the data
    bare = tmp_path / "adapter"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(run / name, bare / name)
    refused = llmtune("eval", bare, timeout=120)
    assert refused.returncode == 2 and f"llmtune eval RECIPE.yaml --model {bare}" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and not (bare / "eval.json").exists()
    result = llmtune("eval", run.with_suffix(".yaml"), "--model", bare, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((bare / "eval.json").read_text())["eval_loss"] == pytest.approx(written["eval_loss"], rel=1e-5)


def test_report_has_a_loss_curve_with_train_and_eval(lora_runs):
    from PIL import Image

    for name in ("single", "zero3"):
        folder = lora_runs[name] / "report"
        curves = json.loads((folder / "curves.json").read_text())
        metrics = json.loads((lora_runs[name] / "metrics.json").read_text())
        train = [e for e in metrics["log_history"] if "loss" in e]
        evals = [e for e in metrics["log_history"] if "eval_loss" in e]
        assert len(train) == metrics["steps"] and len(evals) == metrics["steps"]  # logged and evaluated every step
        # the last step's evaluation is the final one (not run, logged and printed a second time)
        assert [e["step"] for e in evals] == list(range(1, metrics["steps"] + 1))
        assert metrics["eval_loss"] == evals[-1]["eval_loss"]
        assert curves["train"] == {"step": [e["step"] for e in train], "loss": [e["loss"] for e in train],
                                   "learning_rate": [e["learning_rate"] for e in train]}  # fmt: skip
        assert curves["eval"] == {"step": [e["step"] for e in evals], "loss": [e["eval_loss"] for e in evals]}
        with Image.open(folder / "loss.png") as image:
            image.verify()
            assert image.size[0] > 300
        summary = (folder / "summary.md").read_text()
        assert f"world size {metrics['world_size']}" in summary and str(lora_runs[name]) in summary
    (lora_runs["single"] / "report" / "loss.png").unlink()
    rebuilt = llmtune("report", lora_runs["single"], timeout=120)
    assert rebuilt.returncode == 0 and (lora_runs["single"] / "report" / "loss.png").exists()


def test_trackers_write_on_rank_0_only_and_read_back_offline(workspace, monkeypatch):
    """tensorboard event files, an mlflow file store and an offline wandb run, from a 2-rank DDP run."""
    import mlflow  # noqa: F401  (the trackers extra, in dev: missing, this fails rather than skips)
    import tensorboard  # noqa: F401
    import wandb  # noqa: F401

    secret = "wandb-secret-value-0123456789abcdef0123"
    env = {"WANDB_API_KEY": secret, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    root = workspace[0]
    from harness import write_run_recipe

    path = write_run_recipe(workspace, "trackers", report_to=["tensorboard", "mlflow", "wandb"], wandb_project="llmtune-test",
                            mlflow_experiment_name="llmtune-test", logging_steps=1)  # fmt: skip
    result = llmtune("train", path, "--num-processes", 2, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    run = root / "trackers"
    metrics = json.loads((run / "metrics.json").read_text())
    losses = [e["loss"] for e in metrics["log_history"] if "loss" in e]
    assert len(losses) == metrics["steps"] == 4, losses  # logging_steps 1: what the trackers must hold, step by step
    # tensorboard: one writer (rank 0), its scalars are the logged losses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(run.rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    tag = next(t for t in accumulator.Tags()["scalars"] if t.endswith("loss") and "eval" not in t)
    assert [round(e.value, 4) for e in accumulator.Scalars(tag)] == [round(v, 4) for v in losses]
    # mlflow: one run in the local file store, same loss history
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{run / 'mlruns'}")
    experiment = client.get_experiment_by_name("llmtune-test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [round(m.value, 4) for m in sorted(history, key=lambda m: m.step)] == [round(v, 4) for v in losses]
    # wandb: one offline run folder under the output dir, nothing in the working directory
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb"))
    assert not (Path.cwd() / "wandb").exists()
    # no secret in any file written, nor in the output streams
    assert secret not in result.stdout + result.stderr
    for file in run.rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes(), file
