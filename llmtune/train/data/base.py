"""What every dataset format shares: the ignore label, row errors, the format context and small helpers.

Kept apart from formats.py so that the format modules (formats, instruct, sharegpt) import it without a circle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

IGNORE = -100


@dataclass
class PreparedData:
    """What a run trains on: train and eval rows (TokenRows, PackedRows, or preference rows as TRL's strings)."""

    train: Sequence[dict]
    eval: Sequence[dict] | None
    stats: dict = field(default_factory=dict)


def no_progress(items, _description):
    return items


def split_eval(train, size: float):
    """val_set_size: the last `size` rows (a fraction below 1, rounded up, or a count) become the eval set, as
    Axolotl's `train_test_split(test_size, shuffle=False)` takes them. Returns (eval, train)."""
    import math

    from llmtune.errors import UserError

    count = int(size) if size >= 1 else math.ceil(size * len(train))
    if count >= len(train):
        raise UserError(f"val_set_size {size} leaves no training examples (there are {len(train)})")
    return train[len(train) - count :], train[: len(train) - count]


def arrange(train, evaluation, recipe) -> tuple:
    """The merged rows as a run draws them: the training rows in `merged_order` (shuffled, sharded), eval rows
    sharded alike, then val_set_size's split of the training rows. Returns (train, eval)."""
    from llmtune.errors import UserError
    from llmtune.recipe.mixing import merged_order

    def take(rows, order):
        if order is None:
            return rows
        return rows.reorder(order) if hasattr(rows, "reorder") else [rows[i] for i in order]

    count = len(train)
    train = take(train, merged_order(count, recipe))
    if evaluation is not None:
        evaluation = take(evaluation, merged_order(len(evaluation), recipe, shuffle=False))
    if not len(train):
        raise UserError(f"dataset_shard_idx {recipe.dataset_shard_idx} of dataset_shard_num {recipe.dataset_shard_num} "
                        f"holds no training rows (the datasets give {count})", "lower dataset_shard_num")  # fmt: skip
    if evaluation is not None and not len(evaluation):  # the Trainer would stop at its first evaluation
        sharded = recipe.dataset_shard_num is not None
        raise UserError("test_datasets leave no eval rows" + (f" in shard {recipe.dataset_shard_idx} of "
                        f"{recipe.dataset_shard_num}" if sharded else " (every row dropped)"),
                        ("lower dataset_shard_num, or " if sharded else "") + "check the rows against "
                        f"{recipe.test_row_limit[0]} (excess_length_strategy:"
                        " truncate keeps long rows), or remove test_datasets")  # fmt: skip
    if recipe.val_set_size:
        evaluation, train = split_eval(train, recipe.val_set_size)
    return train, evaluation


class RowError(ValueError):
    """A row that doesn't match its dataset type, with a hint on what to change where there is a better one than
    fixing the row."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


@dataclass
class FormatContext:
    tokenizer: object
    spec: object  # DatasetSpec
    train_on_inputs: bool
    sequence_len: int
    template: str | None = None  # the resolved chat template, for chat_template rows
    eot_ids: frozenset[int] = frozenset()  # the recipe's eot_tokens; empty: the first special token ends a turn
    num_labels: int = 2  # process_reward_model: the step labels the head has
    # the recipe's (chat_template, default_system_message) when both are set: sharegpt's chatml or llama3
    # conversation of that name uses the message as its default system prompt (as Axolotl did)
    default_system: tuple[str, str] | None = None
    template_name: str | None = None  # the recipe's (or dataset's) chat_template as written, for messages


Example = tuple[list[int], list[int]]  # input_ids, labels


def _field(row: dict, name: str, kind=str, required: bool = True):
    if name not in row or row[name] is None:
        if required and name in row:
            raise RowError(f"field '{name}' is null")
        if required:
            raise RowError(f"missing field '{name}' (row has: {', '.join(map(str, row)) or 'nothing'})")
        return kind()
    value = row[name]
    if kind is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        # a number where text is read (an answer of 4; a CSV reader types a column of numbers as numbers): its
        # digits; NaN is a CSV's empty cell in such a column
        if value != value:
            return _field({}, name, kind, required)
        return str(value)
    if not isinstance(value, kind):
        raise RowError(f"field '{name}' should be {kind.__name__}, not {type(value).__name__}")
    return value


def _ids(tokenizer, text: str, special: bool = False) -> list[int]:
    return tokenizer(text, add_special_tokens=special)["input_ids"] if text else []


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _prompt_answer(ctx: FormatContext, prompt: str, answer: str) -> list[Example]:
    """The prompt, then the answer and the EOS, as Axolotl tokenizes them: an empty answer adds nothing (no EOS
    trained alone, which would teach answering with nothing), an answer already ending in the EOS no second one."""
    prompt_ids = _ids(ctx.tokenizer, prompt, special=True)
    answer_ids, eos = _ids(ctx.tokenizer, answer), _eos(ctx.tokenizer)
    if answer and not (eos and answer_ids[-1:] == eos):
        answer_ids += eos
    labels = (prompt_ids if ctx.train_on_inputs else [IGNORE] * len(prompt_ids)) + answer_ids
    return [(prompt_ids + answer_ids, labels)]


def empty_data(recipe, what: str):
    """The error for data of which no row was read (an empty file, or a split with nothing in it): the files named,
    and no hint about lengths (nothing was too long). `what`: 'training examples', 'preference rows', 'prompts'."""
    from llmtune.errors import UserError

    files = ", ".join(str(spec.path) for spec in recipe.datasets)
    return UserError(f"no usable {what}: 0 rows read from {files}",
                     "the data is empty: add rows (JSON lines: one object per line), or check path / split")  # fmt: skip
