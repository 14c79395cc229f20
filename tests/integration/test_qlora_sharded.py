"""QLoRA sharded by ZeRO-3 and by FSDP2 on 2 CPU ranks (gloo): the 4-bit weights, stored in the compute dtype
(fp32 in rehearsal), are partitioned like any parameter, the losses match one process, and the adapter reloads.

As in test_distributed.py, one process with gradient accumulation 2 sees the global batch of 8 rows per step that
2 ranks see with accumulation 1, so the per-step losses must agree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from harness import losses, make_workspace, saved_weights, train_run

pytestmark = pytest.mark.integration

QLORA = {"adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16, "lora_target_linear": True}
CASES = {
    "zero3": ({"deepspeed": "zero3"},
              {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "none", "offload_param": "none"}),
    "fsdp2": ({"fsdp_version": 2, "fsdp_config": {"state_dict_type": "FULL_STATE_DICT"}},
              {"engine": "fsdp2", "placements": ["Shard(0)"], "state_dict_type": "FULL_STATE_DICT"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model):
    return make_workspace(tmp_path_factory, "qlora-sharded", tiny_model)


def run(workspace, name: str, processes: int, **changes) -> tuple[dict, Path, Path]:
    """A QLoRA run whose rank 0 writes the in-memory model's logits on the first row (LLMTUNE_PROBE_FILE)."""
    probe = workspace[0] / f"{name}.probe.safetensors"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LLMTUNE_PROBE_FILE", str(probe))
        metrics, output_dir = train_run(workspace, name, processes, gradient_accumulation_steps=2 // processes,
                                        **QLORA, **changes)  # fmt: skip
    return metrics, output_dir, probe


@pytest.fixture(scope="module")
def reference(workspace):
    return run(workspace, "single-qlora", 1)


def reload(output_dir: Path):
    """The saved adapter on the base loaded in 4 bits as the runs load it (NF4, double quantization, fp32 storage)."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base_name = json.loads((output_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=torch.float32)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(base_name, dtype=torch.float32, quantization_config=quant,
                                                device_map={"": "cpu"})  # fmt: skip
    return PeftModel.from_pretrained(base, str(output_dir)).eval()


def probe_matches_reload(probe: Path, model) -> float:
    import torch
    from safetensors.torch import load_file

    saved = load_file(str(probe))
    with torch.no_grad():
        logits = model(input_ids=saved["input_ids"]).logits.float()
    return (logits - saved["logits"]).abs().max().item()


def check_estimate(metrics: dict, output_dir: Path, name: str) -> None:
    """`llmtune estimate`'s row against the parameter bytes each rank held at a step (fp32 in rehearsal). The meter
    counts parameters, so it sees the row's sharded part; the absmax blocks the row keeps whole on every rank are
    attributes of the 4-bit weights, not parameters."""
    import json

    from llmtune.plan.memory.facts import read_model_facts
    from llmtune.plan.memory.peak import estimate
    from llmtune.plan.memory.states import quantization_state_bytes
    from llmtune.recipe import Recipe

    recipe = Recipe.model_validate(json.loads((output_dir / "llmtune" / "plan.json").read_text())["recipe"])
    facts = read_model_facts(recipe.base_model)
    rows = {row.strategy: row for row in estimate(recipe, facts, data_parallel=2, gpus_per_machine=2, mixed=False)}
    row = rows["ZeRO-3" if name == "zero3" else "FSDP full shard"]
    kept = quantization_state_bytes(recipe, facts)
    for rank in metrics["ranks"]:
        assert rank["model_state_bytes"]["params"] == pytest.approx(row.params - kept, rel=0.02), (rank, row)


@pytest.mark.parametrize("name", list(CASES))
def test_qlora_sharded_over_two_ranks_matches_one_process(workspace, reference, name):
    changes, engine = CASES[name]
    metrics, output_dir, probe = run(workspace, name, 2, **changes)
    ref_metrics, ref_dir, _ = reference
    ranks = metrics["ranks"]
    assert metrics["world_size"] == 2 and [r["rank"] for r in ranks] == [0, 1]
    assert ranks[0]["first_batch"] != ranks[1]["first_batch"], "both ranks trained on the same data"
    assert metrics["steps"] == ref_metrics["steps"] == 4
    for rank in ranks:
        assert {key: rank.get(key) for key in engine} == engine, rank
        assert rank["libraries"].keys() == {"bitsandbytes"} | ({"deepspeed"} if name == "zero3" else set()), rank
    assert losses(metrics) == pytest.approx(losses(ref_metrics), abs=2e-5)

    # the adapter saved (ZeRO-3: gathered from the partitions) equals the one-process adapter
    saved, expected = saved_weights(output_dir), saved_weights(ref_dir)
    assert saved.keys() == expected.keys() and len(saved) > 0
    for key, tensor in expected.items():
        assert (saved[key] - tensor).abs().max().item() < 1e-4, key

    # each rank holds half of every parameter, the packed 4-bit weights included. Counted in stored elements
    # (8 weights per fp32 element) on the reloaded model, before it runs (an eval forward on CPU repacks the
    # weights for bitsandbytes' CPU kernel): `whole` is what one process holds, `packed` the 4-bit weights' share.
    # Were the 4-bit weights left whole on each rank (accelerate does that to uint8-stored ones under FSDP2), a
    # rank would hold whole / 2 + packed / 2.
    import bitsandbytes as bnb

    model = reload(output_dir)
    whole = sum(p.numel() for p in model.parameters())
    packed = sum(p.numel() for p in model.parameters() if isinstance(p, bnb.nn.Params4bit))
    assert packed > 0 and ref_metrics["ranks"][0]["local_parameters"] == whole
    for rank in ranks:
        assert rank["local_parameters"] == pytest.approx(whole / 2, abs=packed / 8), (rank, whole, packed)

    # the adapter reloads onto the 4-bit base and gives the logits the trained model gave in memory
    assert probe_matches_reload(probe, model) < 1e-4
    check_estimate(metrics, output_dir, name)
