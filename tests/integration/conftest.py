"""Integration fixtures (tiny models, data, recipes); the helpers live in harness.py."""

from harness import alpaca_file, make_recipe, tiny_model, tiny_model_4_layers  # noqa: F401
