"""Recipe keys about the base model and tokenizer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token")
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


class ModelKeys(Section):
    base_model: str = Field(
        description="Hub id, local folder, or a .gguf file (also `folder/file.gguf`) of the causal LM to fine-tune."
    )
    base_model_config: str | None = Field(None, description="Where to read config.json from, if not base_model.")
    tokenizer_config: str | None = Field(None, description="Where to load the tokenizer from, if not base_model.")
    revision_of_model: str | None = Field(None, description="Hub revision (branch, tag or commit) of base_model.")
    trust_remote_code: bool = Field(False, description="Run modelling code shipped with the model. Off unless set.")
    model_type: str | None = Field(
        None, description="Axolotl's model class (e.g. LlamaForCausalLM); checked against the loaded model."
    )
    tokenizer_type: str | None = Field(
        None, description="Axolotl's tokenizer class; llmtune always uses AutoTokenizer."
    )
    tokenizer_use_fast: bool = Field(True, description="Use the fast (Rust) tokenizer.")
    special_tokens: dict[str, str] | None = Field(
        None, description="Special tokens to set, e.g. {pad_token: '<pad>'}; new ones resize the embeddings."
    )
    tokens: list[str] | None = Field(None, description="Extra tokens to add to the vocabulary.")
    chat_template: str | None = Field(
        None,
        description="Chat template: 'tokenizer_default', a named template ("
        + ", ".join(NAMED_CHAT_TEMPLATES[1:-1])
        + "), or 'jinja' with chat_template_jinja.",
    )
    chat_template_jinja: str | None = Field(None, description="A Jinja chat template (with chat_template: jinja).")
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2", "flex_attention"] | None = Field(
        None, description="Attention kernel; default: the model's default (sdpa where supported)."
    )
    flash_attention: bool = Field(False, description="Axolotl's switch for attn_implementation: flash_attention_2.")
    sdp_attention: bool = Field(False, description="Axolotl's switch for attn_implementation: sdpa.")

    @field_validator(
        "special_tokens", "tokens", "chat_template", "base_model_config", "tokenizer_config", mode="before"
    )
    @classmethod
    def _empty(cls, value):
        return empty_to_none(value)

    @field_validator("base_model")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must name a hub id, a local folder or a .gguf file")
        return value.strip()

    @field_validator("special_tokens")
    @classmethod
    def _known_special_tokens(cls, value):
        for name in value or {}:
            if name not in SPECIAL_TOKEN_NAMES:
                raise ValueError(f"'{name}' is not a special token name; use one of {', '.join(SPECIAL_TOKEN_NAMES)}")
        return value

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value):
        if value is not None and value not in NAMED_CHAT_TEMPLATES:
            raise ValueError(f"'{value}' is not a known template; use one of {', '.join(NAMED_CHAT_TEMPLATES)}")
        return value

    @model_validator(mode="after")
    def _attention_switches(self):
        if self.flash_attention and self.sdp_attention:
            raise ValueError("flash_attention and sdp_attention are both true; choose one (or attn_implementation)")
        wanted = "flash_attention_2" if self.flash_attention else "sdpa" if self.sdp_attention else None
        if wanted and self.attn_implementation not in (None, wanted):
            raise ValueError(f"attn_implementation is '{self.attn_implementation}' but the switches ask for '{wanted}'")
        if wanted:
            self.attn_implementation = wanted
        if self.chat_template == "jinja" and not self.chat_template_jinja:
            raise ValueError("chat_template: jinja needs chat_template_jinja (the template text)")
        return self
