"""The recipe file as YAML: a key written twice is read as yaml.safe_load reads it (the last one wins, as under
Axolotl), with one warning naming the key's path and its lines."""

from __future__ import annotations

from pathlib import Path

import yaml

from llmtune.recipe.loader import load_recipe, read_yaml_mapping

TEXT = """\
base_model: org/model
datasets:
  - path: org/data
    type: alpaca
    path: org/other
learning_rate: 0.0001
output_dir: /runs/x
shared: &shared {lr: 1}
learning_rate: 0.0002
learning_rate: 0.0003
"""


def test_a_key_written_twice_is_warned_of_with_its_path_and_lines(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(TEXT.replace("shared: &shared {lr: 1}\n", ""))
    loaded = load_recipe(path, check_files=False)
    assert loaded.recipe.learning_rate == 0.0003 and loaded.recipe.datasets[0].path == "org/other"
    warnings = [note for note in loaded.notes if "appears" in note]
    assert warnings == [
        "WARNING datasets[0].path appears twice (lines 3 and 5): the last one, line 5, is used",
        "WARNING learning_rate appears 3 times (lines 6, 8 and 9): the last one, line 9, is used",
    ]


def test_the_mapping_is_what_safe_load_reads_and_merges_are_no_duplicates(tmp_path):
    text = TEXT + "other:\n  <<: *shared\n  lr: 2\n"
    path = tmp_path / "r.yaml"
    path.write_text(text)
    found: list[str] = []
    assert read_yaml_mapping(path, found) == yaml.safe_load(text)
    assert not [line for line in found if "other" in line or "shared" in line]
    assert read_yaml_mapping(Path(path)) == yaml.safe_load(text)  # without a list to fill, as before


def test_a_recipe_without_duplicates_has_no_warning(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("base_model: org/model\ndatasets: [{path: org/data, type: alpaca}]\noutput_dir: /runs/x\n")
    assert not [note for note in load_recipe(path, check_files=False).notes if "appears" in note]


def test_warnings_come_in_the_file_order_of_each_key_first_written(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("seed: 1\ndatasets:\n  - path: a\n    path: b\n    type: alpaca\nseed: 2\nbase_model: org/m\n")
    found: list[str] = []
    read_yaml_mapping(path, found)
    assert [line.split()[1] for line in found] == ["seed", "datasets[0].path"]
