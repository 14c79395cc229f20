"""The learning-rate schedule: transformers' named schedules, with the recipe's cosine floor, and Axolotl's quadratic
warm-up (lr_quadratic_warmup) before a cosine decay. One place for the HF Trainer and the pipeline loop alike."""

from __future__ import annotations

import math
from functools import partial


def named_schedule(recipe) -> tuple[str, dict]:
    """transformers' scheduler name and kwargs for the recipe (cosine with a floor is cosine_with_min_lr)."""
    name, kwargs = recipe.lr_scheduler, dict(recipe.lr_scheduler_kwargs or {})
    if recipe.cosine_min_lr_ratio is not None and name in ("cosine", "cosine_with_min_lr"):
        name, kwargs["min_lr_rate"] = "cosine_with_min_lr", recipe.cosine_min_lr_ratio
    return name, kwargs


def quadratic_warmup(recipe) -> bool:
    """Axolotl applies lr_quadratic_warmup to the cosine schedule only (with or without a floor)."""
    return bool(recipe.lr_quadratic_warmup) and recipe.lr_scheduler in ("cosine", "cosine_with_min_lr")


def quadratic_warmup_cosine(step: int, *, warmup: int, total: int, floor: float) -> float:
    """The LR multiplier: (step / warmup)^2 while warming up, then a half cosine from 1 down to `floor`."""
    if step < warmup:
        return (step / max(1, warmup)) ** 2
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def make_scheduler(recipe, optimizer, warmup: int, total: int):
    """The scheduler for `total` optimizer steps with `warmup` of them warming up."""
    if quadratic_warmup(recipe):
        from torch.optim.lr_scheduler import LambdaLR

        floor = recipe.cosine_min_lr_ratio or float((recipe.lr_scheduler_kwargs or {}).get("min_lr_rate", 0.0))
        return LambdaLR(optimizer, partial(quadratic_warmup_cosine, warmup=warmup, total=total, floor=floor))
    from transformers import get_scheduler

    name, kwargs = named_schedule(recipe)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                         scheduler_specific_kwargs=kwargs)  # fmt: skip
