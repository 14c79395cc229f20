"""Collectives: only llmtune.train.runtime.collectives calls them, and it refuses tensors off the communication device.

NCCL refuses a CPU tensor that gloo accepts, so no CPU test run can see that bug; the AST scan below makes
sure no module issues a collective outside the one module that places and checks tensors.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import llmtune

PACKAGE = Path(llmtune.__file__).parent
HOME = PACKAGE / "train" / "runtime" / "collectives.py"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
    "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather",
    "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "barrier", "monitored_barrier", "new_group", "destroy_process_group",
}  # fmt: skip


def violations(source: str, filename: str = "<snippet>") -> list[str]:
    """Calls of torch.distributed collectives in `source`, however the module was imported."""
    tree = ast.parse(source, filename)
    aliases: set[str] = set()  # names bound to the torch.distributed module
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name == "torch.distributed" and name.asname:
                    aliases.add(name.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(n.name == "distributed" for n in node.names):
                aliases.update(n.asname or n.name for n in node.names if n.name == "distributed")
            if node.module == "torch.distributed":
                found += [f"{filename}:{node.lineno} imports {n.name}" for n in node.names if n.name in COLLECTIVES]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in COLLECTIVES:
            continue
        owner = node.func.value
        chain = ast.unparse(owner)
        if (isinstance(owner, ast.Name) and owner.id in aliases) or chain == "torch.distributed":
            found.append(f"{filename}:{node.lineno} calls {chain}.{node.func.attr}")
    return found


def test_no_collective_outside_the_collectives_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != HOME:
            found += violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not found, "call these through llmtune.train.runtime.collectives:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch.distributed as dist\ndist.all_reduce(t)",
        "from torch import distributed as d\nd.barrier()",
        "import torch\ntorch.distributed.all_gather_object(out, obj)",
        "from torch.distributed import all_reduce",
        "def f():\n    import torch.distributed as td\n    td.new_group([0, 1])",
    ],
)
def test_the_scan_finds_every_spelling(snippet):
    assert violations(snippet), snippet


def test_the_scan_leaves_other_calls_alone():
    assert not violations("import torch.distributed as dist\ndist.get_rank()\ncollectives.all_reduce(t)")


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    from llmtune.train.runtime import collectives

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    collectives.configure("cpu", 0)
    yield collectives
    collectives._device = None
    if dist.is_initialized():
        dist.destroy_process_group()


def test_values_are_reduced_on_the_communication_device(one_rank_group):
    collectives = one_rank_group
    assert collectives.active() and collectives.world_size() == 1
    assert collectives.sum_values([3, 0.5]) == [3.0, 0.5]
    assert collectives.any_rank(True) and not collectives.any_rank(False)
    assert collectives.tensor([1.0]).device == collectives.device()
    assert collectives.all_gather_objects({"rank": 0}) == [{"rank": 0}]
    assert collectives.gather_objects("x") == ["x"]
    collectives.barrier()


def test_sums_and_flags_combine_every_ranks_values(one_rank_group, monkeypatch):
    """At world size 1 a sum is its input; here a second rank's values are added inside the all-reduce, so a
    sum_values or any_rank that skipped the reduction (or reduced off the communication device) shows."""
    import torch.distributed as dist

    collectives, real, seen = one_rank_group, dist.all_reduce, []

    def with_a_second_rank(tensor, group=None, **kwargs):  # the other rank holds 1.0 in every slot
        seen.append(tensor.device)
        work = real(tensor, group=group, **kwargs)
        tensor.add_(1.0)
        return work

    monkeypatch.setattr(dist, "all_reduce", with_a_second_rank)
    assert collectives.sum_values([3, 0.5]) == [4.0, 1.5]
    assert collectives.any_rank(False)  # this rank says no, the other yes: every rank stops
    assert seen == [collectives.device()] * 2


def test_a_tensor_elsewhere_is_refused_as_nccl_would(one_rank_group):
    import torch

    collectives = one_rank_group
    # Stand in for a GPU plan (no CUDA here): the rank communicates on another device, and a CPU tensor is refused
    # before gloo, which would have accepted it, ever sees it.
    collectives._device = torch.device("meta")
    with pytest.raises(collectives.MisplacedTensor, match="on cpu, but this rank communicates on meta"):
        collectives.all_reduce(torch.ones(1))
    collectives.check(collectives.tensor([1.0]))  # what the module builds itself is where it should be


def test_without_a_group_nothing_is_communicated():
    from llmtune.train.runtime import collectives

    assert not collectives.active()
    assert collectives.sum_values([2.0]) == [2.0]
    assert collectives.all_gather_objects(1) == [1]
    collectives.barrier()
    collectives.teardown()
