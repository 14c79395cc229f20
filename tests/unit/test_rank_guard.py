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


def _reports(batches: list[str], world: int):
    return lambda report: [dict(report, rank=r, world_size=world, first_batch=b) for r, b in enumerate(batches)]


@pytest.mark.parametrize(
    ("batches", "tp", "error"),
    [
        (["a", "a", "b", "b"], 2, None),  # two tensor-parallel groups, each on its own rows
        (["a", "b", "c", "d"], 2, "tensor-parallel group received different batches"),
        (["a", "a", "a", "a"], 2, "ranks 0 and 2 received the same first batch"),
        (["a", "b", "a", "b"], 1, "same first batch"),  # split over half the mesh only (HSDP replicas not split)
        (["a", "b", "c", "a"], 1, None),  # one chance collision among four (a dataset with repeated rows)
    ],
)
def test_tensor_parallel_groups_share_a_batch_and_data_parallel_groups_do_not(monkeypatch, batches, tp, error):
    import torch

    from llmtune.train import ranks

    monkeypatch.setattr(ranks, "gather", _reports(batches, 4))
    plan = {"world_size": 4, "micro_batch_size": 1, "data_parallel_size": 4 // tp, "mesh": {"tensor_parallel": tp}}
    check = lambda: ranks.check_first_batch(torch.ones(1, 8, dtype=torch.long), plan, 4, dataset_rows=64)  # noqa: E731
    if error is None:
        assert len(check()) == 4
    else:
        with pytest.raises(ranks.SilentlyWrongRun, match=error):
            check()
