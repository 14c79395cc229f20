"""Nodes die: kill -9 one rank of a 2-rank run right after checkpoint k, rerun the same command, and the
final weights equal the uninterrupted run's bit for bit. Also: a kill during a save, an elastic restart,
a rerun of a finished run, and the checkpoint rotation that never loses the last good checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from harness import assert_quiet_console, llmtune, make_workspace, read_metrics, saved_weights, write_run_recipe

pytestmark = pytest.mark.integration

# 32 rows, global batch 8 (micro batch 2 x accumulation 2 x 2 ranks) -> 4 steps per epoch, 2 epochs; checkpoints at
# 3 and 6 (6 is mid-epoch, so resuming must restore the sampler position, not just the epoch)
COMMON = {"num_epochs": 2, "save_strategy": "steps", "save_steps": 3, "save_total_limit": 2, "logging_steps": 1,
          "micro_batch_size": 2, "gradient_accumulation_steps": 2, "weight_decay": 0.1}  # fmt: skip
STRATEGIES = {
    "ddp": {},
    "zero2": {"deepspeed": "zero2"},
    "zero3": {"deepspeed": "zero3"},
    "fsdp2": {"fsdp_version": 2, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}},
}
KILLED = ["ddp", "zero3", "fsdp2"]  # the kill -9 test's; every strategy above resumes on other world sizes


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    """The harness's workspace, with 32 distinct rows: a row's hash then names the row (resume row accounting)."""
    from harness import REPEAT_WORDS
    from tiny import write_jsonl

    root, _, model = make_workspace(tmp_path_factory, "resume", tiny_model)
    rows = [{"instruction": f"Repeat {w} {n}", "output": f"{w} {w} {n}"} for n in range(4) for w in REPEAT_WORDS]
    assert len(rows) == 32
    return root, write_jsonl(root / "distinct.jsonl", rows), model


def write(workspace, name: str, **changes) -> Path:
    return write_run_recipe(workspace, name, **{**COMMON, **changes})


def train(path: Path, env: dict | None = None, *flags: str):
    return llmtune("train", path, "--num-processes", "2", *flags, env=env, timeout=900)


def assert_bit_identical(a_dir: Path, b_dir: Path) -> None:
    import torch

    a, b = saved_weights(a_dir), saved_weights(b_dir)
    assert a.keys() == b.keys() and len(a) > 0
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def straight(workspace):
    """Uninterrupted reference runs, one per strategy, each logging the rows each rank trained at each step."""
    runs = {}
    for name, changes in STRATEGIES.items():
        path = write(workspace, f"straight-{name}", **changes)
        rows = workspace[0] / f"rows-straight-{name}"
        rows.mkdir()
        result = train(path, {"LLMTUNE_TEST_ROW_LOG": str(rows)})
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = path
    return runs


@pytest.mark.parametrize("strategy", KILLED)
def test_kill_9_after_a_checkpoint_then_rerun_is_bit_exact(workspace, straight, strategy):
    path = write(workspace, f"killed-{strategy}", **STRATEGIES[strategy])
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    crashed = train(path, {"LLMTUNE_TEST_EXIT_AFTER_STEP": "6"})  # rank 1 gets SIGKILL right after checkpoint 6
    assert crashed.returncode == 1
    # the launcher names the rank that died and shows its last lines, instead of torchrun's stack trace
    assert (
        "error: rank 1 (local rank 1 on" in crashed.stderr and "was killed by signal 9 (SIGKILL)" in crashed.stderr
    ), crashed.stderr[-3000:]
    # and rank 1's own last lines (its last is the test hook's, just before the kill)
    assert re.search(r"last lines of rank 1 \(.*\n(    .*\n)*    test hook LLMTUNE_TEST_EXIT_AFTER_STEP: rank 1 kills "
                     r"itself at step 6\n", crashed.stderr), crashed.stderr[-2000:]  # fmt: skip
    assert "ChildFailedError" not in crashed.stderr
    assert (out / "checkpoint-6" / "llmtune-complete.json").is_file()
    assert not (out / "metrics.json").exists()
    resumed = train(path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-6'}" in resumed.stderr
    metrics = read_metrics(path)
    assert metrics["steps"] == 8 and metrics["resumed_from"] == str(out / "checkpoint-6")
    # the resumed run logged only steps 7 and 8 itself, and they equal the reference's
    reference = read_metrics(straight[strategy])
    tail = [(e["step"], e["loss"]) for e in metrics["log_history"] if "loss" in e and e["step"] > 6]
    expected = [(e["step"], e["loss"]) for e in reference["log_history"] if "loss" in e and e["step"] > 6]
    assert tail == expected
    assert_bit_identical(Path(yaml.safe_load(straight[strategy].read_text())["output_dir"]), out)
    # save_total_limit 2 kept the two newest complete checkpoints (the Trainer also saves the last step)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    if strategy == "ddp":  # the others resume elsewhere from the reference's checkpoint-6 (below)
        resume_elsewhere(workspace, straight, out / "checkpoint-6", strategy, 1)


def rows_by_step(folder: Path) -> dict[int, list[str]]:
    """Every row (its hash) each step trained, over all ranks, from LLMTUNE_TEST_ROW_LOG's files."""
    steps: dict[int, list[str]] = {}
    for log in folder.glob("rank*.jsonl"):
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            steps.setdefault(entry["step"], []).extend(entry["rows"])
    return {step: sorted(rows) for step, rows in steps.items()}


def resume_elsewhere(workspace, straight, checkpoint: Path, strategy: str, processes: int) -> None:
    """A 2-rank checkpoint-6 resumed by another number of processes (DDP: the full state; FSDP2: its sharded state
    dict, resharded by torch's distributed checkpoint; ZeRO: converted to DeepSpeed's universal checkpoint): the
    gradient accumulation changes so the global batch stays 8, steps 7 and 8 train exactly the rows the
    uninterrupted 2-rank run trained at those steps (none twice, none skipped: the 32 rows once per epoch), the rows
    are counted over the whole run, and the resumed steps' losses are the uninterrupted run's within 1e-5."""
    import shutil

    name = f"resume-on-{processes}-{strategy}"
    path = write(workspace, name, **STRATEGIES[strategy])
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    shutil.copytree(checkpoint, out / checkpoint.name)
    ahead = strategy == "zero2" and processes == 4  # converted by `llmtune checkpoint reshard` before the resume
    if ahead:
        converted = llmtune("checkpoint", "reshard", out)  # the run's folder: its newest checkpoint
        assert converted.returncode == 0, converted.stderr[-3000:]
        assert "converted checkpoint-6 to DeepSpeed's universal checkpoint (global_step6_universal" in converted.stdout
        shown = llmtune("checkpoint", out).stdout
        assert ("checkpoint-6     step 6, world size 2 (DeepSpeed ZeRO-2), data parallel 2, global batch 8, 48 "
                "rows seen (32 per epoch); converted to DeepSpeed's universal checkpoint") in shown, shown  # fmt: skip
    rows = workspace[0] / f"rows-{name}"
    rows.mkdir()
    resumed = llmtune("train", path, "--num-processes", str(processes), env={"LLMTUNE_TEST_ROW_LOG": str(rows)},
                      timeout=900)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_quiet_console(resumed.stdout + resumed.stderr)  # the conversion's bars and prints stay in the logs
    accumulation = 8 // (2 * processes)
    said = (f"resuming checkpoint-6 (world size 2) on world size {processes}: gradient accumulation 2 -> "
            f"{accumulation}, global batch 8 kept, 48 rows seen (epoch 2: 16 of 32)")  # fmt: skip
    assert said in resumed.stderr, resumed.stderr[-3000:]
    if ahead:
        assert "checkpoint-6 was converted to DeepSpeed's universal checkpoint already" in resumed.stderr
    metrics, reference = read_metrics(path), read_metrics(straight[strategy])
    assert (metrics["world_size"], metrics["global_batch_size"], metrics["steps"]) == (processes, 8, 8)
    assert metrics["strategy"] == ("single" if strategy == "ddp" and processes == 1 else strategy)
    # the engine each rank really ran (read from the live objects)
    engine = {"ddp": ("none" if processes == 1 else "ddp", None), "zero2": ("deepspeed", 2),
              "zero3": ("deepspeed", 3), "fsdp2": ("fsdp2", None)}[strategy]  # fmt: skip
    ran = [(r["engine"], r.get("zero_stage")) for r in metrics["ranks"]]
    assert ran == [engine] * processes, metrics["ranks"]
    assert metrics["resumed_from"] == str(out / "checkpoint-6")
    assert (metrics["rows_seen"], metrics["rows_seen_this_run"]) == (64, 16)  # 2 epochs of 32 rows
    # tokens too: the whole run's, as the uninterrupted run counted them, the checkpoint's included
    assert metrics["tokens_seen"] == reference["tokens_seen"] > metrics["tokens_seen_this_run"] > 0
    marker = json.loads((out / "checkpoint-8" / "llmtune-complete.json").read_text())
    assert (marker["world_size"], marker["global_batch_size"], marker["rows_seen"]) == (processes, 8, 64)
    assert marker["tokens_seen"] == metrics["tokens_seen"]
    # the engine layout a later resume must keep (plan/resume.py check_layout), as the live run wrote it
    zero = {"offload_optimizer device": "none", "offload_param device": "none", "optimizer": "the Trainer's",
            "scheduler": "the Trainer's"}  # fmt: skip
    assert marker["engine_layout"] == {"ddp": {}, "zero2": zero, "zero3": {**zero, "sub_group_size": 1_000_000_000},
                                       "fsdp2": {"state_dict_type": "SHARDED_STATE_DICT"}}[strategy]  # fmt: skip
    if strategy.startswith("zero"):  # converted once, in place, before the engine loaded it
        assert ("converted checkpoint-6 to DeepSpeed's universal checkpoint" in resumed.stderr) != ahead
        assert (out / "checkpoint-6" / "latest_universal").read_text() == "global_step6_universal"
    trained, expected = rows_by_step(rows), rows_by_step(workspace[0] / f"rows-straight-{strategy}")
    assert sorted(trained) == [7, 8] and len(expected) == 8
    assert all(len(expected[step]) == 8 for step in expected)
    assert {step: expected[step] for step in (7, 8)} == trained
    epoch = [row for step in (1, 2, 3, 4) for row in expected[step]]
    assert len(set(epoch)) == 32  # each of the 32 rows once per epoch, so equal steps mean none twice
    # the resumed steps' losses: the issue asks for the last within 2%; on another world size only the summation
    # order differs, so they match to about 1e-7 here (measured 8.3e-8 at most): bound them at 1e-5
    resumed_losses = {e["step"]: e["loss"] for e in metrics["log_history"] if "loss" in e and e["step"] > 6}
    expected_losses = {e["step"]: e["loss"] for e in reference["log_history"] if "loss" in e and e["step"] > 6}
    assert resumed_losses.keys() == expected_losses.keys() == {7, 8}
    assert all(abs(resumed_losses[k] - expected_losses[k]) <= 1e-5 * abs(expected_losses[k]) for k in (7, 8)), (
        resumed_losses, expected_losses)  # fmt: skip


@pytest.mark.parametrize("strategy", ["zero2", "zero3", "fsdp2"])
def test_a_checkpoint_resumes_on_fewer_and_on_more_processes(workspace, straight, strategy):
    """The uninterrupted 2-rank run's checkpoint-6 (what a kill after it leaves: the kill test shows the rerun is
    bit-exact from it) resumed on 1 process and on 4."""
    checkpoint = Path(yaml.safe_load(straight[strategy].read_text())["output_dir"]) / "checkpoint-6"
    for processes in (1, 4):
        resume_elsewhere(workspace, straight, checkpoint, strategy, processes)


def test_a_zero_checkpoint_resumes_at_another_stage_and_offload_and_back(workspace, straight):
    """What a run that ran out of memory does: the 2-rank ZeRO-2 checkpoint-6 goes on under ZeRO-3 with the optimizer
    and the parameters offloaded (DeepSpeed's CPU Adam then steps the Trainer's groups: with weight decay 0.1 it ends
    at the ZeRO-2 run's weights only if norms stay undecayed); and a ZeRO-2 run whose config's optimizer section has
    DeepSpeed build it (one group, the schedule in DeepSpeed's files) with the optimizer offloaded goes on from its
    checkpoint-6 under ZeRO-2 without offload on 1 process (the Trainer's two groups and scheduler.pt). Each is
    converted to DeepSpeed's universal checkpoint and loaded with its Adam moments, step and schedule: the resumed
    steps train the uninterrupted run's rows to its losses, and end at its weights (measured 6e-8 apart; a fresh
    optimizer state at the same point ends 7e-4 apart). Both were refused before (one line), and crashed every rank
    before that. And the 2-rank DDP checkpoint-6 goes on under ZeRO-2 with offload, its weights and AdamW state
    written as the universal checkpoint, to the DDP run's losses and weights."""
    import shutil

    import torch
    from harness import saved_weights

    def resume(name: str, checkpoint: Path, processes: int, deepspeed: str, reference: str = "zero2", **changes):
        path = write(workspace, name, deepspeed=deepspeed, **changes)
        out = Path(yaml.safe_load(path.read_text())["output_dir"])
        shutil.copytree(checkpoint, out / checkpoint.name)
        rows = workspace[0] / f"rows-{name}"
        rows.mkdir()
        result = llmtune("train", path, "--num-processes", str(processes), env={"LLMTUNE_TEST_ROW_LOG": str(rows)},
                         timeout=900)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        metrics = read_metrics(path)
        step = int(checkpoint.name.split("-")[1])
        reference_path = straight.get(reference) or reference
        expected = {e["step"]: e["loss"] for e in read_metrics(reference_path)["log_history"] if "loss" in e}
        losses = {e["step"]: e["loss"] for e in metrics["log_history"] if "loss" in e and e["step"] > step}
        assert losses.keys() == set(range(step + 1, 9)), losses
        assert all(abs(losses[k] - expected[k]) <= 1e-5 * abs(expected[k]) for k in losses), (losses, expected)
        expected_rows = rows_by_step(workspace[0] / f"rows-straight-{getattr(reference, 'stem', reference)}")
        assert rows_by_step(rows) == {k: expected_rows[k] for k in losses}
        weights = saved_weights(out)
        final = saved_weights(Path(yaml.safe_load(reference_path.read_text())["output_dir"]))
        assert weights.keys() == final.keys()
        drift = max(float((weights[k].float() - final[k].float()).abs().max()) for k in final)
        assert drift <= 1e-6, drift
        return result.stderr, metrics, out

    saved_checkpoint = Path(yaml.safe_load(straight["zero2"].read_text())["output_dir"]) / "checkpoint-6"
    said, metrics, out = resume("relayout-zero3-offload", saved_checkpoint, 2, "zero3_offload")
    assert ("checkpoint-6 was saved with DeepSpeed ZeRO-2 -> DeepSpeed ZeRO-3; offload_optimizer device none -> cpu; "
            "offload_param device none -> cpu; sub_group_size None -> 1000000000 (saved -> now): it is converted to "
            "DeepSpeed's universal checkpoint") in said, said[-3000:]  # fmt: skip
    assert [(r["engine"], r.get("zero_stage")) for r in metrics["ranks"]] == [("deepspeed", 3)] * 2
    marker = json.loads((out / "checkpoint-8" / "llmtune-complete.json").read_text())
    assert marker["optimizer"] == "deepspeed:adamw" and marker["engine_layout"]["optimizer"] == "the Trainer's"
    assert marker["engine_layout"]["offload_optimizer device"] == "cpu"

    # and back: a checkpoint of DeepSpeed's own CPU Adam (no scheduler.pt: DeepSpeed keeps the schedule in its files),
    # without weight decay, which it would give the norms too
    built = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "optimizer": {"type": "AdamW"}}
    offloaded = write(workspace, "deepspeed-optimizer", deepspeed=built, weight_decay=0.0)
    (workspace[0] / "rows-straight-deepspeed-optimizer").mkdir()
    assert train(offloaded, {"LLMTUNE_TEST_ROW_LOG": str(workspace[0] / "rows-straight-deepspeed-optimizer")}).returncode == 0
    checkpoint = Path(yaml.safe_load(offloaded.read_text())["output_dir"]) / "checkpoint-6"
    assert not (checkpoint / "scheduler.pt").exists()
    said, metrics, back = resume("relayout-back", checkpoint, 1, "zero2", reference=offloaded, weight_decay=0.0)
    assert "checkpoint-6 was saved with offload_optimizer device cpu -> none; optimizer DeepSpeed's -> the" in said
    assert [(r["engine"], r.get("zero_stage")) for r in metrics["ranks"]] == [("deepspeed", 2)]
    schedule = torch.load(back / "checkpoint-6" / "scheduler.pt", weights_only=True)  # written for the Trainer
    assert (schedule["last_epoch"], len(schedule["base_lrs"])) == (6, 2)  # its step; the Trainer's two groups

    # a DDP run that ran out of memory goes on under ZeRO-2 with its optimizer offloaded: its weights and AdamW's
    # moments are written as the universal checkpoint
    checkpoint = Path(yaml.safe_load(straight["ddp"].read_text())["output_dir"]) / "checkpoint-6"
    said, metrics, out = resume("ddp-to-zero", checkpoint, 2, "zero2_offload", reference="ddp")
    assert ("checkpoint-6 was saved by DDP (data parallel); this launch runs DeepSpeed ZeRO-2: its weights and "
            "AdamW's moments are written as DeepSpeed's universal checkpoint") in said, said[-3000:]  # fmt: skip
    assert [(r["engine"], r.get("zero_stage")) for r in metrics["ranks"]] == [("deepspeed", 2)] * 2
    assert "converted checkpoint-6 to DeepSpeed's universal checkpoint (global_step6_universal" in said

    # and a LoRA's: adapter_model.safetensors names its tensors without the adapter's name
    lora = {"adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_target_linear": True}
    adapted = write(workspace, "lora", **lora)
    (workspace[0] / "rows-straight-lora").mkdir()
    assert train(adapted, {"LLMTUNE_TEST_ROW_LOG": str(workspace[0] / "rows-straight-lora")}).returncode == 0
    checkpoint = Path(yaml.safe_load(adapted.read_text())["output_dir"]) / "checkpoint-6"
    said, metrics, out = resume("lora-to-zero3", checkpoint, 1, "zero3", reference=adapted, **lora)
    assert "its weights and AdamW's moments are written as DeepSpeed's universal checkpoint" in said
    assert [(r["engine"], r.get("zero_stage")) for r in metrics["ranks"]] == [("deepspeed", 3)]


def test_kill_during_a_save_resumes_from_the_previous_checkpoint(workspace, straight):
    path = write(workspace, "killed-in-save")
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    crashed = train(path, {"LLMTUNE_TEST_KILL_IN_SAVE": "6"})  # dies after writing checkpoint 6, before it is complete
    assert crashed.returncode != 0
    assert not (out / "checkpoint-6").exists() and (out / "checkpoint-3" / "llmtune-complete.json").is_file()
    assert (out / ".checkpoint-staging" / "checkpoint-6").is_dir()  # the half-written save is there...
    resumed = train(path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {out / 'checkpoint-3'}" in resumed.stderr  # ...and resume ignored it
    assert not (out / ".checkpoint-staging").exists()
    assert_bit_identical(Path(yaml.safe_load(straight["ddp"].read_text())["output_dir"]), out)


def test_an_incomplete_checkpoint_is_never_picked(workspace, straight):
    """A checkpoint folder without the marker (e.g. copied by hand, or from a kill before the marker) is skipped."""
    import shutil

    path = write(workspace, "unmarked")
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    assert train(path, {"LLMTUNE_TEST_EXIT_AFTER_STEP": "6"}).returncode != 0
    (out / "checkpoint-6" / "llmtune-complete.json").unlink()
    shutil.copytree(out / "checkpoint-6", out / "checkpoint-7")  # looks newer, is not complete
    resumed = train(path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "ignoring checkpoint-6, checkpoint-7" in resumed.stderr
    assert f"resuming from {out / 'checkpoint-3'}" in resumed.stderr
    assert_bit_identical(Path(yaml.safe_load(straight["ddp"].read_text())["output_dir"]), out)


def test_max_restarts_recovers_from_a_crash(workspace, straight, tmp_path):
    """A rank dies once; torchrun's elastic agent restarts the ranks, which resume from checkpoint 6."""
    path = write(workspace, "restarted", max_restarts=1)
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    once = tmp_path / "crashed-once"
    result = train(path, {"LLMTUNE_TEST_EXIT_AFTER_STEP": "6", "LLMTUNE_TEST_KILL_ONCE_FILE": str(once)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert once.exists()  # the crash did happen
    assert f"resuming from {out / 'checkpoint-6'}" in result.stderr
    assert_bit_identical(Path(yaml.safe_load(straight["ddp"].read_text())["output_dir"]), out)


def test_rerunning_a_finished_run_does_nothing(workspace, straight):
    path = straight["ddp"]
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    before = (out / "model.safetensors").stat().st_mtime_ns
    again = train(path)
    assert again.returncode == 0 and "already holds this recipe's finished run" in again.stderr
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert json.loads((out / "metrics.json").read_text())["steps"] == 8


def test_sigusr1_checkpoints_after_the_step_and_the_rerun_resumes_bit_exact(workspace, straight):
    """`kill -USR1 <llmtune>`: the ranks save a checkpoint after their current step and stop (the recipe itself saves
    none), nothing is written as if finished, and the same command resumes from that step to the reference weights."""
    from harness import STEP_LINE, train_and_signal

    path = write(workspace, "usr1", save_strategy="no", save_steps=None)  # (the two together are refused)
    out = Path(yaml.safe_load(path.read_text())["output_dir"])
    code, seen = train_and_signal(path, lambda text: len(STEP_LINE.findall(text)) >= 2)
    assert code == 0, seen[-3000:]
    assert "SIGUSR1: the ranks save a checkpoint after this step and stop" in seen
    stopped = re.search(r"stopped on request after step (\d+)", seen)
    assert stopped, seen[-3000:]
    step = int(stopped.group(1))
    assert 2 <= step < 8
    assert (out / f"checkpoint-{step}" / "llmtune-complete.json").is_file()
    assert not (out / "metrics.json").exists() and not (out / "model.safetensors").exists()
    resumed = train(path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_metrics(path)["resumed_from"] == str(out / f"checkpoint-{step}")
    assert_bit_identical(Path(yaml.safe_load(straight["ddp"].read_text())["output_dir"]), out)
