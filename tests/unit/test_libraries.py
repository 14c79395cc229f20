"""A rank imports only the optional libraries its plan uses; when in doubt, it keeps them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmtune.plan import make_cluster, make_plan
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.runtime import libraries


@pytest.fixture
def local_model(tmp_path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.fixture
def local_data(tmp_path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n')
    return path


def needed(model, data, processes: int = 1, **changes) -> set[str]:
    mapping = {"base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "output_dir": "/runs/x",
               **changes}  # fmt: skip
    recipe = recipe_from_mapping(mapping, Path("r.yaml"), check_files=False).recipe
    plan = make_plan(recipe, make_cluster(processes, device="cpu")).to_dict()
    return libraries.needed(recipe, plan)


def test_a_lora_run_on_local_files_needs_none_of_them(local_model, local_data):
    assert needed(local_model, local_data, adapter="lora", lora_r=8, lora_target_linear=True) == set()
    assert needed(local_model, local_data, 2) == set()  # DDP


@pytest.mark.parametrize(
    ("changes", "library"),
    [
        ({"deepspeed": "zero2"}, "deepspeed"),
        ({"deepspeed": "zero3_offload"}, "deepspeed"),
        ({"adapter": "qlora", "load_in_4bit": True}, "bitsandbytes"),
        ({"adapter": "lora", "load_in_8bit": True}, "bitsandbytes"),
        ({"optimizer": "paged_adamw_8bit"}, "bitsandbytes"),
        ({"optimizer": "adamw_torch_8bit"}, "torchao"),
        ({"qat": {"weight_dtype": "int4", "activation_dtype": "int8"}}, "torchao"),
    ],
)
def test_what_the_plan_uses_is_kept(local_model, local_data, changes, library):
    assert library in needed(local_model, local_data, 2, **changes)


def test_a_quantized_checkpoint_or_one_not_on_disk_keeps_its_library(tmp_path, local_model, local_data):
    (local_model / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert needed(local_model, local_data) == {"bitsandbytes"}
    # a hub id whose config.json isn't in the cache: anything may be inside, so nothing is hidden
    assert {"bitsandbytes", "torchao"} <= needed("no-such-org/no-such-model-xyz", local_data)
    assert needed(tmp_path / "missing.gguf", local_data) == set()  # llmtune de-quantizes GGUF itself


def test_sources_other_than_local_json_keep_datasets(tmp_path, local_model, local_data):
    parquet = tmp_path / "rows.parquet"
    parquet.write_bytes(b"")
    assert "datasets" in needed(local_model, parquet)
    assert "datasets" in needed(local_model, "org/hub-dataset")
    folder = tmp_path / "jsons"
    folder.mkdir()
    (folder / "a.json").write_text("[]")
    assert "datasets" not in needed(local_model, folder)


def test_optimizer_tables_are_transformers_own():
    from transformers import trainer_optimizer

    assert {o.value for o in trainer_optimizer._BITSANDBYTES_OPTIMIZERS} == libraries.BITSANDBYTES_OPTIMIZERS
    assert {o.value for o in trainer_optimizer._TORCHAO_OPTIMIZERS} == libraries.TORCHAO_OPTIMIZERS


def test_hidden_libraries_look_absent_to_the_availability_checks():
    code = (
        "import sys, importlib.util; sys.modules['deepspeed'] = None;"
        "print(importlib.util.find_spec('deepspeed') is None);"
        "from accelerate.utils import is_deepspeed_available; print(bool(is_deepspeed_available()))"
    )
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert shown.stdout.split() == ["True", "False"]


def test_scipy_and_boto3_are_hidden_unless_the_recipe_runs_the_users_own_python(tmp_path, local_model, local_data):
    """transformers imports scipy (object-detection losses) and accelerate boto3 (SageMaker) at start-up: no rank of
    a language model's training calls them; a recipe's reward functions or dataset transforms might, so they stay."""
    assert not {"scipy", "boto3"} & needed(local_model, local_data, adapter="lora", lora_target_linear=True)
    mapping = {"base_model": str(local_model), "datasets": [{"path": str(local_data), "type": "rwd.to_prompt"}],
               "output_dir": "/runs/x"}  # fmt: skip
    grpo = {**mapping, "rl": "grpo", "trl": {"reward_funcs": ["rwd.r"], "num_generations": 2}, "micro_batch_size": 2}
    recipe = recipe_from_mapping(grpo, Path("r.yaml"), check_files=False).recipe
    assert {"scipy", "boto3"} <= libraries.needed(recipe, make_plan(recipe, make_cluster(1, device="cpu")).to_dict())
    code = ("import sys; sys.modules['scipy'] = None; sys.modules['boto3'] = None; import peft, accelerate.accelerator; "
            "import transformers.modeling_utils; print(sorted(m for m in ('scipy', 'boto3') if sys.modules.get(m)))")  # fmt: skip
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert shown.stdout.split() == ["[]"]  # both libraries' importers take their not-installed path, and start


def test_trackers_are_hidden_unless_the_recipe_logs_to_them(local_model, local_data):
    """DeepSpeed imports mlflow whenever it is installed (its autotuner); a run that logs to no tracker doesn't load
    it (`sys.modules` entries DeepSpeed's import takes as not installed: tests/unit/test_private_api.py). A recipe that
    asks for a tracker, in either spelling, or runs the user's own Python keeps it."""
    assert not set(libraries.TRACKERS) & needed(local_model, local_data, 2, deepspeed="zero2")
    assert "mlflow" in needed(local_model, local_data, 2, deepspeed="zero2", use_mlflow=True)
    assert {"wandb", "tensorboard"} <= needed(local_model, local_data, report_to=["tensorboard"], wandb_project="p")
    assert "wandb" not in needed(local_model, local_data, wandb_project="p", wandb_mode="disabled")
    # DeepSpeed's own monitors, turned on in the recipe's DeepSpeed JSON, import theirs in every rank
    config = local_data.parent / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}, "tensorboard": {"enabled": True},
                                  "wandb": {"enabled": False}}))  # fmt: skip
    kept = needed(local_model, local_data, 2, deepspeed=str(config))
    assert "tensorboard" in kept and "wandb" not in kept


def test_an_offload_rank_asks_py_cpuinfo_once_and_each_caller_gets_its_own_copy(monkeypatch):
    import cpuinfo

    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx2"]})
    assert not libraries.ask_cpu_info_once({"strategy": "zero3", "deepspeed_config": {"zero_optimization": {}}})
    offload = {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}
    assert libraries.ask_cpu_info_once({"strategy": "zero3", "deepspeed_config": offload})
    first = cpuinfo.get_cpu_info()
    first["flags"].append("changed by a caller")
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]} and len(calls) == 1
