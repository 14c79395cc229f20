"""Every shipped recipe validates and plans, and opens with a comment giving its command."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.plan import make_cluster, make_plan
from llmtune.recipe import load_recipe

RECIPES = sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml"))


def test_there_are_recipes():
    assert len(RECIPES) >= 6


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_validates_and_plans(path, monkeypatch, tmp_path):
    root = path.parents[1]
    # Paths in recipes are relative to the repository root; the demo model only exists after `make demo`,
    # so run from a copy of the root where it stands in as an empty file.
    for entry in root.iterdir():
        if entry.name != ".demo":
            (tmp_path / entry.name).symlink_to(entry)
    demo = tmp_path / ".demo"
    demo.mkdir()
    (demo / "SmolLM2-135M-Instruct.Q4_1.gguf").touch()
    monkeypatch.chdir(tmp_path)
    text = path.read_text()
    assert text.startswith("#"), "a recipe opens with a comment"
    assert "llmtune " in text.split("\n\n")[0] or "llmtune " in "".join(text.splitlines(True)[:8])
    loaded = load_recipe(path)
    recipe = loaded.recipe
    world = max(2, recipe.pipeline_parallel_size * 2)
    # what each data-parallel rank takes per optimizer step: micro-batches (pipeline) or accumulation steps
    per_step = recipe.pipeline_microbatches if recipe.pipeline_parallel_size > 1 else recipe.gradient_accumulation_steps
    model_parallel = recipe.pipeline_parallel_size * recipe.tensor_parallel_size * recipe.context_parallel_size
    for device in ("cuda", "cpu"):
        plan = make_plan(recipe, make_cluster(world, device=device))
        assert plan.world_size == world and plan.data_parallel_size == world // model_parallel
        assert plan.global_batch_size == recipe.micro_batch_size * per_step * plan.data_parallel_size
