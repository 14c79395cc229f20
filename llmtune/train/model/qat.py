"""Quantization-aware training: torchao's fake quantization in the forward pass, full-precision weights trained.

The linear layers (and, with quantize_embedding, the input embeddings) are swapped for fake-quantized ones before
the model is wrapped (DDP, FSDP, DeepSpeed): each forward rounds weights (and activations) to the target format and
back, and the gradient passes straight through. The swapped modules keep the parameter names, so the saved model is
a plain Hugging Face folder with full-precision weights that have learnt to survive that rounding.

NVFP4: torchao's own module computes its forward with NVFP4 matmuls, which only Blackwell GPUs have. Here the
forward rounds with torchao's NVFP4 quantizer and multiplies the dequantized values in high precision (the numerics
torchao's backward already uses), so NVFP4 QAT also runs on Hopper, older GPUs and CPU rehearsal.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import TrainerCallback

from llmtune.errors import UserError
from llmtune.recipe.qat import INSTALL_HINT, Qat


def _torchao():
    try:
        import torchao
    except ImportError:
        raise UserError("qat: needs torchao, which is not installed here", INSTALL_HINT) from None
    return torchao


def nvfp4_round_trip(tensor: torch.Tensor) -> torch.Tensor:
    """Round to NVFP4 along the last dimension (blocks of 16, e4m3 block scales under one fp32 scale) and back."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    flat = tensor.reshape(-1, tensor.shape[-1]).contiguous()
    scale = per_tensor_amax_to_scale(torch.max(torch.abs(flat)).float())
    quantized = NVFP4Tensor.to_nvfp4(flat, block_size=16, per_tensor_scale=scale)
    return quantized.dequantize(tensor.dtype).reshape(tensor.shape)


def _straight_through(tensor: torch.Tensor) -> torch.Tensor:
    """The NVFP4 values forward, the identity backward."""
    return tensor + (nvfp4_round_trip(tensor.detach()) - tensor.detach())


class EmulatedNVFP4Linear(nn.Linear):
    """A linear layer whose forward sees NVFP4-rounded weights (and inputs), computed in high precision."""

    fake_quant_enabled = True
    quantize_inputs = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, quantize_inputs: bool) -> EmulatedNVFP4Linear:
        linear.__class__ = cls  # same parameters, same names: nothing is copied
        linear.quantize_inputs = quantize_inputs
        return linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fake_quant_enabled:
            return F.linear(x, self.weight, self.bias)
        weight = _straight_through(self.weight)
        if self.quantize_inputs:
            x = _straight_through(x)
        return F.linear(x, weight.to(x.dtype), self.bias)


def _pausable_mx():
    from torchao.prototype.qat.mx import MXFakeQuantizedLinear, _MXQuantizedForwardFakeQuantizedBackward

    class PausableMXLinear(MXFakeQuantizedLinear):
        """torchao's MX fake-quantized linear with a switch (fake_quant_after_n_steps), and its bias added outside
        torchao's autograd function, whose backward returns no bias gradient (the bias would silently not train)."""

        fake_quant_enabled = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.fake_quant_enabled:
                return F.linear(x, self.weight, self.bias)
            out = _MXQuantizedForwardFakeQuantizedBackward.apply(
                x, self.weight, None, self.activation_config, self.weight_config
            )
            return out if self.bias is None else out + self.bias

    return PausableMXLinear


def _linear_config(qat: Qat):
    """torchao's QATConfig for the linear layers (None for NVFP4, which llmtune emulates itself)."""
    from torchao.quantization.qat import Float8FakeQuantizeConfig, IntxFakeQuantizeConfig, QATConfig

    # not exported by torchao.quantization.qat (0.18): see docs/private-api.md
    from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig

    act, weight = qat.activation_dtype, qat.weight_dtype
    if weight == "nvfp4":
        return None
    if weight == "mxfp4":
        from torchao.prototype.qat import MXFakeQuantizeConfig

        mx = MXFakeQuantizeConfig(dtype=torch.float4_e2m1fn_x2, block_size=qat.block)
        return QATConfig(activation_config=mx, weight_config=mx)
    if weight == "float8_e4m3fn":
        fp8 = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
        return QATConfig(activation_config=fp8, weight_config=fp8)
    # int4 weights; the activation dtype the int4 kernel will run against
    kernel_activation = {"int8": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}.get(act)
    weights = Int4WeightFakeQuantizeConfig(
        group_size=qat.block, **({"activation_dtype": kernel_activation} if kernel_activation else {})
    )
    activations = None
    if act == "int8":
        activations = IntxFakeQuantizeConfig(dtype=torch.int8, granularity="per_token", is_symmetric=False)
    elif act == "float8_e4m3fn":
        activations = Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fn)
    return QATConfig(weight_config=weights, activation_config=activations)


def check_shapes(model: nn.Module, qat: Qat) -> None:
    """Every fake-quantized row splits into whole groups; torchao would fail deep inside a forward otherwise."""
    block = qat.block
    if not block:
        return
    for name, module in model.named_modules():
        width = None
        if isinstance(module, nn.Linear):
            width = module.in_features
        elif qat.quantize_embedding and isinstance(module, nn.Embedding):
            width = module.embedding_dim
        if width is not None and width % block:
            key = "group_size" if qat.weight_dtype == "int4" else "weight_dtype"
            raise UserError(f"qat.{key}: {name} has rows of {width} elements, not a multiple of {block} "
                            f"({qat.weight_dtype} groups)",
                            "choose a group_size that divides every layer's input width")  # fmt: skip


def prepare(model: nn.Module, qat: Qat) -> dict:
    """Swap in the fake-quantized modules; returns what was swapped (recorded in metrics.json)."""
    torchao = _torchao()
    from torchao.quantization import quantize_

    check_shapes(model, qat)
    config = _linear_config(qat)
    if config is None:
        for module in list(model.modules()):
            if type(module) is nn.Linear:
                EmulatedNVFP4Linear.from_linear(module, quantize_inputs=qat.activation_dtype == "nvfp4")
    else:
        quantize_(model, config)
        if qat.weight_dtype == "mxfp4":
            pausable = _pausable_mx()
            for module in model.modules():
                if type(module).__name__ == "MXFakeQuantizedLinear":
                    module.__class__ = pausable
    if qat.quantize_embedding:
        from torchao.quantization.qat import QATConfig
        from torchao.quantization.qat.fake_quantize_config import Int4WeightFakeQuantizeConfig

        embedding = QATConfig(weight_config=Int4WeightFakeQuantizeConfig(group_size=qat.block))
        quantize_(model, embedding, filter_fn=lambda module, _: isinstance(module, nn.Embedding))
    kinds: dict[str, int] = {}
    for module in model.modules():
        if is_fake_quantized(module):
            kinds[type(module).__name__] = kinds.get(type(module).__name__, 0) + 1
    return {"scheme": qat.describe(), "modules": kinds, "torchao": torchao.__version__,
            "linear_layers": sum(isinstance(m, nn.Linear) for m in model.modules())}  # fmt: skip


def is_fake_quantized(module: nn.Module) -> bool:
    return hasattr(module, "weight_fake_quantizer") or hasattr(module, "fake_quant_enabled")


def set_fake_quant(model: nn.Module, enabled: bool) -> None:
    for module in model.modules():
        if hasattr(module, "fake_quant_enabled"):
            module.fake_quant_enabled = enabled
        for name in ("weight_fake_quantizer", "activation_fake_quantizer"):
            quantizer = getattr(module, name, None)
            if quantizer is not None and hasattr(quantizer, "enabled"):
                quantizer.enabled = enabled


class DelayedFakeQuant(TrainerCallback):
    """fake_quant_after_n_steps: full precision for the first n optimizer steps (resumed runs included)."""

    def __init__(self, after_steps: int):
        self.after_steps = after_steps
        self.enabled: bool | None = None
        self.enabled_at: int | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        wanted = state.global_step >= self.after_steps
        if wanted != self.enabled:
            set_fake_quant(model, wanted)
            self.enabled = wanted
            if wanted:
                self.enabled_at = state.global_step
