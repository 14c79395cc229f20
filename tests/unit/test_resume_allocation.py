"""Resuming a checkpoint saved on another world size: the plan keeps the checkpoint's global batch through gradient
accumulation and says so in one line, or refuses in one line that says what will work."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster
from llmtune.plan import make_plan as plan_alone
from llmtune.recipe.loader import recipe_from_mapping


def make_plan(recipe, cluster):
    """The plan `llmtune train` makes: with what resuming output_dir's checkpoint takes from the recipe checked."""
    return plan_alone(recipe, cluster, resume=True)


def recipe(output_dir: Path, **changes):
    base = {"base_model": "org/model", "datasets": [{"path": "org/data", "type": "alpaca"}],
            "output_dir": str(output_dir), "micro_batch_size": 2, "gradient_accumulation_steps": 2}  # fmt: skip
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def saved(output_dir: Path, step: int = 4, weights_only: bool = False, **info) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "llmtune-complete.json").write_text(json.dumps({"step": step, **info}))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if not weights_only:  # the schedule's state beside the weights, as every checkpoint but save_only_model's has
        (folder / "scheduler.pt").write_bytes(b"")
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


@pytest.mark.parametrize("world", [4, 2])  # another world size, and the same one (where a ZeRO checkpoint resumed
@pytest.mark.parametrize(("saved_as", "changes"), [  # by DDP restarted its optimizer silently)
    ("fsdp2", {}), ("ddp", FSDP2), ("zero2", {}), ("fsdp2", {"deepspeed": "zero3"}), ("zero3", FSDP2)])
def test_a_checkpoint_resumes_only_under_the_strategy_that_wrote_it(tmp_path, saved_as, changes, world):
    saved(tmp_path, **{**DDP_2, "strategy": saved_as})
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path, **changes), make_cluster(world, device="cpu"))
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
        ({"strategy": "fsdp2", "mesh": {"dp_replicate": 2, "dp_shard": 1}}, FSDP2, "FSDP2 (with a device mesh)"),
        ({"strategy": "fsdp1"}, {**FSDP2, "fsdp_version": 1}, "FSDP1"),
        ({"strategy": "pipeline"}, {"pipeline_parallel_size": 2}, "pipeline parallel"),
    ],
)
def test_sharded_checkpoints_on_another_world_size_are_refused_with_what_will_work(tmp_path, saved_as, changes, what):
    saved(tmp_path, **{**DDP_2, **saved_as})
    with pytest.raises(UserError) as caught:  # FSDP1 plans only for GPUs (it can't be rehearsed on CPU)
        make_plan(recipe(tmp_path, **changes), make_cluster(4, device="cuda" if what == "FSDP1" else "cpu"))
    line = caught.value.one_line()
    assert line.startswith(f"checkpoint-4 was saved by 2 process(es); this launch has 4: llmtune resumes {what} "
                           "checkpoints only at the world size that wrote them")  # fmt: skip
    assert "resume with --num-processes 2 (the allocation that saved it)" in line
    assert "run the same command again" not in line


def zero_checkpoint(output_dir: Path, converted: bool = False, **info) -> Path:
    """A ZeRO-2 checkpoint-4 of 2 ranks: DeepSpeed's `latest` and its engine folder (optimizer slices of 3 MiB)."""
    folder = saved(output_dir, **{**DDP_2, "strategy": "zero2", **info})
    (folder / "latest").write_text("global_step4")
    (folder / "global_step4").mkdir()
    for rank in (0, 1):
        (folder / "global_step4" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"0" * 3 * 2**20)
    if converted:
        (folder / "global_step4_universal").mkdir()
        (folder / "latest_universal").write_text("global_step4_universal")
    return folder


@pytest.mark.parametrize("world", [1, 4])
def test_a_zero_checkpoint_resumes_elsewhere_through_a_universal_checkpoint(tmp_path, world):
    zero_checkpoint(tmp_path, rows_seen=32, rows_per_epoch=96)
    plan = make_plan(recipe(tmp_path, deepspeed="zero2"), make_cluster(world, device="cpu"))
    accumulation = 4 // world
    assert (plan.strategy, plan.gradient_accumulation_steps, plan.global_batch_size) == ("zero2", accumulation, 8)
    # the engine's own batch keys follow, and it loads the universal checkpoint the first rank converts
    ds = plan.deepspeed_config
    assert (ds["gradient_accumulation_steps"], ds["train_batch_size"], ds["checkpoint"]) == (
        accumulation, 8, {"load_universal": True})  # fmt: skip
    assert (f"resuming checkpoint-4 (world size 2) on world size {world}: gradient accumulation 2 -> {accumulation}, "
            "global batch 8 kept, 32 of 96 rows seen; checkpoint-4 is converted to DeepSpeed's universal checkpoint "
            f"first (ds_to_universal, data-parallel size 2 -> {world}; about 0.0059 GiB more on disk; `llmtune "
            "checkpoint reshard` does it ahead)") in plan.notes  # fmt: skip


def test_a_converted_zero_checkpoint_is_not_converted_again(tmp_path):
    zero_checkpoint(tmp_path, converted=True, rows_seen=130, rows_per_epoch=96)
    plan = make_plan(recipe(tmp_path, deepspeed="zero2"), make_cluster(1, device="cpu"))
    assert plan.deepspeed_config["checkpoint"] == {"load_universal": True}
    assert any(note.endswith("130 rows seen (epoch 2: 34 of 96); checkpoint-4 was converted to DeepSpeed's "
                             "universal checkpoint already") for note in plan.notes), plan.notes  # fmt: skip


def test_a_zero_checkpoint_at_its_own_size_loads_as_it_is(tmp_path):
    zero_checkpoint(tmp_path, converted=True)
    plan = make_plan(recipe(tmp_path, deepspeed="zero2"), make_cluster(2, device="cpu"))
    assert "checkpoint" not in plan.deepspeed_config and plan.gradient_accumulation_steps == 2


@pytest.mark.parametrize(
    ("setup", "changes", "start", "hint"),
    [
        ("no-latest", {"deepspeed": "zero2"}, "checkpoint-4 has no DeepSpeed engine state", "resume from a checkpoint"),
        ("nvme", {"deepspeed": "zero3_nvme", "offload_nvme_path": "/nvme"}, "checkpoint-4 was saved by 2 process(es) "
         "with the optimizer on NVMe; this launch has 1", "resume with --num-processes 2"),
        ("grouped", {"group_by_length": True}, "checkpoint-4 was saved by 2 process(es); this launch has 1, and "
         "group_by_length", "resume with --num-processes 2 (the allocation that saved it), or set group_by_length"),
        ("own-disks", {"deepspeed": "zero2"}, "checkpoint-4 holds the optimizer slices of 1 of the 2 ranks that saved "
         "it", "copy the other machines' global_step4/*optim_states.pt into"),
    ],
)  # fmt: skip
def test_what_cant_resume_elsewhere_is_refused_with_what_will_work(tmp_path, setup, changes, start, hint):
    if setup == "grouped":
        saved(tmp_path, **DDP_2)
    else:
        folder = zero_checkpoint(tmp_path, strategy="zero3" if setup == "nvme" else "zero2")
        if setup == "no-latest":
            (folder / "latest").unlink()
        if setup == "own-disks":  # rank 1's slice stayed on the other machine
            next((folder / "global_step4").glob("*rank_1_*")).unlink()
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path, **changes), make_cluster(1, device="cpu"))
    line = caught.value.one_line()
    assert line.startswith(start) and f"(hint: {hint}" in line, line
    assert "run the same command again" not in line


def test_no_resume_no_check(tmp_path):
    saved(tmp_path, **DDP_2)
    plan = make_plan(recipe(tmp_path, auto_resume_from_checkpoints=False), make_cluster(1, device="cpu"))
    assert plan.gradient_accumulation_steps == 2


def test_validate_plans_the_recipe_alone_not_the_checkpoint_in_its_output_dir(tmp_path):
    """validate said 'valid, global batch 8' for a recipe of global batch 2 beside a stale checkpoint of another
    world size (its resume arithmetic), while plan and train refused that checkpoint."""
    saved(tmp_path, **DDP_2)
    alone = plan_alone(recipe(tmp_path), make_cluster(1, device="cpu"))
    assert (alone.gradient_accumulation_steps, alone.global_batch_size) == (2, 4)
    assert not any("resuming checkpoint-4" in note for note in alone.notes)
    assert make_plan(recipe(tmp_path), make_cluster(1, device="cpu")).global_batch_size == 8  # train's plan resumes


def test_the_checkpoint_command_shows_each_checkpoints_allocation(tmp_path, run_cli):
    saved(tmp_path, step=3, world_size=2)  # an older marker
    six = saved(tmp_path, step=6, **DDP_2, files=["optimizer.pt", "trainer_state.json"])
    (tmp_path / "checkpoint-9").mkdir()
    result = run_cli("checkpoint", tmp_path)
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0] == "checkpoint-3     step 3, world size 2"
    assert lines[1] == ("checkpoint-6     step 6, world size 2 (DDP (data parallel)), data parallel 2, global batch 8; "
                        "lacks optimizer.pt, which it was saved with (a resume refuses it)")  # fmt: skip
    assert lines[2].startswith("checkpoint-9     no llmtune completion marker: an interrupted save, or another tool's")
    (six / "optimizer.pt").write_bytes(b"x")
    assert "lacks" not in run_cli("checkpoint", tmp_path).out
    assert lines[3].startswith("a resume (auto_resume_from_checkpoints) starts from checkpoint-6")
    empty = run_cli("checkpoint", tmp_path / "checkpoint-6" / "nothing")
    assert empty.code == 2 and "no such folder" in empty.err
    offloaded = tmp_path / "zero"  # the engine layout a resume must keep, where it isn't the default
    saved(offloaded, step=2, **{**DDP_2, "strategy": "zero3", "engine_layout": {
        **ZERO3_LAYOUT, "offload_optimizer device": "cpu", "optimizer": "DeepSpeed's"}})  # fmt: skip
    assert run_cli("checkpoint", offloaded).out.splitlines()[0] == (
        "checkpoint-2     step 2, world size 2 (DeepSpeed ZeRO-3; offload_optimizer device cpu; sub_group_size "
        "1000000000; optimizer DeepSpeed's), data parallel 2, global batch 8")  # fmt: skip


def test_reshard_converts_only_what_needs_it_and_refuses_what_cant_move(tmp_path, run_cli):
    ddp = saved(tmp_path / "ddp", **DDP_2)
    result = run_cli("checkpoint", "reshard", ddp)
    assert result.code == 0 and result.out.strip() == ("checkpoint-4 (DDP (data parallel)) needs no conversion: it "
                                                       "loads on any world size as it is")  # fmt: skip
    zero_checkpoint(tmp_path / "zero", converted=True)
    result = run_cli("checkpoint", "reshard", tmp_path / "zero")  # a run's folder: its newest checkpoint
    assert result.out.strip() == "checkpoint-4 was converted to DeepSpeed's universal checkpoint already"
    tp = saved(tmp_path / "tp", **{**DDP_2, "strategy": "tp", "mesh": {"tensor_parallel": 2}})
    refused = run_cli("checkpoint", "reshard", tp)
    assert refused.code == 2 and ("checkpoint-4 was saved by tensor parallel with a device mesh on 2 process(es): "
                                  "llmtune resumes it only at that world size (hint: resume with --num-processes 2)"
                                  ) in refused.err  # fmt: skip
    lost = zero_checkpoint(tmp_path / "lost")
    (lost / "latest").unlink()
    assert "checkpoint-4 has no DeepSpeed engine state" in run_cli("checkpoint", "reshard", lost).err
    assert "needs the checkpoint" in run_cli("checkpoint", "reshard").err
    assert "no complete llmtune checkpoint" in run_cli("checkpoint", "reshard", lost / "global_step4").err


def test_resuming_with_another_length_says_what_the_schedule_does(tmp_path):
    folder = saved(tmp_path, step=6, **DDP_2)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 6, "max_steps": 8, "num_train_epochs": 2}))
    longer = make_plan(recipe(tmp_path, max_steps=12), make_cluster(2, device="cpu"))
    assert ("resuming checkpoint-6 at step 6 with max_steps 8 -> 12: the learning-rate schedule (cosine) is rebuilt "
            "for the new length, and goes on from step 7 at its rate there") in longer.notes  # fmt: skip
    # a length the checkpoint has reached: the Trainer would run one more step past its schedule's end; refused
    for steps in (6, 4):
        with pytest.raises(UserError) as err:
            make_plan(recipe(tmp_path, max_steps=steps), make_cluster(2, device="cpu"))
        assert (f"checkpoint-6 is at step 6, and max_steps is {steps} (it was saved by a run of 8): there is no step "
                f"left to train (hint: raise max_steps to train on") in err.value.one_line()  # fmt: skip
        assert f"llmtune merge {tmp_path / 'checkpoint-6'}" in err.value.one_line()
    # a checkpoint named by resume_from_checkpoint, in another run's folder: the merge names it where it is, and
    # training from the start means dropping the key (another output_dir would resume it all the same)
    elsewhere = recipe(tmp_path / "new", max_steps=6, resume_from_checkpoint=str(folder))
    with pytest.raises(UserError) as err:
        make_plan(elsewhere, make_cluster(2, device="cpu"))
    assert err.value.hint.endswith(f"llmtune merge {folder}; to train the recipe from the start: remove "
                                   "resume_from_checkpoint")  # fmt: skip
    # the end of a finished run, its recipe changed since (not the same recipe: that one is "nothing to do")
    end = saved(tmp_path / "done", step=8, **DDP_2)
    (end / "trainer_state.json").write_text(json.dumps({"global_step": 8, "max_steps": 8, "num_train_epochs": 2,
                                                        "epoch": 2.0}))  # fmt: skip
    (tmp_path / "done" / "metrics.json").write_text("{}")  # it finished (the same recipe would be "nothing to do")
    for changes in ({"num_epochs": 2, "learning_rate": 0.01}, {"max_steps": 8, "learning_rate": 0.01}):
        with pytest.raises(UserError) as err:
            make_plan(recipe(tmp_path / "done", **changes), make_cluster(2, device="cpu"))
        assert "checkpoint-8 is at step 8, and " in err.value.one_line()
        assert "(the end of its run, which finished; the recipe changed since): there is no step left to train" in (
            err.value.one_line()
        )
    # the same recipe: `llmtune plan` of the finished run plans it and says train has nothing to do (it refused it,
    # saying the recipe had changed)
    from llmtune.recipe.loader import recipe_fingerprint

    unchanged = recipe(tmp_path / "done", num_epochs=2)
    (tmp_path / "done" / "metrics.json").write_text(json.dumps({"recipe_fingerprint": recipe_fingerprint(unchanged)}))
    assert ("checkpoint-8 is the last step of this recipe's finished run (its metrics.json): llmtune train has "
            "nothing to do") in make_plan(unchanged, make_cluster(2, device="cpu")).notes  # fmt: skip
    more = make_plan(recipe(tmp_path / "done", num_epochs=3), make_cluster(2, device="cpu"))
    assert any("with num_epochs 2 -> 3" in n for n in more.notes)
    epochs = make_plan(recipe(tmp_path, num_epochs=3), make_cluster(2, device="cpu"))
    assert any("with num_epochs 2 -> 3: the learning-rate schedule" in n for n in epochs.notes)
    same = make_plan(recipe(tmp_path, num_epochs=2), make_cluster(2, device="cpu"))
    assert not any("learning-rate schedule" in n or "no step is left" in n for n in same.notes)


def test_a_changed_micro_batch_keeps_the_checkpoint_s_global_batch_or_is_refused(tmp_path):
    saved(tmp_path, **DDP_2)  # global batch 8 = micro 2 x accumulation 2 x 2 ranks
    smaller = make_plan(recipe(tmp_path, micro_batch_size=1), make_cluster(2, device="cpu"))  # after an OOM
    assert (smaller.gradient_accumulation_steps, smaller.global_batch_size) == (4, 8)
    assert any("resuming checkpoint-4 at the global batch it trained with, 8: micro_batch_size 1 x gradient "
               "accumulation 4 x 2" in note for note in smaller.notes)  # fmt: skip
    doubled = make_plan(recipe(tmp_path, gradient_accumulation_steps=4), make_cluster(2, device="cpu"))
    assert (doubled.gradient_accumulation_steps, doubled.global_batch_size) == (2, 8)
    with pytest.raises(UserError, match="micro_batch_size 3 on 2 data-parallel process"):
        make_plan(recipe(tmp_path, micro_batch_size=3), make_cluster(2, device="cpu"))


def _write(folder: Path, name: str, value) -> None:
    (folder / name).write_text(json.dumps(value))


def test_a_damaged_checkpoint_or_one_another_recipe_trained_is_refused_or_explained(tmp_path):
    from llmtune.plan.resume_checks import marker_keys

    def checkpoint(out: Path, files=("optimizer.pt", "scheduler.pt", "trainer_state.json"), adapter=None, **keys):
        folder = saved(out, **DDP_2, **keys)
        for name in files:
            (folder / name).write_bytes(b"x")
        if adapter:
            _write(folder, "adapter_config.json", adapter)
        marker = json.loads((folder / "llmtune-complete.json").read_text())
        marker["files"] = sorted(p.name for p in folder.iterdir() if p.name != "llmtune-complete.json")
        _write(folder, "llmtune-complete.json", marker)
        return folder

    plan = lambda out, **changes: make_plan(recipe(out, **changes), make_cluster(2, device="cpu"))  # noqa: E731
    # a file it was saved with is gone: the Trainer would restart the optimizer and schedule silently
    folder = checkpoint(tmp_path / "a", **marker_keys(recipe(tmp_path / "a")))
    plan(tmp_path / "a")  # whole: resumes
    (folder / "optimizer.pt").unlink()
    with pytest.raises(UserError, match=r"checkpoint-4 lacks optimizer.pt, which it was saved with \(the optimizer"):
        plan(tmp_path / "a")
    # the recipe's data or order changed: the skip over the trained batches would skip other rows
    keys = marker_keys(recipe(tmp_path / "b"))
    checkpoint(tmp_path / "b", **keys)
    with pytest.raises(UserError, match="trained with other seed"):
        plan(tmp_path / "b", seed=7)
    with pytest.raises(UserError, match="trained with other datasets"):
        plan(tmp_path / "b", datasets=[{"path": "org/other", "type": "alpaca"}])
    for drawn in ({"dataset_shard_num": 2, "dataset_shard_idx": 1}, {"dataloader_drop_last": True}):
        with pytest.raises(UserError, match=r"trained with other datasets \(or shard, merge order, drop_last\)"):
            plan(tmp_path / "b", **drawn)
    sharded = marker_keys(recipe(tmp_path / "s", dataset_shard_num=2, dataset_shard_idx=0))
    assert sharded["data_key"] != keys["data_key"]  # (and a recipe without them keys as before these keys existed)
    checkpoint(tmp_path / "s", **sharded)
    with pytest.raises(UserError, match="trained with other datasets"):
        plan(tmp_path / "s", dataset_shard_num=2, dataset_shard_idx=1)
    plan(tmp_path / "s", dataset_shard_num=2, dataset_shard_idx=0)
    # another base model of the same shape: the resume would load the checkpoint's weights, not train it
    with pytest.raises(UserError, match="trained from base_model model, and the recipe now names other-model"):
        plan(tmp_path / "b", base_model="org/other-model")
    with pytest.raises(UserError, match="now names model@v2"):
        plan(tmp_path / "b", revision_of_model="v2")
    plan(tmp_path / "b", base_model="/mnt/models/model")  # its download in a local folder is the same model
    # schedule keys: what the resume does with them
    notes = plan(tmp_path / "b", learning_rate=0.01, lr_scheduler="linear").notes
    assert any(f"learning_rate {keys['schedule']['learning_rate']} -> 0.01 since checkpoint-4: the resume keeps "
               in n for n in notes)  # fmt: skip
    assert any("lr_scheduler cosine -> linear since checkpoint-4: the new schedule takes over" in n for n in notes)
    # optimizer keys: the state it loads holds its own settings (they were dropped without a word); another
    # optimizer's state is refused (adamw_torch's into adafactor: a KeyError mid-run)
    notes = plan(tmp_path / "b", weight_decay=0.5, adam_beta2=0.95).notes
    assert any(n.startswith(f"weight_decay {keys['optimizer_settings']['weight_decay']} -> 0.5; adam_beta2 "
                            f"{keys['optimizer_settings']['adam_beta2']} -> 0.95 since checkpoint-4: the resume keeps the "
                            "checkpoint's") for n in notes)  # fmt: skip
    with pytest.raises(UserError, match=r"holds the state of optimizer adamw_torch, and the recipe now names "
                                        r"adafactor") as refused:  # fmt: skip
        plan(tmp_path / "b", optimizer="adafactor")
    assert refused.value.hint.startswith("set optimizer: adamw_torch to resume it; to train on with adafactor: llmtune "
                                         "merge")  # fmt: skip
    # an adapter of another shape, or none
    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8}
    checkpoint(tmp_path / "c", adapter={"r": 4, "lora_alpha": 8, "use_dora": False, "use_rslora": False},
               **marker_keys(recipe(tmp_path / "c", **lora)))  # fmt: skip
    plan(tmp_path / "c", **lora)
    with pytest.raises(UserError, match=r"holds an adapter that the recipe no longer builds \(lora_r 4 -> 8"):
        plan(tmp_path / "c", **{**lora, "lora_r": 8})
    with pytest.raises(UserError, match="was saved by a LoRA run, and this recipe trains the whole model"):
        plan(tmp_path / "c")
    # an older marker (no file list): the Trainer's state at least; a pipeline's checkpoint has none
    old = saved(tmp_path / "d", **DDP_2)
    (old / "trainer_state.json").unlink()
    with pytest.raises(UserError, match="checkpoint-4 lacks trainer_state.json"):
        plan(tmp_path / "d")


def test_checkpoints_another_tool_saved_are_not_overwritten_by_starting_over(tmp_path):
    (tmp_path / "checkpoint-2").mkdir(parents=True)
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text("{}")
    with pytest.raises(UserError) as err:
        make_plan(recipe(tmp_path), make_cluster(1, device="cpu"))
    assert "holds checkpoint-2 without llmtune's completion marker" in err.value.one_line()
    assert f"resume_from_checkpoint: {tmp_path / 'checkpoint-2'}" in err.value.one_line()
    make_plan(recipe(tmp_path, auto_resume_from_checkpoints=False), make_cluster(1, device="cpu"))
    saved(tmp_path, step=4, **DDP_2)  # beside a complete one of llmtune's: that one is resumed
    assert make_plan(recipe(tmp_path), make_cluster(2, device="cpu")).global_batch_size == 8


def test_a_run_started_from_another_runs_checkpoint_resumes_its_own_after_a_crash(tmp_path):
    from llmtune.launch.preflight import finished_run
    from llmtune.plan.resume import resume_checkpoint
    from llmtune.recipe.loader import recipe_fingerprint

    start = saved(tmp_path / "sft", step=2, **DDP_2)
    out = tmp_path / "run"
    assert resume_checkpoint(recipe(out, resume_from_checkpoint=str(start))) == start  # nothing of its own yet
    own = saved(out, step=4, **DDP_2)  # it saved checkpoint-4, then crashed
    assert resume_checkpoint(recipe(out, resume_from_checkpoint=str(start))) == own
    back = saved(out, step=2, **DDP_2)  # going back to an earlier checkpoint of the run itself is kept
    assert resume_checkpoint(recipe(out, resume_from_checkpoint=str(back))) == back
    # and the finished run, rerun as it was, has nothing to do (it resumed from a named checkpoint or not)
    done = recipe(out, resume_from_checkpoint=str(start))
    (out / "metrics.json").write_text(json.dumps({"recipe_fingerprint": recipe_fingerprint(done), "steps": 8}))
    assert "already holds this recipe's finished run" in finished_run(done)


def test_only_train_and_plan_check_what_a_resume_takes(tmp_path):
    # validate, rehearse, doctor and the wizard plan the recipe alone: a finished run's edited recipe validates
    folder = saved(tmp_path, step=8, **DDP_2)
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 8, "max_steps": 8, "epoch": 2.0,
                                                           "num_train_epochs": 2}))  # fmt: skip
    (tmp_path / "metrics.json").write_text("{}")
    changed = recipe(tmp_path, max_steps=8, micro_batch_size=1)
    assert plan_alone(changed, make_cluster(2, device="cpu")).global_batch_size == 4  # the recipe's own
    with pytest.raises(UserError, match="the end of its run, which finished; the recipe changed since"):
        make_plan(changed, make_cluster(2, device="cpu"))


def test_a_run_killed_after_its_last_checkpoint_writes_its_final_model_when_rerun(tmp_path):
    folder = saved(tmp_path, step=8, **DDP_2)
    state = {"global_step": 8, "max_steps": 8, "epoch": 2.0, "num_train_epochs": 2}
    (folder / "trainer_state.json").write_text(json.dumps(state))
    epochs = make_plan(recipe(tmp_path, num_epochs=2), make_cluster(2, device="cpu"))  # no metrics.json: not finished
    assert "resuming checkpoint-8, the run's last step (8): no step is trained, the final model is written" in epochs.notes
    # with max_steps the Trainer would run a step past the end: refused with the checkpoint's model as the way out
    with pytest.raises(UserError, match="the run's last step; it stopped before its final save"):
        make_plan(recipe(tmp_path, max_steps=8), make_cluster(2, device="cpu"))


def test_the_run_a_named_checkpoint_started_is_followed_by_its_markers(tmp_path):
    from llmtune.plan.resume import resume_checkpoint, started_from

    start, out = saved(tmp_path / "sft", step=2, **DDP_2), tmp_path / "run"
    attempt = saved(out, step=4, **DDP_2, started_from="/elsewhere/checkpoint-9")  # an earlier attempt's
    assert resume_checkpoint(recipe(out, resume_from_checkpoint=str(start))) == start
    (attempt / "llmtune-complete.json").write_text(json.dumps({"step": 4, **DDP_2, "started_from": str(start)}))
    assert resume_checkpoint(recipe(out, resume_from_checkpoint=str(start))) == attempt  # the same run, further on
    # another tool's checkpoint in output_dir, named as the refusal says: the run that started there is followed
    hf = out / "checkpoint-1"
    hf.mkdir()
    assert started_from(str(hf), out, {}) == str(hf.resolve())  # unmarked: where the run started
    assert started_from(str(attempt), out, {"started_from": str(start)}) == str(start)  # its own: carried over
    (attempt / "llmtune-complete.json").write_text(json.dumps({"step": 4, **DDP_2, "started_from": str(hf)}))
    assert resume_checkpoint(recipe(out, resume_from_checkpoint=str(hf))) == attempt


@pytest.mark.parametrize(("changes", "strategy"), [({}, "ddp"), ({"deepspeed": "zero2"}, "zero2"), (FSDP2, "fsdp2")])
def test_a_weights_only_checkpoint_resumes_with_a_fresh_optimizer_or_is_refused_by_an_engine(tmp_path, changes,
                                                                                            strategy):  # fmt: skip
    saved(tmp_path, weights_only=True, **{**DDP_2, "strategy": strategy})
    if strategy == "ddp":  # weights, step and schedule go on; the optimizer starts afresh: said in the plan
        notes = make_plan(recipe(tmp_path), make_cluster(2, device="cpu")).notes
        assert any(n.startswith("resuming checkpoint-4, saved with save_only_model") and "starts afresh" in n
                   for n in notes), notes  # fmt: skip
        return
    with pytest.raises(UserError, match="checkpoint-4 holds the weights only") as caught:
        make_plan(recipe(tmp_path, **changes), make_cluster(2, device="cpu"))
    assert "auto_resume_from_checkpoints: false" in caught.value.hint and "base_model" in caught.value.hint


def test_a_weights_only_resume_steps_the_schedule_to_the_checkpoints_step():
    """No scheduler.pt to load: the Trainer's fresh schedule would warm up again from 0 at the checkpoint's step."""
    import torch
    from transformers import TrainingArguments

    from llmtune.train.engine.trainer import LlmtuneTrainer

    model = torch.nn.Linear(2, 2)
    args = TrainingArguments(output_dir="/tmp/unused", learning_rate=1e-3, warmup_steps=2, lr_scheduler_type="cosine",
                             use_cpu=True, report_to=[])  # fmt: skip
    rates = []
    for steps in (0, 4):
        trainer = LlmtuneTrainer(model=model, args=args)
        trainer.scheduler_from_step = steps
        trainer.create_optimizer()
        rates.append(trainer.create_scheduler(8, trainer.optimizer).get_last_lr()[0])
        assert trainer.scheduler_from_step == 0  # once
    fresh, resumed = rates
    assert fresh == 0.0 and resumed == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 2 / 6)))


def test_a_deepspeed_file_pinning_the_global_batch_resumes_on_another_world_size(tmp_path):
    """The file's train_batch_size is the checkpoint's global batch, which the resume keeps: it was refused as
    disagreeing with the recipe's own accumulation, checked before the resume's."""
    checkpoint = saved(tmp_path, **{**DDP_2, "strategy": "zero2"})
    (checkpoint / "latest").write_text("global_step4")
    (checkpoint / "global_step4").mkdir()
    for rank in range(2):  # each rank's optimizer slice, as DeepSpeed names them
        (checkpoint / "global_step4" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 2}}))
    for world, accumulation in ((1, 4), (4, 1)):
        plan = make_plan(recipe(tmp_path, deepspeed=str(config)), make_cluster(world, device="cpu"))
        assert (plan.gradient_accumulation_steps, plan.deepspeed_config["train_batch_size"]) == (accumulation, 8)
    # a file pinning the accumulation itself: the resume needs another, and the line says so (not "change the
    # recipe", which holds no such value)
    config.write_text(json.dumps({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}))
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path, deepspeed=str(config)), make_cluster(1, device="cpu"))
    assert caught.value.message.endswith("sets gradient_accumulation_steps = 2, and resuming the checkpoint on this "
                                         "world size needs 4 (the gradient accumulation that keeps the global batch "
                                         "it trained with)")  # fmt: skip
    assert "recipe" not in caught.value.hint and "resume on the world size that saved it" in caught.value.hint


def test_a_folder_inside_a_checkpoint_is_pointed_at_its_checkpoint(tmp_path):
    checkpoint = saved(tmp_path, **{**DDP_2, "strategy": "zero2"})
    (checkpoint / "global_step4").mkdir()
    with pytest.raises(UserError, match="global_step4 is a folder inside the checkpoint checkpoint-4") as caught:
        make_plan(recipe(tmp_path / "other", deepspeed="zero2", resume_from_checkpoint=str(checkpoint / "global_step4")),
                  make_cluster(2, device="cpu"))  # fmt: skip
    assert caught.value.hint == f"set resume_from_checkpoint: {checkpoint}"


ZERO3_LAYOUT = {"offload_optimizer device": "none", "offload_param device": "none", "sub_group_size": 1_000_000_000,
                "optimizer": "the Trainer's", "scheduler": "the Trainer's"}  # fmt: skip


ZERO2_LAYOUT = {key: value for key, value in ZERO3_LAYOUT.items() if key != "sub_group_size"}


@pytest.mark.parametrize(("strategy", "layout", "changes", "differ"), [
    # saved with Axolotl's zero3_bf16.json (sub_group_size 0, on disk or stood in for), resumed with llmtune's preset
    ("zero3", {**ZERO3_LAYOUT, "sub_group_size": 0}, {"deepspeed": "zero3"}, "sub_group_size 0 -> 1000000000"),
    # the usual answer to an OOM: offload (DeepSpeed's CPU Adam then steps the Trainer's groups), a higher stage, or
    # both; and back
    ("zero3", ZERO3_LAYOUT, {"deepspeed": "zero3_offload"}, "offload_optimizer device none -> cpu; offload_param "
     "device none -> cpu"),
    # an offload checkpoint of a DeepSpeed-built optimizer (an optimizer section; llmtune before it built DeepSpeed's
    # CPU Adam in the Trainer's groups): one group, the schedule in DeepSpeed's files
    ("zero3", {**ZERO3_LAYOUT, "offload_optimizer device": "cpu", "offload_param device": "cpu",
               "optimizer": "DeepSpeed's"}, {"deepspeed": "zero3_offload"}, "optimizer DeepSpeed's -> the Trainer's"),
    ("zero2", ZERO2_LAYOUT, {"deepspeed": "zero3"}, "DeepSpeed ZeRO-2 -> DeepSpeed ZeRO-3; sub_group_size None -> "
     "1000000000"),
    ("zero3", {**ZERO3_LAYOUT, "offload_optimizer device": "cpu", "optimizer": "DeepSpeed's"}, {"deepspeed": "zero2"},
     "DeepSpeed ZeRO-3 -> DeepSpeed ZeRO-2; offload_optimizer device cpu -> none; sub_group_size 1000000000 -> None; "
     "optimizer DeepSpeed's -> the Trainer's"),
])  # fmt: skip
@pytest.mark.parametrize("world", [2, 1])
def test_a_checkpoint_in_another_zero_layout_is_converted_with_its_optimizer_state(tmp_path, strategy, layout,
                                                                                   changes, differ, world):  # fmt: skip
    """Each of these ended every rank in a traceback after loading, then was refused (an offload change, the usual
    fix for an OOM, and a recipe naming Axolotl's file run from another folder among them): the plan now loads the
    checkpoint's universal conversion into the new layout, and says so. (The conversion's files and a real run of
    it: tests/integration/test_resume.py::test_a_zero_checkpoint_resumes_at_another_stage_and_offload_and_back.)"""
    optimizer = "deepspeed:adamw" if layout["optimizer"] == "DeepSpeed's" else "adamw_torch"
    folder = saved(tmp_path, **{**DDP_2, "strategy": strategy, "engine_layout": layout, "optimizer": optimizer})
    (folder / "latest").write_text("global_step4")  # DeepSpeed's engine state, each rank's optimizer slice
    (folder / "global_step4").mkdir()
    for rank in range(2):
        (folder / "global_step4" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")
    plan = make_plan(recipe(tmp_path, **changes), make_cluster(world, device="cpu"))
    said = [note for note in plan.notes if note.startswith("checkpoint-4 was saved with")]
    assert said == [f"checkpoint-4 was saved with {differ} (saved -> now): it is converted to DeepSpeed's universal "
                    "checkpoint and loaded into this layout, with its optimizer state and schedule (`llmtune checkpoint "
                    "reshard` converts it ahead)"]  # fmt: skip
    assert plan.deepspeed_config["checkpoint"] == {"load_universal": True}
    assert plan.global_batch_size == 8  # the checkpoint's, on either world size
    (folder / "global_step4" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()  # a machine's own disk kept it
    with pytest.raises(UserError, match="holds the optimizer slices of 1 of the 2 ranks that saved it"):
        make_plan(recipe(tmp_path, **changes), make_cluster(world, device="cpu"))


@pytest.mark.parametrize(("strategy", "layout", "changes", "differ", "why", "fix"), [
    ("fsdp2", {"state_dict_type": "FULL_STATE_DICT"}, FSDP2, "state_dict_type FULL_STATE_DICT -> SHARDED_STATE_DICT",
     "accelerate reads an FSDP checkpoint only in the state dict format it is told",
     "set fsdp_config.state_dict_type back"),
    ("zero3", ZERO3_LAYOUT, {"deepspeed": "zero3_nvme", "offload_nvme_path": "/tmp"}, "offload_optimizer device none "
     "-> nvme; offload_param device none -> nvme", "DeepSpeed reads "
     "NVMe-offloaded optimizer state back only into the swap files that wrote it", "use the DeepSpeed config"),
    ("zero2", ZERO2_LAYOUT, {"deepspeed": "zero3", "optimizer": "adafactor"}, "DeepSpeed ZeRO-2 -> DeepSpeed ZeRO-3",
     "its conversion carries Adam's moments, and adafactor keeps other state", "use the DeepSpeed config"),
])  # fmt: skip
def test_what_another_layout_cant_carry_over_is_refused_with_what_will_work(tmp_path, strategy, layout, changes,
                                                                            differ, why, fix):  # fmt: skip
    saved(tmp_path, **{**DDP_2, "strategy": strategy, "engine_layout": layout, "optimizer": "adamw_torch"})
    with pytest.raises(UserError) as caught:
        make_plan(recipe(tmp_path, **changes), make_cluster(2, device="cpu"))
    assert caught.value.message.startswith(f"checkpoint-4 was saved with {differ}")
    assert f"(saved -> now): {why}" in caught.value.message
    assert caught.value.hint.startswith(fix) and "llmtune merge" in caught.value.hint
    # markers without the optimizer (before this llmtune) or without the layout (older still) aren't guessed at
    (tmp_path / "checkpoint-4").rename(tmp_path / "old")
    saved(tmp_path, **{**DDP_2, "strategy": "zero2", "engine_layout": ZERO2_LAYOUT})
    with pytest.raises(UserError, match="doesn't record its optimizer"):
        make_plan(recipe(tmp_path, deepspeed="zero2_offload"), make_cluster(2, device="cpu"))
    (tmp_path / "checkpoint-4").rename(tmp_path / "older")
    saved(tmp_path, **{**DDP_2, "strategy": "zero2"})
    with pytest.raises(UserError, match="with an older llmtune, whose checkpoints don't record their engine layout"):
        make_plan(recipe(tmp_path, deepspeed="zero3"), make_cluster(2, device="cpu"))


@pytest.mark.parametrize("world", [2, 1])
def test_a_ddp_checkpoint_of_a_full_fine_tune_resumes_under_zero_and_what_cant_is_refused(tmp_path, world):
    """Refused before at any world size (a DDP checkpoint had no engine state ZeRO reads); now written as the
    universal checkpoint by the first rank (tests/integration/test_resume.py, a real run of it)."""
    folder = saved(tmp_path, **{**DDP_2, "optimizer": "adamw_torch"})
    (folder / "optimizer.pt").write_bytes(b"")
    plan = make_plan(recipe(tmp_path, deepspeed="zero3"), make_cluster(world, device="cpu"))
    assert ("checkpoint-4 was saved by DDP (data parallel); this launch runs DeepSpeed ZeRO-3: its weights and "
            "AdamW's moments are written as DeepSpeed's universal checkpoint and loaded with its schedule") in plan.notes
    assert plan.deepspeed_config["checkpoint"] == {"load_universal": True} and plan.global_batch_size == 8
    lora = make_plan(recipe(tmp_path, deepspeed="zero3", adapter="lora", lora_target_linear=True),
                     make_cluster(world, device="cpu"))  # a plain LoRA's adapter_model.safetensors converts too
    assert lora.deepspeed_config["checkpoint"] == {"load_universal": True}
    for changes, why in [
        ({"adapter": "lora", "lora_target_linear": True, "lora_modules_to_save": ["lm_head"]}, "llmtune converts a "
         "full fine-tune's or a plain LoRA's state (QLoRA, lora_modules_to_save, trainable tokens and ReLoRA save "
         "other names or state)"),
        ({"optimizer": "adafactor"}, "its conversion carries AdamW's moments, and adafactor keeps other state"),
    ]:  # fmt: skip
        with pytest.raises(UserError) as caught:
            make_plan(recipe(tmp_path, deepspeed="zero3", **changes), make_cluster(world, device="cpu"))
        assert caught.value.message == f"checkpoint-4 was saved by DDP (data parallel); this launch runs DeepSpeed ZeRO-3: {why}"  # fmt: skip
        assert "llmtune merge" in caught.value.hint
    (folder / "optimizer.pt").unlink()
    with pytest.raises(UserError, match="it holds no optimizer.pt"):
        make_plan(recipe(tmp_path, deepspeed="zero3"), make_cluster(world, device="cpu"))


@pytest.mark.parametrize("changes", [{"deepspeed": "zero3"}, {"deepspeed": "zero3_offload"}, FSDP2])
def test_the_layout_a_recipe_plans_is_the_one_its_checkpoints_record(tmp_path, changes):
    from llmtune.plan.relayout import engine_layout, optimizer_of

    plan = plan_alone(recipe(tmp_path, **changes), make_cluster(2, device="cpu"))
    saved(tmp_path, **{**DDP_2, "strategy": plan.strategy, "optimizer": optimizer_of("adamw_torch", plan.deepspeed_config),
                       "engine_layout": engine_layout(plan.deepspeed_config, (plan.accelerate_config or {}).get("fsdp_config"))})  # fmt: skip
    resumed = make_plan(recipe(tmp_path, **changes), make_cluster(2, device="cpu"))
    assert not any("was saved with" in note for note in resumed.notes)
    assert "checkpoint" not in (resumed.deepspeed_config or {})


def test_axolotl_s_zero3_file_and_its_stand_in_save_the_same_layout(tmp_path):
    """A recipe naming deepspeed_configs/zero3_bf16.json reads the file where it is on disk and llmtune's stand-in
    where it isn't (another folder, another machine): a checkpoint of one resumes with the other (it was refused,
    sub_group_size 0 -> 1000000000)."""
    from llmtune.plan.relayout import engine_layout

    name = "deepspeed_configs/zero3_bf16.json"
    stood_in = plan_alone(recipe(tmp_path / "a", deepspeed=name), make_cluster(2, device="cpu"))
    assert any("stands for it, with the file's sub_group_size 0" in note for note in stood_in.notes)
    (tmp_path / "deepspeed_configs").mkdir()
    axolotl = {"zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 0,
               "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
               "stage3_param_persistence_threshold": "auto", "max_live_parameters": 0, "max_reuse_distance": 0,
               "gather_16bit_weights_on_model_save": True}, "bf16": {"enabled": True},
               "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
               "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False}  # fmt: skip (Axolotl's file)
    (tmp_path / name).write_text(json.dumps(axolotl))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        read = plan_alone(recipe(tmp_path / "b", deepspeed=name), make_cluster(2, device="cpu"))
    finally:
        os.chdir(cwd)
    assert not any("stands for it" in note for note in read.notes)
    layouts = [engine_layout(plan.deepspeed_config, None) for plan in (stood_in, read)]
    assert layouts[0] == layouts[1] and layouts[0]["sub_group_size"] == 0
