"""Recipe keys about LoRA / QLoRA adapters and weight quantization."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none


class AdapterKeys(Section):
    adapter: Literal["lora", "qlora"] | None = Field(
        None, description="lora, qlora (LoRA on a 4-bit base), or empty for a full fine-tune."
    )
    lora_r: int = Field(8, gt=0, description="LoRA rank.")
    lora_alpha: int = Field(16, gt=0, description="LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r)).")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    lora_target_modules: list[str] | str | None = Field(
        None, description="Module names to adapt (list), or a regex (string). Default: the model family's usual set."
    )
    lora_target_linear: bool | None = Field(None, description="Adapt every linear layer except the output head.")
    lora_modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full and saved with the adapter (e.g. embed_tokens, lm_head)."
    )
    lora_fan_in_fan_out: bool = Field(False, description="Weights stored as (fan_in, fan_out), as in GPT-2's Conv1D.")
    peft_use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    peft_use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    peft_layers_to_transform: list[int] | None = Field(None, description="Only adapt these layer indices.")
    lora_model_dir: str | None = Field(None, description="An existing adapter folder to continue training from.")
    load_in_4bit: bool = Field(False, description="Load the base weights in 4-bit NF4 (bitsandbytes); for qlora.")
    load_in_8bit: bool = Field(False, description="Load the base weights in 8-bit (bitsandbytes); with lora.")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantize the quantization constants too.")

    @field_validator("adapter", "lora_target_modules", "lora_modules_to_save", "lora_model_dir", mode="before")
    @classmethod
    def _empty(cls, value):
        return empty_to_none(value)

    @model_validator(mode="after")
    def _adapter_rules(self):
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both true; choose one")
        if self.adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("adapter: qlora needs load_in_4bit: true (QLoRA trains LoRA on a 4-bit base)")
        if self.adapter is None and (self.load_in_4bit or self.load_in_8bit):
            raise ValueError(
                "load_in_4bit/load_in_8bit need an adapter (lora or qlora): quantized weights can't be trained in full"
            )
        if self.adapter is None and self.lora_model_dir:
            raise ValueError("lora_model_dir is set but adapter is empty; set adapter: lora")
        return self
