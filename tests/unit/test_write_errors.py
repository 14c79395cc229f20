"""A path the CLI can't write is one line naming it (exit 2), with no traceback and no temporary file left."""

from __future__ import annotations

import os

import pytest

from llmtune.errors import UserError
from llmtune.plan.files import atomic_write, make_folder, write_plan_files


def leftovers(folder):
    return sorted(p.name for p in folder.rglob("*.tmp"))


def test_unwritable_paths_are_one_line_for_each_command(run_cli, write_recipe, tmp_path):
    recipe = write_recipe()
    blocker = tmp_path / "some_file"
    blocker.write_text("")
    folder = tmp_path / "d"
    folder.mkdir()
    run = tmp_path / "run"  # a finished run whose report/ can't be made
    run.mkdir()
    (run / "metrics.json").write_text('{"log_history": [{"loss": 2.0, "step": 1}]}')
    (run / "report").write_text("")
    cases = [
        (("plan", recipe, "--write", blocker), f"can't write {blocker} (a file is in the way"),
        (("plan", recipe, "--write", blocker / "sub"), f"can't write {blocker / 'sub'} (a file is in the way"),
        (("slurm", recipe, "-o", folder), f"can't write {folder} (it is a folder)"),
        (("slurm", recipe, "-o", blocker / "job.sbatch"), f"can't write {blocker / 'job.sbatch'} (a file is in"),
        (("config", "-y", "-o", blocker / "x.yaml"), f"can't write {blocker / 'x.yaml'} (a file is in the way"),
        (("infer", "some/model", "-p", "hi", "-o", folder), f"can't write {folder} (it is a folder)"),
        (("infer", "some/model", "-p", "hi", "-o", blocker / "o.jsonl"), f"can't write {blocker / 'o.jsonl'} (a file"),
        (("rehearse", recipe, "-o", blocker), f"can't write {blocker} (a file is in the way"),
        (("report", run), f"can't write {run / 'report'} (a file is in the way"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.code == 2, (args, result.err)
        errors = [line for line in result.err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and message in errors[0] and "(hint: " in errors[0], (args, result.err)
        assert "Traceback" not in result.err
    assert blocker.read_text() == "" and not any(folder.iterdir())
    assert leftovers(tmp_path) == []


def test_upgrade_onto_a_folder_is_one_line(run_cli, write_recipe, tmp_path):
    recipe = write_recipe({"noisy_embedding_alpha": 5})
    (tmp_path / "recipe.upgraded.yaml").mkdir()
    result = run_cli("validate", recipe, "--upgrade", "--force")
    assert result.code == 2
    assert f"error: can't write {tmp_path / 'recipe.upgraded.yaml'} (it is a folder)" in result.err
    assert leftovers(tmp_path) == []


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def refuse(src, dst):
        raise PermissionError(1, "Operation not permitted", str(dst))

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(UserError, match=r"can't write .*out.jsonl \(operation not permitted\)") as caught:
        atomic_write(target, "new\n")
    assert caught.value.hint
    assert target.read_text() == "old\n" and leftovers(tmp_path) == []


def test_folders_name_the_blocking_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UserError, match="a file is in the way"):
        make_folder(tmp_path / "f" / "g")
    with pytest.raises(UserError, match="a file is in the way"):
        write_plan_files(tmp_path / "f", {"plan.json": "{}"})
    make_folder(tmp_path / "a" / "b")
    assert write_plan_files(tmp_path / "a" / "b", {"plan.json": "{}"}) == [tmp_path / "a" / "b" / "plan.json"]
