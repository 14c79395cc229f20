"""ReLoRA in one process: the LoRA merged and restarted every 2 steps, the restarts in metrics.json, the learning
rate at its floor on each restart step, and the saved adapter (every cycle stacked) reloading to the logits the run
had in memory."""

from __future__ import annotations

import json

import pytest
from harness import LORA, llmtune, make_workspace, read_metrics, write_run_recipe

pytestmark = pytest.mark.integration


def test_relora_restarts_and_the_saved_adapter_is_the_trained_model(tmp_path_factory, tiny_model, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    workspace = make_workspace(tmp_path_factory, "relora", tiny_model)
    path = write_run_recipe(workspace, "relora", **LORA, max_steps=7, learning_rate=1e-2, lr_scheduler="constant",
                            logging_steps=1, relora=True, jagged_restart_steps=2, jagged_restart_warmup_steps=1,
                            jagged_restart_anneal_steps=1)  # fmt: skip
    probe = tmp_path / "probe.safetensors"
    result = llmtune("train", path, env={"LLMTUNE_PROBE_FILE": str(probe)}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics, output_dir = read_metrics(path), workspace[0] / "relora"

    relora = metrics["relora"]
    assert [r["step"] for r in relora["restarts"]] == [2, 4, 6]  # at the start of steps 3, 5 and 7
    assert all(r["delta_norm"] > 0 for r in relora["restarts"])
    assert relora["saved_rank"] == 8 * 4 and relora["prune"] == {"method": "magnitude", "ratio": 0.9}
    assert sorted(p.name for p in (output_dir / "relora").iterdir()) == [
        f"restart-0000000{s}.safetensors" for s in (2, 4, 6)
    ]
    # the LR each step ran at (the Trainer logs it with the step): the floor, 0.001 of 1e-2, on the steps that begin
    # with a restart; the whole rate on the others (warm-up and anneal of 1 step in a cycle of 2)
    rates = [e["learning_rate"] for e in metrics["log_history"] if "learning_rate" in e]
    assert rates == pytest.approx([1e-2, 1e-2, 1e-5, 1e-2, 1e-5, 1e-2, 1e-5]), rates

    config = json.loads((output_dir / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (32, 64)
    saved = load_file(str(probe))
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(output_dir)).eval()
    with torch.no_grad():
        reloaded = model(input_ids=saved["input_ids"]).logits
    assert (reloaded - saved["logits"]).abs().max().item() < 1e-4


def test_relora_on_a_4bit_base_with_an_8bit_optimizer_runs_as_axolotl_s_example(tmp_path_factory, tiny_model, tmp_path):
    """Axolotl's llama-2/relora.yml: adapter qlora, adamw_bnb_8bit. The restarts requantize the 4-bit base and prune
    the optimizer state; the stacked adapter on the 16-bit base is the model the run trained, up to the 4-bit rounding
    the run had. (The tiny adapter's tensors are under bitsandbytes' min_8bit_size, so their state is 32-bit here;
    tests/unit/test_relora.py prunes 8-bit state.)"""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    workspace = make_workspace(tmp_path_factory, "relora-qlora", tiny_model)
    path = write_run_recipe(workspace, "relora-qlora", adapter="qlora", load_in_4bit=True, lora_r=8, lora_alpha=16,
                            lora_target_linear=True, optimizer="adamw_bnb_8bit", max_steps=5, learning_rate=1e-2,
                            lr_scheduler="constant", logging_steps=1, relora=True, jagged_restart_steps=2,
                            jagged_restart_warmup_steps=1, jagged_restart_anneal_steps=1)  # fmt: skip
    probe = tmp_path / "probe.safetensors"
    result = llmtune("train", path, env={"LLMTUNE_PROBE_FILE": str(probe)}, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics, output_dir = read_metrics(path), workspace[0] / "relora-qlora"
    relora = metrics["relora"]
    assert [r["step"] for r in relora["restarts"]] == [2, 4] and all(r["delta_norm"] > 0 for r in relora["restarts"])
    assert relora["saved_rank"] == 8 * 3
    saved = load_file(str(probe))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    with torch.no_grad():
        untrained = base(input_ids=saved["input_ids"]).logits
        stacked = PeftModel.from_pretrained(base, str(output_dir)).eval()(input_ids=saved["input_ids"]).logits
    off, moved = (stacked - saved["logits"]).abs().mean().item(), (untrained - saved["logits"]).abs().mean().item()
    assert off < 0.25 * moved, (off, moved)  # the trained model, not the base: what differs is the 4-bit rounding
