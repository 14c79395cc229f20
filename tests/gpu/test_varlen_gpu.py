"""Padding-free batches on the GPU (issue 36): torch's varlen kernel (and flash-attn 2 where it imports) against the
exact per-row path the CPU tests prove, rows kept apart, and a default run that is padding-free, fused, free of host
syncs inside its steps, profiled, and compiled.

The CPU rehearsal never runs these kernels: tests/unit/test_padding_free.py proves the same properties there on the
exact per-row path; this file proves the kernels match it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from harness import llmtune, losses, read_metrics

ROWS = (9, 4, 13, 1, 7, 32)


def flat_batch(vocab: int, lengths=ROWS, seed: int = 0):
    import torch

    from llmtune.train.data.collate import REAL_TOKENS, ROW_LENGTHS, FlatCollator
    from llmtune.train.data.formats import IGNORE

    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": [IGNORE] + ids[1:]})
    batch = FlatCollator(0)(rows)
    batch.pop(REAL_TOKENS), batch.pop(ROW_LENGTHS)
    return rows, {k: v.cuda() if hasattr(v, "cuda") else v for k, v in batch.items()}


def load(path, dtype: str, attention: str):
    import torch
    from transformers import AutoModelForCausalLM

    from llmtune.train.model import varlen

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).cuda().eval()
    model.config.use_cache = False
    if attention == "llmtune_varlen":
        varlen.register()
    model.set_attn_implementation(attention)
    return model


def test_torch_varlen_matches_each_row_alone_and_keeps_rows_apart(tiny_model, monkeypatch):
    import torch

    from llmtune.train.model import varlen

    calls = []
    real = varlen.torch_varlen()
    assert real is not None, "this torch has no torch.nn.attention.varlen"
    monkeypatch.setattr(varlen, "torch_varlen", lambda: lambda *a, **k: calls.append(1) or real(*a, **k))
    model, alone_model = load(tiny_model, "bfloat16", "llmtune_varlen"), load(tiny_model, "bfloat16", "sdpa")
    rows, batch = flat_batch(model.config.vocab_size)
    with torch.no_grad():
        logits = model(**batch).logits.float()[0]
        assert calls, "torch's varlen kernel did not run"
        worst = scale = 0.0
        bounds = batch["cu_seq_lens_q"].tolist()
        for row, start, end in zip(rows, bounds[:-1], bounds[1:], strict=True):
            alone = alone_model(input_ids=torch.tensor([row["input_ids"]], device="cuda")).logits.float()[0]
            worst = max(worst, (logits[start:end] - alone).abs().max().item())
            scale = max(scale, alone.abs().max().item())
            other = batch["input_ids"].clone()  # every other row changed: this row's logits don't move at all
            other[0, :start] = (other[0, :start] + 7) % model.config.vocab_size
            other[0, end:] = (other[0, end:] + 11) % model.config.vocab_size
            moved = model(**{**batch, "input_ids": other}).logits.float()[0]
            assert torch.equal(moved[start:end], logits[start:end]), f"row {start}:{end} saw its neighbours"
    assert worst <= 2e-2 * max(scale, 1.0), (worst, scale)  # bf16: the kernels' blocking differs with the length


def test_flash_attention_2_reads_the_same_flat_batch(tiny_model):
    import torch

    from llmtune.train.model.kernels import flash_attn_importable

    if not flash_attn_importable():
        pytest.skip("flash_attn does not import on this machine (no wheel for its torch/CUDA)")
    model, exact = load(tiny_model, "bfloat16", "flash_attention_2"), load(tiny_model, "bfloat16", "llmtune_varlen")
    _, batch = flat_batch(model.config.vocab_size)
    with torch.no_grad():
        got, want = model(**batch).logits.float(), exact(**batch).logits.float()
    assert (got - want).abs().max().item() <= 2e-2 * max(want.abs().max().item(), 1.0)


def run(make_recipe, name: str, *flags, env=None, **changes) -> tuple[dict, str, Path]:
    recipe = make_recipe(name, bf16=True, max_steps=10, learning_rate=1e-3, **changes)
    result = llmtune("train", recipe, "--device", "cuda", *flags, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return read_metrics(recipe), result.stderr + result.stdout, Path(yaml.safe_load(recipe.read_text())["output_dir"])


def test_a_default_run_is_padding_free_fused_sync_free_and_profiled(make_recipe):
    """The defaults on CUDA: padding-free batches on torch's varlen kernel, fused AdamW, pinned batches prefetched by
    workers; no host sync from one step's start to the next's after the warm-up (torch's sync debug mode watches,
    logging only at step 1); a profile of 5 steps with the GPU's idle share. The padded run (batch_flattening: false)
    trains the same rows to the same losses within bf16 noise."""
    env = {"LLMTUNE_TEST_SYNC_DEBUG": "1", "LLMTUNE_BATCH_HASHES": "1"}
    fast, log, out = run(make_recipe, "padding-free", "--profile", env=env, logging_steps=100)
    padded, _, _ = run(make_recipe, "padded", env={"LLMTUNE_BATCH_HASHES": "1"}, batch_flattening=False)
    assert fast["batches"]["kernel"] == "torch_varlen" and padded["batches"]["layout"] == "padded"
    plan = json.loads((out / "llmtune" / "plan.json").read_text())["plan"]
    assert plan["kernels"]["optimizer"] == "adamw_torch_fused" and plan["kernels"]["loader"]["dataloader_num_workers"] == 2
    rank = fast["ranks"][0]
    assert rank["optimizer_fused"] is True
    assert rank["sync_steps_watched"] >= 5 and rank["host_syncs"] == {}, rank["host_syncs"]
    assert fast["step_padded_tokens"] == fast["step_real_tokens"]
    assert fast["step_batch_hashes"] == padded["step_batch_hashes"]  # the same rows, in the same order
    report = fast["profile"]
    assert report["steps"] == [3, 7] and 0 <= report["gpu_idle"] < 1 and Path(report["trace"]).stat().st_size > 0
    assert "GPU idle" in log
    # logged at step 1 only (logging_steps 100) against every step: compare what both logged
    first = losses(fast)[0]
    assert first == pytest.approx(losses(padded)[0], rel=0.02)


def test_torch_compile_runs_on_padding_free_batches(make_recipe):
    compiled, log, _ = run(make_recipe, "compiled", torch_compile=True)
    eager, _, _ = run(make_recipe, "eager")
    assert compiled["batches"]["layout"] == "padding-free" and "torch.compile" in log
    mine, theirs = losses(compiled), losses(eager)
    assert len(mine) == len(theirs) == 10
    assert max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(mine, theirs, strict=True)) < 0.03
