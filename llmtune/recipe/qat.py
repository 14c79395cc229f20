"""Quantization-aware training (`qat:`), with Axolotl's keys and the dtype pairs torchao fake-quantizes.

Pure and torch-free: the schema validates with it and the planner describes it; train/model/qat.py applies it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section

DTYPES = ("int4", "int8", "float8_e4m3fn", "nvfp4", "mxfp4")
DTYPE_ALIASES = {"fp8": "float8_e4m3fn", "float8": "float8_e4m3fn"}
# (activation_dtype, weight_dtype) -> what is fake-quantized; None: weights only
SCHEMES = {
    (None, "int4"): "int4 weights in groups of {g}",
    ("int8", "int4"): "int8 per-token activations, int4 weights in groups of {g}",
    ("float8_e4m3fn", "int4"): "float8 activations, int4 weights in groups of {g}",
    ("float8_e4m3fn", "float8_e4m3fn"): "float8 activations and weights",
    (None, "nvfp4"): "NVFP4 weights (blocks of 16)",
    ("nvfp4", "nvfp4"): "NVFP4 activations and weights (blocks of 16)",
    (None, "mxfp4"): "MXFP4 activations and weights (blocks of 32; torchao has no weight-only MX QAT)",
    ("mxfp4", "mxfp4"): "MXFP4 activations and weights (blocks of 32)",
}
FIXED_BLOCK = {"nvfp4": 16, "mxfp4": 32}
INSTALL_HINT = "pip install 'llmtune[qat]'"


class Qat(Section):
    activation_dtype: Literal[DTYPES] | None = Field(  # type: ignore[valid-type]
        None, description="Fake-quantize the inputs of each linear layer: int8 (per token), float8_e4m3fn (fp8), "
        "nvfp4 or mxfp4; empty: weights only.",
    )  # fmt: skip
    weight_dtype: Literal[DTYPES] = Field("int8", description="Fake-quantize the weights: int4, float8_e4m3fn, "  # type: ignore[valid-type]
                                          "nvfp4 or mxfp4 (int8 weights only is not a torchao QAT scheme).")  # fmt: skip
    group_size: int | None = Field(None, gt=0, description="Elements per quantization group of int4 weights "
                                   "(default 32; nvfp4 uses 16, mxfp4 32).")  # fmt: skip
    quantize_embedding: bool = Field(False, description="Fake-quantize the input embeddings' weights too.")
    fake_quant_after_n_steps: int | None = Field(
        None, ge=0, description="Train in full precision for this many optimizer steps, then fake-quantize."
    )

    @field_validator("activation_dtype", "weight_dtype", mode="before")
    @classmethod
    def _alias(cls, value):
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _scheme(self):
        pair = (self.activation_dtype, self.weight_dtype)
        if pair not in SCHEMES:
            known = ", ".join(f"{a or 'none'}/{w}" for a, w in SCHEMES)
            raise ValueError(f"qat: activation_dtype {self.activation_dtype or 'none'} with weight_dtype "
                             f"{self.weight_dtype} is not a scheme torchao fake-quantizes; use one of (activations/"
                             f"weights) {known}")  # fmt: skip
        block = FIXED_BLOCK.get(self.weight_dtype)
        if block and self.group_size not in (None, block):
            raise ValueError(f"qat: {self.weight_dtype} uses blocks of {block}; group_size {self.group_size} can't be "
                             f"used (set group_size: {block} or leave it out)")  # fmt: skip
        if self.quantize_embedding and self.weight_dtype not in ("int4",):
            raise ValueError(f"qat: quantize_embedding fake-quantizes embeddings as int4 weights; with weight_dtype "
                             f"{self.weight_dtype} it is not a torchao scheme (remove quantize_embedding)")  # fmt: skip
        return self

    @property
    def block(self) -> int:
        """Elements per group/block along each row's input dimension (0: per tensor, float8)."""
        if self.weight_dtype == "float8_e4m3fn":
            return 0
        return FIXED_BLOCK.get(self.weight_dtype) or self.group_size or 32

    def describe(self) -> str:
        scheme = SCHEMES[(self.activation_dtype, self.weight_dtype)].format(g=self.block)
        where = "every linear layer" + (" and the input embeddings" if self.quantize_embedding else "")
        start = (f", from optimizer step {self.fake_quant_after_n_steps} on (full precision before)"
                 if self.fake_quant_after_n_steps else "")  # fmt: skip
        return f"quantization-aware training: {scheme}, fake-quantized in {where}{start}"
