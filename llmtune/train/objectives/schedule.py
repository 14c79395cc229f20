"""The learning-rate schedule: transformers' named schedules, with the recipe's cosine floor, Axolotl's quadratic
warm-up (lr_quadratic_warmup) before a cosine decay, Axolotl's constant phase after the decay
(cosine_constant_lr_ratio), and Axolotl's jagged restarts (jagged_restart_steps, ReLoRA's
schedule) on top of any of them. One place for the HF Trainer and the pipeline loop alike."""

from __future__ import annotations

import math
from functools import partial

from llmtune.recipe.training import constant_phase, named_schedule, quadratic_warmup


def quadratic_warmup_cosine(step: int, *, warmup: int, total: int, floor: float) -> float:
    """The LR multiplier: (step / warmup)^2 while warming up, then a half cosine from 1 down to `floor` (Axolotl's
    get_cosine_schedule_with_quadratic_warmup where `floor` is 0, as every recipe's is)."""
    if step < warmup:
        return (step / max(1, warmup)) ** 2
    progress = (step - warmup) / max(1, total - warmup)
    return floor + (1 - floor) * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def cosine_to_constant(step: int, *, warmup: int, total: int, constant: float, floor: float) -> float:
    """The LR multiplier of Axolotl's cosine_constant_lr_ratio: step / warmup while warming up, then a half cosine
    from 1 down to `floor` that ends at int(total * constant) steps, and `floor` from there on."""
    if step < warmup:
        return step / max(1, warmup)
    end = int(total * constant)
    progress = (min(step, end) - warmup) / max(1, end - warmup)
    return floor + (1 - floor) * max(0.0, 0.5 * (1 + math.cos(math.pi * progress)))


def jagged_restart_scale(step: int, *, every: int, warmup: int, anneal: int, floor: float) -> float:
    """The multiplier Axolotl's jagged restarts (v0.12+ JaggedLRRestartScheduler; ReLoRAScheduler before) put on the
    schedule's LR: 1 through the first cycle until its anneal; then in each cycle of `every` steps a linear rise
    from `floor` over `warmup` steps after the restart and a linear fall over the last `anneal` steps before the next.
    The restart step itself runs at `floor`: the step right after a ReLoRA merge moves the fresh adapter gently."""
    if step < every - anneal:
        return 1.0
    progress = step % every
    if progress < warmup:
        rise = progress / warmup
    elif progress > every - anneal:
        rise = (every - progress) / anneal
    else:
        rise = 1.0
    return rise * (1 - floor) + floor


def jagged_restarts(recipe):
    """The jagged multiplier of the recipe as a function of the step, or None without jagged_restart_steps."""
    if not getattr(recipe, "jagged_restart_steps", None):  # (tests pass a namespace of the schedule's keys)
        return None
    # Axolotl's floor: cosine_min_lr_ratio when set, else 0.001
    return partial(jagged_restart_scale, every=recipe.jagged_restart_steps, warmup=recipe.jagged_restart_warmup_steps,
                   anneal=recipe.jagged_restart_anneal_steps, floor=recipe.cosine_min_lr_ratio or 0.001)  # fmt: skip


def own_schedule(recipe) -> bool:
    """True when llmtune builds the scheduler itself (make_scheduler) rather than leaving it to the Trainer."""
    return quadratic_warmup(recipe) or constant_phase(recipe) or jagged_restarts(recipe) is not None


def _product(step: int, *, inner, scale) -> float:
    return inner(step) * scale(step)


# Axolotl's warm-up where a recipe sets neither warmup_steps nor warmup_ratio: 3% of the run's steps, at most 100
DEFAULT_WARMUP = (0.03, 100)


def warmup_steps(recipe, total_steps: int | None) -> int | float:
    """The warm-up as Axolotl computes it (core/builders/base.py, _configure_warmup_and_logging, v0.4.0 on):
    warmup_steps as given; warmup_ratio x the run's steps, rounded down; neither, 3% of them, at most 100; one step
    becomes two. `total_steps`: the optimizer steps of num_epochs, capped by max_steps (Axolotl's total_num_steps);
    None where unknown: the ratio, for transformers to apply."""
    ratio = recipe.warmup_ratio if recipe.warmup_ratio is not None else DEFAULT_WARMUP[0]
    if recipe.warmup_steps is not None:
        steps = recipe.warmup_steps
    elif total_steps:
        steps = int(ratio * total_steps)
        steps = steps if recipe.warmup_ratio is not None else min(steps, DEFAULT_WARMUP[1])
    else:
        return ratio
    return 2 if steps == 1 else steps


def run_steps(recipe, epoch_steps: int | None) -> int | None:
    """Axolotl's total_num_steps: num_epochs of optimizer steps, capped by max_steps; None where the epoch's length
    is unknown and max_steps unset."""
    import math

    total = math.ceil(recipe.num_epochs * epoch_steps) if epoch_steps else None
    if recipe.max_steps:
        return min(total, recipe.max_steps) if total else recipe.max_steps
    return total


def make_scheduler(recipe, optimizer, warmup: int, total: int):
    """The scheduler for `total` optimizer steps with `warmup` of them warming up."""
    from torch.optim.lr_scheduler import LambdaLR

    if quadratic_warmup(recipe):
        # 0 for every recipe that loads: Axolotl drops the floor (and lr_scheduler_kwargs) beside the quadratic
        # warm-up, so a recipe setting one with it is refused (recipe/training.py, schedule_conflict)
        floor = recipe.cosine_min_lr_ratio or 0.0
        scheduler = LambdaLR(optimizer, partial(quadratic_warmup_cosine, warmup=warmup, total=total, floor=floor))
    elif constant_phase(recipe):
        scheduler = LambdaLR(optimizer, partial(cosine_to_constant, warmup=warmup, total=total,
                                                constant=recipe.cosine_constant_lr_ratio,
                                                floor=recipe.cosine_min_lr_ratio))  # fmt: skip
    else:
        from transformers import get_scheduler

        name, kwargs = named_schedule(recipe)
        scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total,
                                  scheduler_specific_kwargs=kwargs)  # fmt: skip
    scale = jagged_restarts(recipe)
    if scale is None:
        return scheduler
    if not isinstance(scheduler, LambdaLR):  # every schedule the recipe can name is one; a guard, not a path
        raise TypeError(f"jagged_restart_steps needs a LambdaLR schedule, not {type(scheduler).__name__}")
    # the schedule's own multipliers, each times the jagged one (one per parameter group)
    return LambdaLR(optimizer, [partial(_product, inner=inner, scale=scale) for inner in scheduler.lr_lambdas])
