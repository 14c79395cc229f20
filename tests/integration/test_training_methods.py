"""Training methods in one process, each checked against a plain run of the same recipe:
- qat: fake quantization really runs in the forward pass from the step the recipe says, and the saved model is a
  plain Hugging Face model whose weights are the trained ones;
- LISA: only the drawn layers change; EAFT: its loss is the one trained (alpha 0 gives the plain loss back)."""

from __future__ import annotations

import pytest
from harness import llmtune, losses, make_workspace, read_metrics, saved_weights, train_run, write_run_recipe

pytestmark = pytest.mark.integration

INT8_INT4 = {"activation_dtype": "int8", "weight_dtype": "int4", "group_size": 32}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_4_layers):
    return make_workspace(tmp_path_factory, "methods", tiny_model_4_layers)


@pytest.fixture(scope="module")
def plain(workspace):
    """The reference: the same recipe with no method."""
    return train_run(workspace, "plain", 1, max_steps=4, lr_scheduler="constant")


def test_fake_quantization_starts_at_the_step_asked_and_changes_the_forward(workspace, plain):
    base = plain[0]
    qat, _ = train_run(workspace, "qat", 1, max_steps=4, lr_scheduler="constant",
                       qat={**INT8_INT4, "fake_quant_after_n_steps": 2})  # fmt: skip
    plain_losses, qat_losses = losses(base), losses(qat)
    assert len(plain_losses) == len(qat_losses) == 4
    # steps 1-2 train in full precision: the same losses as a run without qat, to the last bit of fp32 noise
    assert qat_losses[:2] == pytest.approx(plain_losses[:2], abs=1e-6)
    # from step 3 the forward is fake-quantized: the loss departs although the weights were equal before it
    assert abs(qat_losses[2] - plain_losses[2]) > 1e-4, (qat_losses, plain_losses)
    report = qat["qat"]
    assert report["modules"] == {"FakeQuantizedLinear": report["linear_layers"]} and report["linear_layers"] == 29
    assert report["fake_quant_from_step"] == 2
    assert "int8 per-token activations, int4 weights in groups of 32" in report["scheme"]


@pytest.mark.parametrize(
    ("name", "qat", "module"),
    [("int8-int4", INT8_INT4, "FakeQuantizedLinear"),
     ("nvfp4", {"activation_dtype": "nvfp4", "weight_dtype": "nvfp4", "group_size": 16}, "EmulatedNVFP4Linear")],
)  # fmt: skip
def test_saved_model_is_plain_and_holds_the_trained_weights(workspace, tmp_path, name, qat, module):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from llmtune.recipe.qat import Qat
    from llmtune.train.model import qat as qat_train

    probe = tmp_path / "probe.safetensors"
    path = write_run_recipe(workspace, f"saved-{name}", max_steps=3, qat=qat)
    result = llmtune("train", path, env={"LLMTUNE_PROBE_FILE": str(probe)}, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics, output_dir = read_metrics(path), workspace[0] / f"saved-{name}"
    assert metrics["qat"]["modules"] == {module: 29} and metrics["qat"]["fake_quant_from_step"] == 0
    reloaded = AutoModelForCausalLM.from_pretrained(str(output_dir), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(workspace[2]), dtype=torch.float32)
    assert set(reloaded.state_dict()) == set(base.state_dict())
    assert all(type(m).__module__.startswith(("transformers", "torch")) for m in reloaded.modules())
    assert any(not torch.equal(p, base.state_dict()[k]) for k, p in reloaded.state_dict().items())
    # the in-memory model at the end of training (fake quantization on) = the saved weights, fake-quantized again
    saved = load_file(str(probe))
    qat_train.prepare(reloaded, Qat.model_validate(qat))
    reloaded.eval()
    with torch.no_grad():
        logits = reloaded(input_ids=saved["input_ids"]).logits
    assert (logits - saved["logits"]).abs().max().item() < 1e-4
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(str(output_dir), dtype=torch.float32)(saved["input_ids"]).logits
    assert (plain - saved["logits"]).abs().max().item() > 1e-4  # and fake quantization did change the forward


def test_lisa_trains_only_the_drawn_layers(workspace, plain):
    metrics, output_dir = train_run(workspace, "lisa", 1, max_steps=4, lr_scheduler="constant", lisa_n_layers=1,
                                    lisa_step_interval=2)  # fmt: skip
    draws = metrics["lisa"]["draws"]
    assert metrics["lisa"]["layers"] == 4 and [d["step"] for d in draws] == [0, 2]
    assert all(len(d["layers"]) == 1 for d in draws)
    drawn = {i for d in draws for i in d["layers"]}
    trained, base = saved_weights(output_dir), saved_weights(plain[1])
    from safetensors.torch import load_file

    start = load_file(str(workspace[2] / "model.safetensors"))
    for layer in range(4):
        names = [k for k in start if k.startswith(f"model.layers.{layer}.")]
        changed = any(not torch_equal(trained[k], start[k]) for k in names)
        assert changed == (layer in drawn), (layer, drawn)
    assert not torch_equal(trained["model.embed_tokens.weight"], start["model.embed_tokens.weight"])
    assert not torch_equal(base["model.layers.0.mlp.up_proj.weight"], start["model.layers.0.mlp.up_proj.weight"])


def test_eaft_is_the_loss_trained(workspace, plain):
    neutral, _ = train_run(workspace, "eaft-0", 1, max_steps=4, lr_scheduler="constant", use_eaft=True, eaft_alpha=0)
    weighted, _ = train_run(workspace, "eaft-1", 1, max_steps=4, lr_scheduler="constant", use_eaft=True)
    # alpha 0 weighs every token 1: the plain cross-entropy, step for step
    assert losses(neutral) == pytest.approx(losses(plain[0]), abs=1e-5)
    # alpha 1 weighs by the top-20 entropy (up to ln 20 = 3.0 on a model that knows little): a different loss
    assert abs(losses(weighted)[0] - losses(plain[0])[0]) > 0.1


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_quadratic_warmup_is_the_schedule_the_trainer_steps(workspace):
    metrics, _ = train_run(workspace, "quadratic", 1, max_steps=4, lr_scheduler="cosine", warmup_steps=2,
                           lr_quadratic_warmup=True)  # fmt: skip
    logged = [e["learning_rate"] for e in metrics["log_history"] if "loss" in e]
    # the LR each of steps 0-3 ran with (warm-up 2, peak 1e-3): (0/2)^2, (1/2)^2, then the cosine from 1 at step 2
    # (halfway down at step 3); transformers' linear warm-up would give 0, 5e-4
    assert logged == pytest.approx([0.0, 2.5e-4, 1e-3, 5e-4], abs=1e-9)


def test_muon_on_two_fsdp2_ranks_matches_one_process(workspace, plain):
    muon = {"optimizer": "muon", "learning_rate": 0.02, "weight_decay": 0.01, "max_steps": 4, "lr_scheduler": "constant"}
    single, _ = train_run(workspace, "muon-single", 1, gradient_accumulation_steps=2, **muon)
    fsdp, _ = train_run(workspace, "muon-fsdp2", 2, fsdp_version=2, **muon,
                        fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                                     "state_dict_type": "FULL_STATE_DICT"})  # fmt: skip
    assert all(r["optimizer_class"] == "Muon" for r in single["ranks"] + fsdp["ranks"]), fsdp["ranks"]
    assert all(r["engine"] == "fsdp2" for r in fsdp["ranks"])
    # each rank orthogonalizes the whole matrix from its gathered update, then keeps its rows: as one process does
    assert losses(fsdp) == pytest.approx(losses(single), abs=2e-5)
    assert losses(single)[-1] < losses(single)[0] - 0.5, losses(single)


def test_learning_rate_groups_on_two_fsdp2_ranks_reach_the_parameters_they_name(workspace):
    """lr_groups and embedding_lr_scale under FSDP2 with its activation checkpointing, whose wrapper renames every
    decoder layer's parameters (model.layers.1._checkpoint_wrapped_module.self_attn...): the groups still find the
    names the recipe wrote, and each rank steps them at their own rates (at 1e-30 a weight holds still to the last
    bit while the rest trains, layer 1's norms included)."""
    from safetensors.torch import load_file

    still = ["model.layers.1.self_attn.", "model.layers.1.mlp."]
    metrics, output_dir = train_run(
        workspace, "rate-groups", 2, max_steps=2, lr_scheduler="constant", learning_rate=1e-3, weight_decay=0.01,
        embedding_lr_scale=0.5, lr_groups=[{"name": "still", "modules": still, "lr": 1e-30}],
        fsdp_version=2, fsdp_config={"activation_checkpointing": True, "state_dict_type": "FULL_STATE_DICT"},
    )  # fmt: skip
    ranks = metrics["ranks"]
    assert len(ranks) == 2 and all(r["engine"] == "fsdp2" for r in ranks), ranks
    assert all(r["activation_checkpointing"] == "fsdp" for r in ranks), ranks
    assert all(r["optimizer_peak_rates"] == [1e-30, 5e-4, 1e-3] for r in ranks), ranks
    start, trained = load_file(str(workspace[2] / "model.safetensors")), saved_weights(output_dir)
    for name, weight in start.items():
        assert torch_equal(trained[name], weight) == name.startswith(tuple(still)), name
