"""Activation offloading (`activation_offloading`, Axolotl's `gradient_checkpointing: offload|unsloth`): llmtune
asks transformers' checkpoint offload for it, which holds each checkpointed layer's input in CPU memory (torch's
save_on_cpu around each checkpoint) instead of on the device, with the same gradients."""

from __future__ import annotations

from pathlib import Path

import pytest

LAYERS, HIDDEN = 3, 64


def _model(arguments: dict):
    """A tiny Llama with checkpointing enabled as the Trainer enables it from llmtune's TrainingArguments."""
    import torch
    from tiny import load_tokenizer, tiny_llama_config
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = tiny_llama_config(len(load_tokenizer()), layers=LAYERS, hidden=HIDDEN, heads=4, kv_heads=2,
                               intermediate=128, max_position_embeddings=64)  # fmt: skip
    model = LlamaForCausalLM(config)
    options = dict(arguments["activation_checkpointing_kwargs"])
    model.activation_checkpointing_enable(options, every_n_layers=1, offload=options.pop("offload", False))
    model.train()
    return model


def _step(model):
    """Loss, gradients, and the hidden states (3-D, last dimension hidden) that autograd kept on the model's own
    device: an outer hook sees what no checkpoint offload took first."""
    import torch

    ids = torch.arange(2 * 16).reshape(2, 16) % 100 + 5
    kept = []

    def pack(tensor):
        if tensor.dim() == 3 and tensor.shape[-1] == HIDDEN:
            kept.append(tensor)
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}, kept


def _arguments(**recipe_keys):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.engine.arguments import _checkpointing_arguments

    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                                  **recipe_keys}, Path("r.yaml"), check_files=False).recipe  # fmt: skip
    return _checkpointing_arguments(recipe.gradient_checkpointing, {"use_reentrant": False},
                                    bool(recipe.activation_offloading))  # fmt: skip


@pytest.mark.parametrize(
    "written",
    [
        {"gradient_checkpointing": "offload"},
        {"gradient_checkpointing": "unsloth"},
        {"gradient_checkpointing": True, "activation_offloading": "hidden_states"},
    ],
)
def test_offloaded_checkpoints_keep_the_gradients_and_leave_the_layer_inputs_off_the_device(written, monkeypatch):
    import torch
    import transformers.modeling_utils as modeling

    # transformers pins the host copies, which needs an accelerator: on this CPU-only machine the same offload
    # runs unpinned (on a GPU: tests/gpu/test_gpu.py::test_activation_offload_lowers_the_peak)
    pinned = modeling.save_on_cpu
    monkeypatch.setattr(modeling, "save_on_cpu", lambda pin_memory, device_type: pinned(False, device_type))

    plain = _arguments(gradient_checkpointing=True)
    offloaded = _arguments(**written)
    assert offloaded["activation_checkpointing_kwargs"] == {"use_reentrant": False, "offload": True}
    assert "offload" not in plain["activation_checkpointing_kwargs"]
    loss, grads, kept = _step(_model(plain))
    offloaded_loss, offloaded_grads, offloaded_kept = _step(_model(offloaded))
    assert offloaded_loss == loss
    for name, grad in grads.items():
        torch.testing.assert_close(offloaded_grads[name], grad, rtol=0, atol=0, msg=name)
    # without the offload every checkpointed layer's input reaches the outer hook; with it, none does
    assert len(kept) - len(offloaded_kept) == LAYERS


def test_offloading_without_checkpointing_is_one_line():
    from llmtune.errors import UserError
    from llmtune.recipe.loader import recipe_from_mapping

    with pytest.raises(UserError, match="activation_offloading: true moves what checkpointed layers keep: set "
                                        "gradient_checkpointing: true"):  # fmt: skip
        recipe_from_mapping({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                             "activation_offloading": True}, Path("r.yaml"), check_files=False)  # fmt: skip


def test_offload_disk_is_read_as_cpu_memory_and_said_so():
    from llmtune.recipe.loader import recipe_from_mapping

    loaded = recipe_from_mapping({"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                                  "gradient_checkpointing": "offload_disk"}, Path("r.yaml"), check_files=False)  # fmt: skip
    assert loaded.recipe.gradient_checkpointing is True and loaded.recipe.activation_offloading == "disk"
    assert any("to CPU memory: llmtune has no disk offload" in note for note in loaded.notes)


def test_the_estimate_moves_the_layer_inputs_to_cpu_memory():
    """Offloaded, a GPU keeps one layer's input (the one backward brought back) instead of every layer's; each
    process's layer inputs are counted in the machine's CPU memory."""
    from llmtune.plan.memory.facts import ModelFacts
    from llmtune.plan.memory.peak import estimate
    from llmtune.recipe.loader import recipe_from_mapping

    facts = ModelFacts("llama", 4096, 32, 32, 8, 14336, 49152, False)
    keys = {"base_model": "m", "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "bf16": True, "sequence_len": 4096,
            "micro_batch_size": 2}  # fmt: skip

    def rows(**changes):
        recipe = recipe_from_mapping({**keys, **changes}, Path("r.yaml"), check_files=False).recipe
        return {row.strategy: row for row in estimate(recipe, facts, data_parallel=8, gpus_per_machine=8)}

    plain, offloaded = rows(gradient_checkpointing=True), rows(gradient_checkpointing="offload")
    tokens = 2 * 4096
    # the residual stream's width: fp32 under autocast over fp32 weights, bf16 in the engines' 16-bit layout
    for name, width in (("single / DDP", 4), ("ZeRO-3", 2), ("FSDP full shard", 2), ("ZeRO-3 + CPU offload", 2)):
        layer_input = width * 4096 * tokens
        assert plain[name].activations - offloaded[name].activations == pytest.approx(31 * layer_input, rel=1e-6)
        assert offloaded[name].cpu - plain[name].cpu == pytest.approx(8 * 32 * layer_input, rel=1e-6)
        assert offloaded[name].total <= plain[name].total
        if plain[name].peak_at != "step":  # the optimizer step's peak holds no activations
            assert offloaded[name].total < plain[name].total
    assert plain["ZeRO-3"].peak_at == "loss"
