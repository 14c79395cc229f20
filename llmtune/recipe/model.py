"""Recipe keys about the base model and tokenizer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.axolotl_keys import attention_alias
from llmtune.recipe.base import Section, empty_to_none, jinja_syntax, jinja_text
from llmtune.recipe.kernels import CCE_PLUGIN, COMPILE_MODES, LIGER_PLUGIN, check_plugins

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
ADDITIONAL_SPECIAL_TOKENS = "additional_special_tokens"  # a list: added as special tokens after `tokens`
NAMED_CHAT_TEMPLATES = (
    "tokenizer_default",
    "chatml",
    "llama3",
    "mistral",
    "gemma",
    "phi_3",
    "qwen_25",
    "alpaca",
    "jinja",
)
# Axolotl's other named templates (its ChatTemplate list): model-family formats, see train/data/templates.py.
FAMILY_CHAT_TEMPLATES = (
    "mistral_v1", "mistral_v2v3", "mistral_v3_tekken", "mistral_v7_tekken", "pixtral", "cohere", "aya",
    "command_a", "command_a_tool_use", "command_a_rag", "llama3_2_vision", "llama4", "phi_35", "deepseek_v2",
    "deepseek_v3", "jamba", "qwen3", "qwen3_5", "qwen2_vl", "falcon_h1", "nemotron_h", "exaone", "exaone4",
    "metharme", "llava", "gemma3", "gemma3n", "gemma4", "gemma4_unified",
)  # fmt: skip
FALLBACK_PREFIX = "tokenizer_default_fallback_"  # Axolotl: the tokenizer's own template, else the named one
# Quantization configs a checkpoint can be loaded with, and the arguments that make the result trainable.
MODEL_QUANTIZATION_CONFIGS = {"Mxfp4Config": {"dequantize": True}}


def known_chat_template(name: str) -> bool:
    name = name.removeprefix(FALLBACK_PREFIX) if name.startswith(FALLBACK_PREFIX) else name
    return name in NAMED_CHAT_TEMPLATES or name in FAMILY_CHAT_TEMPLATES


def checked_template_name(value: str | None) -> str | None:
    """A recipe's (or a dataset entry's) chat_template, if it names a template llmtune knows."""
    if value is not None and not known_chat_template(value):
        raise ValueError(f"'{value}' is not a known template; use one of "
                         f"{', '.join(NAMED_CHAT_TEMPLATES + FAMILY_CHAT_TEMPLATES)}")  # fmt: skip
    return value


def template_keys(cls, value, info):
    """chat_template names a known template; chat_template_jinja is the text, or a .jinja file's (the recipe's keys
    and a dataset entry's)."""
    if info.field_name == "chat_template":
        return checked_template_name(value)
    text = jinja_text(value, info.field_name)
    if isinstance(text, str):
        jinja_syntax(text, info.field_name)
    return text


class ModelKeys(Section):
    base_model: str = Field(
        description="Hub id, local folder, or a .gguf file (also `folder/file.gguf`) of the causal LM to fine-tune."
    )
    base_model_config: str | None = Field(None, description="Where to read config.json from, if not base_model.")
    cls_model_config: str | None = Field(
        None, description="transformers config class to read it with (e.g. Gemma3TextConfig for the text model "
        "of a multimodal checkpoint); default AutoConfig.",
    )  # fmt: skip
    tokenizer_config: str | None = Field(None, description="Where to load the tokenizer from, if not base_model.")
    revision_of_model: str | None = Field(None, description="Hub revision (branch, tag or commit) of base_model.")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the model. Off unless set.")
    model_type: str | None = Field(
        None, description="Axolotl's model class (e.g. LlamaForCausalLM); checked against the loaded model."
    )
    llama4_linearized_experts: bool = Field(
        False, description="Llama 4: run the routed experts as one linear layer per expert (experts.gate_projs.N, "
        "up_projs.N, down_projs.N), so 4-bit loading quantizes them and LoRA can target them; fused checkpoints are "
        "split at load (16/32-bit), linearized ones load as they are.",
    )  # fmt: skip
    tokenizer_type: str | None = Field(
        None, description="Axolotl's tokenizer class: no effect (said so); llmtune always uses AutoTokenizer."
    )
    tokenizer_use_fast: bool = Field(True, description="Use the fast (Rust) tokenizer.")
    special_tokens: dict[str, str | list[str]] | None = Field(
        None,
        description="Special tokens to set, e.g. {pad_token: '<pad>'}, and additional_special_tokens: a list "
        "of more (added after tokens); new ones resize the embeddings.",
    )
    tokens: list[str] | None = Field(None, description="Extra tokens to add to the vocabulary.")
    chat_template: str | None = Field(
        None,
        description="Chat template: 'tokenizer_default', a named template ("
        + ", ".join(NAMED_CHAT_TEMPLATES[1:-1] + FAMILY_CHAT_TEMPLATES)
        + "), 'tokenizer_default_fallback_<name>' (the tokenizer's own, else <name>), or 'jinja' with "
        "chat_template_jinja.",
    )
    chat_template_jinja: str | None = Field(None, description="A Jinja chat template (with chat_template: jinja).")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables every chat-template rendering gets (Axolotl's), e.g. {enable_thinking: "
        "false}: training rows, preference and GRPO prompts, eval, infer and chat.",
    )  # fmt: skip
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] | None = Field(
        None,
        description="Attention kernel; default: the model's default (sdpa where supported). Axolotl's xformers, "
        "sage and fp8 run as sdpa, flash_attention_3 and hub flash kernels as flash_attention_2 (said once).",
    )
    flash_attention: bool = Field(False, description="Axolotl's switch for attn_implementation: flash_attention_2.")
    sdp_attention: bool = Field(False, description="Axolotl's switch for attn_implementation: sdpa.")
    flex_attention: bool = Field(False, description="Axolotl's switch for attn_implementation: flex_attention.")
    eager_attention: bool = Field(False, description="Axolotl's switch for attn_implementation: eager.")
    # The fast path on GPUs (see llmtune/recipe/kernels.py); in CPU rehearsal these are off, said once.
    plugins: list[str] | None = Field(
        None,
        description=f"Axolotl's plugin list: {LIGER_PLUGIN} and {CCE_PLUGIN} are understood, any other is an "
        "error; liger_* keys also work without it. The kernel keys run on GPUs (pip install 'llmtune[kernels]') "
        "and have no effect in CPU rehearsal (said once).",
    )
    liger_rope: bool = Field(False, description="Liger's fused rotary embedding (GPUs; needs llmtune[kernels]).")
    liger_rms_norm: bool = Field(False, description="Liger's RMSNorm kernel (GPUs; needs llmtune[kernels]).")
    liger_glu_activation: bool = Field(False, description="Liger's SwiGLU/GeGLU MLP kernel, by model (GPUs).")
    liger_swiglu: bool | None = Field(None, description="Axolotl's older name for liger_glu_activation.")
    liger_layer_norm: bool = Field(
        False, description="Liger's LayerNorm kernel, for models that have LayerNorm (GPUs)."
    )
    liger_cross_entropy: bool = Field(False, description="Liger's cross-entropy kernel over the logits (GPUs).")
    liger_fused_linear_cross_entropy: bool = Field(
        False, description="Liger's lm_head + cross-entropy in chunks: the full logits tensor is never made (GPUs)."
    )
    cut_cross_entropy: bool | None = Field(
        None,
        description="Axolotl's Cut Cross Entropy (on by default with its plugin); runs as Liger's fused linear "
        "cross-entropy, the same saving.",
    )
    torch_compile: bool | Literal["auto"] = Field(
        False, description="torch.compile the model on GPUs (TrainingArguments.torch_compile); 'auto' is on."
    )
    torch_compile_backend: str | None = Field(None, description="torch.compile backend; default inductor.")
    torch_compile_mode: Literal[COMPILE_MODES] | None = Field(  # type: ignore[valid-type]
        None, description="torch.compile mode: " + ", ".join(COMPILE_MODES) + "."
    )

    resize_token_embeddings_to_32x: bool = Field(
        False, description="Round the embedding rows up to a multiple of 32 (faster matmuls on GPUs)."
    )
    mean_resizing_embeddings: bool = Field(
        False, description="Start new embedding rows (added tokens) at the mean of the existing rows (transformers' "
        "mean resizing); false, Axolotl's default: the model's own initialisation of new weights, drawn from seed.",
    )  # fmt: skip
    overrides_of_model_config: dict | None = Field(
        None, description="Values set in the model's config before loading, e.g. {output_router_logits: true} "
        "(Axolotl also spells it model_config).",
    )  # fmt: skip
    model_quantization_config: Literal[tuple(MODEL_QUANTIZATION_CONFIGS)] | None = Field(  # type: ignore[valid-type]
        None, description="Load a quantized checkpoint with this transformers config: Mxfp4Config (gpt-oss), "
        "with dequantize: true so the weights train in 16 bits.",
    )  # fmt: skip
    model_quantization_config_kwargs: dict | None = Field(None, description="Arguments of model_quantization_config.")
    reinit_weights: bool = Field(False, description="Re-initialise every weight (train from scratch, same config).")

    @field_validator(
        "special_tokens", "tokens", "chat_template", "chat_template_kwargs", "overrides_of_model_config", "cls_model_config", "model_quantization_config",
        "model_quantization_config_kwargs", "base_model_config", "tokenizer_config", "plugins",
        "torch_compile_backend", mode="before",
    )  # fmt: skip
    @classmethod
    def _model_empty(cls, value):
        return empty_to_none(value)

    @field_validator("base_model")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a hub id, a local folder or a .gguf file")
        return value.strip()

    @field_validator("plugins")
    @classmethod
    def _known_plugins(cls, value):
        return check_plugins(value)

    @field_validator("special_tokens")
    @classmethod
    def _known_special_tokens(cls, value):
        for name, token in (value or {}).items():
            if name == ADDITIONAL_SPECIAL_TOKENS:
                if not isinstance(token, list):
                    raise ValueError(f"{name} must be a list of tokens, e.g. ['<tool>']")
            elif name not in SPECIAL_TOKEN_NAMES:
                names = ", ".join((*SPECIAL_TOKEN_NAMES, ADDITIONAL_SPECIAL_TOKENS))
                raise ValueError(f"'{name}' is not a special token name; use one of {names}")
            elif not isinstance(token, str):
                raise ValueError(f"{name} must be one token (text), not a list")
        return value

    _templates = field_validator("chat_template", "chat_template_jinja")(template_keys)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_template_variables(cls, value):
        """Names apply_chat_template takes itself would collide with llmtune's own arguments (a TypeError)."""
        taken = sorted(set(value or {}) & {"conversation", "messages", "tools", "documents", "chat_template",
                                           "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                           "truncation", "max_length", "return_tensors", "return_dict"})  # fmt: skip
        if taken:
            raise ValueError(f"{', '.join(taken)}: set by llmtune for each rendering, not a template variable")
        return value

    @field_validator("cls_model_config")
    @classmethod
    def _config_class(cls, value):
        if value is not None and not (value.isidentifier() and value.endswith("Config")):
            raise ValueError(f"'{value}' is not a transformers config class name (like LlamaConfig)")
        return value

    @field_validator("attn_implementation", mode="before")
    @classmethod
    def _axolotl_attention(cls, value):
        return attention_alias(value) or value

    @model_validator(mode="after")
    def _attention_switches(self):
        switches = {"flash_attention": "flash_attention_2", "sdp_attention": "sdpa", "flex_attention": "flex_attention",
                    "eager_attention": "eager"}  # fmt: skip
        on = [key for key in switches if getattr(self, key)]
        if len(on) > 1:
            raise ValueError(f"{' and '.join(on)} are all true; choose one (or attn_implementation)")
        wanted = switches[on[0]] if on else None
        if wanted and self.attn_implementation not in (None, wanted):
            raise ValueError(f"attn_implementation is '{self.attn_implementation}' but the switches ask for '{wanted}'")
        if wanted:
            self.attn_implementation = wanted
        if self.liger_swiglu is not None:
            if self.liger_glu_activation and not self.liger_swiglu:
                raise ValueError("liger_swiglu (the older name) and liger_glu_activation disagree; keep one")
            self.liger_glu_activation = self.liger_glu_activation or self.liger_swiglu
        if self.chat_template_jinja and not self.chat_template:
            self.chat_template = "jinja"  # the text given is the template (Axolotl sets chat_template: jinja too)
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            raise ValueError("chat_template: jinja needs chat_template_jinja (the template text)")
        required = MODEL_QUANTIZATION_CONFIGS.get(self.model_quantization_config or "", {})
        given = self.model_quantization_config_kwargs or {}
        wrong = {k: v for k, v in required.items() if given.get(k) != v}
        if wrong:
            raise ValueError(f"model_quantization_config: {self.model_quantization_config} trains only with "
                             f"model_quantization_config_kwargs {wrong} (quantized weights can't be trained)")  # fmt: skip
        if given and not self.model_quantization_config:
            raise ValueError("model_quantization_config_kwargs is set without model_quantization_config")
        return self
