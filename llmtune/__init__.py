"""llmtune: one Axolotl-style recipe, any scale of fine-tuning."""

__version__ = "0.1.0"
