from pathlib import Path

from llmtune.recipe.reference import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "recipe-reference.md"


def test_recipe_reference_is_up_to_date():
    assert DOC.read_text() == render(), "run: python -m llmtune.recipe.reference > docs/recipe-reference.md"


def test_reference_lists_every_top_level_key():
    from llmtune.recipe import Recipe

    text = DOC.read_text()
    missing = [k for k in Recipe.model_fields if f"| `{k}` |" not in text]
    assert not missing
