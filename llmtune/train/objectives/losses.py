"""Training methods Axolotl recipes name that change what a step trains, not how it is sharded:

- EAFT (use_eaft): each trained token's cross-entropy is weighted by the entropy of the model's top-k
  next-token distribution (raised to eaft_alpha), so tokens the model is unsure about weigh more; the
  weight carries no gradient. Normalised like the plain loss (by the trained tokens of the whole batch).
- LISA (lisa_n_layers): of the decoder layers only lisa_n_layers, drawn at random every
  lisa_step_interval optimizer steps, train; embeddings, norms and the head always train. The draw is
  seeded by the recipe's seed and the step, so a resumed run draws the same layers.
"""

from __future__ import annotations

import random
from functools import partial, reduce

import torch
from torch.nn import functional as F
from transformers import TrainerCallback

from llmtune.errors import UserError


def eaft_loss(outputs, labels, num_items_in_batch=None, alpha: float = 1.0, k: int = 20):
    """The EAFT loss for a causal LM (the Trainer's compute_loss_func signature)."""
    logits = outputs.logits[..., :-1, :]
    targets = labels[..., 1:].to(logits.device)
    trained = targets != -100
    picked = logits[trained].float()
    token_loss = F.cross_entropy(picked, targets[trained], reduction="none")
    with torch.no_grad():
        top = torch.softmax(torch.topk(picked, k=min(k, picked.shape[-1]), dim=-1).values, dim=-1)
        entropy = -(top * torch.log(top + 1e-10)).sum(dim=-1)
        weight = entropy.pow(alpha)
    weighted = token_loss * weight
    if num_items_in_batch is not None:
        return weighted.sum() / num_items_in_batch
    return weighted.mean() if weighted.numel() else weighted.sum()


def eaft_for(recipe):
    return partial(eaft_loss, alpha=recipe.eaft_alpha, k=recipe.eaft_k) if recipe.use_eaft else None


def layer_list(model, attribute: str):
    """The decoder layers at `attribute` (e.g. model.layers), from the model or the one it wraps."""
    for root in (model, getattr(model, "module", None)):
        if root is None:
            continue
        try:
            layers = reduce(getattr, attribute.split("."), root)
        except AttributeError:
            continue
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise UserError(f"lisa_layers_attribute: {type(model).__name__} has no layer list at '{attribute}'",
                    "name where the model keeps its decoder layers, e.g. model.layers")  # fmt: skip


class LayerSampling(TrainerCallback):
    """LISA: the trained layers change every `interval` optimizer steps."""

    def __init__(self, model, count: int, interval: int, attribute: str, seed: int):
        self.layers = layer_list(model, attribute)
        if count > len(self.layers):
            raise UserError(f"lisa_n_layers: {count} is more than the model's {len(self.layers)} layers",
                            f"use at most {len(self.layers)}")  # fmt: skip
        self.count, self.interval, self.seed = count, interval, seed
        self.active: list[int] | None = None
        self.history: list[dict] = []  # {step, layers} each time the draw changes (metrics.json)

    def draw(self, step: int) -> list[int]:
        period = step // self.interval
        return sorted(random.Random(f"{self.seed}:{period}").sample(range(len(self.layers)), self.count))

    def on_step_begin(self, args, state, control, **kwargs):
        chosen = self.draw(state.global_step)
        if chosen == self.active:
            return
        for index, layer in enumerate(self.layers):
            for param in layer.parameters():
                param.requires_grad_(index in chosen)
        self.active = chosen
        self.history.append({"step": state.global_step, "layers": chosen})
