"""`llmtune validate --upgrade`: an old recipe rewritten in today's vocabulary beside the original, each changed
line commented, reading (and planning) exactly as the original does."""

from __future__ import annotations

import json

import pytest
import yaml

from llmtune.errors import UserError
from llmtune.recipe import load_recipe
from llmtune.recipe import upgrade as upgrade_module
from llmtune.recipe.upgrade import upgrade_recipe

# A recipe as written for Axolotl in 2023: older keys and value forms, the user's own comments and layout.
OLD_RECIPE = """\
# my 2023 recipe
base_model: HuggingFaceTB/SmolLM2-135M-Instruct
strict: false

datasets:
  - path: {data}
    type: sharegpt
    conversation: chatml
output_dir: {out}

sequence_len: 4096
max_packed_sequence_len: 2048
noisy_embedding_alpha: 5   # NEFTune

adapter: lora
lora_r: 8
lora_alpha: 16
lora_target_linear: true

wandb_watch: false
evaluation_strategy: "no"
dataset_num_proc: 4
micro_batch_size: 2
gradient_accumulation_steps: 4
learning_rate: 0.0002
bf16: full
gradient_checkpointing: unsloth
logging_steps: 0.01
xformers_attention: true
deepspeed: false
rope_scaling:
  type: linear
  factor: 2.0
eval_table_max_new_tokens: 128
"""
OLD_KEYS = ("max_packed_sequence_len", "noisy_embedding_alpha", "evaluation_strategy", "xformers_attention",
            "dataset_num_proc", "deepspeed", "rope_scaling", "eval_table_max_new_tokens")  # fmt: skip


@pytest.fixture
def old_recipe(tmp_path):
    data = tmp_path / "chat.jsonl"
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    data.write_text(json.dumps(row) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(OLD_RECIPE.format(data=data, out=tmp_path / "out"))
    return path


def _plan_json(run_cli, path):
    result = run_cli("plan", "--json", path, "--num-processes", "2", "--device", "cpu")
    assert result.code == 0, result.err
    return json.loads(result.out.replace(str(path), "<recipe>"))


def test_a_2023_recipe_is_upgraded_beside_the_original_and_plans_the_same(run_cli, old_recipe):
    before = old_recipe.read_text()
    result = run_cli("validate", "--upgrade", old_recipe)
    assert result.code == 0, result.err
    target = old_recipe.with_name("recipe.upgraded.yaml")
    assert f"wrote {target}" in result.out
    assert old_recipe.read_text() == before  # the original is never touched

    # the upgraded recipe validates with nothing left to read the old way, and reads and plans as the original
    upgraded = load_recipe(target)
    assert not [note for note in upgraded.notes if "read as" in note or any(key in note for key in OLD_KEYS)]
    assert upgraded.recipe.model_dump(mode="json") == load_recipe(old_recipe).recipe.model_dump(mode="json")
    assert _plan_json(run_cli, target) == _plan_json(run_cli, old_recipe)

    new = yaml.safe_load(target.read_text())
    assert not set(OLD_KEYS) & set(new)
    expected = {
        "sequence_len": 2048, "sample_packing": True, "neftune_noise_alpha": 5, "eval_strategy": "no",
        "dataset_processes": 4, "wandb_watch": "false", "bf16": True, "gradient_checkpointing": True,
        "activation_offloading": True, "attn_implementation": "sdpa", "logging_steps": 0.01,
        "overrides_of_model_config": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    }  # fmt: skip
    assert {key: new.get(key) for key in expected} == expected
    # the sharegpt dataset is today's vocabulary: its lines are as written
    assert "    type: sharegpt\n    conversation: chatml\n" in target.read_text()

    # every line that changed says what it was; every other line (comments included) is kept, in its order
    old_lines, new_lines = before.splitlines(), target.read_text().splitlines()
    changed = [line for line in new_lines if line not in old_lines]
    assert len(changed) >= len(OLD_KEYS) + 4
    assert all("  # was " in line or "  # removed: " in line for line in changed), changed
    assert [line for line in new_lines if line in old_lines] == [line for line in old_lines if line in new_lines]
    assert "# my 2023 recipe" in new_lines
    assert "neftune_noise_alpha: 5   # NEFTune  # was noisy_embedding_alpha (a key of Axolotl since v0.4.0, " in (
        target.read_text()
    )
    assert "sample_packing: true  # was max_packed_sequence_len: 2048 (a key of Axolotl since v0.3.0" in new_lines[11]

    assert result.out.strip().splitlines()[-1] == f"{target}: valid (single process, world size 1, global batch 8)"


def test_translations_merge_into_keys_the_recipe_already_has(tmp_path, write_recipe):
    text = write_recipe().read_text() + (
        "rope_scaling: {type: linear, factor: 2.0}\n"
        "model_config:\n  max_position_embeddings: 4096\n"
        "eta_min: 0.00001\nlearning_rate: 0.0001\n"
        "tokens:\n  pad_token: <pad>\n"
        "warmup_steps: 0.1\n"
        "sample_packing: false\nmax_packed_sequence_len: 1024\n"
    )  # fmt: skip
    path = write_recipe(text=text.replace("type: alpaca", "type: alpaca\n  text_column: output"))
    upgrade_recipe(path)
    target = tmp_path / "recipe.upgraded.yaml"
    new = yaml.safe_load(target.read_text())
    assert new["overrides_of_model_config"] == {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear",
                                                                                                   "factor": 2.0}}  # fmt: skip
    assert (new["cosine_min_lr_ratio"], new["special_tokens"], new["warmup_ratio"]) == (
        0.1,
        {"pad_token": "<pad>"},
        0.1,
    )
    assert (new["sample_packing"], new["sequence_len"], new["datasets"][0]["field"]) == (True, 1024, "output")
    for old in ("rope_scaling", "model_config", "eta_min", "tokens", "warmup_steps", "max_packed_sequence_len"):
        assert old not in new
    upgraded = load_recipe(target)
    assert not [note for note in upgraded.notes if "read as" in note]
    assert upgraded.recipe.model_dump(mode="json") == load_recipe(path).recipe.model_dump(mode="json")


def test_a_key_written_twice_keeps_only_the_one_read(tmp_path, write_recipe):
    """The loader reads the last of a key written twice (and warns); the upgraded recipe kept both."""
    path = write_recipe(text=write_recipe().read_text() + "learning_rate: 0.001\nsequence_len: 512\nlearning_rate: 0.002\n")
    result = upgrade_recipe(path)
    text = (tmp_path / "recipe.upgraded.yaml").read_text()
    assert "# learning_rate: 0.001  # removed: written again at line" in text
    assert [line for line in text.splitlines() if line.startswith("learning_rate")] == ["learning_rate: 0.002"]
    assert any("learning_rate removed (written again at line" in change for change in result.changes)
    upgraded = load_recipe(tmp_path / "recipe.upgraded.yaml")
    assert upgraded.recipe.learning_rate == 0.002 and not [n for n in upgraded.notes if "appears twice" in n]


def test_a_recipe_in_todays_vocabulary_is_left_alone(run_cli, write_recipe, tmp_path):
    result = run_cli("validate", "--upgrade", write_recipe({"strict": False, "sequence_len": 512}))
    assert result.code == 0, result.err
    assert "already in today's vocabulary; nothing written" in result.out
    assert not (tmp_path / "recipe.upgraded.yaml").exists()


def test_keys_asking_for_missing_capabilities_stop_the_upgrade(run_cli, write_recipe, tmp_path):
    path = write_recipe({"max_packed_sequence_len": 1024, "use_pose": True, "kd_trainer": True})
    result = run_cli("validate", "--upgrade", path)
    assert result.code == 2
    assert "use_pose (PoSE position skipping)" in result.err
    assert "kd_trainer (knowledge distillation" in result.err
    assert "nothing written" in result.err and "Traceback" not in result.err
    assert not (tmp_path / "recipe.upgraded.yaml").exists()


def test_an_existing_upgraded_file_is_kept_unless_forced(run_cli, write_recipe, tmp_path):
    path = write_recipe({"noisy_embedding_alpha": 5})
    target = tmp_path / "recipe.upgraded.yaml"
    target.write_text("mine\n")
    refused = run_cli("validate", "--upgrade", path)
    assert refused.code == 2 and "already exists" in refused.err and "--force" in refused.err
    assert target.read_text() == "mine\n"
    forced = run_cli("validate", "--upgrade", "--force", path)
    assert forced.code == 0, forced.err
    assert yaml.safe_load(target.read_text())["neftune_noise_alpha"] == 5


def test_an_upgrade_that_would_read_differently_writes_nothing(monkeypatch, write_recipe, tmp_path):
    """The safety net: the new text is loaded again before writing, and must give the same Recipe."""
    monkeypatch.setattr(
        upgrade_module, "_value_form", lambda key, value, read: (False, "wrong") if key == "bf16" else None
    )
    with pytest.raises(UserError, match="would read differently \\(bf16\\); nothing written"):
        upgrade_recipe(write_recipe({"bf16": "full"}))
    assert not (tmp_path / "recipe.upgraded.yaml").exists()


def test_a_recipe_written_as_one_flow_mapping_is_refused(write_recipe, tmp_path):
    path = write_recipe(text=json.dumps({"base_model": "m", "noisy_embedding_alpha": 5, "datasets": [{"path": "a/b"}]}))
    with pytest.raises(UserError, match="one key per line"):
        upgrade_recipe(path)
    assert not (tmp_path / "recipe.upgraded.yaml").exists()
