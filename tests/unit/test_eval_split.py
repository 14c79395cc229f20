"""val_set_size and shuffle_merged_datasets pick the rows Axolotl picks: datasets' shuffle(seed) permutation, then
train_test_split(test_size, shuffle=False), which takes the last ceil(test_size x n) rows for eval."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from llmtune.recipe.mixing import merged_order
from llmtune.train.data.base import split_eval


@pytest.mark.parametrize(("rows", "size"), [(16, 0.2), (25, 0.1), (16, 0.15), (10, 0.5), (30, 4)])
def test_the_eval_rows_are_the_ones_datasets_train_test_split_takes(rows, size):
    """It took the first round(f x n) rows: 3 of 16 at 0.2 (rows 0-2) where Axolotl evaluates on 4 (rows 12-15)."""
    from datasets import Dataset

    data = Dataset.from_dict({"i": list(range(rows))})
    theirs = data.train_test_split(test_size=size, shuffle=False)
    evaluation, train = split_eval(list(range(rows)), size)
    assert (evaluation, train) == (theirs["test"]["i"], theirs["train"]["i"])


@pytest.mark.parametrize("seed", [42, 0, 7])
def test_the_merged_rows_are_shuffled_as_datasets_shuffles_them(seed):
    from datasets import Dataset

    data = Dataset.from_dict({"i": list(range(50))})
    assert merged_order(50, SimpleNamespace(seed=seed, shuffle_merged_datasets=True, curriculum_sampling=False,
                                            dataset_shard_num=None)) == data.shuffle(seed=seed)["i"]
