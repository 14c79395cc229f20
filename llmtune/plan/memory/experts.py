"""How LoRA reaches a mixture of experts' fused expert weights, for the estimate: no model built, nothing imported.

transformers 5 holds each MoE layer's routed experts as two 3D tensors (gate_up_proj: every expert's gate and up
projections, down_proj), parameters rather than linear layers. peft adapts them where it maps transformers 4's
per-expert module names onto them: for the families transformers converts from Mixtral's or Qwen2-MoE's checkpoint
layout (its conversion table, read here as text) and Mixtral itself; gate and up, fused, take rank 2r there. In the
other families (peft 0.21: Qwen2-MoE itself, GraniteMoE, PhiMoE, gpt-oss, Llama 4, Qwen3.5-MoE) all-linear leaves
the experts frozen, and only lora_target_parameters adapts them, each tensor at rank r. The worker says which
happened (adapters.frozen_experts); tests/unit/test_estimate_moe_lora.py compares these counts with peft's.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

PEFT_MAPPED_LAYOUTS = ("mixtral", "qwen2_moe")  # the checkpoint layouts peft maps expert names for
GATE, UP, DOWN = ("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")  # transformers 4's names (Mixtral's)


@functools.cache
def conversion_layouts() -> dict[str, str] | None:
    """transformers' model type -> checkpoint layout table (_MODEL_TO_CONVERSION_PATTERN in conversion_mapping.py,
    a literal dict read from the file); None where there is none (transformers 4: experts are linear layers)."""
    spec = importlib.util.find_spec("transformers")  # the package's folder, without importing it (nor torch)
    if spec is None or not spec.origin:
        return None
    try:
        tree = ast.parse((Path(spec.origin).parent / "conversion_mapping.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_MODEL_TO_CONVERSION_PATTERN"
                                                for t in node.targets):  # fmt: skip
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return None
            return table if isinstance(table, dict) else None
    return None


def peft_maps_experts(model_type: str) -> bool | None:
    """Whether peft maps per-expert module names (and all-linear) onto this family's fused expert tensors; None
    where transformers has no fused experts (its experts are linear layers, adapted as such)."""
    table = conversion_layouts()
    if table is None:
        return None
    return model_type == "mixtral" or table.get(model_type) in PEFT_MAPPED_LAYOUTS


def fused_expert_lora(
    hidden: int, width: int, rank: int, chosen: set[str] | None, parameters: list[str], mapped: bool
) -> int:
    """One expert's adapter parameters in one layer (the caller multiplies by experts and layers): gate_up_proj
    (hidden -> 2·width) and down_proj (width -> hidden), each adapted through a mapped module name (rank 2r for the
    fused pair, r for down) or a lora_target_parameters entry (rank r)."""

    def named(names: tuple[str, ...]) -> bool:
        return mapped and (chosen is None or any(name in chosen for name in names))

    def listed(tensor: str) -> bool:
        return any(entry == tensor or entry.endswith(f".{tensor}") for entry in parameters)

    total = 0
    if named(GATE) and named(UP):
        total += 2 * rank * (hidden + 2 * width)
    elif listed("gate_up_proj"):
        total += rank * (hidden + 2 * width)
    if named(DOWN) or listed("down_proj"):
        total += rank * (width + hidden)
    return total
