"""The supervised run a preference step starts from (`llmtune config --base-model <an llmtune output_dir>`): its
resolved recipe and what it saved (a LoRA adapter or a full model); a folder with no model yet is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmtune.errors import UserError


@dataclass
class SftResult:
    folder: str  # as the user gave it
    recipe: dict  # the SFT run's resolved recipe
    adapter: dict | None  # adapter_config.json; None for a full model

    @property
    def base(self) -> str:
        """What the adapter was trained on: the SFT recipe's base_model (a GGUF file stays one), else peft's record."""
        return self.recipe.get("base_model") or (self.adapter or {}).get("base_model_name_or_path") or self.folder

    def describe(self) -> str:
        return f"a LoRA adapter on {self.base}" if self.adapter is not None else "a full model"


def read_sft_result(name: str) -> SftResult | None:
    """The llmtune run a base-model answer names, or None when it names none."""
    folder = Path(name).expanduser()
    plan_file = folder / "llmtune" / "plan.json"
    if not plan_file.is_file():
        return None
    try:
        recipe = json.loads(plan_file.read_text()).get("recipe") or {}
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"--base-model {name}: llmtune/plan.json can't be read ({err})",
                        "point at a run's output_dir") from None  # fmt: skip
    if recipe.get("num_labels") or recipe.get("reward_model") or recipe.get("process_reward_model"):
        return None  # a reward model scores texts; it is no policy to train on preferences
    if (folder / "adapter_config.json").is_file():
        return SftResult(name, recipe, json.loads((folder / "adapter_config.json").read_text()))
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return SftResult(name, recipe, None)
    raise UserError(f"--base-model {name} is an llmtune run folder with no saved model yet (no adapter_config.json, "
                    "no config.json with safetensors)", "point at a finished run's output_dir")  # fmt: skip


def sft_problem(name: str) -> str | None:
    """For the base-model question: a run folder that holds no model yet is refused in place."""
    try:
        read_sft_result(name)
    except UserError as err:
        return err.message
    return None
