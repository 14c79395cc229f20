"""The guard against silently wrong distributed runs."""

from __future__ import annotations

import pytest

DISTINCT = [{"input_ids": [index, index + 1]} for index in range(64)]  # no two rows alike
REPEATS = DISTINCT[:63] + [{"input_ids": [0, 1]}]  # the first row twice


def test_ranks_that_would_share_data_are_stopped(monkeypatch):
    """The guard itself: a run whose ranks see the same first batch must not be allowed to continue."""
    import torch

    from llmtune.train.runtime import ranks

    monkeypatch.setattr(
        ranks, "gather", lambda report: [dict(report, rank=0, world_size=2), dict(report, rank=1, world_size=2)]
    )
    plan = {"world_size": 2, "micro_batch_size": 4, "data_parallel_size": 2}
    with pytest.raises(ranks.SilentlyWrongRun, match="ranks 0 and 1 received the same first batch, and the dataset"):
        ranks.check_first_batch(torch.ones(4, 8, dtype=torch.long), plan, accelerate_world=2, dataset=DISTINCT)
    monkeypatch.setattr(ranks, "gather", lambda report: [dict(report, rank=0, world_size=1)])
    with pytest.raises(ranks.SilentlyWrongRun, match="world size 1"):
        ranks.check_first_batch(torch.ones(4, 8, dtype=torch.long), plan, accelerate_world=1, dataset=DISTINCT)


def _reports(batches: list[str], world: int):
    return lambda report: [dict(report, rank=r, world_size=world, first_batch=b) for r, b in enumerate(batches)]


def _check(monkeypatch, batches: list[str], tp: int, dataset, micro: int = 1):
    import torch

    from llmtune.train.runtime import ranks

    world = len(batches)
    monkeypatch.setattr(ranks, "gather", _reports(batches, world))
    plan = {"world_size": world, "micro_batch_size": micro, "data_parallel_size": world // tp,
            "mesh": {"tensor_parallel": tp}}  # fmt: skip
    return ranks.check_first_batch(torch.ones(micro, 8, dtype=torch.long), plan, world, dataset)


@pytest.mark.parametrize(
    ("batches", "tp", "dataset", "error"),
    [
        (["a", "a", "b", "b"], 2, DISTINCT, None),  # two tensor-parallel groups, each on its own rows
        (["a", "b", "c", "d"], 2, DISTINCT, "tensor-parallel group received different batches"),
        (["a", "a", "a", "a"], 2, DISTINCT, "ranks 0 and 2 received the same first batch, and the dataset has no"),
        (["a", "a", "a", "a"], 2, REPEATS, None),  # one pair of groups, on a dataset that repeats a row
        (["a", "b", "c", "d"], 1, DISTINCT, None),  # no collision
        (["a", "b", "c", "a"], 1, REPEATS, None),  # one pair: a dataset with repeated rows can do that by chance
        (["a", "b", "c", "a"], 1, DISTINCT, "ranks 0 and 3 received the same first batch, and the dataset has no"),
        (["a", "b", "a", "b"], 1, REPEATS, "ranks 0 and 2; 1 and 3 received the same first batch, 2 colliding"),
        (["a", "a", "a", "b"], 1, REPEATS, "ranks 0 and 1 and 2 received the same first batch, 3 colliding pairs"),
        # the case: 3 duplicate pairs among 8 data-parallel groups are a sharding bug, repeats or not
        (["a", "b", "c", "a", "b", "c", "d", "e"], 1, REPEATS, "3 colliding pairs among 8 groups"),
    ],
)
def test_at_most_one_pair_of_data_parallel_groups_may_share_a_first_batch(monkeypatch, batches, tp, dataset, error):
    from llmtune.train.runtime import ranks

    if error is None:
        assert len(_check(monkeypatch, batches, tp, dataset)) == len(batches)
    else:
        with pytest.raises(ranks.SilentlyWrongRun, match=error):
            _check(monkeypatch, batches, tp, dataset)


def test_too_few_rows_for_every_group_may_repeat(monkeypatch):
    """Fewer rows than micro_batch_size x data-parallel groups: the sampler wraps around, so batches repeat."""
    from llmtune.train.runtime import ranks

    assert len(_check(monkeypatch, ["a", "a", "a", "a"], 1, DISTINCT[:3])) == 4
    with pytest.raises(ranks.SilentlyWrongRun, match="3 colliding pairs"):  # 4 rows are enough for 4 groups
        _check(monkeypatch, ["a", "a", "a", "b"], 1, DISTINCT[:4])


class Unreadable:
    """A dataset whose rows must not be read: hashing every row is paid only where it decides."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        raise AssertionError("the guard read the dataset's rows without a collision to judge")


def test_rows_are_hashed_only_for_a_single_collision(monkeypatch):
    from llmtune.train.runtime import ranks

    assert len(_check(monkeypatch, ["a", "b", "c", "d"], 1, Unreadable())) == 4
    with pytest.raises(ranks.SilentlyWrongRun, match="2 colliding pairs"):
        _check(monkeypatch, ["a", "b", "a", "b"], 1, Unreadable())


def test_duplicate_rows_counts_repeated_input_ids():
    from llmtune.train.runtime.ranks import duplicate_rows

    assert duplicate_rows(DISTINCT) == 0
    assert duplicate_rows(REPEATS) == 1
    assert duplicate_rows([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 0]}, {"input_ids": [2, 1]}]) == 0
    assert duplicate_rows([{"input_ids": [5]}] * 3) == 2
    # online RL's prompt rows have no input_ids until generation: their content decides (it raised KeyError)
    prompts = [{"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]
    assert duplicate_rows(prompts) == 0 and duplicate_rows([*prompts, dict(prompts[0])]) == 1
