"""optimizer: muon: Axolotl's parameter groups, an AdamW group stepping as torch's AdamW, a Muon step as its formula
(the spectral-norm scaled orthogonal factor of the nesterov momentum), and the strategies it refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from llmtune.errors import UserError
from llmtune.train.objectives.muon import Muon, muon_groups, orthogonalize


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 10, bias=False)


def test_groups_follow_axolotl_matrices_to_muon_the_rest_to_adamw():
    model = Tiny()
    groups = muon_groups(model, {"proj.weight", "lm_head.weight", "embed_tokens.weight"}, 0.1)
    by_param = {id(p): (g["algorithm"], g["weight_decay"]) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert by_param[id(named["proj.weight"])] == ("muon", 0.1)
    assert by_param[id(named["embed_tokens.weight"])] == ("adamw", 0.0)  # embeddings and head: AdamW, no decay
    assert by_param[id(named["lm_head.weight"])] == ("adamw", 0.0)
    assert by_param[id(named["proj.bias"])] == ("adamw", 0.0) and by_param[id(named["norm.weight"])] == ("adamw", 0.0)


def test_embeddings_and_heads_go_to_adamw_whatever_their_names():
    class Gpt2Like(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(10, 8), nn.Embedding(16, 8)
            self.c_fc = nn.Linear(8, 8)
            self.score = nn.Linear(8, 1, bias=False)  # a reward model's head

        def get_input_embeddings(self):
            return self.wte

    model = Gpt2Like()
    groups = muon_groups(model, set(dict(model.named_parameters())), 0.1)
    muon = [p for g in groups if g["algorithm"] == "muon" for p in g["params"]]
    assert len(muon) == 1 and muon[0] is model.c_fc.weight


def test_an_adamw_group_steps_exactly_as_torchs_adamw():
    torch.manual_seed(0)
    ours, theirs = nn.Parameter(torch.randn(5)), None
    theirs = nn.Parameter(ours.detach().clone())
    mine = Muon([{"params": [ours], "algorithm": "adamw", "weight_decay": 0.01}], lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW([theirs], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    for _ in range(5):
        grad = torch.randn(5)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        ref.step()
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_a_muon_step_is_the_scaled_orthogonal_factor_of_the_nesterov_momentum():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 16))
    start = weight.detach().clone()
    optimizer = Muon([{"params": [weight], "algorithm": "muon", "weight_decay": 0.1}], lr=0.02)
    grads = [torch.randn(4, 16), torch.randn(4, 16)]
    momentum = torch.zeros(4, 16)
    expected = start
    for grad in grads:
        weight.grad = grad
        optimizer.step()
        momentum = 0.95 * momentum + grad
        update = orthogonalize(grad + 0.95 * momentum)
        expected = expected * (1 - 0.02 * 0.1) - 0.02 * math.sqrt(4 / 16) * update
    assert torch.allclose(weight.detach(), expected, atol=1e-6)
    singular = torch.linalg.svdvals(orthogonalize(torch.randn(4, 16)))
    assert ((singular > 0.6) & (singular < 1.3)).all(), singular  # Newton-Schulz: near-orthogonal, not exact


def test_muon_is_refused_where_whole_matrices_are_not_at_hand():
    from llmtune.plan import make_cluster, make_plan
    from llmtune.recipe.loader import recipe_from_mapping

    base = {"base_model": "org/m", "output_dir": "/runs/x", "datasets": [{"path": "o/d", "type": "alpaca"}],
            "optimizer": "muon"}  # fmt: skip
    for extra, strategy in (({"deepspeed": "zero2"}, "DeepSpeed"), ({"fsdp_version": 1}, "fsdp1")):
        recipe = recipe_from_mapping({**base, **extra}, Path("r.yml"), check_files=False).recipe
        with pytest.raises(UserError, match=f"optimizer: muon under {strategy} is not supported"):
            make_plan(recipe, make_cluster(num_processes=2))
