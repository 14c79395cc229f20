"""EAFT's loss and LISA's layer draws (train/objectives/losses.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from llmtune.errors import UserError
from llmtune.train.objectives.losses import LayerSampling, eaft_loss


def _batch():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 50, requires_grad=True)
    labels = torch.randint(0, 50, (2, 6))
    labels[0, :3] = -100
    return SimpleNamespace(logits=logits), labels


def test_eaft_with_alpha_zero_is_plain_cross_entropy():
    outputs, labels = _batch()
    plain = F.cross_entropy(outputs.logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert eaft_loss(outputs, labels, alpha=0.0).item() == pytest.approx(plain.item(), abs=1e-6)
    trained = int((labels[:, 1:] != -100).sum())
    assert eaft_loss(outputs, labels, num_items_in_batch=trained, alpha=0.0).item() == pytest.approx(plain.item(), abs=1e-6)


def test_eaft_weights_each_token_by_its_top_k_entropy_without_gradient_through_the_weight():
    outputs, labels = _batch()
    loss = eaft_loss(outputs, labels, alpha=1.0, k=5)
    logits, targets = outputs.logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1)
    keep = targets != -100
    top = torch.softmax(torch.topk(logits[keep], 5).values, dim=-1)
    entropy = -(top * torch.log(top + 1e-10)).sum(-1)
    expected = (F.cross_entropy(logits[keep], targets[keep], reduction="none") * entropy).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    loss.backward()
    grad = outputs.logits.grad.clone()
    outputs.logits.grad = None
    (F.cross_entropy(logits[keep], targets[keep], reduction="none") * entropy.detach()).mean().backward()
    assert torch.allclose(grad, outputs.logits.grad)


class _Tiny(nn.Module):
    def __init__(self, layers: int = 6):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(layers))
        self.lm_head = nn.Linear(4, 4)


def test_lisa_draws_are_seeded_per_period_and_set_requires_grad():
    model = _Tiny()
    lisa = LayerSampling(model, 2, 3, "model.layers", seed=7)
    state = SimpleNamespace(global_step=0)
    lisa.on_step_begin(None, state, None)
    first = lisa.active
    assert len(first) == 2 and [i for i, m in enumerate(model.model.layers) if m.weight.requires_grad] == first
    assert model.lm_head.weight.requires_grad
    for step in (1, 2):
        state.global_step = step
        lisa.on_step_begin(None, state, None)
    assert lisa.active == first and len(lisa.history) == 1  # same period, same layers
    assert LayerSampling(_Tiny(), 2, 3, "model.layers", seed=7).draw(0) == first  # a resumed run draws the same
    draws = {tuple(lisa.draw(step)) for step in range(0, 60, 3)}
    assert len(draws) > 3  # and the draw does change between periods


def test_lisa_errors_name_the_key():
    with pytest.raises(UserError, match="lisa_n_layers: 9 is more than the model's 6 layers"):
        LayerSampling(_Tiny(), 9, 3, "model.layers", seed=0)
    with pytest.raises(UserError, match="lisa_layers_attribute: _Tiny has no layer list at 'model.blocks'"):
        LayerSampling(_Tiny(), 1, 3, "model.blocks", seed=0)


def test_quadratic_warmup_rises_as_the_square_then_decays_by_cosine_to_the_floor():
    import math
    from types import SimpleNamespace

    import torch

    from llmtune.train.objectives.schedule import make_scheduler, quadratic_warmup

    recipe = SimpleNamespace(lr_quadratic_warmup=True, lr_scheduler="cosine", cosine_min_lr_ratio=0.1,
                             lr_scheduler_kwargs=None)  # fmt: skip
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = make_scheduler(recipe, optimizer, warmup=4, total=12)
    seen = []
    for _ in range(12):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    warm = [2.0 * (s / 4) ** 2 for s in range(4)]
    decay = [2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 8))) for s in range(4, 12)]
    assert seen == pytest.approx(warm + decay)
    assert not quadratic_warmup(SimpleNamespace(lr_quadratic_warmup=True, lr_scheduler="linear"))


def test_cosine_constant_lr_ratio_decays_to_the_floor_by_its_step_and_stays_there():
    """Axolotl's warm-up, cosine decay and constant phase: with cosine_min_lr_ratio 0.1 and cosine_constant_lr_ratio
    0.5 over 12 steps, the LR is at its floor from step 6 on (it was refused); 0 or no floor: the plain cosine, as
    Axolotl tests both for truth."""
    import math
    from pathlib import Path

    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.objectives.schedule import make_scheduler, own_schedule

    base = {"base_model": "org/m", "output_dir": "/x", "datasets": [{"path": "o/d", "type": "alpaca"}],
            "cosine_min_lr_ratio": 0.1, "learning_rate": 2.0}  # fmt: skip
    recipe = recipe_from_mapping({**base, "cosine_constant_lr_ratio": 0.5}, Path("r.yml"), check_files=False).recipe
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = make_scheduler(recipe, optimizer, warmup=2, total=12)
    seen = []
    for _ in range(12):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    decay = [2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 2) / 4))) for s in range(2, 6)]
    assert seen == pytest.approx([0.0, 1.0, *decay, *[0.2] * 6])
    for ratio in (0, None):
        plain = recipe_from_mapping({**base, "cosine_constant_lr_ratio": ratio}, Path("r.yml"), check_files=False)
        assert not own_schedule(plain.recipe)


def test_the_cosine_floor_applies_to_both_cosine_names_and_cosine_with_min_lr_needs_one():
    from pathlib import Path

    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.recipe.training import named_schedule

    for name in ("cosine", "cosine_with_min_lr"):
        recipe = SimpleNamespace(lr_scheduler=name, cosine_min_lr_ratio=0.1, lr_scheduler_kwargs=None)
        assert named_schedule(recipe) == ("cosine_with_min_lr", {"min_lr_rate": 0.1})
    base = {"base_model": "org/m", "output_dir": "/x", "datasets": [{"path": "o/d", "type": "alpaca"}]}
    with pytest.raises(UserError, match="cosine_with_min_lr needs its floor"):
        recipe_from_mapping({**base, "lr_scheduler": "cosine_with_min_lr"}, Path("r.yml"), check_files=False)
    floored = {**base, "lr_scheduler": "cosine_with_min_lr", "eta_min": 2e-6, "learning_rate": 2e-5}
    assert recipe_from_mapping(floored, Path("r.yml"), check_files=False).recipe.cosine_min_lr_ratio == 0.1


def test_load_best_model_at_end_keeps_the_best_checkpoint_by_the_recipe_s_metric():
    """load_best_model_at_end with metric_for_best_model and greater_is_better (they were refused unless they only
    restated early_stopping_patience): the Trainer's arguments say them, saves follow the evaluations; without eval
    data the plan says they have no effect."""
    from pathlib import Path

    from llmtune.plan import make_cluster, make_plan
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.engine.arguments import training_arguments

    base = {"base_model": "org/m", "output_dir": "/tmp/unused-best", "datasets": [{"path": "o/d", "type": "alpaca"}],
            "load_best_model_at_end": True, "eval_steps": 5, "save_steps": 7}  # fmt: skip
    cluster = make_cluster(num_processes=1, device="cpu")
    for keys, metric, greater in (({}, "eval_loss", False),  # transformers: a loss is better lower
                                  ({"metric_for_best_model": "loss", "greater_is_better": False}, "loss", False)):
        recipe = recipe_from_mapping({**base, **keys, "val_set_size": 0.1}, Path("r.yml"), check_files=False).recipe
        args = training_arguments(recipe, make_plan(recipe, cluster).to_dict(), 100, has_eval=True)
        assert (args.load_best_model_at_end, args.metric_for_best_model, args.greater_is_better) == (True, metric,
                                                                                                     greater)
        assert args.save_steps == args.eval_steps == 5  # a checkpoint at every evaluation, as the Trainer needs
    with pytest.raises(UserError, match="metric_for_best_model: eval_accuracy: this run's evaluation reports "
                                        "eval_loss only"):  # fmt: skip
        recipe_from_mapping({**base, "metric_for_best_model": "eval_accuracy"}, Path("r.yml"), check_files=False)
    recipe = recipe_from_mapping(base, Path("r.yml"), check_files=False).recipe
    plan = make_plan(recipe, cluster)
    assert not training_arguments(recipe, plan.to_dict(), 100, has_eval=False).load_best_model_at_end
    notes = plan.notes
    assert any(note.startswith("load_best_model_at_end: no effect: the recipe has no eval data") for note in notes)


def test_early_stopping_says_so_only_when_it_ends_the_run_and_never_formats_a_missing_best(capsys):
    """The Trainer sets should_training_stop at its last step too: a run whose only evaluation was at its end crashed
    formatting a best metric it had none of yet (TypeError, the model unsaved), and one whose eval loss improved to
    the end said it stopped early with the wrong best."""
    from pathlib import Path

    from transformers import TrainerControl, TrainerState

    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.engine.callbacks import early_stopping

    recipe = recipe_from_mapping({"base_model": "org/m", "output_dir": "/x", "val_set_size": 0.1, "datasets": [
        {"path": "o/d", "type": "alpaca"}], "early_stopping_patience": 2}, Path("r.yml"), check_files=False).recipe  # fmt: skip
    args = SimpleNamespace(metric_for_best_model="eval_loss", greater_is_better=False)

    def evaluate(callback, state, step, loss, last=False):
        state.global_step = step
        control = TrainerControl(should_training_stop=last)  # the Trainer's own stop at max_steps
        callback.on_evaluate(args, state, control, metrics={"eval_loss": loss})
        if state.best_metric is None or loss < state.best_metric:  # the Trainer's bookkeeping, after the callbacks
            state.best_metric, state.best_global_step = loss, step
        return control.should_training_stop

    only_at_the_end = early_stopping(recipe, True)[0]
    assert evaluate(only_at_the_end, TrainerState(max_steps=4), 4, 5.7, last=True)
    improving, state = early_stopping(recipe, True)[0], TrainerState(max_steps=4)
    assert not evaluate(improving, state, 2, 5.71) and evaluate(improving, state, 4, 5.61, last=True)
    assert "early stopping" not in capsys.readouterr().err
    worsening, state = early_stopping(recipe, True)[0], TrainerState(max_steps=12)
    for step, loss in ((2, 5.0), (4, 5.2)):
        assert not evaluate(worsening, state, step, loss)
    assert evaluate(worsening, state, 6, 5.3)  # two evaluations without a better loss: stopped
    said = capsys.readouterr().err
    assert "early stopping at step 6 of 12: eval loss has not improved for 2 evaluations (best 5.0000 at step 2)" in said
