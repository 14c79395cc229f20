"""Resuming a checkpoint saved on another world size: the plan keeps the checkpoint's global batch through gradient
accumulation and says so in one line, or refuses in one line that says what will work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.loader import recipe_from_mapping


def recipe(output_dir: Path, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}],
            "output_dir": str(output_dir), "micro_batch_size": 2, "gradient_accumulation_steps": 2}  # fmt: skip
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def saved(output_dir: Path, step: int = 4, **info) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "llmtune-complete.json").write_text(json.dumps({"step": step, **info}))
    return folder


DDP_2 = {"world_size": 2, "strategy": "ddp", "data_parallel_size": 2, "global_batch_size": 8}
FSDP2 = {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}


@pytest.mark.parametrize(("world", "accumulation"), [(1, 4), (4, 1)])
def test_a_ddp_checkpoint_resumes_on_fewer_or_more_processes_with_its_global_batch(tmp_path, world, accumulation):
    saved(tmp_path, **DDP_2)
    plan = make_plan(recipe(tmp_path), make_cluster(world, device="cpu"))
    assert (plan.gradient_accumulation_steps, plan.global_batch_size) == (accumulation, 8)
    assert (f"resuming checkpoint-4 (world size 2) on world size {world}: gradient accumulation 2 -> "
            f"{accumulation}, global batch 8 kept") in plan.notes  # fmt: skip


@pytest.mark.parametrize(("saved_as", "changes"), [("fsdp2", {}), ("ddp", FSDP2)])
def test_a_checkpoint_resumes_only_under_the_strategy_that_wrote_it(tmp_path, saved_as, changes):
    saved(tmp_path, **{**DDP_2, "strategy": saved_as})
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path, **changes), make_cluster(4, device="cpu"))
    line = caught.value.one_line()
    assert line.startswith("checkpoint-4 was saved by ") and "a checkpoint resumes only under the strategy" in line


@pytest.mark.parametrize("world", [1, 4])
def test_a_plain_fsdp2_checkpoint_reshards_onto_another_world_size(tmp_path, world):
    saved(tmp_path, **{**DDP_2, "strategy": "fsdp2"})
    plan = make_plan(recipe(tmp_path, **FSDP2), make_cluster(world, device="cpu"))
    assert plan.strategy == "fsdp2" and plan.global_batch_size == 8
    assert any(note.startswith(f"resuming checkpoint-4 (world size 2) on world size {world}") for note in plan.notes)


def test_the_same_world_size_changes_nothing(tmp_path):
    saved(tmp_path, **DDP_2)
    plan = make_plan(recipe(tmp_path), make_cluster(2, device="cpu"))
    assert plan.gradient_accumulation_steps == 2 and not any("resuming" in note for note in plan.notes)


def test_the_newest_complete_checkpoint_is_the_one_read(tmp_path):
    saved(tmp_path, step=2, world_size=1, strategy="single", data_parallel_size=1, global_batch_size=4)
    saved(tmp_path, step=4, **DDP_2)
    (tmp_path / "checkpoint-6").mkdir()  # a save that never completed: resume ignores it, and so does the plan
    plan = make_plan(recipe(tmp_path), make_cluster(1, device="cpu"))
    assert plan.global_batch_size == 8 and any(note.startswith("resuming checkpoint-4") for note in plan.notes)


def test_an_older_marker_reads_the_global_batch_from_the_recipe(tmp_path):
    saved(tmp_path, world_size=2)  # before markers recorded the allocation: DDP's data parallel is the world
    plan = make_plan(recipe(tmp_path), make_cluster(1, device="cpu"))
    assert (plan.gradient_accumulation_steps, plan.global_batch_size) == (4, 8)


def test_a_global_batch_that_cant_be_kept_is_refused_with_the_arithmetic(tmp_path):
    saved(tmp_path, **DDP_2)
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path), make_cluster(3, device="cpu"))
    assert caught.value.one_line() == (
        "checkpoint-4 trained at global batch 8; on 3 data-parallel process(es) it can't be kept (8 is not a multiple "
        "of micro_batch_size 2 x 3) (hint: resume with --num-processes 2 (or a count that divides 4))"
    )


@pytest.mark.parametrize(
    ("saved_as", "changes", "what"),
    [
        ({"strategy": "zero2"}, {"deepspeed": "zero2"}, "DeepSpeed ZeRO-2"),
        ({"strategy": "fsdp2", "mesh": {"dp_replicate": 2, "dp_shard": 1}}, FSDP2, "FSDP2 (with a device mesh)"),
    ],
)
def test_sharded_checkpoints_on_another_world_size_are_refused_with_what_will_work(tmp_path, saved_as, changes, what):
    saved(tmp_path, **{**DDP_2, **saved_as})
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path, **changes), make_cluster(4, device="cpu"))
    line = caught.value.one_line()
    assert line.startswith(f"checkpoint-4 was saved by 2 process(es); this launch has 4: llmtune resumes {what} "
                           "checkpoints only at the world size that wrote them")  # fmt: skip
    assert "resume with --num-processes 2 (the allocation that saved it)" in line
    assert "run the same command again" not in line


def test_no_resume_no_check(tmp_path):
    saved(tmp_path, **DDP_2)
    plan = make_plan(recipe(tmp_path, auto_resume_from_checkpoints=False), make_cluster(1, device="cpu"))
    assert plan.gradient_accumulation_steps == 2


def test_the_checkpoint_command_shows_each_checkpoints_allocation(tmp_path, run_cli):
    saved(tmp_path, step=3, world_size=2)  # an older marker
    saved(tmp_path, step=6, **DDP_2)
    (tmp_path / "checkpoint-9").mkdir()
    result = run_cli("checkpoint", tmp_path)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0] == "checkpoint-3     step 3, world size 2"
    assert lines[1] == "checkpoint-6     step 6, world size 2 (DDP (data parallel)), data parallel 2, global batch 8"
    assert lines[2].startswith("checkpoint-9     incomplete")
    assert lines[3].startswith("a resume (auto_resume_from_checkpoints) starts from checkpoint-6")
    empty = run_cli("checkpoint", tmp_path / "checkpoint-6" / "nothing")
    assert empty.code == 2 and "no such folder" in empty.err
