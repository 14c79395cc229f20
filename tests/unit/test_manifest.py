"""Checkpoints of machines with their own disks (train/checkpoint/manifest.py, launch/lobby.py): the manifest of who holds which
file, and the check-in that stops a resume where a machine lacks its ranks' files before any rank starts. Two
"machines" are two threads on 127.0.0.1, each with its own plan and (own disks) its own output_dir."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.launch import lobby
from llmtune.launch.net import free_port
from llmtune.plan import make_cluster, make_plan
from llmtune.plan.files import plan_files, write_plan_files
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.checkpoint import folders as checkpoints
from llmtune.train.checkpoint import manifest

COMMON = ["model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"]
FILES = {0: sorted([*COMMON, "rng_state_0.pth"]), 1: sorted([*COMMON, "rng_state_1.pth"])}
HOSTS = {0: "10.0.0.1", 1: "10.0.0.2"}
MANIFEST = [{"machine_rank": r, "host": f"node{r}", "address": HOSTS[r], "files": FILES[r]} for r in (0, 1)]


def save_copy(output_dir: Path, step: int, files: list[str], machines=MANIFEST) -> Path:
    """A machine's copy of checkpoint-STEP: its files and the marker (with the manifest) its first rank wrote."""
    folder = output_dir / f"checkpoint-{step}"
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("x")
    marker = {"step": step, "world_size": 2, **({manifest.KEY: machines} if machines else {})}
    (folder / checkpoints.MARKER).write_text(json.dumps(marker))
    return folder


def report(output_dir: Path) -> dict | None:
    return manifest.resume_report(output_dir, None, True)


def test_files_in_lists_a_copy_relative_to_it_without_the_marker(tmp_path):
    folder = save_copy(tmp_path, 2, ["a.pt", "global_step2/mp_rank_00_model_states.pt"])
    assert manifest.files_in(folder) == ["a.pt", "global_step2/mp_rank_00_model_states.pt"]


def test_gather_names_this_machine_from_the_launchers_environment(tmp_path, monkeypatch):
    folder = save_copy(tmp_path, 2, ["rng_state_1.pth"])
    monkeypatch.setenv(manifest.MACHINE_RANK_ENV, "1")
    monkeypatch.setenv(manifest.ADDRESS_ENV, "10.0.0.2")
    [entry] = manifest.gather(folder, lists=True)  # one process: no process group, its own entry
    assert entry["machine_rank"] == 1 and entry["address"] == "10.0.0.2" and entry["files"] == ["rng_state_1.pth"]
    assert manifest.gather(folder, lists=False) == []  # not the machine's first rank: lists nothing


def test_deepspeed_latest_is_written_on_a_machine_with_its_own_disk(tmp_path):
    (tmp_path / "global_step4").mkdir()
    manifest.complete_deepspeed_copy(tmp_path)
    assert (tmp_path / "latest").read_text() == "global_step4"


def test_a_machine_with_its_own_disk_saves_the_weights_its_ranks_hold():
    class Model:  # transformers' rule: torch.distributed rank 0 writes, whatever is_main_process says
        def should_save_on_this_rank(self, is_main_process):
            return False

    model = Model()
    manifest.save_weights_here(model)
    assert model.should_save_on_this_rank(True) and not model.should_save_on_this_rank(False)


def test_the_same_machines_resume(tmp_path):
    reports = {r: report(save_copy(tmp_path / f"m{r}", 2, FILES[r]).parent) for r in (0, 1)}
    assert manifest.resume_refusal(reports, HOSTS) is None


def test_swapped_machine_ranks_are_refused_naming_the_files_and_who_held_them(tmp_path):
    reports = {r: report(save_copy(tmp_path / f"m{r}", 2, FILES[1 - r]).parent) for r in (0, 1)}  # swapped copies
    swapped = {0: HOSTS[1], 1: HOSTS[0]}
    message, hint = manifest.resume_refusal(reports, swapped)
    assert message == (
        f"can't resume from {reports[0]['path']} on these machines' own disks: machine rank 0 lacks 1 file(s) of "
        "checkpoint-2 (rng_state_0.pth), held by machine rank 0 (node0, 10.0.0.1) when it was saved (now machine rank "
        "1); machine rank 1 lacks 1 file(s) of checkpoint-2 (rng_state_1.pth), held by machine rank 1 (node1, "
        "10.0.0.2) when it was saved (now machine rank 0)"
    )
    assert "machine rank it had when checkpoint-2 was saved" in hint and "from machine rank 0 (node0, 10.0.0.1)" in hint


def test_a_machine_without_the_checkpoint_lacks_all_its_files(tmp_path):
    reports = {0: report(save_copy(tmp_path / "m0", 2, FILES[0]).parent), 1: None}  # machine 1's folder emptied
    message, _ = manifest.resume_refusal(reports, HOSTS)
    assert message.endswith(
        ": machine rank 1 lacks 5 file(s) of checkpoint-2 (model.safetensors, optimizer.pt, "
        "rng_state_1.pth and 2 more), held by machine rank 1 (node1, 10.0.0.2) when it was saved"
    )
    assert "machine rank 0 lacks" not in message


def test_an_older_checkpoint_on_one_machine_is_not_enough(tmp_path):
    reports = {0: report(save_copy(tmp_path / "m0", 4, FILES[0]).parent),
               1: report(save_copy(tmp_path / "m1", 2, FILES[1]).parent)}  # fmt: skip
    message, _ = manifest.resume_refusal(reports, HOSTS)
    assert "machine rank 1 lacks 5 file(s) of checkpoint-4" in message and "machine rank 0 lacks" not in message


def test_without_a_manifest_every_machine_needs_what_the_saved_copy_holds(tmp_path):
    saved_alone = save_copy(tmp_path / "m0", 2, FILES[0], machines=None)  # saved by a run on one machine
    message, _ = manifest.resume_refusal({0: report(saved_alone.parent), 1: None}, HOSTS)
    assert "machine rank 1 lacks 5 file(s) of checkpoint-2" in message and "held by" not in message


def test_a_machine_the_saving_run_did_not_have_needs_the_common_files(tmp_path):
    reports = {r: report(save_copy(tmp_path / f"m{r}", 2, FILES[r]).parent) for r in (0, 1)}
    reports[2] = report(save_copy(tmp_path / "m2", 2, COMMON).parent)  # no rng state of its own: not required
    assert manifest.resume_refusal(reports, HOSTS) is None
    reports[2] = report(save_copy(tmp_path / "m3", 2, COMMON[1:]).parent)
    message, _ = manifest.resume_refusal(reports, HOSTS)
    assert message.endswith(
        ": machine rank 2 lacks 1 file(s) of checkpoint-2 (model.safetensors), held by machine "
        "rank 0 (node0, 10.0.0.1) and machine rank 1 (node1, 10.0.0.2) when it was saved"
    )


# The check-in


def _plans(tmp_path: Path, shared: bool, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}], **changes}
    port = free_port()
    plans = []
    for rank in (0, 1):
        output_dir = tmp_path / ("out" if shared else f"machine-{rank}")
        loaded = recipe_from_mapping({**base, "output_dir": str(output_dir)}, Path("r.yaml"), check_files=False)
        cluster = make_cluster(2, num_machines=2, machine_rank=rank, main_process_ip="127.0.0.1",
                               main_process_port=port, device="cpu")  # fmt: skip
        plan = make_plan(loaded.recipe, cluster)
        write_plan_files(Path(plan.config_dir), plan_files(plan, loaded.recipe.model_dump(mode="json"), "r.yaml", []))
        plans.append(plan)
    return plans


def _check_in(plans):
    """Machine 0 gathers in a thread, machine 1 joins here: (what each returned or raised, machine 1's log)."""
    outcome: dict = {}

    def machine_0():
        try:
            outcome[0] = lobby.gather(plans[0], timeout=20, log=lambda line: None)
        except UserError as err:
            outcome[0] = err

    thread = threading.Thread(target=machine_0)
    thread.start()
    lines: list[str] = []
    try:
        outcome[1] = lobby.join(plans[1], timeout=20, log=lines.append)
    except UserError as err:
        outcome[1] = err
    thread.join(timeout=30)
    assert not thread.is_alive(), "machine 0 never finished its check-in"
    return outcome[0], outcome[1], lines


def _output(plan) -> Path:
    return Path(plan.config_dir).parent


def test_own_disks_tell_the_other_machines_ranks_and_the_same_machines_resume(tmp_path):
    plans = _plans(tmp_path, shared=False)
    for rank, plan in enumerate(plans):
        save_copy(_output(plan), 2, FILES[rank], [{**e, "address": "127.0.0.1"} for e in MANIFEST])
    first, second, lines = _check_in(plans)
    assert first == {manifest.MACHINE_RANK_ENV: "0", manifest.ADDRESS_ENV: "127.0.0.1"}  # rank 0 writes as ever
    assert second == {manifest.MACHINE_RANK_ENV: "1", manifest.ADDRESS_ENV: "127.0.0.1", manifest.OWN_DISK_ENV: "1"}
    assert any("its own output_dir" in line for line in lines)


def test_swapped_copies_are_refused_at_check_in_in_one_line(tmp_path):
    plans = _plans(tmp_path, shared=False)
    for rank, plan in enumerate(plans):
        save_copy(_output(plan), 2, FILES[1 - rank])
    first, second, _ = _check_in(plans)
    assert isinstance(first, UserError) and isinstance(second, UserError)
    for err in (first, second):
        line = err.one_line()
        assert "\n" not in line and "machine rank 0 lacks 1 file(s) of checkpoint-2 (rng_state_0.pth)" in line, line
        assert "machine rank 1 lacks 1 file(s) of checkpoint-2 (rng_state_1.pth)" in line
    assert second.one_line().startswith("machine rank 0 stopped the launch: can't resume from")


def test_shared_storage_is_not_checked(tmp_path):
    plans = _plans(tmp_path, shared=True)
    save_copy(_output(plans[0]), 2, FILES[0])  # one folder: machine 1's rng state is missing, as before this check
    first, second, _ = _check_in(plans)
    assert manifest.OWN_DISK_ENV not in first and manifest.OWN_DISK_ENV not in second
    assert second[manifest.MACHINE_RANK_ENV] == "1"


@pytest.mark.parametrize("changes", [{"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}},
                                     {"pipeline_parallel_size": 2}], ids=["fsdp2", "pipeline"])  # fmt: skip
def test_checkpoints_only_rank_0_publishes_are_refused_on_own_disks(tmp_path, changes):
    plans = _plans(tmp_path, shared=False, **changes)
    first, second, _ = _check_in(plans)
    assert isinstance(first, UserError) and isinstance(second, UserError), (first, second)
    assert "need output_dir on storage every machine shares, but machine rank(s) 1" in first.one_line()
    assert "save_only_model: true" in first.one_line()
    go = _plans(tmp_path / "snapshots", shared=False, save_only_model=True, **changes)
    assert not isinstance(_check_in(go)[0], UserError)
