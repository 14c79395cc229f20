"""Recipe keys about LoRA / QLoRA adapters, weight quantization and which parameters train."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none
from llmtune.recipe.qat import Qat

UNFROZEN_RANGE = re.compile(r"^(.+)\[([0-9]*)(?::([0-9]*))?\]$")


def names_module(path: str, name: str) -> bool:
    """peft's trainable-token module keys: `path` is the module `name`, or ends with it at a dot (as peft matches a
    key against a module's path)."""
    return path == name or path.endswith(f".{name}")


def unfrozen_pattern(pattern: str) -> tuple[re.Pattern, tuple[int | None, int | None] | None]:
    """Axolotl's reading of an unfrozen_parameters entry: a regex matched from the start of the parameter name,
    where '.' is a literal dot unless followed by '+', and an optional trailing [start:end] row range."""
    rows = None
    found = UNFROZEN_RANGE.match(pattern)
    if found:
        pattern = found.group(1)
        start, end = found.group(2), found.group(3)
        rows = (int(start) if start else None, int(end) if end else None)
    return re.compile(re.sub(r"\.(?!\+)", "\\.", pattern)), rows


class LoftQ(Section):
    loftq_bits: Literal[2, 4, 8] = Field(4, description="Bits of the quantized base LoftQ initialises against.")


class PeftOptions(Section):
    loftq_config: LoftQ | None = Field(None, description="Initialise LoRA with LoftQ (for a base quantized later).")


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
    lora_target_linear: bool | None = Field(
        None, description="Adapt every linear layer except the output head, and with them the modules "
        "lora_target_modules lists (e.g. lm_head, embed_tokens), as Axolotl does.",
    )  # fmt: skip
    lora_modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full and saved with the adapter (e.g. embed_tokens, lm_head)."
    )
    lora_fan_in_fan_out: bool = Field(False, description="Weights stored as (fan_in, fan_out), as in GPT-2's Conv1D.")
    peft_use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA).")
    peft_use_rslora: bool = Field(False, description="Rank-stabilised LoRA: scale by alpha / sqrt(r).")
    peft_layers_to_transform: list[int] | None = Field(None, description="Only adapt these layer indices.")
    peft_layers_pattern: list[str] | str | None = Field(
        None, description="The name of the layer list peft_layers_to_transform indexes (peft's layers_pattern)."
    )
    lora_rank_pattern: dict[str, int] | None = Field(
        None, description="Per-module ranks by name or regex, e.g. {'.*down_proj': 32} (peft's rank_pattern); the "
        "estimate counts lora_r everywhere.",
    )  # fmt: skip
    lora_alpha_pattern: dict[str, float] | None = Field(
        None, description="Per-module alphas by name or regex (peft's alpha_pattern)."
    )
    peft_init_lora_weights: bool | Literal["gaussian"] | None = Field(
        None, description="How LoRA starts: true (B zero, A Kaiming: the default), gaussian, or false (random: "
        "the adapter changes the model from step 0). Inits that rewrite the base weights or need data (pissa, "
        "olora, eva, corda) are refused: the saved adapter fits only their modified base.",
    )  # fmt: skip
    peft_ensure_weight_tying: bool | None = Field(
        None, description="Keep a tied embedding and output head tied when both are adapted or trained (peft's)."
    )
    peft_trainable_token_indices: list[int] | dict[str, list[int]] | None = Field(
        None, description="Train only these rows of the embeddings beside LoRA (peft's trainable tokens): a list "
        "for the input embedding (a tied output head follows it), or {module: [ids]}, e.g. {embed_tokens: [ids], "
        "lm_head: [ids]} for an untied head. Covers tokens the recipe adds instead of lora_modules_to_save; "
        "llmtune merge writes the trained rows into the embedding. Not with ZeRO-3.",
    )  # fmt: skip
    peft_autocast_adapter_dtype: bool = Field(
        True, description="Keep the adapter's weights in float32 over a bf16/fp16 base (peft's default)."
    )
    lora_model_dir: str | None = Field(None, description="An existing adapter folder to continue training from.")
    loraplus_lr_ratio: float | None = Field(
        None, gt=0, description="LoRA+: the B matrices learn at learning_rate times this (peft's LoRA+ optimizer; the "
        "paper suggests 16), weight_decay applied to them as to the A matrices.",
    )  # fmt: skip
    loraplus_lr_embedding: float | None = Field(
        None, gt=0, description="LoRA+: the learning rate of LoRA on embedding layers (default 1e-6, as peft's)."
    )
    lora_target_parameters: list[str] | None = Field(
        None, description="Parameters (not modules) to adapt, e.g. MoE experts: [mlp.experts.gate_up_proj]."
    )
    peft: PeftOptions | None = Field(None, description="Axolotl's peft block: {loftq_config: {loftq_bits: 4}}.")
    unfrozen_parameters: list[str] | None = Field(
        None,
        description="Only parameters matching one of these regexes train (from the name's start; '.' is a literal "
        "dot; a trailing [start:end] trains only those rows). With an adapter, they choose among its parameters. "
        "A full fine-tune's plan refuses an entry that matches no parameter of the model (its config read on the "
        "meta device), and the estimate counts grads and optimizer states of what they match only.",
    )
    load_in_4bit: bool = Field(False, description="Load the base weights in 4-bit NF4 (bitsandbytes); for qlora.")
    load_in_8bit: bool = Field(False, description="Load the base weights in 8-bit (bitsandbytes); with lora.")
    gptq: bool = Field(False, description="base_model is GPTQ-quantized: loaded as quantized; with lora.")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantize the quantization constants too.")
    qat: Qat | None = Field(
        None, description="Quantization-aware training (torchao): {activation_dtype, weight_dtype, group_size, "
        "quantize_embedding, fake_quant_after_n_steps}; a full fine-tune.",
    )  # fmt: skip
    relora: bool = Field(False, description="ReLoRA: every jagged_restart_steps optimizer steps the LoRA is merged into "
                         "the base weights, a fresh one starts and its optimizer state is pruned (adapter: lora, or qlora: "
                         "the 4-bit base requantized; one process or DDP). The saved adapter holds every cycle: its rank is lora_r x cycles.")  # fmt: skip
    relora_steps: int | None = Field(None, gt=0, description="Axolotl v0.3-v0.11's ReLoRA switch: ReLoRA every this "
                                     "many steps (read as relora: true with jagged_restart_steps).")  # fmt: skip
    relora_prune_ratio: float | None = Field(None, gt=0, le=1, description="ReLoRA: the fraction of each optimizer "
                                             "state zeroed at a restart (default 0.9; 0.999 for reset).")  # fmt: skip
    relora_prune_method: Literal["magnitude", "random", "reset"] = Field(
        "magnitude", description="ReLoRA: zero the smallest values (magnitude), a random subset (random), or nearly "
        "all of them at random (reset).",
    )  # fmt: skip
    jagged_restart_steps: int | None = Field(None, gt=0, description="Jagged LR: every this many optimizer steps the "
                                             "LR falls and warms up again (with relora: the steps that merge).")  # fmt: skip
    jagged_restart_warmup_steps: int = Field(10, gt=0, description="Jagged LR: steps of warm-up after each restart "
                                             "(empty or 0: 10, as Axolotl reads it).")  # fmt: skip
    jagged_restart_anneal_steps: int = Field(1, gt=0, description="Jagged LR: steps of decay before each restart "
                                             "(empty or 0: 1).")  # fmt: skip

    @field_validator(
        "adapter", "lora_target_modules", "lora_modules_to_save", "lora_model_dir", "lora_target_parameters", "peft",
        "unfrozen_parameters", "qat", "loraplus_lr_ratio", "loraplus_lr_embedding", "lora_rank_pattern",
        "lora_alpha_pattern", "peft_layers_pattern", "peft_init_lora_weights", "peft_ensure_weight_tying",
        "peft_trainable_token_indices", mode="before",
    )  # fmt: skip
    @classmethod
    def _adapter_empty(cls, value):
        value = empty_to_none(value)
        return None if isinstance(value, (list, dict)) and not value else value

    @field_validator("peft_init_lora_weights", mode="before")
    @classmethod
    def _known_init(cls, value):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, str) and value.split("_")[0] in ("pissa", "olora", "eva", "corda", "loftq", "orthogonal"):
            how = "needs a data pass before training" if value in ("eva", "corda") else \
                "is set with peft: {loftq_config: ...}" if value == "loftq" else \
                "rewrites the base weights, so the saved adapter fits only that modified base (llmtune's merge, " \
                "eval and chat load the original)"  # fmt: skip
            raise ValueError(f"'{value}' {how}; use true, false or gaussian")
        return value

    @field_validator("peft_trainable_token_indices", mode="before")
    @classmethod
    def _one_token(cls, value):
        return [value] if isinstance(value, int) and not isinstance(value, bool) else value  # as Axolotl reads one id

    @field_validator("peft_trainable_token_indices")
    @classmethod
    def _token_ids(cls, value):
        for module, ids in value.items() if isinstance(value, dict) else [(None, value)] if value else []:
            where = f" ({module})" if module else ""
            if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
                raise ValueError(f"the token ids{where} must be distinct ids, 0 or more (got {ids})")
        return value

    @field_validator("unfrozen_parameters")
    @classmethod
    def _patterns_compile(cls, value):
        for pattern in value or []:
            try:
                unfrozen_pattern(pattern)
            except re.error as err:
                raise ValueError(f"'{pattern}' is not a regular expression ({err})") from None
        return value

    @property
    def relora_pruned_fraction(self) -> float:
        """The share of the LoRA optimizer state a restart zeroes: relora_prune_ratio, else Axolotl's default (0.9;
        0.999 for reset, after the ReLoRA paper's code: reset without a ratio zeroes nearly all)."""
        if self.relora_prune_ratio is not None:
            return self.relora_prune_ratio
        return 0.999 if self.relora_prune_method == "reset" else 0.9

    @model_validator(mode="after")
    def _adapter_rules(self):
        if self.load_in_4bit and self.load_in_8bit:
            raise ValueError("load_in_4bit and load_in_8bit are both true; choose one")
        if self.gptq and (self.load_in_4bit or self.load_in_8bit):
            raise ValueError("gptq: true loads the base as GPTQ quantized it; remove load_in_4bit/load_in_8bit")
        if self.gptq and self.adapter != "lora":
            raise ValueError("gptq: true: a GPTQ base's weights are frozen integers, train it with adapter: lora")
        if self.adapter == "qlora" and not self.load_in_4bit:
            raise ValueError("adapter: qlora needs load_in_4bit: true (QLoRA trains LoRA on a 4-bit base)")
        if self.adapter is None and (self.load_in_4bit or self.load_in_8bit):
            raise ValueError(
                "load_in_4bit/load_in_8bit need an adapter (lora or qlora): quantized weights can't be trained in full"
            )
        if self.adapter is None and self.lora_model_dir:
            raise ValueError("lora_model_dir is set but adapter is empty; set adapter: lora")
        if self.qat and (self.adapter or self.load_in_4bit or self.load_in_8bit):
            raise ValueError("qat fake-quantizes the weights a full fine-tune trains; it can't be combined with "
                             "adapter or load_in_4bit/load_in_8bit (remove them, or remove qat)")  # fmt: skip
        loftq = self.peft and self.peft.loftq_config
        if loftq and self.adapter != "lora":
            raise ValueError("peft.loftq_config needs adapter: lora (LoftQ initialises LoRA for a 16-bit base)")
        if loftq and (self.load_in_4bit or self.load_in_8bit or self.lora_model_dir):
            raise ValueError("peft.loftq_config initialises a new adapter on the 16-bit weights; remove "
                             "load_in_4bit/load_in_8bit/lora_model_dir")  # fmt: skip
        if self.peft_trainable_token_indices is not None:
            self._trainable_token_rules()
        self._relora_rules()
        return self

    def _trainable_token_rules(self) -> None:
        if self.adapter is None:
            raise ValueError("peft_trainable_token_indices trains embedding rows beside a LoRA adapter; set adapter: "
                             "lora (or train the full model)")  # fmt: skip
        if self.lora_model_dir:
            raise ValueError("peft_trainable_token_indices with lora_model_dir: the loaded adapter trains the token "
                             "rows it was saved with; remove the key")  # fmt: skip
        if self.relora:
            raise ValueError("relora with peft_trainable_token_indices is not supported: a restart merges plain LoRA "
                             "layers only; remove one")  # fmt: skip
        if getattr(self, "pipeline_parallel_size", 1) > 1:
            raise ValueError("peft_trainable_token_indices with pipeline_parallel_size > 1 is not supported: the "
                             "pipeline's stages are cut from the plain model; use lora_modules_to_save")  # fmt: skip

    @field_validator("jagged_restart_warmup_steps", "jagged_restart_anneal_steps", mode="before")
    @classmethod
    def _axolotl_default_steps(cls, value, info):
        # Axolotl reads these as `value or default`: empty, false and 0 all mean the default
        if empty_to_none(value) is None or value is False or value == 0:
            return cls.model_fields[info.field_name].default
        return value

    @model_validator(mode="before")
    @classmethod
    def _relora_steps(cls, data):
        """Axolotl v0.3-v0.11 switched ReLoRA on with relora_steps (its cycle); v0.12 on, relora: true with the
        cycle in jagged_restart_steps. Both read the same."""
        if not isinstance(data, dict) or not data.get("relora_steps"):
            return data
        data = dict(data)
        steps, cycle = data["relora_steps"], data.get("jagged_restart_steps")
        if cycle not in (None, steps):
            raise ValueError(f"relora_steps ({steps}) and jagged_restart_steps ({cycle}) disagree; keep "
                             "jagged_restart_steps")  # fmt: skip
        if data.get("relora") is False:
            raise ValueError("relora_steps asks for ReLoRA and relora is false; keep one")
        data["relora"], data["jagged_restart_steps"] = True, steps
        return data

    def _relora_rules(self) -> None:
        if self.relora:
            self._relora_adapter_rules()
        elif self.relora_prune_ratio is not None or self.relora_prune_method != "magnitude":
            key = "relora_prune_ratio" if self.relora_prune_ratio is not None else "relora_prune_method"
            raise ValueError(f"{key} prunes the optimizer at ReLoRA restarts; set relora: true (or remove it)")
        cycle = self.jagged_restart_steps
        warmup, anneal = self.jagged_restart_warmup_steps, self.jagged_restart_anneal_steps
        if cycle and warmup + anneal > cycle:
            given = self.model_fields_set
            shown = [f"{key} ({value}{'' if key in given else ', the default'})" for key, value in
                     (("jagged_restart_warmup_steps", warmup), ("jagged_restart_anneal_steps", anneal))]  # fmt: skip
            raise ValueError(f"{shown[0]} + {shown[1]} don't fit in one cycle of jagged_restart_steps ({cycle}); "
                             "shorten them or lengthen the cycle")  # fmt: skip

    def _relora_adapter_rules(self) -> None:
        if not self.jagged_restart_steps:
            raise ValueError("relora: true needs jagged_restart_steps: the optimizer steps between merges")
        if self.adapter is None:
            raise ValueError("relora: true needs adapter: lora (ReLoRA merges and restarts a LoRA adapter)")
        quantized = next((key for key, on in (("load_in_8bit", self.load_in_8bit),
                                              ("gptq", getattr(self, "gptq", False))) if on), None)  # fmt: skip
        if quantized:
            raise ValueError(f"relora with {quantized} is not supported: a restart merges the LoRA into the base "
                             "weights, which llmtune requantizes for a 4-bit base (adapter: qlora) only; use "
                             "adapter: qlora (load_in_4bit) or adapter: lora on the 16-bit model")  # fmt: skip
        for key, on in (("peft_use_dora", self.peft_use_dora), ("lora_target_parameters", self.lora_target_parameters)):
            if on:
                raise ValueError(f"relora with {key} is not supported: a restart merges plain LoRA layers "
                                 f"(B x A on a module's weight); remove {key}")  # fmt: skip
