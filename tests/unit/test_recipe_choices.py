"""Optimizer and schedule names: every one Axolotl or transformers takes that llmtune doesn't run is refused in one
line saying why and what to use; an unknown one gets a did-you-mean."""

from __future__ import annotations

import pytest
from recipe_loading import load, refusal

from llmtune.recipe.choices import OTHER_OPTIMIZERS, OTHER_SCHEDULERS
from llmtune.recipe.training import LR_SCHEDULERS, OPTIMIZERS, OWN_OPTIMIZERS


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("lr_scheduler", "rex", "use cosine"),
        ("lr_scheduler", "one_cycle", "use cosine"),
        ("lr_scheduler", "log_sweep", "use cosine"),
        ("lr_scheduler", "reduce_lr_on_plateau", "use cosine"),
        ("optimizer", "schedule_free_adamw", "use adamw_torch"),
        ("optimizer", "galore_adamw", "use adamw_torch"),
        ("optimizer", "adamw_hf", "use adamw_torch"),
        ("optimizer", "adamw_apex_fused", "use adamw_torch_fused"),
    ],
)
def test_known_names_llmtune_does_not_run_say_why_and_what_instead(key, value, instead):
    line = refusal(**{key: value})
    assert f"{key}: '{value}' (" in line and f"is not supported; {instead}" in line
    assert "Input should be" not in line


def test_unknown_names_get_a_did_you_mean():
    assert "did you mean 'adamw_torch'?" in refusal(optimizer="adamw_torhc")
    assert "did you mean 'cosine_with_restarts'?" in refusal(lr_scheduler="cosine_with_restart")
    assert "is not a name llmtune knows for optimizer" in refusal(optimizer="zzz")


def test_supported_names_still_load():
    assert load(optimizer="paged_adamw_8bit", lr_scheduler="inverse_sqrt").recipe.optimizer == "paged_adamw_8bit"
    assert load(lr_scheduler=None).recipe.lr_scheduler == "cosine"


def test_every_transformers_name_is_run_or_refused_with_a_reason():
    from transformers.trainer_utils import SchedulerType
    from transformers.training_args import OptimizerNames

    assert not set(OTHER_OPTIMIZERS) & set(OPTIMIZERS + OWN_OPTIMIZERS)
    assert not set(OTHER_SCHEDULERS) & set(LR_SCHEDULERS)
    assert {o.value for o in OptimizerNames} <= set(OPTIMIZERS) | set(OTHER_OPTIMIZERS)
    assert {s.value for s in SchedulerType} <= set(LR_SCHEDULERS) | set(OTHER_SCHEDULERS)
