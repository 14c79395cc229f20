"""The machines' check-in (launch/lobby.py) finds out whether they share output_dir, and stops a tensor-parallel run
whose checkpoints need it before any rank starts. Two "machines" here are two threads on 127.0.0.1, each with its
own plan; a machine with its own disk is one whose output_dir is another folder."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.launch import lobby
from llmtune.launch.net import free_port
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.loader import recipe_from_mapping


def _plans(tmp_path: Path, shared: bool, second: dict | None = None, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}],
            "tensor_parallel_size": 2, **changes}  # fmt: skip
    port = free_port()
    plans = []
    for rank in (0, 1):
        output_dir = tmp_path / ("out" if shared else f"machine-{rank}")
        mine = {**base, **((second or {}) if rank else {}), "output_dir": str(output_dir)}
        recipe = recipe_from_mapping(mine, Path("r.yaml"), check_files=False).recipe
        cluster = make_cluster(2, num_machines=2, machine_rank=rank, main_process_ip="127.0.0.1",
                               main_process_port=port, device="cpu")  # fmt: skip
        plans.append(make_plan(recipe, cluster))
    return plans


def _check_in(plans) -> tuple[BaseException | None, BaseException | None, list[str]]:
    """Machine 0 gathers in a thread while machine 1 joins here; what each raised, and machine 0's log."""
    lines: list[str] = []
    outcome: dict[str, BaseException | None] = {"gather": None}

    def machine_0():
        try:
            lobby.gather(plans[0], timeout=20, log=lines.append)
        except BaseException as err:  # noqa: BLE001 - handed back to the test
            outcome["gather"] = err

    thread = threading.Thread(target=machine_0)
    thread.start()
    joined = None
    try:
        lobby.join(plans[1], timeout=20, log=lambda line: None)
    except UserError as err:
        joined = err
    thread.join(timeout=30)
    assert not thread.is_alive(), "machine 0 never finished its check-in"
    return outcome["gather"], joined, lines


def test_machines_sharing_output_dir_go(tmp_path):
    plans = _plans(tmp_path, shared=True)
    assert plans[0].shared_output_dir  # a resumable tensor-parallel run on two machines needs it
    gathered, joined, lines = _check_in(plans)
    assert gathered is None and joined is None
    assert any("machine rank 1 joined" in line and "shares this output_dir" in line for line in lines), lines


def test_tensor_parallel_checkpoints_on_machines_with_their_own_disks_are_refused_before_launch(tmp_path):
    plans = _plans(tmp_path, shared=False)
    (Path(plans[1].config_dir)).mkdir(parents=True)
    (Path(plans[1].config_dir) / lobby.STORAGE_PROBE).write_text("a token of an earlier run")  # stale: not shared
    gathered, joined, _ = _check_in(plans)
    assert isinstance(gathered, UserError) and isinstance(joined, UserError)
    for err in (gathered, joined):
        line = err.one_line()
        assert "tensor-parallel checkpoints" in line and "machine rank(s) 1 can't see" in line, line
        assert "save_only_model: true" in line and "\n" not in line
    assert joined.one_line().startswith("machine rank 0 stopped the launch")


def test_own_disks_are_fine_when_nothing_reads_another_machines_files(tmp_path):
    plans = _plans(tmp_path, shared=False, save_only_model=True)  # weight snapshots: rank 0 writes, nothing resumes
    assert plans[0].shared_output_dir is None
    gathered, joined, lines = _check_in(plans)
    assert gathered is None and joined is None
    assert any("its own output_dir" in line for line in lines), lines


@pytest.mark.parametrize(("tp", "machines"), [(2, 1), (1, 2)], ids=["tp-one-machine", "ddp-two-machines"])
def test_only_tensor_parallel_across_machines_needs_the_check(tmp_path, tp, machines):
    recipe = recipe_from_mapping({"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}],
                                  "output_dir": str(tmp_path), "tensor_parallel_size": tp}, Path("r.yaml"),
                                 check_files=False).recipe  # fmt: skip
    cluster = make_cluster(2, num_machines=machines, main_process_ip="127.0.0.1", device="cpu")
    assert make_plan(recipe, cluster).shared_output_dir is None


def test_a_machine_started_with_another_recipe_is_refused_on_both_sides(tmp_path):
    """Same sizes, another learning rate: the sizes alone let it train (on shared storage, machine 0's ranks read
    whichever plan was written last)."""
    plans = _plans(tmp_path, shared=True, second={"learning_rate": 0.5})
    assert plans[0].global_batch_size == plans[1].global_batch_size and plans[0].recipe_digest != plans[1].recipe_digest
    gathered, joined, _ = _check_in(plans)
    assert isinstance(gathered, UserError) and isinstance(joined, UserError)
    assert "machine rank 1 (127.0.0.1) plans another recipe than machine 0's" in gathered.one_line()
    assert "another recipe" in joined.one_line() and joined.one_line().startswith("machine rank 0 stopped the launch")
    own = _plans(tmp_path / "own", shared=False)  # output_dir on each machine's own disk: another path, same recipe
    assert own[0].recipe_digest == own[1].recipe_digest
    longer = _plans(tmp_path / "flags", shared=True, second={"rdzv_timeout": 3600, "max_restarts": 2})
    assert longer[0].recipe_digest == longer[1].recipe_digest  # what one machine's launcher flags set


def test_the_machines_that_joined_hear_which_one_did_not(tmp_path):
    """Machine 2 never comes: machine 1 is told so by machine 0, not left to time out blaming machine 0."""
    recipe = recipe_from_mapping({"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}],
                                  "output_dir": str(tmp_path)}, Path("r.yaml"), check_files=False).recipe  # fmt: skip
    port = free_port()
    plans = [make_plan(recipe, make_cluster(3, num_machines=3, machine_rank=rank, main_process_ip="127.0.0.1",
                                            main_process_port=port, device="cpu")) for rank in (0, 1)]  # fmt: skip
    outcome: dict[str, BaseException | None] = {}

    def machine_0():
        try:
            lobby.gather(plans[0], timeout=4, log=lambda line: None)
        except UserError as err:
            outcome["gather"] = err

    thread = threading.Thread(target=machine_0)
    thread.start()
    with pytest.raises(UserError) as joined:
        lobby.join(plans[1], timeout=30, log=lambda line: None)
    thread.join(timeout=30)
    assert "machine rank(s) 2 of 3 did not join within 4 s" in outcome["gather"].one_line()
    line = joined.value.one_line()
    assert line.startswith("machine rank 0 stopped the launch: machine rank(s) 2 of 3 did not join"), line
