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
