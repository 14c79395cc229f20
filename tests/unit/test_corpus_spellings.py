"""Spellings public Axolotl recipes carry (scripts/axolotl_corpus.tsv) whose intent is plain: honoured as llmtune's
key, each said once; the data order's own seed; and v0.4.0's documented `train_on_split` as the split to load."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping

BASE = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}]}


def loaded(**changes):
    return recipe_from_mapping({**BASE, **changes}, Path("r.yaml"), check_files=False)


@pytest.mark.parametrize(
    ("key", "value", "field"),
    [("epochs", 3, "num_epochs"), ("wandb_run_name", "run-1", "wandb_name"),
     ("tokenizer_path", "org/tokenizer", "tokenizer_config"), ("deepspeed_config", "zero2", "deepspeed")],
)  # fmt: skip
def test_a_plain_spelling_is_honoured_and_said(key, value, field):
    result = loaded(**{key: value})
    assert getattr(result.recipe, field) == value
    assert any(note.startswith(f"{key}: read as {field}: {value}") for note in result.notes)


def test_a_spelling_that_disagrees_with_the_key_itself_is_one_line():
    with pytest.raises(UserError, match="epochs .read as num_epochs: 3. and num_epochs: 2 disagree; keep num_epochs"):
        loaded(epochs=3, num_epochs=2)


def test_data_seed_orders_the_data_alone():
    from llmtune.train.engine.arguments import training_arguments

    plan = {"cluster": {"device": "cpu", "num_processes": 1, "num_machines": 1}, "precision": "no",
            "strategy": "single", "micro_batch_size": 1, "data_parallel_size": 1, "gradient_accumulation_steps": 1,
            "world_size": 1}  # fmt: skip
    for changes, expected in (({}, (42, 42)), ({"data_seed": 7}, (42, 7))):
        args = training_arguments(loaded(output_dir="/tmp/x", **changes).recipe, plan, 16, False)
        assert (args.seed, args.data_seed) == expected


def test_train_on_split_is_the_split_to_load():
    spec = loaded(datasets=[{"path": "org/data", "type": "alpaca", "train_on_split": "validation"}]).recipe.datasets[0]
    assert spec.split == "validation"
