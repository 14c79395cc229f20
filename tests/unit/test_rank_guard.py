"""The guard against silently wrong distributed runs."""

from __future__ import annotations

import pytest


def test_ranks_that_would_share_data_are_stopped(monkeypatch):
    """The guard itself: a run whose ranks see the same first batch must not be allowed to continue."""
    import torch

    from llmtune.train import ranks

    monkeypatch.setattr(ranks, "gather", lambda report: [dict(report, rank=0, world_size=2), dict(report, rank=1, world_size=2)])
    plan = {"world_size": 2, "micro_batch_size": 4, "data_parallel_size": 2}
    with pytest.raises(ranks.SilentlyWrongRun, match="same first batch"):
        ranks.check_first_batch(torch.ones(4, 8, dtype=torch.long), plan, accelerate_world=2, dataset_rows=64)
    monkeypatch.setattr(ranks, "gather", lambda report: [dict(report, rank=0, world_size=1)])
    with pytest.raises(ranks.SilentlyWrongRun, match="world size 1"):
        ranks.check_first_batch(torch.ones(4, 8, dtype=torch.long), plan, accelerate_world=1, dataset_rows=64)
