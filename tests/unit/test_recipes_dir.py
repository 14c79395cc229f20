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
    world = max(2, loaded.recipe.pipeline_parallel_size * 2)
    for device in ("cuda", "cpu"):
        plan = make_plan(loaded.recipe, make_cluster(world, device=device))
        assert plan.world_size == world
        assert plan.global_batch_size >= plan.data_parallel_size
