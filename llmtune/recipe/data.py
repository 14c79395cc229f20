"""Recipe keys about datasets, tokenization and packing."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from llmtune.recipe.base import Section, empty_to_none
from llmtune.recipe.model import template_keys
from llmtune.recipe.preference import ALL_TYPES as PREFERENCE_TYPES
from llmtune.recipe.preference import PreferenceFormat

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
# Axolotl's older formats (2023-2024), each as its releases tokenized it (llmtune/train/data/instruct.py,
# sharegpt.py). A `name:style` suffix picks the prompt style of the STYLED ones: instruct (default), chat, chatml,
# phi.
LEGACY_TYPES = {
    "sharegpt": "conversations [{from: human|gpt|system, value}] in a FastChat template (`conversation:`, default "
    "vicuna_v1.1); gpt turns are trained",
    "sharegpt.load_role": "sharegpt rows whose messages say role instead of from",
    "sharegpt.load_guanaco": "sharegpt rows of {role: prompter|assistant, text}",
    "sharegpt.load_ultrachat": "messages [{role: user|assistant, content}] in a FastChat template",
    "sharegpt.load_glaive": "Glaive function-calling rows (system, chat) in chatml_glaive; ASSISTANT turns trained",
    "sharegpt_jokes": "title / text / explanation as a two-turn joke chat",
    "oasst": "INSTRUCTION / RESPONSE in the Alpaca prompt",
    "gpteacher": "instruction / input / response in the Alpaca prompt",
    "reflection": "instruction / input / output / reflection / corrected; thought, reflection and answer trained",
    "explainchoice": "question / choices / solution (or explanation), explaining the choice",
    "concisechoice": "question / choices / solution (or explanation), concisely, in USER:/ASSISTANT: turns",
    "summarizetldr": "article / summary, asked for a TL;DR",
    "alpaca_instruct": "alpaca in the instruct style", "alpaca_instruct.load_no_prompt": "alpaca without a system prompt",
    "alpaca_chat": "alpaca in USER:/ASSISTANT: turns (`conversation:` picks the style)",
    "alpaca_chat.load_qa": "question / answer in USER:/ASSISTANT: turns",
    "alpaca_chat.load_concise": "alpaca in USER:/ASSISTANT: turns, asked for concise answers",
    "alpaca_chat.load_camel_ai": "message_1 / message_2 in USER:/ASSISTANT: turns",
    "alpaca_chat.load_no_prompt": "alpaca in USER:/ASSISTANT: turns without a system prompt",
    "alpaca_w_system": "alpaca with the row's `system` (chat style)", "alpaca_w_system.load_chat": "the same",
    "alpaca_w_system.load_instruct": "alpaca with the row's `system` (instruct style)",
    "alpaca_w_system.load_open_orca": "OpenOrca rows: system_prompt / question / response",
    "alpaca_w_system.load_open_orca_chatml": "OpenOrca rows in ChatML",
    "orcamini": "OpenOrca rows in Orca Mini's '### System:' prompt",
    "context_qa": "article / question / answer", "context_qa.load_v2": "context / question / answer",
    "context_qa.load_404": "article / unanswerable_question, answered with a fixed refusal",
    "llama2_chat": "sharegpt conversations in Llama 2 chat's [INST] format; answers and </s> trained",
    "metharme": "prompt / generation; the generation and three EOS tokens trained",
    "pygmalion": "conversations [{role: system|human|bot, value}]; bot turns trained",
    "creative_acr.load_answer": "instruction / revision", "creative_acr.load_critique": "instruction / answer / "
    "scores / critiques; the YAML evaluation trained", "creative_acr.load_revise": "instruction / answer / scores / "
    "critiques / revision; the revision trained",
}  # fmt: skip
STYLED = ("alpaca", "oasst", "gpteacher", "reflection", "explainchoice")
PROMPT_STYLES = ("instruct", "chat", "chatml", "phi")
# FastChat conversation templates `conversation:` takes (sharegpt); train/data/sharegpt.py holds their text.
CONVERSATIONS = (
    "vicuna_v1.1", "chatml", "chatml_glaive", "llama3", "llama-3", "llama-2", "airoboros_v3", "mistral", "zephyr",
    "TinyLlama", "alpaca", "airoboros_v1", "airoboros_v2", "koala_v1", "dolly_v2", "oasst_pythia", "oasst_llama",
    "openchat_3.5", "tulu", "orca-2", "Yi-34b-chat", "qwen-7b-chat", "starchat", "metharme", "gemma", "solar",
    "phind", "stable-vicuna",
)  # fmt: skip
TYPE_ALIASES = {
    "text": "completion", "pretrain": "completion", "tokenized": "pretokenized",
    "chat_template.default": "chat_template", "chat_template.load": "chat_template",
    "bradley_terry": "bradley_terry.chat_template",
    # Axolotl 0.4 rewrote these (and sharegpt:chat, whose suffix drops below) to sharegpt
    "sharegpt_simple": "sharegpt", "sharegpt_simple.load_role": "sharegpt.load_role",
    "sharegpt_simple.load_guanaco": "sharegpt.load_guanaco",
}  # fmt: skip
# Axolotl's other prompt formats: kept apart from typos, so the error names what isn't supported.
AXOLOTL_TYPES = (
    "creative_acr", "user_defined", "messages", "stepwise_supervised",
    "bradley_terry", "dpo", "kto", "orpo", "ebft", "chatml", "llama3", "zephyr", "passthrough", "_synthetic",
    "sharegpt", "alpaca_w_system", "alpaca_chat", "context_qa",
)  # fmt: skip
DS_TYPES = ("json", "csv", "parquet", "arrow", "text")


class CustomFormat(Section):
    """Axolotl's user-defined instruction format (a mapping given as `type:`)."""

    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str = Field("system", description="Row field with a system prompt (else system_prompt).")
    system_prompt: str = ""
    system_format: str = Field("{system}", description="How a non-empty system prompt is written before the turn.")
    # Axolotl's defaults, so that a mapping that leaves them out renders as it did there
    format: str = Field("{instruction} {input} ", description="Prompt template with {instruction} and {input}.")
    no_input_format: str = Field("{instruction} ", description="Prompt template when the input is empty.")
    field: str | None = Field(None, description="Accepted for Axolotl's schema; unused.")


def is_transform(kind) -> bool:
    """A dataset type that names a function in the user's file (module.function), not one of the known formats."""
    if not isinstance(kind, str) or "." not in kind or "/" in kind or ":" in kind:
        return False
    family = kind.split(".")[0]
    return family not in (*AXOLOTL_TYPES, *DATASET_TYPES, *LEGACY_TYPES, "chatml", "llama3", "user_defined",
                          "passthrough", "chat_template")  # fmt: skip


# Axolotl's preference strategy families (`family.function`): an unknown one is answered with the preference types
PREFERENCE_FAMILIES = ("chatml", "llama3", "zephyr", "user_defined", "passthrough")


class DatasetSpec(Section):
    path: str = Field(description="Local file or folder, a `datasets` saved folder, or a hub dataset id.")
    type: str | CustomFormat | PreferenceFormat | None = Field(
        None,
        description="Format: " + ", ".join(DATASET_TYPES) + " (or a custom format mapping); also Axolotl's "
        "older ones: " + ", ".join(LEGACY_TYPES) + ", and name:style (alpaca:chat, alpaca:chatml, alpaca:phi). "
        "With rl: Axolotl's preference types (chatml.intel, llama3.ultra, chat_template.default, ...; see the "
        "preference section).",
    )
    ds_type: Literal[DS_TYPES] | None = Field(None, description="File format when the extension doesn't say.")  # type: ignore[valid-type]
    split: str = Field("train", description="Split to read.")
    data_files: str | list[str] | None = Field(None, description="Files inside `path` to read.")
    name: str | list[str] | None = Field(
        None, description="Dataset configuration name (hub datasets); a list reads each and mixes them."
    )
    revision: str | None = Field(None, description="Hub revision of the dataset.")
    trust_remote_code: bool = Field(False, description="Allow the dataset's loading script to run.")
    field: str | None = Field(None, description="Text field for completion data (default 'text').")
    field_messages: str = Field(
        "messages", description="Field holding the list of messages (chat_template; sharegpt: default conversations)."
    )
    field_chosen: str | None = Field(None, description="rl: the field holding the chosen reply (or conversation).")
    field_rejected: str | None = Field(None, description="rl: the field holding the rejected reply (or conversation).")
    message_property_mappings: dict[str, str] | None = Field(
        None, description="Where each message keeps its role and content, e.g. {role: from, content: value}."
    )
    message_field_role: str | None = Field(None, description="Deprecated Axolotl spelling of mappings.role.")
    message_field_content: str | None = Field(None, description="Deprecated Axolotl spelling of mappings.content.")
    roles: dict[str, list[str]] | None = Field(
        None, description="Role aliases, e.g. {user: [human], assistant: [gpt]}; sharegpt: {input: [...], "
        "output: [...]}, the senders read as the user's and as the model's.",
    )  # fmt: skip
    roles_to_train: list[str] = Field(
        ["assistant"],
        description="Roles whose content gets labels: the template's roles or the rows' own names (gpt), mapped as the rows are.",
    )
    train_on_eos: Literal["turn", "last", "all", "none"] = Field(
        "turn", description="Which end-of-turn tokens get labels: each trained turn's, the last, all, none."
    )
    train_on_eot: Literal["turn", "last", "all", "none"] | None = Field(
        None, description="As train_on_eos, for the recipe's eot_tokens (default: train_on_eos)."
    )
    message_field_training: str | None = Field(
        None, description="A per-message true/false field that overrides roles_to_train for that message."
    )
    message_field_training_detail: str | None = Field(
        None, description="A per-message field of {begin_offset, end_offset, train} ranges over the content (end "
        "inclusive): the message trains where they say. Content parts with train (or weight) flags make one too.",
    )  # fmt: skip
    split_thinking: bool = Field(
        False, description="Move an assistant's <think>...</think> block out of its content into reasoning_content "
        "(trained with the answer where the chat template renders it).",
    )  # fmt: skip
    field_thinking: str | None = Field(
        None,
        description="Message field holding reasoning text (chat_template; "
        "default: reasoning_content, where a message has it).",
    )
    field_system: str = Field(
        "system",
        description="chat_template: a row field with a system prompt, put first when "
        "the conversation has no system message (Axolotl from v0.9.0).",
    )
    field_tools: str = Field(
        "tools",
        description="chat_template: a row field with tool definitions (a list, or its "
        "JSON text), given to the chat template as `tools`.",
    )
    template_thinking_key: str | None = Field(
        None, description="Name the chat template reads reasoning from (default: field_thinking); trained with "
        "the answer.",
    )  # fmt: skip
    chat_template: str | None = Field(None, description="Per-dataset chat template (overrides the recipe's).")
    chat_template_jinja: str | None = Field(None, description="Per-dataset Jinja template (chat_template: jinja).")
    drop_system_message: bool = Field(False, description="Drop system messages before templating.")
    shards: int | None = Field(None, gt=0, description="Keep only one of this many shards (quick trials).")
    shards_idx: int = Field(
        0,
        ge=0,
        description="Which shard `shards` keeps: the rows shuffled by the recipe's "
        "seed, then this contiguous block (Axolotl's shuffle(seed).shard()).",
    )
    conversation: str | None = Field(
        None, description="sharegpt: the FastChat template (default vicuna_v1.1); alpaca_chat: the prompt style."
    )
    field_human: str | None = Field(None, description="sharegpt: the `from` value of the user's messages.")
    field_model: str | None = Field(None, description="sharegpt: the `from` value of the model's messages.")
    strict: bool = Field(False, description="sharegpt (Axolotl 0.4): accepted; message keys are always detected.")
    skip: int | None = Field(None, ge=0, description="Skip this many rows at the start of the source.")
    step_separator: str = Field("\n", description="stepwise_supervised: text after each step (its last token is "
                                "labelled).")  # fmt: skip
    train_on_last_step_only: bool = Field(False, description="stepwise_supervised: label only the last step.")
    max_completion_length: int | None = Field(
        None, gt=0, description="stepwise_supervised: cut the steps (separators included) to this many tokens."
    )

    @field_validator("type", "data_files", "name", "field", "chat_template", "chat_template_jinja", mode="before")
    @classmethod
    def _dataset_empty(cls, value):
        return empty_to_none(value)

    _templates = field_validator("chat_template", "chat_template_jinja")(template_keys)

    @property
    def transform(self) -> bool:
        """The type names a function in the user's file (module.function), GRPO's dataset transform."""
        return is_transform(self.type)

    @field_validator("type")
    @classmethod
    def _known_type(cls, value):
        if isinstance(value, str):
            if value in PREFERENCE_TYPES and value not in TYPE_ALIASES:  # rl: checks the recipe's method takes it
                return value
            value = TYPE_ALIASES.get(value, value)
            base, _, style = value.partition(":")  # Axolotl's 'alpaca:chatml' prompt-style suffix
            base = TYPE_ALIASES.get(base, base)
            known = (*DATASET_TYPES, *LEGACY_TYPES)
            if base not in known and is_transform(base):
                return value  # module.function: a transform from the user's file (rl: grpo/gdpo, checked there)
            if base not in known and base.split(".")[0] in PREFERENCE_FAMILIES:
                raise ValueError(f"'{value}' is not one of the preference types llmtune converts; with rl: use one of "
                                 f"{', '.join(sorted(PREFERENCE_TYPES))}")  # fmt: skip
            if base not in known and base.split(".")[0] in AXOLOTL_TYPES:
                raise ValueError(f"Axolotl's dataset type '{value}' is not supported; use one of "
                                 f"{', '.join(DATASET_TYPES)} (or a custom format mapping)")  # fmt: skip
            if base not in known:
                raise ValueError(f"unknown dataset type '{value}'; use one of {', '.join(DATASET_TYPES)}, or one "
                                 "of Axolotl's older formats (sharegpt, alpaca_chat, oasst, ...)")  # fmt: skip
            dotted = TYPE_ALIASES.get(f"{base}.{style}", f"{base}.{style}")
            if style and dotted in known:  # Axolotl names its loader functions with a dot
                raise ValueError(f"type '{value}': did you mean {dotted}? (a loader function follows a dot; a colon "
                                 "gives an alpaca-style type its prompt style)")  # fmt: skip
            if base in STYLED and style and style not in PROMPT_STYLES:
                raise ValueError(f"type '{value}': the prompt style is one of {', '.join(PROMPT_STYLES)}")
            if style and base not in STYLED and value != "sharegpt:chat":  # (Axolotl read that one as sharegpt; it
                # refused the others: "unhandled prompt tokenization strategy")
                instead = (f"type: {base} with conversation: {style}" if base == "sharegpt" and style in CONVERSATIONS
                           else f"type: {base} with chat_template: {style}" if base == "chat_template"
                           else f"type: {base}")  # fmt: skip
                raise ValueError(f"type '{value}': a ':{style}' prompt style belongs to the alpaca-style types "
                                 f"({', '.join(STYLED)}); for this data write {instead}")  # fmt: skip
            return f"{base}:{style}" if base in STYLED and style not in ("", "instruct") else base
        return value

    @field_validator("conversation")
    @classmethod
    def _conversation(cls, value, info):
        """`conversation:` names a FastChat template for sharegpt, a prompt style for alpaca_chat."""
        kind = info.data.get("type")
        kind = kind if isinstance(kind, str) else ""
        if value and kind.startswith("sharegpt") and value not in CONVERSATIONS:
            raise ValueError(
                f"'{value}' is not one of the FastChat templates llmtune writes: {', '.join(CONVERSATIONS)}"
            )
        if value and kind == "alpaca_chat" and value not in PROMPT_STYLES:
            raise ValueError(f"'{value}' for alpaca_chat is a prompt style: {', '.join(PROMPT_STYLES)}")
        return value

    @model_validator(mode="after")
    def _shard(self):
        if self.chat_template_jinja and not self.chat_template:
            self.chat_template = "jinja"  # the entry's own text is its template (the recipe's key does the same)
        kind = self.type if isinstance(self.type, str) else ""
        if kind.startswith("sharegpt") and "field_messages" not in self.model_fields_set:
            # ShareGPT rows keep their messages under `conversations` (ultrachat's under `messages`); set here, not
            # at read time, so that the recipe the ranks reload from plan.json says the same
            self.field_messages = "messages" if kind == "sharegpt.load_ultrachat" else "conversations"
        if self.shards_idx and (not self.shards or self.shards_idx >= self.shards):
            raise ValueError(f"shards_idx {self.shards_idx} needs shards above it")
        return self

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
    val_set_size: float = Field(
        0.0,
        ge=0.0,
        description="Eval split: a fraction (< 1, rounded up) or a number of examples (> 1), "
        "the last ones after shuffling (as Axolotl's train_test_split takes them).",
    )
    dataset_prepared_path: str | None = Field(
        "last_run_prepared", description="Cache folder for tokenized data (keyed by data, tokenizer and recipe)."
    )
    dataset_processes: int | None = Field(None, gt=0, description="Worker processes for tokenization.")
    shuffle_merged_datasets: bool = Field(True, description="Shuffle after mixing datasets.")
    sequence_len: int = Field(2048, gt=0, description="Maximum tokens per training row.")
    excess_length_strategy: Literal["drop", "truncate", "raise"] = Field(
        "drop",
        description="What to do with examples longer than sequence_len: drop them, truncate them, or "
        "raise (stop with an error naming the first such row). GRPO prompts past sequence_len minus "
        "trl.max_completion_length are dropped under truncate too (TRL trains whole prompts).",
    )
    sample_packing: bool = Field(False, description="Pack several examples per row, with no attention between them.")
    eval_sample_packing: bool | None = Field(None, description="Pack eval rows too (default: as sample_packing).")
    pad_to_sequence_len: bool = Field(False, description="Pad every row to sequence_len (fixed shapes); with "
                                      "padding-free batches, pad each micro-batch to micro_batch_size x sequence_len "
                                      "tokens (one pad segment no token attends to).")  # fmt: skip
    batch_flattening: bool | Literal["auto"] | None = Field(
        None, description="Padding-free batches: a micro-batch is its rows concatenated, positions restarting per "
        "row, read by a varlen attention kernel (no pad token computed, no attention mask). Default (or auto): on "
        "wherever the model and the plan allow it; false: padded rows with an attention mask; true: required.",
    )  # fmt: skip
    train_on_inputs: bool = Field(False, description="Also train on prompt tokens (no -100 labels).")
    default_system_message: str | None = Field(
        None, description="sharegpt with conversation chatml or llama3, when chat_template names the same template: "
        "the system message of conversations that have none (instead of 'You are a helpful assistant.').",
    )  # fmt: skip

    @field_validator("test_datasets", "dataset_prepared_path", "pretraining_dataset", "eot_tokens", mode="before")
    @classmethod
    def _data_empty(cls, value):
        value = empty_to_none(value)
        return [value] if isinstance(value, dict) else value  # Axolotl accepts one mapping for a list

    @field_validator("pretraining_dataset", mode="before")
    @classmethod
    def _pretraining_as_a_name(cls, value):
        """Axolotl v0.3.0-v0.4.0 took one hub id or path as a string (loaded with split train, streamed)."""
        return [{"path": value.strip()}] if isinstance(value, str) and value.strip() else value

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
        if self.val_set_size == 1:  # Axolotl: a count above 1, a fraction up to it (1: datasets refuses all rows)
            raise ValueError(
                "val_set_size: 1 is read as the fraction 1.0 (every row, as Axolotl reads it), which "
                "leaves nothing to train; write a fraction below 1 (0.05) or a count of 2 or more"
            )
        if self.val_set_size > 1 and self.val_set_size != int(self.val_set_size):
            raise ValueError("val_set_size must be a fraction below 1 or a whole number of examples")
        return self
