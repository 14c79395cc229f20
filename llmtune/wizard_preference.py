"""`llmtune config` after SFT: preference training (DPO, IPO, ORPO, KTO, SimPO) on an llmtune run's result.

A base model that is an llmtune output folder (llmtune/plan.json beside a saved model or adapter) is an SFT result:
the wizard offers preference training on it. An adapter result is continued (its base as base_model,
`lora_model_dir:` the folder, its settings from adapter_config.json); a full model is the new base_model. The SFT
run's recipe (plan.json "recipe") gives the chat template, tokenizer, sequence length and precision to carry over.
`--rl` (or any preference flag) asks for preference training on any base model too.

The questions live here (which type a first row is: wizard_preference_rows.py), the conversation's order in
wizard.py; the estimate is of the recipe text written here (wizard.py renders it without a strategy for the
strategy question), so the two cannot differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtune.errors import UserError
from llmtune.recipe.preference import KEY_METHODS, KTO_TYPES, PAIR_TYPES, RL_METHODS
from llmtune.recipe.writer import STRATEGIES, Answers, block, closing_blocks, header_block
from llmtune.wizard_preference_rows import (
    ONE_OF,
    fields_text,
    first_row,
    guess_type,
    kind_problem,
    row_problem,
    type_fields,
)
from llmtune.wizard_sft import SftResult, read_sft_result

FLAGS = ("rl", "preference_data", "preference_type", "rl_beta", "orpo_alpha", "simpo_gamma", "cpo_alpha")
METHODS = {
    "dpo": "DPO: pairs (chosen vs rejected), a frozen reference model keeps the policy close",
    "ipo": "IPO: DPO's pairs with a squared loss that doesn't overfit confident pairs (reference model)",
    "orpo": "ORPO: pairs, no reference model, the SFT loss built in (among the lightest)",
    "simpo": "SimPO: pairs, no reference model, length-normalised rewards (among the lightest)",
    "kto": "KTO: single completions labelled good or bad, no pairs needed (reference model)",
}
# rl_beta by method: TRL's 0.1 for DPO, IPO (its tau) and KTO; SimPO's paper tunes beta in 2.0-2.5 (its gamma is
# a margin in those units), and TRL's 0.1 there makes gamma / beta a margin of 5 nats per token.
BETA = {"dpo": 0.1, "ipo": 0.1, "kto": 0.1, "simpo": 2.0}
# Learning rates: TRL's preference configs default to 1e-6 for a full model; adapters take about 10x the full rate
# (the alignment handbook's Zephyr DPO: 5e-7 full, 5e-6 QLoRA). Both are 20x below the wizard's SFT rates: the model
# is already tuned, and a preference step should move it only a little from where it is (the reference).
LEARNING_RATE = {"full": 1e-6, "lora": 1e-5, "qlora": 1e-5}
DEFAULT_DATA = {"pairs": "Intel/orca_dpo_pairs", "kto": "argilla/ultrafeedback-binarized-preferences-cleaned-kto"}
DEFAULT_TYPE = {"pairs": "chatml.intel", "kto": "chatml.ultra"}
# user_defined.default's fields by kind, and the names each is looked for under in a first row (else the first)
USER_DEFINED = {
    "pairs": {"field_prompt": ONE_OF, "field_chosen": ("chosen", "chosen_response"),
              "field_rejected": ("rejected", "rejected_response")},
    "kto": {"field_prompt": ONE_OF, "field_completion": ("completion",), "field_label": ("label",)},
}  # fmt: skip
# From the SFT run's recipe: how it read text (template, tokenizer, tokens) and ran the model (attention kernel).
# resize_token_embeddings_to_32x: the embeddings' shape the adapter's saved rows have (a size mismatch otherwise)
CARRIED = ("chat_template", "chat_template_jinja", "default_system_message", "eot_tokens", "tokenizer_type",
           "tokenizer_use_fast", "trust_remote_code", "special_tokens", "tokens", "resize_token_embeddings_to_32x",
           "attn_implementation", "flash_attention", "sdp_attention", "flex_attention", "eager_attention")  # fmt: skip
CARRIED_FOR_ADAPTER = ("tokenizer_config", "revision_of_model", "base_model_config")  # they describe its base
QUANTIZED_BASE = ("load_in_8bit", "gptq")
ADAPTER_NAMES = {"lora": "LoRA", "qlora": "QLoRA"}
SPLIT_STRATEGIES = ("pipeline", "context_parallel", "tensor_parallel")  # TRL's trainers run none of them


@dataclass
class Preference:
    rl: str = "dpo"
    data: str = ""
    type: Any = ""  # a type name, or user_defined's mapping
    extra: dict = field(default_factory=dict)  # dataset keys the type needs (field_messages, ...)
    rl_beta: float | None = None
    orpo_alpha: float | None = None
    simpo_gamma: float | None = None
    cpo_alpha: float | None = None
    sft: SftResult | None = None

    @property
    def kind(self) -> str:
        return "kto" if self.rl == "kto" else "pairs"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def start(given: dict[str, Any], answers: Answers, ask, want, sft_flags: bool) -> Preference | None:
    """After the base-model answer: preference training, or None for SFT. Sets the answers the SFT run decides."""
    if given.get("rl") is not None and given["rl"] not in RL_METHODS:
        raise UserError(f"--rl {given['rl']!r} is not one of {', '.join(RL_METHODS)}")
    flagged = next((_flag(k) for k, v in given.items() if v is not None), None)
    if flagged and sft_flags:
        raise UserError(f"{flagged} asks for preference training, whose data is --preference-data, not "
                        "--dataset/--dataset-type", "drop the SFT data flags")  # fmt: skip
    sft = read_sft_result(answers.base_model)
    if sft is None and not flagged:
        return None
    if sft is not None and sft.adapter is not None and sft_flags and not flagged:
        raise UserError(f"--base-model {sft.folder} is a LoRA adapter (an SFT result): `llmtune config` continues it "
                        "with preference training (--rl)", f"for more SFT, set lora_model_dir: {sft.folder} in an "
                        "SFT recipe with its base model")  # fmt: skip
    if sft is not None and not flagged:
        if sft_flags:
            return None
        step = "preference"
        title = f"{sft.folder} is an llmtune SFT result ({sft.describe()}). Next step:"
        if sft.adapter is None:
            step = ask.select(title, [("preference", "preference training (DPO, IPO, ORPO, KTO, SimPO) on this SFT "
                                       "result"), ("sft", "supervised fine-tuning again, starting from it")],
                              "preference")  # fmt: skip
        else:
            ask.show(f"{title} preference training (DPO, IPO, ORPO, KTO, SimPO) on it, continuing the adapter")
        if step == "sft":
            return None
    pref = Preference(sft=sft)
    pref.rl = given.get("rl") or ask.select("Preference method:", list(METHODS.items()), "dpo")
    for key in ("orpo_alpha", "simpo_gamma", "cpo_alpha"):
        if given.get(key) is not None and pref.rl not in KEY_METHODS[key]:
            raise UserError(f"{_flag(key)} belongs to --rl {' or '.join(KEY_METHODS[key])}, not --rl {pref.rl}")
    if not want("strategy") and answers.strategy in SPLIT_STRATEGIES:
        raise UserError(f"--strategy {answers.strategy}: TRL's preference trainers split no layers, rows or stages",
                        "use ddp, a ZeRO stage or fsdp")  # fmt: skip
    if pref.rl == "orpo" and given.get("rl_beta") is not None and given.get("orpo_alpha") is not None:
        raise UserError("--rl-beta and --orpo-alpha both set ORPO's weight (TRL's beta); give one")
    if sft is not None:
        _from_sft(sft, answers, want)
    return pref


def _from_sft(sft: SftResult, answers: Answers, want) -> None:
    recipe = sft.recipe
    if sft.adapter is not None:
        method = "qlora" if recipe.get("adapter") == "qlora" or recipe.get("load_in_4bit") else "lora"
        if not want("method") and answers.method != method:
            raise UserError(f"--method {answers.method}: {sft.folder} is a {ADAPTER_NAMES[method]} adapter, and "
                            "preference training continues it (lora_model_dir)",
                            f"drop --method, or give --method {method}")  # fmt: skip
        answers.method = method
    if want("sequence_len") and recipe.get("sequence_len"):
        answers.sequence_len = int(recipe["sequence_len"])
    if want("mixed_precision") and recipe:
        on = [p for p in ("bf16", "fp16") if recipe.get(p) in (True, "auto")]
        answers.mixed_precision = on[0] if on else "no"


# --- the data and the method's numbers ---------------------------------------------------------------------------


def ask_data(given: dict[str, Any], pref: Preference, ask, existing) -> None:
    """The preference data, its type (preselected from the first row of a local JSON/JSONL file), the numbers."""
    kind, allowed = pref.kind, (KTO_TYPES if pref.kind == "kto" else PAIR_TYPES)
    pref.data = given.get("preference_data") or ask.text(
        f"Preference data ({'prompt, completion, label' if kind == 'kto' else 'pairs'}; local .jsonl/.json/.parquet "
        "file or hub id):", DEFAULT_DATA[kind], lambda v: existing(v) or kind_problem(v, pref.rl))  # fmt: skip
    problem = kind_problem(pref.data, pref.rl)
    if problem:
        raise UserError(f"--preference-data {pref.data}: {problem}")
    row = first_row(Path(pref.data).expanduser())
    guessed = guess_type(row, kind) if row else None
    pref.type, pref.extra = guessed or (DEFAULT_TYPE[kind], {})
    if guessed:
        ask.show(f"{pref.data}: the first row has {', '.join(map(str, row))}: type {guessed[0]}")
    elif row is not None:
        ask.show(f"{pref.data}: no type reads the first row's fields ({', '.join(map(str, row))}); pick one")
    if given.get("preference_type") is not None:
        pref.type = given["preference_type"]
        if pref.type not in allowed:
            raise UserError(f"--preference-type {pref.type} is not a type for --rl {pref.rl}; use one of "
                            f"{', '.join(allowed)}")  # fmt: skip
    else:
        choices = [(t, f"{t} ({fields_text(type_fields(kind, t)) or 'a mapping of your field names'})"
                    + ("  [matches the first row]" if guessed and t == guessed[0] else ""))
                   for t in allowed]  # fmt: skip
        while True:
            pref.type = ask.select("Preference data format:", choices, pref.type)
            if not ask.interactive or not row or pref.type == "user_defined.default":
                break
            mismatch = row_problem(row, kind, pref.type, pref.extra if guessed and pref.type == guessed[0] else {})
            if not mismatch:
                break
            ask.show(f"{pref.data}: {mismatch}")
    if guessed is None or pref.type != guessed[0]:
        pref.extra = {}
    if pref.type == "user_defined.default":
        pref.type = _ask_fields(row or {}, kind, ask)
    mismatch = row_problem(row, kind, pref.type, pref.extra) if row else None
    if mismatch and ask.interactive:  # the fields typed for user_defined: theirs to know
        ask.show(f"{pref.data}: {mismatch}")
    elif mismatch:  # a recipe whose data its type can't read would stop at the first row
        name = given.get("preference_type") or f"(default {DEFAULT_TYPE[kind]})"
        raise UserError(f"--preference-type {name} for --rl {pref.rl}: {mismatch}",
                        "give the type that reads these fields; without --yes, user_defined.default asks "
                        "for their names")  # fmt: skip
    _ask_numbers(given, pref, ask)


def _ask_fields(row: dict, kind: str, ask) -> dict:
    """user_defined.default's mapping: each field's name, preselected from the first row where it has one."""
    names = {key: next((n for n in candidates if n in row), candidates[0])
             for key, candidates in USER_DEFINED[kind].items()}  # fmt: skip
    if "system" in row:
        names["field_system"] = "system"
    return {key: ask.text(f"Field of the {key[6:]}:", name) for key, name in names.items()}


def _number(low: float, strict: bool):
    def check(value: str) -> str | None:
        try:
            number = float(value)
        except ValueError:
            return "a number"
        return (
            None if (number > low if strict else number >= low) else f"a number {'above' if strict else 'from'} {low}"
        )

    return check


def _ask_numbers(given: dict[str, Any], pref: Preference, ask) -> None:
    def number(key: str, question: str, default: float, strict: bool = True) -> float:
        if given.get(key) is not None:
            problem = _number(0, strict)(str(given[key]))
            if problem:
                raise UserError(f"{_flag(key)} {given[key]} is not {problem}")
            return float(given[key])
        return float(ask.text(question, str(default), _number(0, strict)))

    if pref.rl == "orpo":  # ORPO's weight is rl_beta or orpo_alpha (TRL's beta): one of them
        if given.get("rl_beta") is not None:
            pref.rl_beta = number("rl_beta", "", 0.1)
        else:
            pref.orpo_alpha = number("orpo_alpha", "ORPO alpha (weight of the odds-ratio term beside the SFT loss):",
                                     0.1)  # fmt: skip
        return
    how = "IPO's tau (smaller: further from the reference)" if pref.rl == "ipo" else (
        "SimPO's beta (reward scale)" if pref.rl == "simpo" else "Beta (smaller: the policy may move further from "
        "the reference)")  # fmt: skip
    pref.rl_beta = number("rl_beta", f"{how}:", BETA[pref.rl])
    if pref.rl == "simpo":
        pref.simpo_gamma = number("simpo_gamma", "SimPO gamma (target reward margin):", 0.5, strict=False)
        pref.cpo_alpha = number("cpo_alpha", "CPO alpha (weight of the chosen reply's NLL; 0: SimPO as published):",
                                0.0, strict=False)  # fmt: skip


# --- the recipe ---------------------------------------------------------------------------------------------------


def _set(recipe: dict, keys: tuple) -> dict:
    """The keys the SFT recipe set away from their defaults (empty, false and default-true values left out)."""
    values = {}
    for key in keys:
        value = recipe.get(key)
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None} or None
        if value in (None, False, "", [], {}) or (key == "tokenizer_use_fast" and value is True):
            continue
        values[key] = value
    return values


def _adapter_block(answers: Answers, pref: Preference) -> tuple[str, dict]:
    sft = pref.sft
    if sft is not None and sft.adapter is not None:
        config = sft.adapter
        targets = config.get("target_modules")
        values = {"adapter": answers.method, "lora_model_dir": sft.folder, "lora_r": int(config.get("r") or 8),
                  "lora_alpha": int(config.get("lora_alpha") or 16),
                  "lora_dropout": float(config.get("lora_dropout") or 0.0),
                  "lora_target_modules": sorted(targets) if isinstance(targets, list) else targets}  # fmt: skip
        if not targets:
            values.pop("lora_target_modules")
            values["lora_target_linear"] = True
        values.update({k: True for k, p in (("peft_use_dora", "use_dora"), ("peft_use_rslora", "use_rslora"))
                       if config.get(p)})  # fmt: skip
        if config.get("modules_to_save"):
            values["lora_modules_to_save"] = sorted(config["modules_to_save"])
        if answers.method == "qlora":
            values["load_in_4bit"] = True
        values.update(_set(sft.recipe, QUANTIZED_BASE))
        reference = " It is also the reference model (a frozen copy)." if pref.rl in ("dpo", "ipo", "kto") else ""
        return (f"{ADAPTER_NAMES[answers.method]}: continue training the SFT adapter (lora_model_dir), with its "
                f"settings as its adapter_config.json has them (peft reads them from there).{reference}",
                values)  # fmt: skip
    values = {
        "adapter": answers.method,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "lora_target_linear": True,
    }
    if answers.method == "qlora":
        values["load_in_4bit"] = True
    reference = (" The reference model is the base with the adapter switched off (no second copy)."
                 if pref.rl in ("dpo", "ipo", "kto") else "")  # fmt: skip
    return f"{ADAPTER_NAMES[answers.method]}: train new low-rank adapters on every linear layer.{reference}", values


def blocks(answers: Answers, pref: Preference) -> list[tuple[str, dict]]:
    """(comment, keys) for every part of the recipe but the strategy and the output folder."""
    sft = pref.sft
    adapter_result = sft is not None and sft.adapter is not None
    model = {"base_model": sft.base if adapter_result else answers.base_model}
    if sft is not None:
        model.update(_set(sft.recipe, CARRIED + (CARRIED_FOR_ADAPTER if adapter_result else ())))
        if adapter_result and (Path(sft.folder).expanduser() / "tokenizer_config.json").is_file():
            model["tokenizer_config"] = sft.folder  # the tokenizer the SFT run saved: its template, its tokens
    where = (f"the SFT result {sft.folder} ({sft.describe()}); tokenizer and chat template as that run had them"
             if sft is not None else "a hub id or a local folder")  # fmt: skip
    out = [(f"The model: {where}.", model)]
    if answers.method != "full":
        out.append(_adapter_block(answers, pref))
    method = {"rl": pref.rl}
    method.update({k: getattr(pref, k) for k in ("rl_beta", "orpo_alpha", "simpo_gamma", "cpo_alpha")
                   if getattr(pref, k) is not None})  # fmt: skip
    out.append((f"Preference training: {METHODS[pref.rl]}.", method))
    dataset = {"path": pref.data, "type": pref.type, **pref.extra}
    fields = fields_text(type_fields(pref.kind, pref.type))
    out.append((f"Preference data and its format ({fields}).", {"datasets": [dataset]}))
    rate = LEARNING_RATE[answers.method]
    training = {"sequence_len": answers.sequence_len, "sample_packing": False,
                "micro_batch_size": answers.micro_batch_size,
                "gradient_accumulation_steps": answers.gradient_accumulation_steps,
                "num_epochs": answers.num_epochs, "learning_rate": rate, "lr_scheduler": "cosine",
                "warmup_ratio": 0.1, "gradient_checkpointing": answers.gradient_checkpointing}  # fmt: skip
    batch = ("micro_batch_size completions and as many mismatched ones for KTO's KL term" if pref.kind == "kto"
             else "chosen and rejected together (2 x micro_batch_size sequences)")  # fmt: skip
    out.append((f"Training. Each step runs {batch}; no packing (TRL pads each row).\nlearning_rate: TRL's default "
                "for a full model (1e-6), about 10x that for adapters; 20x below SFT's, as the model is already "
                "tuned.", training))  # fmt: skip
    out.append(("Mixed precision.", {"bf16": False} if answers.mixed_precision == "no"
                else {answers.mixed_precision: True}))  # fmt: skip
    return out


def default_output_dir(answers: Answers, pref: Preference) -> str:
    if pref.sft is not None:
        return f"./outputs/{Path(pref.sft.folder).expanduser().resolve().name}-{pref.rl}"
    return f"./outputs/{answers.base_model.rstrip('/').split('/')[-1].lower()}-{answers.method}-{pref.rl}"


def recipe_text(answers: Answers, pref: Preference, recipe_path: str, estimate_line: str | None,
                written_on: str) -> str:  # fmt: skip
    """The commented preference recipe, in Axolotl's keys."""
    label = STRATEGIES[answers.strategy][0]
    header = [f"Written by `llmtune config` on {written_on}. Check it with: llmtune validate {recipe_path}",
              f"Preference training ({METHODS[pref.rl].split(':')[0]}) on "
              + (f"the SFT result {pref.sft.folder}." if pref.sft else f"{answers.base_model}."),
              f"Strategy: {label}, on {answers.num_machines} machine(s) x {answers.gpus_per_machine} GPU(s)."
              ]  # fmt: skip
    parts = [header_block(header, answers, recipe_path, estimate_line)]
    parts += [block(comment, values) for comment, values in blocks(answers, pref)]
    return "\n".join(parts + closing_blocks(answers, label))
