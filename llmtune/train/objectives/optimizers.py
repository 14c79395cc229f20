"""Optimizers llmtune builds instead of the Trainer's: Muon (llmtune's own, objectives/muon.py) and LoRA+ (peft's
create_loraplus_optimizer, with the Trainer's optimizer class and arguments). The Trainer builds every other."""

from __future__ import annotations


def own_optimizer(trainer, model):
    """The recipe's own optimizer for `model`, or None where the Trainer's create_optimizer builds it."""
    recipe = trainer.recipe
    if recipe.optimizer == "muon":
        from llmtune.train.objectives.muon import make_muon

        return make_muon(model, trainer.args, set(trainer.get_decay_parameter_names(model)))
    if recipe.loraplus_lr_ratio:
        from peft.optimizers import create_loraplus_optimizer

        optimizer_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(trainer.args, model)
        # peft's groups: A matrices at learning_rate, B at ratio x learning_rate, LoRA on embeddings at their own
        # rate; weight_decay as the recipe says (Axolotl left peft's default, 0)
        return create_loraplus_optimizer(
            model, optimizer_cls, loraplus_lr_ratio=recipe.loraplus_lr_ratio,
            loraplus_lr_embedding=recipe.loraplus_lr_embedding or 1e-6,
            loraplus_weight_decay=trainer.args.weight_decay, **kwargs,
        )  # fmt: skip
    return None
