"""qat: the schemes the recipe accepts, what the plan says, and the NVFP4 fake quantization llmtune emulates."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from llmtune.errors import UserError
from llmtune.recipe.qat import SCHEMES, Qat
from llmtune.train.model import qat as qat_train


def test_axolotl_spellings_and_defaults():
    assert Qat.model_validate({"weight_dtype": "fp8", "activation_dtype": "float8"}).weight_dtype == "float8_e4m3fn"
    default = Qat.model_validate({"weight_dtype": "int4"})
    assert default.group_size is None and default.activation_dtype is None and default.block == 32  # Axolotl: 32
    assert Qat.model_validate({"weight_dtype": "nvfp4"}).block == 16
    assert Qat.model_validate({"weight_dtype": "mxfp4", "activation_dtype": "mxfp4"}).block == 32


@pytest.mark.parametrize(("activation", "weight"), list(SCHEMES))
def test_every_scheme_builds_and_runs_a_forward(activation, weight):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    x = torch.randn(4, 32)
    plain = model(x)
    report = qat_train.prepare(model, Qat.model_validate({"activation_dtype": activation, "weight_dtype": weight}))
    assert sum(report["modules"].values()) == report["linear_layers"] == 2
    out = model(x)
    assert out.shape == plain.shape and torch.isfinite(out).all()
    assert not torch.equal(out, plain)  # the forward is fake-quantized
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    qat_train.set_fake_quant(model, False)
    assert torch.allclose(model(x), plain)  # switched off, the same forward as before


def test_group_size_that_does_not_divide_a_layer_is_a_user_error():
    model = nn.Sequential(nn.Linear(48, 32))
    with pytest.raises(UserError) as err:
        qat_train.prepare(model, Qat.model_validate({"weight_dtype": "int4", "group_size": 32}))
    assert "qat.group_size" in err.value.one_line() and "0 has rows of 48" in err.value.one_line()


def test_nvfp4_round_trip_is_fp4_values_in_scaled_blocks_of_16():
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    q = qat_train.nvfp4_round_trip(w)
    assert q.shape == w.shape and not torch.equal(q, w)
    assert (q - w).abs().mean() < 0.15 * w.abs().mean()
    # within a block of 16, every value is a scale times one of FP4 e2m1's eight magnitudes
    for block in q.reshape(-1, 16):
        scale = block.abs().max() / 6
        magnitudes = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
        ratio = block.abs() / scale
        assert torch.min((ratio[:, None] - magnitudes[None]).abs(), dim=1).values.max() < 0.13  # fp8 scale rounding


def test_nvfp4_linear_is_straight_through():
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    reference = nn.Linear(32, 16)
    reference.load_state_dict(linear.state_dict())
    qat_train.EmulatedNVFP4Linear.from_linear(linear, quantize_inputs=True)
    x = torch.randn(3, 5, 32, requires_grad=True)
    out = linear(x)
    xq, wq = qat_train.nvfp4_round_trip(x.detach()), qat_train.nvfp4_round_trip(reference.weight.detach())
    assert torch.allclose(out, nn.functional.linear(xq, wq, reference.bias), atol=1e-6)
    grad = torch.randn_like(out)
    out.backward(grad)
    flat_grad = grad.reshape(-1, 16)
    assert torch.allclose(linear.weight.grad, flat_grad.T @ xq.reshape(-1, 32), atol=1e-5)
    assert torch.allclose(x.grad, grad @ wq, atol=1e-5)
    assert set(linear.state_dict()) == {"weight", "bias"}
