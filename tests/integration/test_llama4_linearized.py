"""llama4_linearized_experts end to end on a tiny Llama 4 with a fused checkpoint (as transformers saves it):
LoRA reaches every routed expert; FSDP2 on 2 ranks matches one process; `llmtune merge` folds the per-expert LoRA
back into the fused tensors, so the merged model is a plain Llama 4 giving the adapter's logits; infer runs."""

from __future__ import annotations

import pytest
from harness import llmtune, losses, make_workspace, train_run

pytestmark = pytest.mark.integration

TARGETS = ["self_attn.q_proj", "self_attn.v_proj", "shared_expert.gate_proj", "experts.gate_projs.[0-9]+$",
           "experts.up_projs.[0-9]+$", "experts.down_projs.[0-9]+$"]  # fmt: skip
RECIPE = {"llama4_linearized_experts": True, "model_type": "Llama4ForConditionalGeneration", "adapter": "lora",
          "lora_r": 8, "lora_alpha": 16, "lora_target_modules": TARGETS, "max_steps": 3, "lr_scheduler": "constant"}  # fmt: skip
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"transformer_layer_cls_to_wrap": "Llama4TextDecoderLayer",
                                            "state_dict_type": "FULL_STATE_DICT"}}  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_linearize import tiny_llama4
    from tiny import load_tokenizer

    models = tmp_path_factory.mktemp("llama4-model")
    tiny_llama4(models / "fused")
    load_tokenizer().save_pretrained(str(models / "fused"))
    return make_workspace(tmp_path_factory, "llama4", models / "fused")


@pytest.fixture(scope="module")
def single(workspace):
    return train_run(workspace, "single", 1, gradient_accumulation_steps=2, **RECIPE)


def test_two_fsdp2_ranks_match_one_process_with_lora_on_every_expert(workspace, single):
    from safetensors import safe_open

    metrics, output_dir = single
    fsdp, _ = train_run(workspace, "fsdp2", 2, **RECIPE, **FSDP2)
    assert fsdp["world_size"] == 2 and all(r["engine"] == "fsdp2" for r in fsdp["ranks"]), fsdp["ranks"]
    assert losses(fsdp) == pytest.approx(losses(metrics), abs=2e-5)
    with safe_open(str(output_dir / "adapter_model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
    for projection in ("gate_projs", "up_projs", "down_projs"):
        assert sum(f"experts.{projection}." in k and "lora_B" in k for k in keys) == 4 * 2  # 4 experts x 2 layers


def test_merge_folds_expert_lora_into_the_fused_tensors(workspace, single, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmtune.train.model import linearize

    _, output_dir = single
    merged = tmp_path / "merged"
    result = llmtune("merge", output_dir, "--output", merged)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "30 LoRA modules folded in" in result.stdout  # per layer: q, v, shared gate + 4 experts x (gate, up, down)
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert type(plain.model.layers[0].feed_forward.experts).__name__ == "Llama4TextExperts"
    with linearize.linear_experts(plain.config):
        base = AutoModelForCausalLM.from_pretrained(str(workspace[2]))
    linearize.fill_from_fused(base, str(workspace[2]), None, False, lambda _: None)
    adapted = PeftModel.from_pretrained(base, str(output_dir)).eval()
    ids = torch.tensor([[1, 20, 35, 8, 77, 12, 5, 9]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5)
    infer = llmtune("infer", output_dir, "--prompt", "Repeat apple", "--max-new-tokens", "4")
    assert infer.returncode == 0 and '"output"' in infer.stdout, infer.stderr[-2000:]


def test_a_full_fine_tune_saved_linear_loads_linear_and_merges_back_fused(workspace, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.model import linearize

    recipe = {k: v for k, v in RECIPE.items() if not k.startswith(("adapter", "lora_"))}
    _, output_dir = train_run(workspace, "full", 1, **{**recipe, "max_steps": 2})
    assert linearize.saved_linear(output_dir)  # the run's own folder keeps the layout it trained in
    trained = linearize.from_pretrained(AutoModelForCausalLM, str(output_dir), None).eval()
    assert type(trained.model.layers[0].feed_forward.experts).__name__ == "LinearizedExperts"
    merged = tmp_path / "merged"
    result = llmtune("merge", output_dir, "--output", merged)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not linearize.saved_linear(merged)
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()  # plain transformers, fused experts
    ids = torch.tensor([[1, 20, 35, 8, 77, 12, 5, 9]])
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, trained(input_ids=ids).logits, atol=1e-5)
    infer = llmtune("infer", output_dir, "--prompt", "Repeat apple", "--max-new-tokens", "4")
    assert infer.returncode == 0 and '"output"' in infer.stdout, infer.stderr[-2000:]
