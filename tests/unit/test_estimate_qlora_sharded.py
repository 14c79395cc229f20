"""QLoRA under ZeRO-3 and FSDP: the estimate shards the 4-bit weights by N, but not their quantization state.

The packed 4-bit weights are parameters (stored in the compute dtype) and are partitioned with the rest; the absmax
blocks beside them are attributes of the weights, which neither engine shards (tests/integration/
test_qlora_sharded.py measures the partitioned parameters at 2 ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.plan.memory.buffers import GB
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.peak import estimate
from llmtune.recipe.loader import recipe_from_mapping

EIGHT_B = ModelFacts("llama", 4096, 32, 32, 8, 14336, 49152, False)
QLORA = {"base_model": "m", "datasets": [{"path": "d", "type": "alpaca"}], "bf16": True, "adapter": "qlora",
         "load_in_4bit": True, "lora_r": 8, "lora_target_linear": True}  # fmt: skip


def recipe(**changes):
    return recipe_from_mapping({**QLORA, **changes}, Path("r.yaml"), check_files=False).recipe


@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize(("strategy", "shards"), [("ZeRO-3", 8), ("FSDP full shard", 8), ("FSDP hybrid shard", 4)])
def test_sharded_rows_split_the_4bit_weights_and_keep_their_absmax(strategy, shards, double_quant):
    qlora = recipe(bnb_4bit_use_double_quant=double_quant)
    rows = {row.strategy: row for row in estimate(qlora, EIGHT_B, data_parallel=8, gpus_per_machine=4)}
    # absmax per weight: one fp32 per 64-weight block, or with double quantization one byte per block and an fp32
    # per 256 blocks (bitsandbytes' defaults); counted here from the model's linear layers, independently
    absmax = EIGHT_B.linear_params() * ((1 + 4 / 256) / 64 if double_quant else 4 / 64)
    whole = rows["ZeRO-2" if strategy == "ZeRO-3" else "FSDP shard grad op"].params  # what no sharding holds
    assert rows[strategy].params == pytest.approx((whole - absmax) / shards + absmax, rel=1e-9)
    assert absmax > 0.01 * GB  # a term the comparison can see: 0.11 GB for 8B with double quantization


def test_offloaded_zero3_keeps_the_absmax_on_the_gpu():
    rows = {row.strategy: row for row in estimate(recipe(), EIGHT_B, data_parallel=8, gpus_per_machine=8)}
    absmax = EIGHT_B.linear_params() * (1 + 4 / 256) / 64
    for strategy in ("ZeRO-3 + CPU offload", "ZeRO-3 + NVMe offload"):
        assert rows[strategy].params == pytest.approx(absmax, rel=1e-9), strategy
