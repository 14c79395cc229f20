"""GRPO's data (`rl: grpo | gdpo`): each row's prompt (a string, or chat messages TRL renders with the tokenizer's
chat template) and the columns the reward functions read (e.g. the reference answer).

A dataset's `type` is a transform from the user's file, as Axolotl writes it: `transform(cfg)` returns
`(transform_fn, {"remove_columns": [...]})` and `transform_fn(row, tokenizer=...)` returns the new row; or no type,
for rows that carry a `prompt` already. A row without a prompt, or a transform that raises, is one line naming the
row. Prompts longer than sequence_len minus the completion budget are dropped before launch and counted (TRL's
GRPO trains whole prompts; there is no truncation to ask for), or stop it with excess_length_strategy: raise.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from llmtune.errors import UserError
from llmtune.recipe.mixing import shuffle_each
from llmtune.train.data.base import PreparedData, arrange, empty_data, no_progress
from llmtune.train.data.sources import read_rows


def _transform(function, recipe, key: str):
    made = function(SimpleNamespace(**recipe.model_dump()))
    if callable(made):
        return made, {}
    if isinstance(made, tuple) and len(made) == 2 and callable(made[0]):
        return made[0], dict(made[1] or {})
    raise UserError(f"{key}: the transform returned {type(made).__name__}; it must return (transform_fn, options) as "
                    "Axolotl's transforms do", "return transform_fn, {'remove_columns': [...]}")  # fmt: skip


def _call(transform_fn, row: dict, tokenizer):
    parameters = inspect.signature(transform_fn).parameters
    if "tokenizer" in parameters:
        return transform_fn(row, tokenizer=tokenizer)
    if "processing_class" in parameters:
        return transform_fn(row, processing_class=tokenizer)
    return transform_fn(row)


def _prompt_tokens(prompt, tokenizer) -> int:
    if isinstance(prompt, str):
        return len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    from llmtune.train.data.templates import template_kwargs

    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         **template_kwargs(tokenizer))  # fmt: skip
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def read_group(specs, group: str, recipe, tokenizer, functions: dict, stats: dict, progress) -> list[dict]:
    from llmtune.recipe.online import trl_value

    budget = recipe.sequence_len - int(trl_value(recipe, "max_completion_length", 512))  # TRL's default
    rows: list[dict] = []
    for index, spec in enumerate(specs):
        label, start = f"{group}[{index}]", len(rows)
        function = functions.get(f"{label}.type")
        transform_fn, options = _transform(function, recipe, f"{label}.type") if function else (None, {})
        drop = set(options.get("remove_columns") or [])
        for row, where in progress(read_rows(spec, label, recipe.streaming, recipe.seed), f"reading {label}"):
            stats["rows"] += 1
            if transform_fn is not None:
                try:
                    made = _call(transform_fn, dict(row), tokenizer)
                except Exception as err:
                    raise UserError(f"{where}: {spec.type} raised {type(err).__name__}: {err}",
                                    "fix the transform (or the row)") from None  # fmt: skip
                row = {k: v for k, v in {**row, **made}.items() if k not in drop or k in made}
            prompt = row.get("prompt")
            if not prompt or not isinstance(prompt, (str, list)):
                raise UserError(f"{where}: no prompt (a string or a list of chat messages) in the row"
                                + (f" {spec.type} returned" if transform_fn else ""),
                                "GRPO's rows need a 'prompt'; give the dataset a transform (type: module.function)")  # fmt: skip
            length = _prompt_tokens(prompt, tokenizer)
            if length > budget:
                if recipe.excess_length_strategy == "raise":
                    raise UserError(f"{where}: the prompt is {length} tokens, over the {budget} that sequence_len "
                                    f"{recipe.sequence_len} leaves beside trl.max_completion_length (excess_length_"
                                    "strategy is raise)", "shorten or remove the row, raise sequence_len, lower "
                                    "trl.max_completion_length, or set excess_length_strategy: drop")  # fmt: skip
                stats["dropped_too_long"] += 1
                continue
            rows.append(row)
        shuffle_each(rows, start, recipe, len(specs))
    return rows


def prepare_online_data(recipe, tokenizer, functions: dict, progress=no_progress) -> PreparedData:
    stats = {"rows": 0, "dropped_too_long": 0, "truncated": 0, "dropped_long_prompt": 0, "dropped_no_labels": 0,
             "dropped_duplicates": 0, "cache_hit": False, "cache_dir": None}  # fmt: skip
    train = read_group(recipe.datasets, "datasets", recipe, tokenizer, functions, stats, progress)
    evaluation = (read_group(recipe.test_datasets, "test_datasets", recipe, tokenizer, functions, stats, progress)
                  if recipe.test_datasets else None)  # fmt: skip
    if not train and not stats["rows"]:
        raise empty_data(recipe, "prompts")
    if not train:
        raise UserError(f"no usable prompts: {stats['rows']} read, {stats['dropped_too_long']} longer than "
                        "sequence_len minus trl.max_completion_length",
                        "raise sequence_len, or lower trl.max_completion_length")  # fmt: skip
    train, evaluation = arrange(train, evaluation, recipe)
    stats.update(train_examples=len(train), eval_examples=len(evaluation) if evaluation else 0, train_rows=len(train))
    return PreparedData(train, evaluation or None, stats)
