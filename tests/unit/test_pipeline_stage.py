"""A pipeline stage computes in the plan's precision: bf16 autocast on GPUs, as the Trainer's runs do."""

from __future__ import annotations

import pytest

from llmtune.errors import UserError


def test_a_stage_under_bf16_computes_in_bf16_and_fp32_without():
    import torch
    from tiny import tiny_llama_config
    from transformers import LlamaForCausalLM

    from llmtune.train.pipeline.stages import Stage, find_parts

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(64, layers=2, hidden=32, heads=4, kv_heads=2, intermediate=64))
    stage = Stage(find_parts(model), range(2), first=True, last=True)
    ids = torch.randint(0, 64, (1, 8))
    positions = torch.arange(8)[None]
    assert stage(ids, positions).dtype == torch.float32
    stage.autocast_dtype = torch.bfloat16  # CPU autocast stands in for the GPU's here
    assert stage(ids, positions).dtype == torch.bfloat16


def test_fp16_pipelines_are_refused_in_rehearsal_as_on_gpus():
    from pathlib import Path

    from llmtune.plan import make_cluster, make_plan
    from llmtune.recipe.loader import recipe_from_mapping

    base = {"base_model": "org/m", "datasets": [{"path": "org/d", "type": "alpaca"}], "pipeline_parallel_size": 2}
    for precision, refused in (({"bf16": True}, False), ({"fp16": True}, True)):
        recipe = recipe_from_mapping({**base, **precision}, Path("r.yaml"), check_files=False).recipe
        if not refused:
            assert make_plan(recipe, make_cluster(2, device="cpu")).strategy == "pipeline"
            continue
        with pytest.raises(UserError, match="fp16 needs loss scaling"):
            make_plan(recipe, make_cluster(2, device="cpu"))
