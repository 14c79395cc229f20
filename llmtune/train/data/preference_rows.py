"""Preference data for `rl:` recipes: each dataset's rows as TRL's strings, length-checked, split and shuffled.

TRL tokenizes the strings itself (its trainers own the prompt masking and the pair layout), so what llmtune adds is
what its SFT path adds: Axolotl's types (train/data/preference.py), one-line errors naming the row, the lengths
checked against sequence_len and max_prompt_len before any GPU starts, and the same split and shuffle.
"""

from __future__ import annotations

from llmtune.errors import UserError
from llmtune.recipe.mixing import shuffle_each
from llmtune.recipe.preference import preference_type
from llmtune.train.data.base import PreparedData, arrange, empty_data, no_progress
from llmtune.train.data.preference import context_for, convert_rows, converter_for
from llmtune.train.data.sources import read_rows

# The dataset keys that say where a row's fields are (preference.py reads them from the context's options).
OPTION_KEYS = ("field_messages", "field_chosen", "field_rejected", "message_property_mappings", "roles",
               "message_field_role", "message_field_content")  # fmt: skip


def _template(spec, recipe, tokenizer) -> str | None:
    """The recipe's (or the dataset's) chat_template; None leaves it to the tokenizer's own or the type's family."""
    from llmtune.train.data.templates import resolve_chat_template

    name = spec.chat_template or recipe.chat_template
    if name is None:
        return None
    return resolve_chat_template(name, spec.chat_template_jinja or recipe.chat_template_jinja, tokenizer)


def _lengths(row: dict, tokenizer) -> tuple[int, int]:
    """(prompt tokens, longest reply's tokens as TRL will see them: the eos TRL appends when missing counted)."""

    def count(text: str, reply: bool) -> int:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = tokenizer.eos_token
        return len(ids) + (1 if reply and eos and not text.endswith(eos) else 0)

    replies = [row[k] for k in ("chosen", "rejected", "completion") if k in row]
    return count(row["prompt"], False), max(count(r, True) for r in replies)


def _keep_end(text: str, tokenizer, count: int) -> str:
    """The end of `text` that is at most `count` tokens, cut where a token starts."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [start for start, _ in encoded["offset_mapping"]]
    for first in range(len(starts) - count, len(starts)):
        kept = text[starts[first] :]
        if len(tokenizer(kept, add_special_tokens=False)["input_ids"]) <= count:
            return kept
    return ""


def read_group(specs, group: str, recipe, tokenizer, stats: dict, progress) -> list[dict]:
    rows: list[dict] = []
    for index, spec in enumerate(specs):
        label, start = f"{group}[{index}]", len(rows)
        kind = spec.type.model_dump(exclude_none=True) if hasattr(spec.type, "model_dump") else spec.type
        options = {key: getattr(spec, key) for key in OPTION_KEYS if getattr(spec, key, None) is not None}
        ctx = context_for(recipe.rl, kind, tokenizer, _template(spec, recipe, tokenizer), options, label)
        convert = converter_for(recipe.rl, preference_type(kind), label)
        read = progress(read_rows(spec, label, recipe.streaming, recipe.seed), f"reading {label}")
        for number, row in enumerate(convert_rows(read, convert, ctx, label, preference_type(kind)), 1):
            stats["rows"] += 1
            prompt, reply = _lengths(row, tokenizer)
            if recipe.max_prompt_len and prompt > recipe.max_prompt_len:
                if recipe.excess_length_strategy != "truncate":
                    stats["dropped_long_prompt"] += 1
                    continue
                # as TRL's max_prompt_length did: the prompt's last tokens, the ones next to the reply
                row = {**row, "prompt": _keep_end(row["prompt"], tokenizer, recipe.max_prompt_len)}
                prompt = _lengths(row, tokenizer)[0]
                stats["truncated_prompt"] += 1
            if prompt + reply > recipe.sequence_len:
                if recipe.excess_length_strategy == "raise":
                    raise UserError(f"{label}: row {number} is {prompt + reply} tokens (prompt and longest reply), "
                                    f"longer than sequence_len {recipe.sequence_len} (excess_length_strategy is "
                                    "raise)", "shorten or remove the row, raise sequence_len, or set "
                                    "excess_length_strategy: drop or truncate")  # fmt: skip
                if recipe.excess_length_strategy == "drop" or prompt >= recipe.sequence_len:
                    stats["dropped_too_long"] += 1
                    continue
                stats["truncated"] += 1  # TRL keeps the start: the prompt whole, the replies cut
            rows.append(row)
        shuffle_each(rows, start, recipe, len(specs))
    return rows


def prepare_preference_data(recipe, tokenizer, progress=no_progress) -> PreparedData:
    stats = {"rows": 0, "dropped_too_long": 0, "truncated": 0, "dropped_long_prompt": 0, "truncated_prompt": 0,
             "dropped_no_labels": 0, "dropped_duplicates": 0, "cache_hit": False, "cache_dir": None}  # fmt: skip
    train = read_group(recipe.datasets, "datasets", recipe, tokenizer, stats, progress)
    evaluation = read_group(recipe.test_datasets, "test_datasets", recipe, tokenizer, stats, progress) \
        if recipe.test_datasets else None  # fmt: skip
    if recipe.dataset_exact_deduplication:
        seen: set[tuple] = set()
        for group in (train, evaluation or []):
            kept = []
            for row in group:
                key = tuple(sorted(row.items()))
                stats["dropped_duplicates"] += key in seen
                if key not in seen:
                    seen.add(key)
                    kept.append(row)
            group[:] = kept
    if not train and not stats["rows"]:
        raise empty_data(recipe, "preference rows")
    if not train:
        # truncate keeps the end of a prompt over max_prompt_len and cuts replies, never a prompt over sequence_len
        hint = "raise sequence_len (or max_prompt_len)" + ("" if recipe.excess_length_strategy == "truncate" else
                                                           ", or set excess_length_strategy: truncate")  # fmt: skip
        raise UserError(f"no usable preference rows: {stats['rows']} read, {stats['dropped_too_long']} longer than "
                        f"sequence_len {recipe.sequence_len}, {stats['dropped_long_prompt']} with a prompt over "
                        f"max_prompt_len", hint)  # fmt: skip
    train, evaluation = arrange(train, evaluation, recipe)
    if recipe.rl == "kto":
        labels = {bool(row["label"]) for row in train}
        if len(labels) < 2:
            which = "desirable" if True in labels else "undesirable"
            raise UserError(f"rl: kto needs desirable and undesirable completions; every training row is {which}",
                            "check the label field (true for desirable)")  # fmt: skip
    stats.update(train_examples=len(train), eval_examples=len(evaluation) if evaluation else 0, train_rows=len(train))
    return PreparedData(train, evaluation or None, stats)
