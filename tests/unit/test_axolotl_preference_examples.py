"""Axolotl's own `rl:` examples as written: every recipe with `rl:` under examples/ of Axolotl's latest release
(v0.18.0) is kept as tests/fixtures/axolotl_recipes/rl-*.yml, its keys and values unchanged. `llmtune validate`
(offline: hub models and datasets are named, not downloaded) accepts the preference ones (dpo, kto, orpo) with
every preference key read, and answers the RL-with-generation ones (EBFT, GDPO, GRPO) with exit code 2 and one
line naming `rl:`. With AXOLOTL_GIT set to an Axolotl clone, the fixtures are compared with the tag itself.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from llmtune.recipe import load_recipe
from llmtune.recipe.preference import ONLINE_METHODS, RL_METHODS, PreferenceKeys, preference_type

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "axolotl_recipes"
RELEASE = "v0.18.0"
# `git grep -l "^rl:" v0.18.0 -- examples` (the README beside them left out)
RL_EXAMPLES = {
    "examples/ebft/llama-1b-ebft-opencode-novllm.yaml", "examples/ebft/llama-1b-ebft-opencode.yaml",
    "examples/ebft/llama-1b-ebft-strided-structured.yaml", "examples/ebft/llama-1b-ebft-strided.yaml",
    "examples/ebft/llama-3b-ebft-strided-fft.yaml", "examples/ebft/llama-8b-ebft-strided-fft.yaml",
    "examples/ebft/qwen35-4b-ebft-structured-async.yaml", "examples/ebft/qwen35-4b-ebft-structured.yaml",
    "examples/ebft/qwen35-9b-ebft-structured.yaml", "examples/falcon-e/falcon-e-3b-dpo.yaml",
    "examples/llama-3/instruct-dpo-lora-8b.yml", "examples/llama-3/lora-1b-deduplicate-dpo.yml",
    "examples/llama-3/qlora-1b-gdpo.yaml", "examples/llama-3/qlora-1b-kto.yaml",
    "examples/mistral/dpo/mistral-dpo-qlora.yml", "examples/mistral/orpo/mistral-qlora-orpo.yml",
    "examples/qwen2/dpo.yaml", "examples/swanlab/dpo-swanlab-completions.yml",
    "examples/swanlab/dpo-swanlab-full-featured.yml",
}  # fmt: skip
# The one preference example refused, for what it asks besides preference training.
BITNET = CORPUS / "rl-falcon-e-falcon-e-3b-dpo.yml"


def source(path: Path) -> str:
    """The examples/ path a fixture keeps, from its header."""
    for line in path.read_text().splitlines():
        if line.startswith(f"# Axolotl {RELEASE} examples/"):
            return line.removeprefix(f"# Axolotl {RELEASE} ").split(":")[0]
    raise AssertionError(f"{path.name} names no {RELEASE} example")


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


KEPT = sorted(CORPUS.glob("rl-*.yml"))
PREFERENCE = [p for p in KEPT if raw(p)["rl"] in RL_METHODS and p != BITNET]
# Axolotl's online RL (GRPO, GDPO) validates with the reward file beside it; a GRPO recipe in their style too
# (v0.18.0 has no GRPO example); EBFT, Axolotl's own method, is refused
ONLINE = [p for p in KEPT if raw(p)["rl"] in ONLINE_METHODS] + [CORPUS / "grpo-vllm.yml"]
GENERATING = [p for p in KEPT if raw(p)["rl"] not in (*RL_METHODS, *ONLINE_METHODS)]


def test_every_rl_example_of_the_release_is_kept():
    assert sorted(source(p) for p in KEPT) == sorted(RL_EXAMPLES)
    assert {raw(p)["rl"] for p in PREFERENCE} == {"dpo", "kto", "orpo"}
    assert {raw(p)["rl"] for p in GENERATING} == {"ebft"} and {raw(p)["rl"] for p in ONLINE} == {"gdpo", "grpo"}
    assert len(PREFERENCE) == 8 and len(GENERATING) == 9 and len(ONLINE) == 2


@pytest.mark.parametrize("path", ONLINE, ids=[p.stem for p in ONLINE])
def test_an_online_rl_example_validates_as_written_with_its_reward_file(path, run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(CORPUS)
    result = run_cli("validate", path.name)
    assert result.code == 0, result.err
    recipe = load_recipe(path).recipe
    assert recipe.trl["reward_funcs"] == raw(path)["trl"]["reward_funcs"]
    # without its Python file beside it or in the working directory, one line names the function it can't find
    alone = tmp_path / path.name
    alone.write_text(path.read_text())
    monkeypatch.chdir(tmp_path)
    missing = run_cli("validate", alone)
    assert missing.code == 2 and missing.err.count("\n") == 1 and "trl.reward_funcs[0]" in missing.err


@pytest.mark.parametrize("path", PREFERENCE, ids=[p.stem for p in PREFERENCE])
def test_a_preference_example_validates_as_written(path, run_cli, monkeypatch):
    monkeypatch.chdir(CORPUS)
    result = run_cli("validate", path.name)
    assert result.code == 0, result.err
    assert result.out.strip().splitlines()[-1].startswith(f"{path.name}: valid (")
    assert "unknown" not in result.out
    written, loaded = raw(path), load_recipe(path)
    recipe = loaded.recipe
    # every preference key is read as written, none set aside as having no effect
    for key in set(written) & set(PreferenceKeys.model_fields):
        assert getattr(recipe, key) == written[key], key
        assert not [note for note in loaded.notes if note.startswith(key)], key
    for spec, entry in zip(recipe.datasets, written["datasets"], strict=True):
        assert preference_type(spec.type) == preference_type(entry["type"])
        for key in ("field_messages", "field_chosen", "field_rejected", "roles", "message_property_mappings"):
            if key in entry:
                assert getattr(spec, key) == entry[key], key


def test_the_bitnet_dpo_example_is_refused_for_1_bit_training_and_its_dpo_is_accepted(run_cli, tmp_path):
    refused = run_cli("validate", BITNET)
    assert refused.code == 2 and refused.err.count("\n") == 1
    assert "1-bit (BitNet) training is not supported (use_onebitllms: True)" in refused.err
    assert "rl" not in refused.err.split("(hint")[0].replace(str(BITNET), "")
    without = raw(BITNET)
    del without["use_onebitllms"]
    path = tmp_path / "falcon-e-dpo.yml"
    path.write_text(yaml.safe_dump(without, sort_keys=False))
    result = run_cli("validate", path)
    assert result.code == 0, result.err
    assert load_recipe(path).recipe.rl == "dpo"


@pytest.mark.parametrize("path", GENERATING, ids=[p.stem for p in GENERATING])
def test_rl_with_generation_exits_with_one_line_naming_rl(path, run_cli, monkeypatch):
    monkeypatch.chdir(CORPUS)
    result = run_cli("validate", path.name)
    method = raw(path)["rl"]
    assert result.code == 2 and result.out == ""
    assert result.err.count("\n") == 1 and result.err.startswith("error: "), result.err
    line = result.err.split(" (hint: ")[0]  # the hint may name rl: too; the refusal itself must
    assert f"rl: {method}" in line and "not supported" in line, result.err
    assert "unknown key" not in result.err


GIT = os.environ.get("AXOLOTL_GIT")


def git(*args: str) -> str:
    return subprocess.run(["git", f"--git-dir={GIT}", *args], check=True, capture_output=True, text=True).stdout


@pytest.mark.skipif(not GIT, reason="set AXOLOTL_GIT to a clone of axolotl-ai-cloud/axolotl (bare or not)")
def test_the_kept_recipes_are_the_release_s_examples():
    listed = {line.split(":", 1)[1] for line in git("grep", "-l", "^rl:", RELEASE, "--", "examples").split()}
    assert {p for p in listed if p.endswith((".yml", ".yaml"))} == RL_EXAMPLES
    for path in KEPT:
        assert raw(path) == yaml.safe_load(git("show", f"{RELEASE}:{source(path)}")), path.name
