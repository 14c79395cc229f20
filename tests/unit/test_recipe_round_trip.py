"""A resolved recipe is what the worker reads back (plan.json holds its dump, validated again on every rank): the dump
of every recipe must validate to the same recipe, whatever older spellings the recipe file used."""

from __future__ import annotations

from pathlib import Path

import pytest
from recipe_loading import load

from llmtune.errors import UserError
from llmtune.recipe.loader import read_yaml_mapping, recipe_from_mapping
from llmtune.recipe.schema import Recipe

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fixtures" / "axolotl_recipes"
FILES = sorted((ROOT / "recipes").glob("*.yaml")) + sorted(CORPUS.glob("*.yml"))

# keys the schema's validators fill in or rewrite (Axolotl's older spellings and values)
FILLED = [
    {"batch_size": 4, "micro_batch_size": 2},
    {"batch_size": 5},
    {"warmup_steps": 0.1},
    {"gradient_checkpointing": "offload_disk"},
    {"evals_per_epoch": 0, "val_set_size": 0.1},
    {"bf16": "full"},
    {"flash_attention": True},
    {"liger_swiglu": True},
    {"adapter": "lora", "relora_steps": 100},
    {"evaluation_strategy": "no", "save_strategy": False},
    {"max_packed_sequence_len": 512},
    {"tokens": {"pad_token": "<pad>"}},
    {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}},
    {"reward_model": True, "datasets": [{"path": "org/d", "type": "bradley_terry.chat_template"}]},
]


def same_after_dump(recipe: Recipe) -> None:
    for mode in ("python", "json"):
        again = Recipe.model_validate(recipe.model_dump(mode=mode))
        assert again.model_dump(mode="json") == recipe.model_dump(mode="json")


@pytest.mark.parametrize("changes", FILLED, ids=lambda c: "+".join(c))
def test_dump_of_filled_in_keys_validates_to_the_same_recipe(changes):
    same_after_dump(load(**changes).recipe)


def test_batch_size_is_read_as_the_accumulation_it_gives():
    recipe = load(batch_size=4, micro_batch_size=2).recipe
    assert (recipe.gradient_accumulation_steps, recipe.batch_size) == (2, None)
    assert load(batch_size=5, micro_batch_size=2).recipe.gradient_accumulation_steps == 2  # floored, as Axolotl does


def test_dump_of_every_shipped_and_corpus_recipe_validates_to_the_same_recipe():
    checked = 0
    for path in FILES:
        try:
            recipe = recipe_from_mapping(read_yaml_mapping(path), path, check_files=False).recipe
        except UserError:  # refused by a capability: the corpus tests say which
            continue
        same_after_dump(recipe)
        checked += 1
    assert checked > 40
