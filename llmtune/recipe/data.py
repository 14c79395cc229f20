"""Recipe keys about datasets, tokenization and packing."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none

# Dataset formats llmtune understands, with aliases Axolotl users write. A dataset with no
# `type` must already be tokenized (input_ids, optional labels/attention_mask).
DATASET_TYPES = {
    "alpaca": "instruction / input / output fields",
    "chat_template": "a list of messages rendered with the chat template",
    "completion": "plain text in one field (`field`, default 'text'); every token is trained",
    "input_output": "segments [{text, label: true|false}] concatenated; only label: true segments are trained",
    "jeopardy": "question / category / answer fields (Axolotl's Jeopardy prompt); 'what is <answer>' is trained",
    "pretokenized": "input_ids (and optional labels) already tokenized",
    "bradley_terry.chat_template": "reward_model pairs: input (prompt), chosen, rejected (strings, optional "
    "system), or chosen/rejected as whole message lists, each rendered with the chat template",
    "stepwise_supervised": "process_reward_model rows: prompt, completions (steps) and labels (one true/false per "
    "step); each step's last separator token is labelled",
}
# Formats whose rows train a reward head rather than the language model: the recipe key each one needs.
REWARD_TYPES = {"bradley_terry.chat_template": "reward_model", "stepwise_supervised": "process_reward_model"}
TYPE_ALIASES = {
    "alpaca_chat": "alpaca", "text": "completion", "pretrain": "completion", "tokenized": "pretokenized",
    "chat_template.default": "chat_template", "chat_template.load": "chat_template",
    "bradley_terry": "bradley_terry.chat_template",
}  # fmt: skip
# Axolotl's other prompt formats: kept apart from typos, so the error names what isn't supported.
AXOLOTL_TYPES = (
    "oasst", "gpteacher", "reflection", "explainchoice", "concisechoice", "summarizetldr",
    "alpaca_w_system", "alpaca_instruct", "context_qa", "creative_acr", "llama2_chat", "metharme", "orcamini",
    "pygmalion", "user_defined", "messages", "stepwise_supervised", "bradley_terry", "dpo", "kto", "orpo", "ebft",
    "chatml", "llama3", "zephyr", "passthrough", "rwd", "_synthetic",
)  # fmt: skip
REMOVED_TYPES = {
    "sharegpt": "use type: chat_template with field_messages: conversations and "
    "message_property_mappings: {role: from, content: value}",
}
DS_TYPES = ("json", "csv", "parquet", "arrow", "text")


class CustomFormat(Section):
    """Axolotl's user-defined instruction format (a mapping given as `type:`)."""

    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str | None = None
    system_prompt: str = ""
    system_format: str = "{system}"
    format: str = Field(description="Prompt template with {instruction} and {input}.")
    no_input_format: str | None = Field(None, description="Prompt template when the input is empty.")


class DatasetSpec(Section):
    path: str = Field(description="Local file or folder, a `datasets` saved folder, or a hub dataset id.")
    type: str | CustomFormat | None = Field(
        None, description="Format: " + ", ".join(DATASET_TYPES) + " (or a custom format mapping)."
    )
    ds_type: Literal[DS_TYPES] | None = Field(None, description="File format when the extension doesn't say.")  # type: ignore[valid-type]
    split: str = Field("train", description="Split to read.")
    data_files: str | list[str] | None = Field(None, description="Files inside `path` to read.")
    name: str | None = Field(None, description="Dataset configuration name (hub datasets).")
    revision: str | None = Field(None, description="Hub revision of the dataset.")
    trust_remote_code: bool = Field(False, description="Allow the dataset's loading script to run.")
    field: str | None = Field(None, description="Text field for completion data (default 'text').")
    field_messages: str = Field("messages", description="Field holding the list of messages (chat_template).")
    message_property_mappings: dict[str, str] | None = Field(
        None, description="Where each message keeps its role and content, e.g. {role: from, content: value}."
    )
    message_field_role: str | None = Field(None, description="Deprecated Axolotl spelling of mappings.role.")
    message_field_content: str | None = Field(None, description="Deprecated Axolotl spelling of mappings.content.")
    roles: dict[str, list[str]] | None = Field(
        None, description="Role aliases, e.g. {user: [human], assistant: [gpt]}."
    )
    roles_to_train: list[str] = Field(["assistant"], description="Roles whose content gets labels.")
    train_on_eos: Literal["turn", "last", "all", "none"] = Field(
        "turn", description="Which end-of-turn tokens get labels: each trained turn's, the last, all, none."
    )
    train_on_eot: Literal["turn", "last", "all", "none"] | None = Field(
        None, description="As train_on_eos, for the recipe's eot_tokens (default: train_on_eos)."
    )
    message_field_training: str | None = Field(
        None, description="A per-message true/false field that overrides roles_to_train for that message."
    )
    field_thinking: str | None = Field(None, description="Message field holding reasoning text (chat_template).")
    template_thinking_key: str | None = Field(
        None, description="Name the chat template reads reasoning from (default: field_thinking); trained with "
        "the answer.",
    )  # fmt: skip
    chat_template: str | None = Field(None, description="Per-dataset chat template (overrides the recipe's).")
    chat_template_jinja: str | None = Field(None, description="Per-dataset Jinja template (chat_template: jinja).")
    drop_system_message: bool = Field(False, description="Drop system messages before templating.")
    shards: int | None = Field(None, gt=0, description="Keep only one of this many shards (quick trials).")
    skip: int | None = Field(None, ge=0, description="Skip this many rows at the start of the source.")
    step_separator: str = Field("\n", description="stepwise_supervised: text after each step (its last token is "
                                "labelled).")  # fmt: skip
    train_on_last_step_only: bool = Field(False, description="stepwise_supervised: label only the last step.")
    max_completion_length: int | None = Field(
        None, gt=0, description="stepwise_supervised: cut the steps (separators included) to this many tokens."
    )

    @field_validator("type", "data_files", "name", "field", "chat_template", "chat_template_jinja", mode="before")
    @classmethod
    def _empty(cls, value):
        return empty_to_none(value)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value):
        if isinstance(value, str):
            base = value.split(":", 1)[0]  # Axolotl's 'alpaca:chatml' prompt-style suffix
            if base in REMOVED_TYPES:
                raise ValueError(f"type '{base}' was removed from Axolotl; {REMOVED_TYPES[base]}")
            base = TYPE_ALIASES.get(base, base)
            if base not in DATASET_TYPES and base.split(".")[0] in AXOLOTL_TYPES:
                raise ValueError(f"Axolotl's dataset type '{value}' is not supported; use one of "
                                 f"{', '.join(DATASET_TYPES)} (or a custom format mapping)")  # fmt: skip
            if base not in DATASET_TYPES:
                raise ValueError(f"unknown dataset type '{value}'; use one of {', '.join(DATASET_TYPES)}")
            return base
        return value

    @model_validator(mode="after")
    def _mappings(self):
        mappings = dict(self.message_property_mappings or {})
        if self.message_field_role:
            mappings.setdefault("role", self.message_field_role)
        if self.message_field_content:
            mappings.setdefault("content", self.message_field_content)
        self.message_property_mappings = {"role": "role", "content": "content", **mappings}
        return self


class DataKeys(Section):
    datasets: list[DatasetSpec] | None = Field(
        None, description="Training datasets, mixed and shuffled together (required unless pretraining_dataset)."
    )
    pretraining_dataset: list[DatasetSpec] | None = Field(
        None, description="Plain-text pre-training data (local file, folder or hub id; field/text_column names the "
        "text): read as type: completion and packed. Hub sources are streamed: set max_steps.",
    )  # fmt: skip
    streaming: bool = Field(
        False, description="Read hub datasets in datasets' streaming mode (no full download); needs max_steps, "
        "and only as many rows as max_steps uses are read.",
    )  # fmt: skip
    dataset_exact_deduplication: bool = Field(False, description="Drop rows that are exact duplicates of another.")
    min_sample_len: int | None = Field(None, gt=0, description="Drop examples shorter than this many tokens.")
    eot_tokens: list[str] | None = Field(
        None, description="Tokens that end a turn (chat_template): the first after each message gets labels per "
        "train_on_eot. Default: the first special token after the message.",
    )  # fmt: skip
    test_datasets: list[DatasetSpec] | None = Field(None, description="Evaluation datasets (instead of val_set_size).")
    val_set_size: float = Field(0.0, ge=0.0, description="Eval split: a fraction (< 1) or a number of examples.")
    dataset_prepared_path: str | None = Field(
        "last_run_prepared", description="Cache folder for tokenized data (keyed by data, tokenizer and recipe)."
    )
    dataset_processes: int | None = Field(None, gt=0, description="Worker processes for tokenization.")
    shuffle_merged_datasets: bool = Field(True, description="Shuffle after mixing datasets.")
    sequence_len: int = Field(2048, gt=0, description="Maximum tokens per training row.")
    excess_length_strategy: Literal["drop", "truncate"] = Field(
        "drop", description="What to do with examples longer than sequence_len."
    )
    sample_packing: bool = Field(False, description="Pack several examples per row, with no attention between them.")
    eval_sample_packing: bool | None = Field(None, description="Pack eval rows too (default: as sample_packing).")
    pad_to_sequence_len: bool = Field(False, description="Pad every row to sequence_len (fixed shapes).")
    train_on_inputs: bool = Field(False, description="Also train on prompt tokens (no -100 labels).")

    @field_validator("test_datasets", "dataset_prepared_path", "pretraining_dataset", "eot_tokens", mode="before")
    @classmethod
    def _empty(cls, value):
        value = empty_to_none(value)
        return [value] if isinstance(value, dict) else value  # Axolotl accepts one mapping for a list

    @model_validator(mode="after")
    def _pretraining(self):
        """pretraining_dataset entries become completion datasets, packed; what's left in the recipe is plain."""
        if self.pretraining_dataset:
            if self.datasets:
                raise ValueError("datasets and pretraining_dataset are both set; use one")
            for spec in self.pretraining_dataset:
                if spec.type not in (None, "completion"):
                    raise ValueError(f"pretraining_dataset entries are plain text (type: pretrain), not {spec.type}")
                spec.type = "completion"
                if not Path(spec.path).exists():
                    self.streaming = True  # a hub corpus is streamed, as Axolotl does
            self.datasets, self.pretraining_dataset, self.sample_packing = self.pretraining_dataset, None, True
        if not self.datasets:
            raise ValueError("datasets: required key is missing (or give pretraining_dataset)")
        if self.streaming and self.dataset_exact_deduplication:
            raise ValueError("dataset_exact_deduplication can't run on streamed data (it needs every row)")
        return self

    @model_validator(mode="after")
    def _eval_source(self):
        if self.test_datasets and self.val_set_size:
            raise ValueError("test_datasets and val_set_size are both set; use one source of eval data")
        if self.val_set_size >= 1 and self.val_set_size != int(self.val_set_size):
            raise ValueError("val_set_size must be a fraction below 1 or a whole number of examples")
        return self
