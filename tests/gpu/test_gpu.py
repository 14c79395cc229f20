"""Every strategy trains and saves over CUDA: one GPU, NCCL at world size 1, and 2 ranks sharing the GPU over gloo.

What the CPU rehearsal cannot see lives here: NCCL refusing CPU tensors, bf16 on real kernels, DeepSpeed's CUDA
ops (CPU Adam for offload, NVMe swapping), bitsandbytes' 4-bit weights. Each run goes through `llmtune train`;
the assertions are on what it did (exit code, falling loss, strategy and world size in metrics.json, a saved
model that reloads to the logits the run recorded).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from harness import LORA, llmtune, losses, make_workspace, read_metrics, saved_weights, write_run_recipe

from llmtune.launch.preflight import async_io_builds

QLORA = {"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True}
ZERO3_NVME = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "NVME"},
                                    "offload_optimizer": {"device": "nvme", "nvme_path": "NVME"}}}  # fmt: skip


def output_of(recipe: Path) -> Path:
    return Path(yaml.safe_load(recipe.read_text())["output_dir"])


def reloaded_logits(output_dir: Path, input_ids, four_bit: bool):
    """The saved model (or base + adapter) loaded fresh with transformers/peft, on the GPU, in its saved dtype."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    adapter = output_dir / "adapter_config.json"
    if adapter.exists():
        from peft import PeftModel

        base_name = json.loads(adapter.read_text())["base_model_name_or_path"]
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)  # fmt: skip
        extra = {"quantization_config": quant} if four_bit else {}
        base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.bfloat16, device_map={"": 0}, **extra)
        model = PeftModel.from_pretrained(base, str(output_dir))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(output_dir), device_map={"": 0})
    return logits_of(model, input_ids)


def logits_of(model, input_ids):
    import torch

    with torch.no_grad():
        return model.eval()(input_ids=input_ids.cuda()).logits.float().cpu()


def train_with_probe(make_recipe, tmp_path, name: str, *flags, **changes) -> tuple[dict, Path, Path]:
    if changes.get("adapter"):
        changes.setdefault("learning_rate", 1e-2)  # r=8 adapters on the tiny model: 3e-3 fell 0.45 in 24 steps (H100)
    recipe = make_recipe(name, bf16=True, **changes)
    probe = tmp_path / f"{name}-probe.safetensors"
    result = llmtune("train", recipe, "--device", "cuda", *flags, env={"LLMTUNE_PROBE_FILE": str(probe)}, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(recipe), output_of(recipe), probe


def base_logits(base: Path, input_ids):
    """The untrained base model's logits (fp32): what a save that lost the training would reload to."""
    import torch
    from transformers import AutoModelForCausalLM

    return logits_of(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32, device_map={"": 0}), input_ids
    )


def assert_learned_and_reloads(metrics: dict, output_dir: Path, probe: Path, base: Path, four_bit: bool = False):
    from safetensors.torch import load_file

    history = losses(metrics)
    assert len(history) == metrics["steps"] > 5
    assert sum(history[-3:]) / 3 < history[0] - 0.5, history
    recorded = load_file(str(probe))
    logits = reloaded_logits(output_dir, recorded["input_ids"], four_bit)
    scale = max(recorded["logits"].abs().max().item(), 1.0)
    # The probe ran in the run's precision (bf16 autocast, or FSDP's bf16 parameters): a reload in the saved dtype
    # differs by bf16 rounding, measured 0.013-0.018 at a logit scale of 3.8 on an H100. A save that lost the
    # training would reload to the base model, which the same tolerance must tell apart.
    # An adapter's base reloads in bf16 (all its compute in bf16, not autocast): measured 0.027 at scale 1.0.
    tolerance = (5e-2 if (output_dir / "adapter_config.json").exists() else 2e-2) * scale
    assert (logits - recorded["logits"]).abs().max().item() <= tolerance
    assert (base_logits(base, recorded["input_ids"]) - recorded["logits"]).abs().max().item() > 3 * tolerance
    ranks = metrics["ranks"]
    assert all(r["cuda_max_allocated_bytes"] > 0 and r["cuda_max_reserved_bytes"] >= r["cuda_max_allocated_bytes"]
               for r in ranks)  # fmt: skip


@pytest.mark.parametrize(("method", "changes"), [("full", {}), ("lora", LORA), ("qlora", QLORA)])
def test_one_gpu_trains_saves_and_reloads(make_recipe, tiny_model, tmp_path, method, changes):
    metrics, out, probe = train_with_probe(make_recipe, tmp_path, method, **changes)
    assert metrics["strategy"] == "single" and metrics["world_size"] == 1
    assert_learned_and_reloads(metrics, out, probe, tiny_model, four_bit=method == "qlora")


WORLD_SIZE_1 = {
    "zero1": {"deepspeed": "zero1"},
    "zero2": {"deepspeed": "zero2"},
    "zero3": {"deepspeed": "zero3"},
    "zero3-cpu-offload": {"deepspeed": "zero3_offload"},
    "zero3-nvme-offload": {"deepspeed": ZERO3_NVME},
    "fsdp1": {"fsdp_version": 1, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}},
    "fsdp2": {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}},
}


@pytest.mark.parametrize("name", list(WORLD_SIZE_1))
def test_every_strategy_over_nccl_at_world_size_1(make_recipe, tiny_model, tmp_path, name):
    """World size 1 over NCCL: the collectives at the end of a run (token counts, rank reports) are the real path
    that killed ZeRO-2 and ZeRO-3 runs after their last step."""
    changes = json.loads(json.dumps(WORLD_SIZE_1[name]).replace('"NVME"', json.dumps(str(tmp_path / "nvme"))))
    if isinstance(changes.get("deepspeed"), dict):
        ds = tmp_path / "ds.json"
        ds.write_text(json.dumps(changes["deepspeed"]))
        changes["deepspeed"] = str(ds)
    if name == "zero3-nvme-offload" and not async_io_builds():
        refused = llmtune("train", make_recipe(name, bf16=True, **changes), "--device", "cuda", timeout=300)
        assert refused.returncode == 2 and "libaio" in refused.stderr, refused.stderr[-3000:]
        pytest.skip("no libaio on this machine: the refusal was checked, NVMe offload did not train")
    metrics, out, probe = train_with_probe(make_recipe, tmp_path, name, **changes)
    expected = name.split("-")[0] if name.startswith("zero") else name
    assert metrics["strategy"] == expected and metrics["world_size"] == 1
    assert_learned_and_reloads(metrics, out, probe, tiny_model)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "gpu-shared", tiny_model)


def shared_gpu_run(workspace, name: str, processes: int, **changes) -> tuple[dict, Path]:
    """Same global batch of 8 either way: one process accumulates 2, two ranks 1 each (fp32, so parity is tight)."""
    path = write_run_recipe(workspace, name, gradient_accumulation_steps=2 // processes, bf16=False, **changes)
    device = "cuda:gloo" if processes > 1 else "cuda"
    result = llmtune("train", path, "--num-processes", processes, "--device", device, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(path), workspace[0] / name


SHARED = {
    "ddp": {},
    "zero2": {"deepspeed": "zero2"},
    "zero3": {"deepspeed": "zero3"},
    "fsdp2": {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}},
}


@pytest.mark.parametrize("name", list(SHARED))
def test_two_ranks_sharing_the_gpu_match_one_process(workspace, name):
    reference, _ = shared_gpu_run(workspace, f"one-{name}", 1)
    metrics, out = shared_gpu_run(workspace, f"two-{name}", 2, **SHARED[name])
    assert metrics["world_size"] == 2 and metrics["strategy"] == name
    assert [r["world_size"] for r in metrics["ranks"]] == [2, 2]
    assert len({r["first_batch"] for r in metrics["ranks"]}) == 2  # distinct data shards
    mine, theirs = losses(metrics), losses(reference)
    assert len(mine) == len(theirs) > 2
    assert max(abs(a - b) for a, b in zip(mine, theirs, strict=True)) < 1e-4, (mine, theirs)
    assert saved_weights(out)


def test_ulysses_on_a_shared_gpu_matches_one_process_in_bf16(workspace):
    """Context parallelism under DeepSpeed (Ulysses) on packed rows, 2 ranks over gloo on one GPU, in bf16: torch's
    varlen kernel attends to each example after DeepSpeed's all-to-all (the CPU rehearsal runs SDPA per example).
    SGD without clipping, so a gradient of the wrong scale would show; bf16, so the tolerance is bf16's."""
    changes = {"sample_packing": True, "bf16": True, "optimizer": "sgd", "max_grad_norm": 0, "learning_rate": 0.5,
               "micro_batch_size": 1, "gradient_accumulation_steps": 2, "max_steps": 4}  # fmt: skip
    runs = {}
    for name, processes, extra in (("ulysses-one", 1, {}),
                                   ("ulysses-two", 2, {"deepspeed": "zero2", "context_parallel_size": 2})):  # fmt: skip
        path = write_run_recipe(workspace, name, **changes, **extra)
        result = llmtune("train", path, "--num-processes", processes, "--device",
                         "cuda:gloo" if processes > 1 else "cuda", timeout=900)  # fmt: skip
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = read_metrics(path)
    plan = json.loads((workspace[0] / "ulysses-two" / "llmtune" / "plan.json").read_text())["plan"]
    assert plan["kernels"]["batches"]["layout"] == "sequence-split"
    assert plan["kernels"]["batches"]["kernel"] == "torch_varlen"
    ranks = runs["ulysses-two"]["ranks"]
    assert all(r["sequence_parallel"]["wrapper"] == "uattn_wrapper" for r in ranks)
    mine, theirs = losses(runs["ulysses-two"]), losses(runs["ulysses-one"])
    assert len(mine) == len(theirs) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(mine, theirs, strict=True)) < 2e-2, (mine, theirs)


def test_a_pipeline_on_a_shared_gpu_is_refused_with_the_reason(workspace):
    path = write_run_recipe(workspace, "pipe", pipeline_parallel_size=2)
    result = llmtune("train", path, "--num-processes", 2, "--device", "cuda:gloo", timeout=300)
    assert result.returncode == 2
    assert "send/recv, which gloo cannot do on CUDA tensors" in result.stderr


COLLECTIVES_SCRIPT = """
import json, os, sys, torch, torch.distributed as dist
from llmtune.train.runtime import collectives
dist.init_process_group("gloo")
collectives.configure("cuda", int(os.environ["LOCAL_RANK"]))
summed = collectives.sum_values([1.0])[0]
try:
    collectives.all_reduce(torch.ones(1))
    refused = False
except collectives.MisplacedTensor:
    refused = True
print(json.dumps({"rank": dist.get_rank(), "summed": summed, "cpu_refused": refused,
                  "device": str(collectives.device())}), flush=True)
collectives.teardown()
"""


def test_a_cpu_tensor_fails_on_a_gpu_plan_even_under_gloo(tmp_path):
    script = tmp_path / "collectives.py"
    script.write_text(COLLECTIVES_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             "29641", str(script)], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    assert all(r["summed"] == 2.0 and r["cpu_refused"] and r["device"] == "cuda:0" for r in reports)


def test_kill_9_mid_run_then_resume(make_recipe):
    """SIGKILL right after checkpoint 6 (ZeRO-3 over NCCL), then the same command resumes and finishes."""
    changes = {"deepspeed": "zero3", "bf16": True, "num_epochs": 2, "save_strategy": "steps", "save_steps": 6}
    recipe = make_recipe("killed", **changes)
    out = output_of(recipe)
    killed = llmtune("train", recipe, "--device", "cuda", env={"LLMTUNE_TEST_EXIT_AFTER_STEP": "6"}, timeout=900)
    assert killed.returncode != 0 and "signal 9" in killed.stderr, killed.stderr[-3000:]
    assert (out / "checkpoint-6" / "llmtune-complete.json").is_file() and not (out / "metrics.json").exists()
    resumed = llmtune("train", recipe, "--device", "cuda", timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    metrics = read_metrics(recipe)
    assert metrics["resumed_from"] == str(out / "checkpoint-6") and metrics["steps"] == 12
    # the history carries the killed run's steps 1-6 from the checkpoint, then the resumed run's own 7-12
    assert sorted(e["step"] for e in metrics["log_history"] if "loss" in e) == list(range(1, 13))
    assert f"resuming from {out / 'checkpoint-6'}" in resumed.stderr


def test_merge_eval_and_infer_on_the_gpu(make_recipe, alpaca_file, tmp_path):
    recipe = make_recipe("post", bf16=True, **LORA)
    assert llmtune("train", recipe, "--device", "cuda", timeout=900).returncode == 0
    out = output_of(recipe)
    merged = llmtune("merge", out, timeout=600)
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert (out / "merged" / "config.json").exists()
    evaluated = llmtune("eval", out / "merged", "--data", alpaca_file, timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads(next((out / "merged").rglob("eval.json")).read_text())
    assert 0 < result["eval_loss"] < 20 and result["examples"] > 0  # finite, on real rows
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Repeat the word {w}"}) + "\n" for w in ("apple", "river")))
    answers = tmp_path / "answers.jsonl"
    inferred = llmtune("infer", out, "--file", prompts, "--output", answers, timeout=600)
    assert inferred.returncode == 0, inferred.stderr[-3000:]
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert len(rows) == 2 and all("output" in r for r in rows)


def test_activation_offload_lowers_the_peak(make_recipe, tiny_model, tmp_path):
    """`gradient_checkpointing: offload` on the GPU: the same losses as plain checkpointing (the layers' inputs make
    a round trip through pinned CPU memory, bit for bit), and a lower CUDA peak at a sequence long enough for the
    inputs to matter (layers x tokens x hidden)."""
    runs = {}
    for name, value in (("plain", True), ("offload", "offload")):
        metrics, _, _ = train_with_probe(make_recipe, tmp_path, f"offload-{name}", gradient_checkpointing=value,
                                         sequence_len=1024, pad_to_sequence_len=True, micro_batch_size=8,
                                         max_steps=4)  # fmt: skip
        runs[name] = metrics
    assert losses(runs["offload"]) == losses(runs["plain"])
    peak = {name: m["ranks"][0]["cuda_max_allocated_bytes"] for name, m in runs.items()}
    assert peak["offload"] < peak["plain"], peak


def test_qlora_on_a_mixture_of_experts_trains_with_its_fused_experts_in_bf16(make_recipe, tmp_path):
    """The experts are 3D tensors bitsandbytes leaves unquantized; llmtune keeps them bf16 (peft's k-bit preparation
    made them fp32). On the GPU: the 4-bit attention, the bf16 experts and their fp32 LoRA train together."""
    from tiny import load_tokenizer
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tokenizer = load_tokenizer()
    config = CONFIG_MAPPING["qwen3_moe"](vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                         intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                         num_experts_per_tok=2, max_position_embeddings=256)  # fmt: skip
    base = tmp_path / "moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    tokenizer.save_pretrained(base)
    recipe = make_recipe("qlora-moe", bf16=True, base_model=str(base), learning_rate=1e-2, **QLORA)
    result = llmtune("train", recipe, "--device", "cuda", timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "its fused expert weights" in result.stderr and "stay 16-bit" in result.stderr  # the plan says so
    metrics = read_metrics(recipe)
    trained = losses(metrics)
    assert trained[-1] < trained[0] - 0.3, trained
