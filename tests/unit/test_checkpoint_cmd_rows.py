"""With sample_packing the rows a run counts (rows_seen, rows per epoch) are packed sequences of several examples: the
checkpoint command, the checkpoint marker, metrics.json and the model card say so, so the counts square with the
epoch; an unpacked run's rows are its examples and read as rows."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from llmtune.train.checkpoint.final import model_card, packed_rows
from llmtune.train.checkpoint.manager import CheckpointManager

SINGLE = {"world_size": 1, "strategy": "single", "data_parallel_size": 1, "global_batch_size": 2}


def _checkpoint(run: Path, step: int, **info) -> None:
    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "llmtune-complete.json").write_text(json.dumps({"step": step, **SINGLE, **info}))


def _plan(run: Path, sample_packing: bool) -> None:
    (run / "llmtune").mkdir(parents=True, exist_ok=True)
    (run / "llmtune" / "plan.json").write_text(json.dumps({"plan": {}, "recipe": {"sample_packing": sample_packing}}))


def test_the_checkpoint_command_counts_a_packed_runs_rows_as_packed_sequences(tmp_path, run_cli):
    packed = tmp_path / "packed"  # 12 examples packed into 6 sequences per epoch; step 4 of micro-batch 2
    _checkpoint(packed, 4, rows_seen=8, rows_per_epoch=6, rows_are="packed sequences")
    assert run_cli("checkpoint", packed).out.splitlines()[0] == (
        "checkpoint-4     step 4, world size 1 (single process), data parallel 1, global batch 2, 8 packed sequences "
        "seen (6 per epoch)")  # fmt: skip
    older = tmp_path / "older"  # a marker from before `rows_are`: the run's recipe says the rows were packed
    _checkpoint(older, 4, rows_seen=8, rows_per_epoch=6)
    _plan(older, sample_packing=True)
    assert "8 packed sequences seen (6 per epoch)" in run_cli("checkpoint", older / "checkpoint-4").out
    plain = tmp_path / "plain"  # unpacked: a row is an example
    _checkpoint(plain, 4, rows_seen=8, rows_per_epoch=12)
    _plan(plain, sample_packing=False)
    assert run_cli("checkpoint", plain).out.splitlines()[0].endswith("global batch 2, 8 rows seen (12 per epoch)")


def test_a_packed_runs_checkpoint_marker_says_its_rows_are_packed_sequences(tmp_path):
    def publish(run: Path, sample_packing: bool) -> dict:
        recipe = SimpleNamespace(sample_packing=sample_packing, rl=None, save_total_limit=None)
        manager = CheckpointManager(run, {"strategy": "single", "cluster": {"num_machines": 1}}, recipe)
        (manager.staging / "checkpoint-4").mkdir(parents=True)
        manager.publish(manager.staging / "checkpoint-4", run / "checkpoint-4",
                        {"step": 4, "rows_seen": 8, "rows_per_epoch": 6})  # fmt: skip
        return json.loads((run / "checkpoint-4" / "llmtune-complete.json").read_text())

    assert publish(tmp_path / "packed", True)["rows_are"] == "packed sequences"
    assert "rows_are" not in publish(tmp_path / "plain", False)


def test_a_packed_runs_metrics_and_model_card_give_rows_per_epoch_in_packed_sequences_beside_the_examples():
    data = {"train_examples": 12, "train_rows": 6, "packing_efficiency": 0.83}
    metrics = {"rows_seen": 8, "rows_seen_this_run": 8, "epoch": 4 / 3, "packing_efficiency": 0.83, "data": data}
    metrics.update(packed_rows(metrics))
    assert metrics["rows_seen"] / metrics["rows_per_epoch"] == metrics["epoch"]
    assert metrics["rows_are"] == "packed sequences (12 examples packed into 6 per epoch)"
    recipe = SimpleNamespace(adapter=None, datasets=[], base_model="base", output_dir="/runs/mpsl")
    card = model_card(recipe, {"title": "single process", "world_size": 1}, metrics, None)
    assert "| rows_seen | 8 packed sequences |" in card and "| rows_per_epoch | 6 packed sequences |" in card
    unpacked = {"rows_seen": 8, "data": {"train_examples": 12, "train_rows": 12}}
    assert packed_rows(unpacked) == {}
    assert "| rows_seen | 8 |" in model_card(recipe, {"title": "single process", "world_size": 1}, unpacked, None)
