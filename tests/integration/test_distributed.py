"""Every strategy really runs on 2 CPU processes (gloo) and matches a single-process run.

A single process with gradient accumulation 2 sees the same global batch of 8 rows per step as
2 ranks with accumulation 1, so the per-step losses must agree. This is what catches the silent
failures (DeepSpeed at world size 1, FSDP turned into DDP): an exit code alone proves nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import llmtune, losses, read_metrics
from tiny import write_jsonl

pytestmark = pytest.mark.integration

LORA = {"adapter": "lora", "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("dist")
    words = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]
    data = write_jsonl(root / "data.jsonl", [{"instruction": f"Repeat {w}", "output": f"{w} {w}"} for w in words * 4])
    return root, data, tiny_model


def run(workspace, name: str, processes: int, **changes) -> tuple[dict, Path]:
    root, data, model = workspace
    recipe = {
        "base_model": str(model), "datasets": [{"path": str(data), "type": "alpaca"}], "sequence_len": 128,
        "micro_batch_size": 4, "gradient_accumulation_steps": 2 // processes, "num_epochs": 1,
        "learning_rate": 1e-3, "lr_scheduler": "linear", "save_strategy": "no",
        "dataset_prepared_path": str(root / "prepared"), "output_dir": str(root / name), **changes,
    }  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = llmtune("train", path, "--num-processes", processes, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(path), root / name


@pytest.fixture(scope="module")
def reference(workspace):
    return {"full": run(workspace, "single-full", 1), "lora": run(workspace, "single-lora", 1, **LORA)}


def saved_tensors(output_dir: Path) -> dict:
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (output_dir / "adapter_config.json").exists() else "model.safetensors"
    return load_file(str(output_dir / name))


CASES = [
    ("ddp", {}, "full"),
    ("ddp-lora", LORA, "lora"),
    ("zero1", {"deepspeed": "zero1"}, "full"),
    ("zero2-lora", {"deepspeed": "zero2", **LORA}, "lora"),
    ("zero3", {"deepspeed": "zero3"}, "full"),
    ("zero3-lora", {"deepspeed": "zero3", **LORA}, "lora"),
    ("zero3-offload", {"deepspeed": "zero3_offload"}, "full"),
]


@pytest.mark.parametrize(("name", "changes", "kind"), CASES, ids=[c[0] for c in CASES])
def test_two_ranks_match_single_process(workspace, reference, name, changes, kind):
    metrics, output_dir = run(workspace, name, 2, **changes)
    ref_metrics, ref_dir = reference[kind]
    assert metrics["world_size"] == 2
    ranks = metrics["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["world_size"] == 2 for r in ranks)
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks trained on the same data"
    assert metrics["steps"] == ref_metrics["steps"] == 4
    assert losses(metrics) == pytest.approx(losses(ref_metrics), abs=2e-5)
    # the saved model (ZeRO-3: gathered from the shards) equals the single-process result
    saved, expected = saved_tensors(output_dir), saved_tensors(ref_dir)
    assert saved.keys() == expected.keys() and len(saved) > 0
    for key, tensor in expected.items():
        assert saved[key].shape == tensor.shape and saved[key].abs().sum() > 0, key
        assert (saved[key].float() - tensor.float()).abs().max().item() < 1e-4, key
    full_size = ref_metrics["ranks"][0]["local_parameters"]
    if name.startswith("zero3") and kind == "full":
        # ZeRO-3 partitions every parameter: each rank holds half
        assert all(r["local_parameters"] == pytest.approx(full_size / 2, rel=0.01) for r in ranks)
    else:
        assert all(r["local_parameters"] == full_size for r in ranks) or name.startswith("zero3")
