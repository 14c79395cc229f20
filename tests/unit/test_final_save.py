"""A final save the disk can't take: one line, that save's files removed (a folder that looks like a model must be
one), the checkpoints kept, and the advice true to them."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.train.checkpoint.manager import CheckpointManager


class Tokenizer:
    def save_pretrained(self, folder: str) -> None:
        (Path(folder) / "tokenizer.json").write_text("{}")


def checkpoint(run: Path, step: int) -> None:
    (run / f"checkpoint-{step}").mkdir(parents=True)
    (run / f"checkpoint-{step}" / "llmtune-complete.json").write_text(json.dumps({"step": step}))


def failing_save(folder: Path) -> None:
    (folder / "config.json").write_text("{}")  # the config went out, the weights didn't fit
    (folder / "model.safetensors").write_bytes(b"\0" * 10)
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_final_save_the_disk_cant_take_leaves_no_half_model_and_says_what_gets_it(tmp_path):
    run = tmp_path / "run"
    checkpoint(run, 4)
    (run / "notes.txt").write_text("the user's")  # a file the save doesn't write stays
    manager = CheckpointManager(run)
    with pytest.raises(UserError) as err:
        manager.save_final(failing_save, Tokenizer(), {"steps": 4}, None, main=True)
    assert "the disk filled while saving the final model" in err.value.one_line()
    assert "No space left on device" in err.value.one_line() and "\n" not in err.value.one_line()
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "notes.txt"]
    # the checkpoint at the last step holds the model: a rerun finds no step left, a merge writes it
    assert err.value.hint == (f"free space, then llmtune merge {run / 'checkpoint-4'}: it writes the final model from "
                              "that checkpoint")  # fmt: skip
    with pytest.raises(UserError) as err:
        manager.save_final(failing_save, Tokenizer(), {"steps": 6}, None, main=True)
    assert err.value.hint == "free space, then run the same command: it resumes from checkpoint-4"
    (tmp_path / "none").mkdir()
    with pytest.raises(UserError) as err:
        CheckpointManager(tmp_path / "none").save_final(failing_save, Tokenizer(), {"steps": 6}, None, main=True)
    assert err.value.hint.endswith("no checkpoint was saved, so it trains from the start")

    def broken(folder: Path) -> None:  # another error is not the disk's: it goes on as it is
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        manager.save_final(broken, Tokenizer(), {"steps": 4}, None, main=True)
