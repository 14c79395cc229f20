"""Preference training keys (`rl:` and its options), spelled as Axolotl spells them, and what goes with what.

The trainers are TRL's (llmtune/train/preference.py maps these keys onto their configs): DPO and IPO (one of DPO's
loss types) on `DPOTrainer`, KTO on `KTOTrainer`, ORPO on `trl.experimental.orpo`, SimPO on CPO's trainer with
`loss_type: simpo`. Every check here names the key and says why, so a recipe TRL can't honour stops before launch.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from llmtune.errors import did_you_mean
from llmtune.recipe.base import Section, empty_to_none, unfilled_placeholder
from llmtune.recipe.trl_trainers import INERT, refuse_clashes

RL_METHODS = ("dpo", "ipo", "orpo", "kto", "simpo")  # preference training: fixed pairs or labelled completions
ONLINE_METHODS = ("grpo", "gdpo")  # online RL: generations scored by reward functions (llmtune/recipe/online.py)
# Axolotl's other `rl:` values: its own methods.
RL_NOT_YET = {"ebft": "EBFT"}
# TRL 1.16 DPOConfig.loss_type values
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")  # fmt: skip
# Methods that keep a reference model (or its precomputed log-probs); ORPO and SimPO are reference-free.
WITH_REFERENCE = ("dpo", "ipo", "kto")

# Axolotl's preference dataset types (train/data/preference.py converts them; a unit test keeps the two in step).
_FAMILY_PAIR = ("default", "argilla", "argilla_chat", "icr", "intel", "prompt_pairs", "ultra")
_FAMILY_KTO = ("argilla", "argilla_chat", "intel", "prompt_pairs", "ultra")
PAIR_TYPES = (*(f"{f}.{t}" for f in ("chatml", "llama3") for t in _FAMILY_PAIR), "chat_template.default",
              "chat_template.argilla_chat", "chat_template.argilla", "user_defined.default", "passthrough")  # fmt: skip
KTO_TYPES = (*(f"{f}.{t}" for f in ("chatml", "llama3") for t in _FAMILY_KTO), "user_defined.default", "passthrough")
TYPE_ALIASES = {"chatml": "chatml.default", "llama3": "llama3.default", "chat_template": "chat_template.default",
                "user_defined": "user_defined.default", "passthrough.default": "passthrough"}  # fmt: skip
ALL_TYPES = frozenset((*PAIR_TYPES, *KTO_TYPES, *TYPE_ALIASES))

# The keys of Axolotl's `trl:` section that a preference trainer takes (TRL's TR-DPO reference sync included);
# the others are GRPO's (generation, rewards, vLLM).
TRL_PREFERENCE_KEYS = ("beta", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps")
TRL_GRPO_KEYS = frozenset("""
    max_completion_length use_vllm vllm_mode vllm_server_host vllm_server_port vllm_server_timeout
    vllm_guided_decoding_regex reward_funcs reward_weights generation_batch_size num_generations log_completions
    num_completions_to_print importance_sampling_level scale_rewards temperature top_p top_k min_p
    repetition_penalty generation_kwargs chat_template_kwargs num_iterations epsilon epsilon_high use_liger_loss
    loss_type mask_truncated_completions vllm_enable_sleep_mode rollout_func multi_objective_aggregation
    use_data_producer async_prefetch prefetch_depth vllm_sync_interval streaming_partial_batch streaming_min_groups
    vllm_importance_sampling_correction vllm_importance_sampling_mode vllm_importance_sampling_cap
    off_policy_mask_threshold use_bias_correction_kl reward_num_workers replay_buffer_size replay_recompute_logps
    reroll_start_fraction reroll_max_groups skip_zero_advantage_batches vllm_lora_sync
    num_generations_eval shuffle_dataset pad_to_multiple_of steps_per_generation cache_implementation
    vllm_model_impl vllm_structured_outputs_regex vllm_server_base_url vllm_group_port vllm_gpu_memory_utilization
    vllm_max_model_length vllm_tensor_parallel_size delta sapo_temperature_neg sapo_temperature_pos top_entropy_quantile
    entropy_coef vllm_importance_sampling_clip_max vllm_importance_sampling_clip_min log_unique_prompts
    max_tool_calling_iterations disable_dropout
""".split())  # GRPOConfig's fields (TRL 1.16) and Axolotl's names; the worker checks them against TRL's own  # fmt: skip

# Which method each key belongs to (a key set for another method is an error, not silently unused).
KEY_METHODS = {
    "dpo_loss_type": ("dpo",), "dpo_loss_weights": ("dpo",), "dpo_label_smoothing": ("dpo",),
    "dpo_norm_loss": ("dpo",), "rpo_alpha": ("dpo",), "dpo_use_weighting": ("dpo", "ipo"),
    "dpo_padding_free": ("dpo", "ipo"), "orpo_alpha": ("orpo",), "simpo_gamma": ("simpo",), "cpo_alpha": ("simpo",),
    "kto_desirable_weight": ("kto",), "kto_undesirable_weight": ("kto",), "precompute_ref_log_probs": WITH_REFERENCE,
}  # fmt: skip


def _one_of(name, names: tuple, message: str) -> None:
    if name not in names:
        guess = did_you_mean(str(name), names)
        raise ValueError(f"{message}; use one of {', '.join(names)}" + (f" (did you mean '{guess}'?)" if guess else ""))


class PreferenceFormat(Section):
    """user_defined.default's mapping (given as the dataset's `type:`): where each field is and how it's written."""

    field_prompt: str | None = None
    field_system: str | None = None
    field_chosen: str | None = None
    field_rejected: str | None = None
    field_completion: str | None = None
    field_label: str | None = None
    prompt_format: str | None = None
    chosen_format: str | None = None
    rejected_format: str | None = None
    completion_format: str | None = None


class VllmSection(Section):
    """Axolotl's `vllm:` section: the engine `llmtune vllm-serve` starts (server mode) or TRL colocates."""

    host: str = Field("0.0.0.0", description="Address the vLLM server listens on.")
    port: int = Field(8000, gt=0, lt=65536, description="Its port.")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs the server splits the model over.")
    data_parallel_size: int = Field(1, gt=0, description="Model replicas the server runs.")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="Share of each GPU vLLM may take.")
    dtype: str = Field("auto", description="vLLM's dtype (auto, bfloat16, float16).")
    max_model_len: int | None = Field(None, gt=0, description="vLLM's context length (prompt + completion).")
    enable_prefix_caching: bool | None = Field(None, description="vLLM's prefix caching.")


class PreferenceKeys(Section):
    rl: str | None = Field(None, description="Preference training after SFT: " + ", ".join(RL_METHODS) + "; online "
                           "RL: " + ", ".join(ONLINE_METHODS) + " (TRL).")  # fmt: skip
    rl_beta: float | None = Field(None, description="How far the policy may move from the reference (TRL's beta); "
                                  "for IPO its tau.")  # fmt: skip
    dpo_loss_type: list[str] | None = Field(None, description="DPO's loss, or several combined with "
                                            "dpo_loss_weights: " + ", ".join(DPO_LOSS_TYPES) + ".")  # fmt: skip
    dpo_loss_weights: list[float] | None = Field(None, description="One weight per dpo_loss_type.")
    dpo_label_smoothing: float | None = Field(None, ge=0.0, lt=0.5, description="Conservative/robust DPO: the "
                                              "probability a preference label is flipped.")  # fmt: skip
    dpo_use_weighting: bool | None = Field(None, description="WPO weighting of pairs by the policy's probability.")
    dpo_norm_loss: bool | None = Field(None, description="DPO on length-normalised log-probs (sigmoid_norm).")
    dpo_padding_free: bool | None = Field(None, description="Unpadded DPO batches (TRL 1.16: not available).")
    rpo_alpha: float | None = Field(None, gt=0, description="RPO: adds the chosen reply's NLL with this weight.")
    orpo_alpha: float | None = Field(None, gt=0, description="ORPO's odds-ratio weight (lambda; TRL's beta).")
    cpo_alpha: float | None = Field(None, ge=0, description="SimPO: weight of the chosen reply's NLL (CPO's BC term).")
    simpo_gamma: float | None = Field(None, description="SimPO's target reward margin.")
    kto_desirable_weight: float | None = Field(None, gt=0, description="KTO: weight of desirable completions.")
    kto_undesirable_weight: float | None = Field(None, gt=0, description="KTO: weight of undesirable completions.")
    precompute_ref_log_probs: bool | None = Field(None, description="Compute the reference's log-probs once before "
                                                  "training; no reference model is kept.")  # fmt: skip
    max_prompt_len: int | None = Field(
        None,
        gt=0,
        description="Pairs whose prompt is longer (tokens) are dropped; "
        "with excess_length_strategy: truncate, the prompt keeps its last tokens.",
    )
    trl: dict[str, Any] | None = Field(None, description="Axolotl's TRL section: " + ", ".join(TRL_PREFERENCE_KEYS)
                                       + " for preference training; GRPO's generation and reward keys for grpo and "
                                       "gdpo (llmtune/recipe/online.py).")  # fmt: skip
    vllm: VllmSection | None = Field(None, description="grpo/gdpo with trl.use_vllm: the vLLM server or colocated "
                                     "engine (host, port, tensor_parallel_size, gpu_memory_utilization, dtype, "
                                     "max_model_len, enable_prefix_caching).")  # fmt: skip

    @field_validator("rl", mode="before")
    @classmethod
    def _rl(cls, value):
        value = empty_to_none(value)
        if value is False:  # `rl: false` in older recipes
            return None
        if value is True:
            raise ValueError("rl: true names no method; use one of " + ", ".join(RL_METHODS))
        value = str(value).lower() if value is not None else None
        if value in RL_NOT_YET:
            raise ValueError(f"rl: {value} ({RL_NOT_YET[value]}) is not supported yet: llmtune trains "
                             f"{', '.join((*RL_METHODS, *ONLINE_METHODS))} through TRL")  # fmt: skip
        if value is not None:
            _one_of(value, (*RL_METHODS, *ONLINE_METHODS), f"rl: {value} is not a method llmtune trains")
        return value

    @field_validator("dpo_loss_type", mode="before")
    @classmethod
    def _loss_type(cls, value):
        value = empty_to_none(value)
        value = [value] if isinstance(value, str) else value
        if value is not None and not (isinstance(value, list) and all(isinstance(name, str) for name in value)):
            raise ValueError(f"dpo_loss_type is a loss name or a list of them (e.g. sigmoid), not {value!r}")
        for name in value or []:
            _one_of(name, DPO_LOSS_TYPES, f"'{name}' is not one of TRL's DPO loss types")
        return value

    @field_validator("trl", mode="before")
    @classmethod
    def _trl(cls, value):
        value = empty_to_none(value)
        if value is not None and not isinstance(value, dict):
            raise ValueError("trl: is a mapping of TRL arguments, e.g. {beta: 0.1}")
        for key, item in (value or {}).items():
            if key in TRL_PREFERENCE_KEYS or key in TRL_GRPO_KEYS or item in INERT:
                continue
            guess = did_you_mean(str(key), [*TRL_PREFERENCE_KEYS, *TRL_GRPO_KEYS])
            raise ValueError(f"unknown key 'trl.{key}'" + (f"; did you mean '{guess}'?" if guess else ""))
        # a GRPO key under a preference method is refused by check(), which knows the method
        return {k: v for k, v in (value or {}).items() if v is not None} or None


def preference_type(kind) -> str:
    """A dataset `type:` as the preference registry names it (a mapping: user_defined; none: passthrough)."""
    if kind is None:
        return "passthrough"
    if not isinstance(kind, str):
        return "user_defined.default"
    return TYPE_ALIASES.get(kind, kind)


def beta(recipe) -> float | None:
    """TRL's beta, as Axolotl reads it: trl.beta, else rl_beta (ORPO: orpo_alpha is its beta)."""
    trl = recipe.trl or {}
    if trl.get("beta") is not None:
        return trl["beta"]
    if recipe.rl == "orpo":
        return recipe.orpo_alpha if recipe.orpo_alpha is not None else recipe.rl_beta
    return recipe.rl_beta


def loss_types(recipe) -> tuple[list[str], list[float] | None]:
    """DPO's loss types and weights after Axolotl's shorthands: ipo, dpo_norm_loss (sigmoid_norm), rpo_alpha (the
    chosen reply's NLL, TRL's 'sft' loss, added with that weight: RPO)."""
    if recipe.rl == "ipo":
        return ["ipo"], None
    types = list(recipe.dpo_loss_type or (["sigmoid_norm"] if recipe.dpo_norm_loss else ["sigmoid"]))
    weights = list(recipe.dpo_loss_weights) if recipe.dpo_loss_weights else None
    if recipe.rpo_alpha:
        weights = (weights or [1.0] * len(types)) + [recipe.rpo_alpha]
        types.append("sft")
    return types, weights


def check(recipe) -> None:
    """What a recipe's `rl:` can go with; ValueError naming the key (the loader turns it into one line)."""
    set_keys = [key for key in KEY_METHODS if getattr(recipe, key) not in (None, False)]
    if not recipe.rl:
        for key in (*set_keys, "rl_beta", "max_prompt_len", "trl", "vllm"):
            if getattr(recipe, key) not in (None, False):
                raise ValueError(f"{key} belongs to preference training or online RL; set rl: "
                                 f"({', '.join((*RL_METHODS, *ONLINE_METHODS))})")  # fmt: skip
        _datasets_without_rl(recipe)
        return
    rl = recipe.rl
    for key in set_keys:
        if rl not in KEY_METHODS[key]:
            raise ValueError(f"{key} belongs to rl: {' or '.join(KEY_METHODS[key])}, not rl: {rl}")
    if (recipe.trl or {}).get("sync_ref_model") and recipe.adapter:
        raise ValueError(f"trl.sync_ref_model with adapter: {recipe.adapter}: TRL syncs a separate reference model, "
                         "and a LoRA run has none (its reference is the base with the adapter switched off, or the "
                         "starting adapter's copy); TRL refuses PEFT models here: drop trl.sync_ref_model, or train "
                         "the full model")  # fmt: skip
    if rl in ONLINE_METHODS:
        from llmtune.recipe.online import check_online

        check_online(recipe)
        return
    grpo_key = next((k for k, v in (recipe.trl or {}).items() if k in TRL_GRPO_KEYS and v not in INERT), None)
    if grpo_key:
        raise ValueError(f"trl.{grpo_key} is a GRPO setting (generation, rewards, vLLM): it belongs to rl: grpo or "
                         f"gdpo, and rl: {rl} takes only {', '.join(TRL_PREFERENCE_KEYS)}")  # fmt: skip
    if recipe.vllm:
        raise ValueError(f"vllm: with rl: {rl} is not supported: vLLM generates for rl: grpo or gdpo, and rl: {rl} "
                         "learns from fixed data")  # fmt: skip
    syncing = [k for k in recipe.trl or {} if k in TRL_PREFERENCE_KEYS and k != "beta"]
    if syncing and rl not in WITH_REFERENCE:
        raise ValueError(f"trl.{syncing[0]} syncs a reference model, which rl: {rl} doesn't have (it is "
                         "reference-free)")  # fmt: skip
    if recipe.dpo_loss_weights and len(recipe.dpo_loss_weights) != len(recipe.dpo_loss_type or ["sigmoid"]):
        raise ValueError(f"dpo_loss_weights has {len(recipe.dpo_loss_weights)} weights for "
                         f"{len(recipe.dpo_loss_type or ['sigmoid'])} dpo_loss_type(s); give one per loss type")  # fmt: skip
    if recipe.dpo_norm_loss and recipe.dpo_loss_type:
        raise ValueError("dpo_norm_loss is dpo_loss_type: sigmoid_norm; set one of them")
    if recipe.rpo_alpha and "sft" in (recipe.dpo_loss_type or []):
        raise ValueError("rpo_alpha adds TRL's 'sft' loss, which dpo_loss_type already has; set one of them")
    if recipe.dpo_padding_free:
        raise ValueError("dpo_padding_free: TRL 1.16's DPO has padding-free batches switched off (it would pad "
                         "anyway); remove it")  # fmt: skip
    if rl == "orpo" and recipe.orpo_alpha is not None and recipe.rl_beta is not None:
        raise ValueError("orpo_alpha and rl_beta both set ORPO's weight (TRL's beta); set one")
    why = {
        "sample_packing": "TRL's preference trainers pad each pair (its prompt masked); set sample_packing: false",
        "pipeline_parallel_size > 1": "TRL's trainers run through the HF Trainer, which pipeline stages replace",
        "tensor_parallel_size > 1": "TRL's trainers don't shard the reference model or their per-sequence log-probs "
        "across a tensor-parallel mesh",
        "context_parallel_size > 1": "TRL sums each sequence's log-probs over the whole row, which context "
        "parallelism splits across ranks",
    }  # fmt: skip
    refuse_clashes(recipe, why, "it changes the supervised loss or its data, which a preference loss replaces")
    _datasets_with_rl(recipe)


def _datasets_with_rl(recipe) -> None:
    allowed = KTO_TYPES if recipe.rl == "kto" else PAIR_TYPES
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            kind = spec.type
            if kind is not None and not isinstance(kind, str) and not isinstance(kind, PreferenceFormat):
                kind = _as_preference_format(kind, f"{group}[{index}]")
                spec.type = kind
            name = preference_type(kind)
            if name not in allowed:
                guess = did_you_mean(name, allowed)
                raise ValueError(f"{group}[{index}].type {name} is not a preference type for rl: {recipe.rl}; use "
                                 f"one of {', '.join(allowed)}" + (f" (did you mean {guess}?)" if guess else ""))  # fmt: skip


def _as_preference_format(kind, label: str) -> PreferenceFormat:
    """A mapping type parsed as SFT's custom format (its keys overlap): read as user_defined's, or refused."""
    values = kind.model_dump(exclude_unset=True)
    unknown = [key for key in values if key not in PreferenceFormat.model_fields]
    if unknown:
        raise ValueError(f"{label}.type.{unknown[0]} is not a user_defined preference key; use "
                         f"{', '.join(PreferenceFormat.model_fields)}")  # fmt: skip
    return PreferenceFormat(**values)


def _datasets_without_rl(recipe) -> None:
    for group in ("datasets", "test_datasets"):
        for index, spec in enumerate(getattr(recipe, group) or []):
            kind = spec.type
            custom = getattr(kind, "no_input_format", None) is not None  # SFT's custom mapping (recipe/data.py)
            for key in ("format", "no_input_format", "system_format") if custom else ():
                problem = unfilled_placeholder(getattr(kind, key), key)
                if problem:
                    raise ValueError(f"{group}[{index}].type.{key}: {problem}")
            if spec.transform:
                raise ValueError(f"{group}[{index}].type {kind} names a transform in your file, which GRPO's data "
                                 "takes: set rl: grpo (or gdpo), or use one of the dataset formats")  # fmt: skip
            side = "field_chosen" if spec.field_chosen else "field_rejected" if spec.field_rejected else None
            if side:
                raise ValueError(f"{group}[{index}].{side} belongs to preference data; set rl: dpo (ipo, orpo, "
                                 "simpo), or remove it")  # fmt: skip
            if isinstance(kind, PreferenceFormat):
                raise ValueError(f"{group}[{index}].type is a preference mapping ({', '.join(kind.model_fields_set)}"
                                 "); set rl: dpo (or kto), or use an instruction format's keys")  # fmt: skip
            if isinstance(kind, str) and kind in ALL_TYPES and kind != "chat_template":  # chat_template: SFT's too
                raise ValueError(f"{group}[{index}].type {kind} is preference data: set rl: dpo (ipo, orpo, simpo; "
                                 "kto for its own types)")  # fmt: skip
