"""Memory estimates follow the ZeRO paper's accounting (Rajbhandari et al., Table 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.plan.estimate import GB, estimate, state_bytes
from llmtune.plan.model_facts import ModelFacts
from llmtune.recipe.loader import recipe_from_mapping


def recipe(**changes):
    base = {"base_model": "m", "datasets": [{"path": "d", "type": "alpaca"}], "bf16": True, "optimizer": "adamw_torch"}
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


class SevenPointFiveB(ModelFacts):
    def total_params(self) -> int:
        return 7_500_000_000


FACTS = SevenPointFiveB("llama", 4096, 32, 32, 32, 11008, 32000, False)


def test_mixed_precision_adam_is_16_bytes_per_parameter():
    b = state_bytes("adamw_torch", mixed=True)
    assert (b.params, b.grads, b.optimizer) == (2, 2, 12)


@pytest.mark.parametrize(
    ("strategy", "expected_gb"),
    [("single / DDP", 120), ("ZeRO-1", 31.4), ("ZeRO-2", 16.6), ("ZeRO-3 / FSDP full shard", 1.9)],
)
def test_model_states_match_the_zero_paper_table(strategy, expected_gb):
    # Table 1 of the ZeRO paper: Psi = 7.5B, K = 12, N_d = 64
    rows = {e.strategy: e for e in estimate(recipe(), FACTS, data_parallel=64, gpus_per_machine=8)}
    row = rows[strategy]
    assert (row.params + row.grads + row.optimizer) / GB == pytest.approx(expected_gb, abs=0.05)


def test_offload_moves_states_to_cpu():
    rows = {e.strategy: e for e in estimate(recipe(), FACTS, data_parallel=8, gpus_per_machine=8)}
    off = rows["ZeRO-3 + CPU offload"]
    assert off.params == 0 and off.optimizer == 0
    assert off.cpu == pytest.approx((2 + 12) * 7.5e9)  # the whole machine's shards of params and optimizer


def test_llama3_8b_parameter_count():
    llama = ModelFacts("llama", 4096, 32, 32, 8, 14336, 128256, False)
    assert llama.total_params() == pytest.approx(8.03e9, rel=0.005)


def test_lora_keeps_the_base_frozen_in_16_bits():
    llama = ModelFacts("llama", 4096, 32, 32, 8, 14336, 128256, False)
    [ddp, *_] = estimate(recipe(adapter="lora", lora_r=16, lora_target_linear=True), llama, 1, 1)
    assert ddp.params == pytest.approx(2 * llama.total_params() + 4 * 41_943_040, rel=1e-6)
    assert ddp.optimizer == pytest.approx(8 * 41_943_040)


def test_estimate_command_recommends_by_the_seeds_rules(run_cli, tmp_path):
    import json

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "r.yaml"
    path.write_text(f"base_model: {tmp_path}\ndatasets:\n  - path: org/d\n    type: alpaca\nbf16: true\n"
                    "sequence_len: 2048\ngradient_checkpointing: true\n")  # fmt: skip
    one = run_cli("estimate", path, "--gpus-per-machine", "1", "--gpu-memory", "80GB")
    assert one.code == 0 and "8.03B parameters" in one.out
    assert "recommended: ZeRO-2 + CPU offload" in one.out  # 16 bytes x 8B = 128 GB of states can't fit one 80 GB GPU
    eight = run_cli("estimate", path, "--gpus-per-machine", "8", "--gpu-memory", "80GB")
    assert "recommended: ZeRO-1" in eight.out
    tiny = run_cli("estimate", path, "--gpus-per-machine", "8", "--gpu-memory", "4GB")
    assert "recommended: ZeRO-3 + CPU offload" in tiny.out or "nothing fits" in tiny.out
    bad = run_cli("estimate", path, "--gpu-memory", "lots")
    assert bad.code == 2 and "--gpu-memory" in bad.err
