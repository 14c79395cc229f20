"""Training continued in an output_dir where `llmtune merge` and `llmtune eval` had already worked on the final
model: the new final save names each output now stale with the command that rewrites it, and deletes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from llmtune.train.checkpoint.manager import CheckpointManager


class Tokenizer:
    def save_pretrained(self, folder: str) -> None:
        (Path(folder) / "tokenizer.json").write_text("{}")


def _save_final(run: Path) -> None:
    recipe = SimpleNamespace(adapter=None, datasets=[], base_model="base", output_dir=str(run), save_total_limit=None)
    manager = CheckpointManager(run, {"strategy": "single", "cluster": {"num_machines": 1}, "title": "single process",
                                      "world_size": 1}, recipe)  # fmt: skip
    manager.save_final(lambda folder: (folder / "model.safetensors").write_bytes(b"new"), Tokenizer(),
                       {"steps": 6, "eval_loss": 5.68}, None, main=True)  # fmt: skip


def test_a_final_save_over_an_earlier_merge_and_eval_names_each_with_the_command_that_rewrites_it(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "run"
    (run / "merged").mkdir(parents=True)  # llmtune merge RUN after the step-4 run
    (run / "merged" / "model.safetensors").write_bytes(b"step 4")
    (run / "eval.json").write_text(json.dumps({"eval_loss": 5.74}))  # llmtune eval RUN: the step-4 model
    (run / "eval_base.json").write_text("{}")  # the base model's: still true
    (run / "eval-checkpoint-4.json").write_text("{}")  # checkpoint-4's own: still true
    (run / "merged-checkpoint-4").mkdir()
    _save_final(run)
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == [
        f"[llmtune] note: {run / 'merged'} holds the model merged before this training continued, not the one just "
        f"saved: llmtune merge {run} --force rewrites it",
        f"[llmtune] note: {run / 'eval.json'} measured the model saved before this training continued (metrics.json "
        f"has this run's eval loss): llmtune eval {run} measures the new one",
    ]
    assert (run / "merged" / "model.safetensors").read_bytes() == b"step 4"  # the user's to replace
    assert json.loads((run / "eval.json").read_text()) == {"eval_loss": 5.74}
    assert json.loads((run / "metrics.json").read_text())["eval_loss"] == 5.68


def test_a_first_final_save_notes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "run").mkdir()
    _save_final(tmp_path / "run")
    assert "note:" not in capsys.readouterr().err
