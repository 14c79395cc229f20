"""What `llmtune estimate` (and `llmtune config`, and train's memory check) recommends: a strategy the recipe can
run, in the seeds' order, adjusted for what the order doesn't see (a pipeline's bubble, the slow links between
machines), from rows of what the GPU run really holds (fused AdamW, QLoRA's load under ZeRO-3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmtune.plan.memory.buffers import FIT_FRACTION, GB
from llmtune.plan.memory.facts import ModelFacts
from llmtune.plan.memory.fit import estimate_recipe
from llmtune.plan.memory.peak import estimate
from llmtune.plan.memory.recommend import recommend
from llmtune.recipe.loader import recipe_from_mapping

LLAMA_8B = ModelFacts("llama", 4096, 32, 32, 8, 14336, 128256, False)
LLAMA_70B = ModelFacts("llama", 8192, 80, 64, 8, 28672, 128256, False)


def recipe(**changes):
    base = {"base_model": "m", "datasets": [{"path": "d", "type": "alpaca"}], "bf16": True, "sequence_len": 2048,
            "micro_batch_size": 1, "gradient_checkpointing": True}  # fmt: skip
    return recipe_from_mapping({**base, **changes}, Path("r.yaml"), check_files=False).recipe


def test_a_pipeline_with_a_large_bubble_comes_after_sharding_on_one_machine():
    """8B full on 8 x 40 GB: ZeRO-2 fits once the step is counted as the GPU run does it (fused AdamW: the foreach
    scratch had it at 41 GB, and the pipeline was recommended, at 8 micro-batches a 47% bubble). Where only the
    pipeline and ZeRO-3 fit, ZeRO-3 wins unless the micro-batches keep the bubble under a fifth."""
    report = estimate_recipe(recipe(), 8, 1, 40 * GB, facts=LLAMA_8B)
    assert report.choice[0].name == "ZeRO-2"
    for accumulation, chosen in ((1, "ZeRO-3"), (32, "pipeline")):
        rows = estimate(recipe(gradient_accumulation_steps=accumulation), LLAMA_8B, 8, 8, stages=8)
        by_name = {row.name: row for row in rows}
        budget = max(by_name["pipeline"].total, by_name["ZeRO-3"].total) / FIT_FRACTION * 1.001
        assert not by_name["ZeRO-2"].fits(budget) and by_name["pipeline"].fits(budget)
        choice = recommend(rows, budget, recipe=recipe(gradient_accumulation_steps=accumulation))
        assert choice[0].name == chosen, accumulation
        if chosen == "pipeline":
            assert "bubble 18% at its micro-batches" in choice[1]
    rows = estimate(recipe(), LLAMA_8B, 8, 8, stages=8)  # without the recipe (no bubble known): the seeds' order
    budget = max(r.total for r in rows if r.name in ("pipeline", "ZeRO-3")) / FIT_FRACTION * 1.001
    if not {r.name: r for r in rows}["ZeRO-2"].fits(budget):
        assert recommend(rows, budget)[0].name == "pipeline"


def test_a_strategy_the_recipe_refuses_is_never_recommended():
    """Tensor parallelism trains the full weights: a LoRA recipe was told to use it, then validate refused it."""
    long_rows = {"sequence_len": 65536, "sample_packing": True, "gradient_checkpointing": False}
    for adapter in (None, "lora"):
        r = recipe(**long_rows, **({"adapter": adapter, "lora_target_linear": True} if adapter else {}))
        rows = estimate(r, LLAMA_8B, 8, 8)
        tp = {row.name: row for row in rows}["tensor parallel"]
        budget = tp.total / FIT_FRACTION * 1.001
        choice = recommend(rows, budget, recipe=r)
        assert (choice is not None and choice[0].name == "tensor parallel") == (adapter is None), adapter
    qlora = recipe(adapter="qlora", load_in_4bit=True, lora_target_linear=True)
    rows = [row for row in estimate(qlora, LLAMA_70B, 8, 8, stages=8) if row.name == "pipeline"]
    assert recommend(rows, 1e15, recipe=qlora) is None  # QLoRA with a pipeline is refused by the recipe


def test_over_slow_links_the_sharding_that_crosses_machines_says_so_and_comes_after_tensor_parallel():
    report = estimate_recipe(recipe(), 8, 2, 24 * GB, interconnect="slow", facts=LLAMA_8B)
    by_name = {row.name: row for row in report.rows}
    assert report.choice[0].name == "FSDP hybrid shard"  # its all-gathers stay inside each machine
    assert estimate_recipe(recipe(), 8, 2, 24 * GB, interconnect="fast", facts=LLAMA_8B).choice[0].name == "ZeRO-3"
    rows = [by_name[name] for name in ("ZeRO-2", "ZeRO-3", "tensor parallel")]
    assert recommend(rows, 1e15, 2, "slow")[0].name == "tensor parallel"  # inside a machine, before ZeRO-2/3
    for name in ("ZeRO-3", "FSDP full shard"):
        chosen = recommend([by_name[name]], 1e15, 2, "slow")
        assert "needed when even one layer" not in chosen[1] and "cross the slow links" in chosen[1]


def test_a_pipeline_recipe_s_other_rows_are_those_strategies_on_every_gpu():
    """llmtune estimate on a pipeline recipe worked its other rows out at data parallel 1 (ZeRO-3 at 201 GB per GPU
    where the same cluster's table said 27)."""
    flat = estimate_recipe(recipe(), 8, 1, 40 * GB, facts=LLAMA_8B)
    piped = estimate_recipe(recipe(pipeline_parallel_size=8), 8, 1, 40 * GB, facts=LLAMA_8B)
    for name in ("ZeRO-3", "FSDP full shard", "ZeRO-2"):
        assert piped.row(name).total == pytest.approx(flat.row(name).total), name
    assert {row.name for row in piped.rows} >= {"tensor parallel", "pipeline"}


def test_qlora_under_zero3_counts_the_whole_4bit_model_each_rank_loads():
    """transformers builds a quantized model without zero.Init: each rank holds all of it until DeepSpeed
    partitions it. 70B QLoRA on one 24 GB GPU was recommended ZeRO-3 + CPU offload at 18.6 GB; it loads ~45 GB."""
    qlora = recipe(adapter="qlora", load_in_4bit=True, lora_target_linear=True)
    report = estimate_recipe(qlora, 1, 1, 24 * GB, facts=LLAMA_70B)
    whole = report.row("single / DDP").params
    for name in ("ZeRO-3", "ZeRO-3 + CPU offload", "ZeRO-3 + NVMe offload"):
        row = report.row(name)
        assert row.loading == whole and row.allocated >= whole, name
    assert report.row("ZeRO-3 + CPU offload").peak_at == "load" and whole > 35 * GB
    assert report.choice is None  # nothing fits one 24 GB GPU
    assert report.row("ZeRO-2").loading == 0 and report.row("FSDP full shard").loading == 0


def test_context_parallel_keeps_a_4bit_base_s_quantization_constants_whole_as_the_other_shardings_do():
    """The absmax blocks are attributes beside the packed weights: FSDP2 under context parallelism shards the weights
    and leaves them whole on every rank, as ZeRO-3 and FSDP do (the row divided them too, 5.6 GB low at 405B)."""
    from llmtune.plan.memory.states import quantization_state_bytes

    qlora = recipe(adapter="qlora", load_in_4bit=True, lora_target_linear=True, sequence_len=65536)
    rows = {row.name: row for row in estimate(qlora, LLAMA_70B, 8, 8)}
    kept = quantization_state_bytes(qlora, LLAMA_70B)
    whole = rows["single / DDP"].params
    assert rows["context parallel"].params == pytest.approx((whole - kept) / 8 + kept)
    assert rows["FSDP full shard"].params == pytest.approx((whole - kept) / 8 + kept)
