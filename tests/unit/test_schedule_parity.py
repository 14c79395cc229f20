"""The learning rate of each step as Axolotl v0.18.0 runs a recipe (SchedulerMixin.create_scheduler,
utils/schedulers.py, and the warm-up of core/builders/base.py), against the rate llmtune's Trainer really uses: the
scheduler is built the way a rank builds it (training_arguments, then LlmtuneTrainer.create_scheduler) on a tiny
optimizer. The expected rates are worked out by hand from Axolotl's formulas, written as numbers or closed forms.
A schedule key Axolotl ignores in a recipe is refused at load, in one line (it was accepted and dropped, or it gave
rates the Axolotl run doesn't)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping

PLAN = {"precision": "no", "cluster": {"device": "cpu"}, "strategy": "single", "micro_batch_size": 2,
        "data_parallel_size": 1, "gradient_accumulation_steps": 1}  # fmt: skip
ROWS = 58  # at micro-batch 2: 29 optimizer steps an epoch
PEAK = 1.0  # learning_rate: each rate below is the schedule's multiplier


def load(**keys):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], "micro_batch_size": 2,
            "output_dir": "/tmp/llmtune-schedule-parity", "learning_rate": PEAK}  # fmt: skip
    return recipe_from_mapping({**base, **keys}, Path("r.yaml"), check_files=False).recipe


def rates(steps: int, **keys) -> list[float]:
    """The rate each of the first `steps` optimizer steps runs at, the Trainer's schedule over `steps` steps."""
    import torch

    from llmtune.train.engine.arguments import training_arguments
    from llmtune.train.engine.trainer import LlmtuneTrainer

    recipe = load(**keys)
    trainer = LlmtuneTrainer.__new__(LlmtuneTrainer)  # the scheduler alone: no model, no data
    trainer.args, trainer.recipe, trainer.plan, trainer.lr_scheduler = (
        training_arguments(recipe, PLAN, ROWS, False), recipe, PLAN, None)  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=trainer.args.learning_rate)
    trainer.optimizer = optimizer
    scheduler = trainer.create_scheduler(steps, optimizer)
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
    return seen


def half_cosine(done: int, of: int, floor: float = 0.0) -> float:
    """floor + (1 - floor) * (1 + cos(pi * done / of)) / 2: Axolotl's and transformers' decay `done` steps in."""
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done / of))


C = math.cos  # the closed forms below


# ---- quadratic warm-up: Axolotl's get_cosine_schedule_with_quadratic_warmup, (s / w)^2 then a cosine to 0 ----


def test_quadratic_warmup_rises_as_the_square_and_decays_to_zero():
    seen = rates(12, lr_quadratic_warmup=True, warmup_steps=4, max_steps=12)
    # warm-up 4 of 12 steps: 0, 1/16, 1/4, 9/16; then (1 + cos(pi (s - 4) / 8)) / 2
    assert seen[:5] == pytest.approx([0.0, 0.0625, 0.25, 0.5625, 1.0])
    assert seen[6] == pytest.approx((1 + C(math.pi / 4)) / 2)  # 0.853553...
    assert seen[-1] == pytest.approx((1 + C(7 * math.pi / 8)) / 2)  # 0.038060..., not a floor
    assert seen[-1] == pytest.approx(0.0380602, abs=1e-7)


@pytest.mark.parametrize("keys", [
    {"cosine_min_lr_ratio": 0.1},  # Axolotl: "Both cosine quadratic warmup and min lr detected. Using quadratic warmup."
    {"cosine_min_lr_ratio": 0.1, "cosine_constant_lr_ratio": 0.5},  # the constant phase dropped with the floor
])  # fmt: skip
def test_quadratic_warmup_with_a_floor_is_refused(keys):
    """Axolotl drops the floor beside the quadratic warm-up (its last rate 0.0029 of the peak over 29 steps, where
    llmtune's was 0.1026: it kept the floor)."""
    with pytest.raises(UserError, match="lr_quadratic_warmup and cosine_min_lr_ratio are both set"):
        load(lr_quadratic_warmup=True, **keys)
    assert rates(12, lr_quadratic_warmup=True, cosine_min_lr_ratio=0, warmup_steps=4, max_steps=12)[-1] == \
        pytest.approx(0.0380602, abs=1e-7)  # a floor of 0 is no floor: accepted  # fmt: skip


@pytest.mark.parametrize("scheduler", ["linear", "constant", "cosine_with_restarts", "polynomial", "inverse_sqrt",
                                       "constant_with_warmup", "cosine_with_min_lr"])  # fmt: skip
def test_quadratic_warmup_on_another_schedule_is_refused(scheduler):
    """Axolotl tests lr_scheduler_type == "cosine": it ignores the key elsewhere. llmtune ignored it too (a plan note),
    except on cosine_with_min_lr, where it warmed up quadratically (step 1 of a 4-step warm-up: 0.0625, Axolotl 0.25)."""
    with pytest.raises(UserError, match=f"lr_quadratic_warmup applies to lr_scheduler: cosine only .*with {scheduler}"):
        load(lr_quadratic_warmup=True, lr_scheduler=scheduler,
             lr_scheduler_kwargs={"min_lr_rate": 0.1} if scheduler == "cosine_with_min_lr" else None)  # fmt: skip


def test_quadratic_warmup_takes_no_scheduler_kwargs():
    with pytest.raises(UserError, match=r"lr_scheduler_kwargs \(num_cycles\) with Axolotl's own quadratic warm-up"):
        load(lr_quadratic_warmup=True, lr_scheduler_kwargs={"num_cycles": 1.0})


# ---- the cosine floor and the constant phase ----


def test_the_floored_cosine_is_axolotl_s():
    """get_cosine_schedule_with_min_lr: linear warm-up, then a half cosine from 1 down to the floor."""
    seen = rates(10, cosine_min_lr_ratio=0.1, warmup_steps=2, max_steps=10)
    assert seen[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert seen[6] == pytest.approx(0.55)  # halfway through the 8 decay steps: 0.1 + 0.9 / 2
    assert seen[-1] == pytest.approx(0.1 + 0.45 * (1 + C(7 * math.pi / 8)))  # 0.134227...
    assert seen == pytest.approx([0.0, 0.5] + [half_cosine(s, 8, 0.1) for s in range(8)])


def test_the_constant_phase_holds_the_floor_from_its_step():
    """get_cosine_schedule_with_warmup_decay_constant: with 12 steps and cosine_constant_lr_ratio 0.5 the decay ends
    at int(12 x 0.5) = 6, the floor from there on."""
    seen = rates(12, cosine_min_lr_ratio=0.2, cosine_constant_lr_ratio=0.5, warmup_steps=2, max_steps=12)
    assert seen == pytest.approx([0.0, 0.5, 1.0, 0.2 + 0.4 * (1 + C(math.pi / 4)), 0.6, 0.2 + 0.4 * (1 - C(math.pi / 4)),
                                  0.2, 0.2, 0.2, 0.2, 0.2, 0.2])  # fmt: skip


@pytest.mark.parametrize(("keys", "said"), [
    ({"cosine_constant_lr_ratio": 0.5}, "cosine_constant_lr_ratio holds the floor"),  # no floor: Axolotl ignores it
    ({"cosine_constant_lr_ratio": 0.5, "cosine_min_lr_ratio": 0.1, "lr_scheduler": "cosine_with_min_lr"},
     "cosine_constant_lr_ratio holds the floor"),  # Axolotl: transformers' cosine_with_min_lr, no constant phase
    ({"cosine_min_lr_ratio": 0.1, "lr_scheduler": "linear"}, "cosine_min_lr_ratio floors a cosine schedule"),
    ({"cosine_min_lr_ratio": 0.0, "lr_scheduler": "constant"}, "cosine_min_lr_ratio floors a cosine schedule"),
    ({"cosine_min_lr_ratio": 0.1, "lr_scheduler_kwargs": {"num_cycles": 1.0}}, "own floored cosine schedule"),
    ({"cosine_min_lr_ratio": 0.1, "lr_scheduler_kwargs": {"min_lr": 1e-3}}, "both set the floor"),
    ({"cosine_min_lr_ratio": 0.0, "lr_scheduler": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.2}},
     "both set the floor"),  # Axolotl's floor: 0.2 (it reads the kwargs); llmtune's was 0
])  # fmt: skip
def test_a_floor_key_axolotl_ignores_is_refused(keys, said):
    with pytest.raises(UserError, match=said):
        load(**keys)


def test_what_the_floor_keys_do_where_they_apply():
    # cosine_with_min_lr: the floor from the kwargs (Axolotl hands them to transformers) or from cosine_min_lr_ratio
    by_kwargs = rates(6, lr_scheduler="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.2}, warmup_steps=0,
                      max_steps=6)  # fmt: skip
    by_ratio = rates(6, lr_scheduler="cosine_with_min_lr", cosine_min_lr_ratio=0.2, warmup_steps=0, max_steps=6)
    assert by_kwargs == pytest.approx(by_ratio) and by_ratio[3] == pytest.approx(0.6)  # 0.2 + 0.8 / 2
    # a floor of 0 on cosine: transformers' plain cosine, its kwargs honoured (Axolotl tests the floor's truth)
    waves = rates(8, cosine_min_lr_ratio=0, lr_scheduler_kwargs={"num_cycles": 1.0}, warmup_steps=0, max_steps=8)
    assert waves == pytest.approx([1.0, (1 + C(math.pi / 4)) / 2, 0.5, (1 - C(math.pi / 4)) / 2, 0.0,
                                   (1 - C(math.pi / 4)) / 2, 0.5, (1 + C(math.pi / 4)) / 2])  # fmt: skip
    # jagged restarts read cosine_min_lr_ratio as their floor on any schedule, so it stands beside linear there
    assert load(lr_scheduler="linear", cosine_min_lr_ratio=0.1, adapter="lora", relora=True,
                jagged_restart_steps=20).cosine_min_lr_ratio == 0.1  # fmt: skip


# ---- transformers' named schedules, as Axolotl hands them over (its lr_scheduler_type and lr_scheduler_kwargs) ----


@pytest.mark.parametrize(("keys", "expected"), [
    ({"lr_scheduler": "linear"}, [0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    ({"lr_scheduler": "constant"}, [1.0] * 8),
    ({"lr_scheduler": "constant_with_warmup"}, [0.0, 0.5] + [1.0] * 6),
    ({"lr_scheduler": "inverse_sqrt"}, [0.0, 0.5] + [1 / math.sqrt(s / 2) for s in range(2, 8)]),  # timescale: warm-up
    ({"lr_scheduler": "polynomial", "lr_scheduler_kwargs": {"power": 2.0, "lr_end": 0.0}},
     [0.0, 0.5] + [((8 - s) / 6) ** 2 for s in range(2, 8)]),
    ({"lr_scheduler": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": 2}},
     [0.0, 0.5, 1.0, 0.75, 0.25, 1.0, 0.75, 0.25]),  # 2 cosines of 3 steps: (1 + cos(pi (d / 3 mod 1))) / 2, d into the decay
    ({"lr_scheduler": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_steps": 2}},
     [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]),  # decay (1 + cos(pi s / 2)) / 2 over the last two steps
    ({"lr_scheduler": "cosine"}, [0.0, 0.5] + [half_cosine(s, 6) for s in range(6)]),
])  # fmt: skip
def test_named_schedules_run_as_under_axolotl(keys, expected):
    assert rates(8, warmup_steps=2, max_steps=8, **keys) == pytest.approx(expected, abs=1e-12)


# ---- the warm-up Axolotl chooses (core/builders/base.py, _configure_warmup_and_logging) ----


@pytest.mark.parametrize(("keys", "steps", "warmup"), [
    ({"num_epochs": 4}, 116, 3),  # neither key: int(0.03 x 116) = 3 (at most 100)
    ({"num_epochs": 1}, 29, 0),  # int(0.87): none
    ({"warmup_ratio": 0.1, "max_steps": 25}, 25, 2),  # int(2.5)
    ({"warmup_steps": 1, "max_steps": 10}, 10, 2),  # one step becomes two
])  # fmt: skip
def test_the_warmup_is_axolotl_s(keys, steps, warmup):
    seen = rates(steps, **keys)  # cosine: a linear warm-up of `warmup` steps, then the peak
    assert seen[: warmup + 1] == pytest.approx([s / warmup for s in range(warmup)] + [1.0])


def test_the_quadratic_warmup_counts_axolotl_s_default_warmup():
    seen = rates(116, lr_quadratic_warmup=True, num_epochs=4)  # 3 steps: 0, 1/9, 4/9, then the cosine from 1
    assert seen[:4] == pytest.approx([0.0, 1 / 9, 4 / 9, 1.0])
    assert seen[-1] == pytest.approx(half_cosine(112, 113))
