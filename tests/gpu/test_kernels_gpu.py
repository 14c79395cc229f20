"""The fast path on the GPU (issue 18): packed rows attend only within their example, and Liger keeps the loss.

The CPU rehearsal never runs these kernels (the planner says so once), so their correctness is proven here only.
"""

from __future__ import annotations

import re

import pytest
from harness import llmtune, losses, read_metrics

# Three examples in two packed rows of 24 tokens: row 0 holds a 10- and a 14-token example, row 1 one of 24.
LENGTHS = ((10, 14), (24,))


def packed_batch(vocab: int):
    import torch

    generator = torch.Generator().manual_seed(0)
    rows, positions, examples = [], [], []
    for row in LENGTHS:
        ids = [torch.randint(3, vocab, (n,), generator=generator) for n in row]
        examples.append(ids)
        rows.append(torch.cat(ids))
        positions.append(torch.cat([torch.arange(n) for n in row]))
    return torch.stack(rows), torch.stack(positions), examples


def attention_available(name: str) -> bool:
    if name != "flash_attention_2":
        return True
    from llmtune.train.model.kernels import flash_attn_importable

    return flash_attn_importable()


@pytest.mark.parametrize(("attention", "dtype"), [("sdpa", "float32"), ("sdpa", "bfloat16"),
                                                  ("flash_attention_2", "bfloat16")])  # fmt: skip
def test_packed_rows_give_each_example_its_own_logits(tiny_model, attention, dtype):
    """micro_batch_size 2, packed: each example's logits equal the example run alone (no attention across)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.model.kernels import keep_packed_rows_apart

    if not attention_available(attention):
        pytest.skip("flash_attn does not import on this machine (no wheel for its torch/CUDA)")
    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch_dtype, attn_implementation=attention)
    model = model.cuda().eval()
    if attention == "flash_attention_2":
        keep_packed_rows_apart(model)
    input_ids, position_ids, examples = packed_batch(model.config.vocab_size)
    with torch.no_grad():
        packed = model(input_ids=input_ids.cuda(), position_ids=position_ids.cuda(), use_cache=False).logits.float()
        worst, scale = 0.0, 0.0
        for row, ids in enumerate(examples):
            start = 0
            for example in ids:
                alone = model(input_ids=example[None].cuda(), use_cache=False).logits.float()[0]
                part = packed[row, start : start + len(example)]
                worst = max(worst, (part - alone).abs().max().item())
                scale = max(scale, alone.abs().max().item())
                start += len(example)
    tolerance = 1e-4 if dtype == "float32" else 2e-2  # bf16: the kernels' blocking differs with the length
    assert worst <= tolerance * max(scale, 1.0), (worst, scale)
    # and the check can fail: without the example boundaries the second example sees the first
    with torch.no_grad():
        leaked = model(input_ids=input_ids[:1].cuda(), use_cache=False).logits.float()[0, 10:24]
        alone = model(input_ids=examples[0][1][None].cuda(), use_cache=False).logits.float()[0]
    assert (leaked - alone).abs().max().item() > 10 * tolerance * max(scale, 1.0)


LIGER = {"plugins": ["axolotl.integrations.liger.LigerPlugin"], "liger_rope": True, "liger_rms_norm": True,
         "liger_glu_activation": True, "liger_fused_linear_cross_entropy": True}  # fmt: skip


@pytest.mark.parametrize("engine", [{}, {"deepspeed": "zero3"}], ids=["single", "zero3"])
def test_liger_kernels_keep_the_loss_on_the_same_batches(make_recipe, engine):
    """Kernels on against off, bf16, same data order: every step's loss within bf16 noise, and Liger really ran.
    Under ZeRO-3 the fused cross-entropy reads lm_head.weight, which DeepSpeed gathers when it is read (the CPU
    check of that: tests/integration/test_zero3_direct_weight.py)."""
    runs = {}
    for name, changes in (("plain", engine), ("liger", {**LIGER, **engine})):
        recipe = make_recipe(f"{name}-{len(engine)}", bf16=True, learning_rate=1e-3, **changes)
        result = llmtune("train", recipe, "--device", "cuda", env={"LLMTUNE_BATCH_HASHES": "1"}, timeout=900)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = (read_metrics(recipe), result.stderr + result.stdout)
    (plain, _), (liger, log) = runs["plain"], runs["liger"]
    assert re.search(r"kernels: liger .*rms_norm", log), log[-3000:]
    assert plain["step_batch_hashes"] == liger["step_batch_hashes"]
    mine, theirs = losses(liger), losses(plain)
    assert len(mine) == len(theirs) > 5
    drift = [abs(a - b) / max(abs(b), 1.0) for a, b in zip(mine, theirs, strict=True)]
    assert max(drift) < 0.03, list(zip(mine, theirs, strict=True))
