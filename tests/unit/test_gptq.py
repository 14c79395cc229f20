"""A GPTQ base (`gptq: true`, Axolotl v0.3.0 on): LoRA over the model as it was quantized, through transformers'
GPTQ integration. Where optimum and gptqmodel aren't installed, the plan stops in one line naming what to install;
the engines that would shard the packed weights are refused. The training itself waits for a machine with
gptqmodel (not installable on this CPU-only box without building it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from llmtune.errors import UserError
from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.loader import recipe_from_mapping

BASE = {"base_model": "org/model-GPTQ", "datasets": [{"path": "org/data", "type": "alpaca"}], "output_dir": "/runs/x"}


def loaded(**changes):
    return recipe_from_mapping({**BASE, **changes}, Path("r.yaml"), check_files=False)


@pytest.fixture
def installed(monkeypatch):
    """optimum and gptqmodel look installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("optimum", "gptqmodel") else real(name, *a))  # fmt: skip


def test_a_2023_gptq_recipe_loads_with_its_old_keys_read_from_the_model(installed):
    """Axolotl v0.3.0-v0.4.0's GPTQ keys: the settings they carried come from the model's quantization_config."""
    recipe = loaded(gptq=True, gptq_groupsize=128, gptq_model_v1=False, gptq_disable_exllama=True, adapter="lora")
    assert recipe.recipe.gptq is True and recipe.recipe.adapter == "lora"
    said = " ".join(recipe.notes)
    for key in ("gptq_groupsize", "gptq_model_v1", "gptq_disable_exllama"):
        assert key in said
    assert "quantization_config" in said
    plan = make_plan(recipe.recipe, make_cluster(2, device="cuda"))
    assert plan.strategy == "ddp"
    assert any(note.startswith("GPTQ base: loaded as quantized") for note in plan.notes)


def test_missing_libraries_are_named_with_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gptqmodel" else real(name, *a))
    with pytest.raises(UserError) as caught:
        make_plan(loaded(gptq=True, adapter="lora").recipe, make_cluster(1, device="cuda"))
    line = caught.value.one_line()
    assert line.startswith("gptq: true (a GPTQ base) is not supported here: it needs")
    assert "gptqmodel" in line and "not installed" in line and "pip install" in line


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"deepspeed": "zero3"}, "gptq: true under DeepSpeed ZeRO-3 is not supported"),
        ({"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}}, "gptq: true under FSDP"),
    ],
)
def test_sharding_engines_are_refused(installed, changes, message):
    with pytest.raises(UserError, match=message):
        make_plan(loaded(gptq=True, adapter="lora", **changes).recipe, make_cluster(2, device="cuda"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({}, "gptq: true: a GPTQ base's weights are frozen integers, train it with adapter: lora"),
        ({"adapter": "qlora", "load_in_4bit": True}, "remove load_in_4bit/load_in_8bit"),
    ],
)
def test_gptq_needs_lora_on_the_quantized_base(changes, message):
    with pytest.raises(UserError, match=message):
        loaded(gptq=True, **changes)


def test_the_estimate_counts_4_bit_weights_with_their_group_scales():
    from llmtune.plan.memory.facts import ModelFacts
    from llmtune.plan.memory.states import quantized_base_bytes

    facts = ModelFacts("llama", 4096, 32, 32, 8, 14336, 49152, False)
    gptq = quantized_base_bytes(loaded(gptq=True, adapter="lora").recipe, facts)
    linear = facts.linear_params()
    assert gptq == pytest.approx(linear * (0.5 + 2.5 / 128) + 4.0 * (facts.total_params() - linear))
