"""Mappings a recipe hands on to a library function as keyword arguments: `lr_scheduler_kwargs` (transformers'
schedule function) and `gradient_checkpointing_kwargs` (torch's checkpoint). Their keys are checked against what
the function takes, so that a misspelt one is a line naming it at validate instead of a TypeError at step 1."""

from __future__ import annotations

import inspect

from llmtune.errors import did_you_mean
from llmtune.recipe.training import constant_phase, named_schedule, quadratic_warmup

# transformers passes these itself (get_scheduler)
SCHEDULER_OWN = ("optimizer", "num_warmup_steps", "num_training_steps")
# torch.utils.checkpoint.checkpoint reads this one from **kwargs (its other options are keyword-only parameters)
CHECKPOINT_POPPED = ("preserve_rng_state",)


def unknown_key(given: dict, accepted: list[str], key: str, where: str) -> str | None:
    """The message for the first key of `given` that `accepted` lacks, else None."""
    for name in given:
        if name not in accepted:
            close = did_you_mean(str(name), accepted)
            return (f"{key}.{name}: {where} takes no such argument"
                    + (f" (did you mean {close}?)" if close else f"; it takes {', '.join(accepted) or 'none'}"))  # fmt: skip
    return None


def check_passed_kwargs(recipe) -> str | None:
    """The message for a key a library function would refuse at its call, else None."""
    if recipe.lr_scheduler_kwargs and not (quadratic_warmup(recipe) or constant_phase(recipe)):
        from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType

        name, kwargs = named_schedule(recipe)  # what the Trainer is handed (a cosine floor: cosine_with_min_lr)
        function = TYPE_TO_SCHEDULER_FUNCTION.get(SchedulerType(name))
        parameters = inspect.signature(function).parameters.values() if function else []
        if function and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            accepted = [p.name for p in parameters if p.name not in SCHEDULER_OWN]
            said = unknown_key(kwargs, accepted, "lr_scheduler_kwargs",
                               f"lr_scheduler: {recipe.lr_scheduler} ({function.__name__})")  # fmt: skip
            if said:
                return said
    if recipe.gradient_checkpointing_kwargs:
        from torch.utils.checkpoint import checkpoint

        parameters = inspect.signature(checkpoint).parameters.values()
        accepted = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY] + list(CHECKPOINT_POPPED)
        return unknown_key(recipe.gradient_checkpointing_kwargs, accepted, "gradient_checkpointing_kwargs",
                           "torch.utils.checkpoint.checkpoint")  # fmt: skip
    return None
