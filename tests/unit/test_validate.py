"""`llmtune validate`: without cluster flags the recipe is checked on its own and the cluster facts it could not
check are notes; with cluster flags the fit to that cluster is checked as well."""

from __future__ import annotations

import json

import pytest

from llmtune.plan import make_cluster
from llmtune.plan.smallest_cluster import smallest_cluster
from llmtune.recipe import load_recipe

PIPELINE_NOTE = (
    "note: pipeline_parallel_size 2 needs a world size divisible by 2; "
    "checked when you pass --num-processes, or at train time"
)


def test_pipeline_recipe_validates_on_one_process_without_cluster_flags(run_cli, write_recipe):
    result = run_cli("validate", write_recipe({"pipeline_parallel_size": 2}))
    assert result.code == 0, result.err
    assert PIPELINE_NOTE in result.out.splitlines()
    assert "note: no cluster flags: planned for the smallest world the recipe needs (2 GPU processes on 1 machine)" in (
        result.out
    )
    assert result.out.strip().splitlines()[-1].endswith("valid (pipeline parallel, world size 2, global batch 2)")


def test_with_cluster_flags_the_fit_is_checked_as_before(run_cli, write_recipe):
    path = write_recipe({"pipeline_parallel_size": 2})
    bad = run_cli("validate", path, "--num-processes", "1", "--device", "cpu")
    assert bad.code == 2 and "world size 1 is not divisible by pipeline_parallel_size 2" in bad.err
    assert "note:" not in bad.out
    good = run_cli("validate", path, "--num-processes", "4", "--device", "cpu")
    assert good.code == 0 and "world size 4" in good.out
    assert "no cluster flags" not in good.out and PIPELINE_NOTE not in good.out


def test_device_flags_alone_are_not_cluster_flags(run_cli, write_recipe):
    result = run_cli("validate", write_recipe({"pipeline_parallel_size": 2}), "--rehearse")
    assert result.code == 0, result.err
    assert "(2 CPU processes on 1 machine)" in result.out and PIPELINE_NOTE in result.out


def test_recipe_errors_stay_errors_without_cluster_flags(run_cli, write_recipe):
    result = run_cli("validate", write_recipe({"pipeline_parallel_size": 2, "pipeline_microbatches": 1}))
    assert result.code == 2 and "pipeline_microbatches" in result.err


def test_fsdp1_recipe_is_checked_for_gpus_unless_rehearsal_is_asked(run_cli, write_recipe):
    path = write_recipe({"fsdp_version": 1, "fsdp_config": {"reshard_after_forward": True}})
    assert run_cli("validate", path).code == 0  # on a laptop without GPUs too: the recipe is for GPUs
    rehearsed = run_cli("validate", path, "--device", "cpu")
    assert rehearsed.code == 2 and "can't be rehearsed on CPU" in rehearsed.err


@pytest.mark.parametrize(
    ("changes", "world", "machines", "words"),
    [
        ({}, 1, 1, []),
        ({"pipeline_parallel_size": 3}, 3, 1, ["pipeline_parallel_size 3 needs a world size divisible by 3"]),
        ({"rdzv_backend": "c10d"}, 2, 2, ["rdzv_backend: c10d needs 2 or more machines"]),
        ({"rdzv_backend": "c10d", "min_machines": 3}, 3, 3, ["c10d needs 3 or more machines"]),
        ({"rdzv_backend": "c10d", "pipeline_parallel_size": 4}, 4, 2, ["c10d", "divisible by 4"]),
    ],
)
def test_smallest_cluster(write_recipe, changes, world, machines, words):
    recipe = load_recipe(write_recipe(changes)).recipe
    cluster, notes = smallest_cluster(recipe, make_cluster(1, device="cuda"))
    assert (cluster.num_processes, cluster.num_machines, cluster.device) == (world, machines, "cuda")
    assert notes[0].startswith("no cluster flags") and len(notes) == 1 + (len(words) > 0) + ("divisible by 4" in words)
    for word in words:
        assert any(word in note for note in notes[1:]), notes


def test_deepspeed_json_with_a_fixed_batch_plans_its_data_parallel_size(run_cli, write_recipe, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 2}}))
    path = write_recipe({"deepspeed": str(ds), "micro_batch_size": 2, "gradient_accumulation_steps": 4})
    result = run_cli("validate", path)
    assert result.code == 0, result.err
    assert "deepspeed train_batch_size fixes 8 data-parallel processes" in result.out
    assert "world size 8, global batch 64" in result.out
    mismatch = run_cli("validate", path, "--num-processes", "2", "--device", "cpu")
    assert mismatch.code == 2 and "train_batch_size = 64" in mismatch.err


def test_plan_without_flags_takes_the_recipes_own_world_where_this_machine_s_is_too_small(run_cli, write_recipe,
                                                                                          monkeypatch):
    """`plan` on a machine with no GPU starts one CPU process; a recipe whose sizes need two (dp_shard_size: 2) is
    planned for two, as `validate` plans it, with a note that says so; a flag given is kept, and refused."""
    monkeypatch.setenv("COLUMNS", "300")
    path = write_recipe({"fsdp_version": 2, "fsdp_config": {"reshard_after_forward": True}, "dp_shard_size": 2})
    shown = run_cli("plan", path, "--json")
    assert shown.code == 0, shown.err
    assert json.loads(shown.out)["world_size"] == 2
    said = run_cli("plan", path)
    assert ("no cluster flags: this machine starts 1 process, fewer than the recipe's sizes need; planned for 2 "
            "(`llmtune train` needs --num-processes 2)") in " ".join(said.out.split())  # fmt: skip
    refused = run_cli("plan", path, "--num-processes", "1")
    assert refused.code == 2 and "dp_shard_size 2" in refused.err
    plain = run_cli("plan", write_recipe({}), "--json")
    assert json.loads(plain.out)["world_size"] == 1
