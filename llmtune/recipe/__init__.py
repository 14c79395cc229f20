"""The recipe room: YAML in, a validated and normalised `Recipe` out."""

from llmtune.recipe.loader import LoadedRecipe, load_recipe
from llmtune.recipe.schema import Recipe

__all__ = ["LoadedRecipe", "Recipe", "load_recipe"]
