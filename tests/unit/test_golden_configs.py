"""Generated accelerate YAML and DeepSpeed JSON: golden files, and accepted by the libraries' own parsers.

Regenerate after an intended change with: LLMTUNE_UPDATE_GOLDEN=1 pytest tests/unit/test_golden_configs.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from llmtune.plan import make_cluster, make_plan
from llmtune.plan.files import plan_files
from llmtune.recipe.loader import recipe_from_mapping

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
WORLD = 8
CASES = {
    "ddp": {},
    "zero1": {"deepspeed": "zero1"},
    "zero2": {"deepspeed": "zero2", "bf16": True},
    "zero3": {"deepspeed": "zero3", "bf16": True},
    "zero2_offload": {"deepspeed": "zero2_offload", "bf16": True},
    "zero3_offload": {"deepspeed": "zero3_offload", "bf16": True},
    "zero3_nvme": {"deepspeed": "zero3_nvme", "offload_nvme_path": "/local_nvme", "bf16": True},
    "zero2_fp16": {"deepspeed": "zero2", "fp16": True},
    "fsdp1": {"fsdp": ["full_shard", "auto_wrap"], "fsdp_config": {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}},
    "fsdp2": {"fsdp_version": 2, "fsdp_config": {"offload_params": True, "state_dict_type": "SHARDED_STATE_DICT"}},
    "pipeline": {"pipeline_parallel_size": 2, "pipeline_schedule": "gpipe", "pipeline_microbatches": 4},
}


def generate(name: str) -> dict[str, str]:
    recipe = {
        "base_model": "org/model",
        "datasets": [{"path": "org/data", "type": "alpaca"}],
        "micro_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "learning_rate": 1e-4,
        "output_dir": "/runs/golden",
        **CASES[name],
    }
    loaded = recipe_from_mapping(recipe, Path("golden.yaml"), check_files=False)
    cluster = make_cluster(WORLD, device="cuda")
    plan = make_plan(loaded.recipe, cluster, config_dir="/runs/golden/llmtune")
    files = plan_files(plan, {}, "golden.yaml", [])
    return {k: v for k, v in files.items() if k in ("accelerate_config.yaml", "deepspeed.json")}


@pytest.mark.parametrize("name", CASES)
def test_matches_golden(name):
    files = generate(name)
    assert files, "every case generates an accelerate config"
    for file_name, text in files.items():
        golden = GOLDEN / name / file_name
        if os.environ.get("LLMTUNE_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(text)
        assert golden.exists(), f"missing golden file {golden}; run with LLMTUNE_UPDATE_GOLDEN=1"
        assert text == golden.read_text(), f"{golden} differs from what llmtune generates"
    expected = {"accelerate_config.yaml", "deepspeed.json"} if name.startswith("zero") else {"accelerate_config.yaml"}
    assert set(files) == expected


@pytest.mark.parametrize("name", CASES)
def test_accelerate_loads_the_config(name, tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    path = tmp_path / "accelerate_config.yaml"
    path.write_text((GOLDEN / name / "accelerate_config.yaml").read_text())
    config = load_config_from_file(str(path))
    assert config.num_processes == WORLD
    expected = {"ddp": "MULTI_GPU", "pipeline": "MULTI_GPU", "fsdp1": "FSDP", "fsdp2": "FSDP"}.get(name, "DEEPSPEED")
    assert config.distributed_type.value == expected
    if name.startswith("fsdp"):
        assert config.fsdp_config["fsdp_version"] == int(name[-1])


@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("zero")])
def test_deepspeed_accepts_the_config(name, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    import deepspeed.runtime.config as ds_config

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: WORLD)
    raw = json.loads((GOLDEN / name / "deepspeed.json").read_text())
    assert "auto" not in json.dumps(raw)
    parsed = ds_config.DeepSpeedConfig(raw)
    assert parsed.world_size == WORLD
    assert parsed.train_batch_size == 2 * 4 * WORLD
    assert parsed.zero_optimization_stage == int(name[4])
    assert parsed.gradient_accumulation_steps == 4


def test_accelerate_config_points_at_the_deepspeed_json():
    config = yaml.safe_load(generate("zero3")["accelerate_config.yaml"])
    assert config["deepspeed_config"]["deepspeed_config_file"] == "/runs/golden/llmtune/deepspeed.json"
    assert config["deepspeed_config"]["zero3_init_flag"] is True
