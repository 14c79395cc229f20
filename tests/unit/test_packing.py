"""Packing: no attention or position leakage between examples, and the same loss as running them one by one."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import make_tiny_model

from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.data.collate import REAL_TOKENS, Collator
from llmtune.train.data.formats import IGNORE
from llmtune.train.data.packing import pack_examples, pack_indices


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from llmtune.train.model.load import load_model, load_tokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", layers=2)
    recipe = recipe_from_mapping({"base_model": str(path), "datasets": [{"path": "x", "type": "alpaca"}]},
                                 Path("r.yaml"), check_files=False).recipe  # fmt: skip
    tokenizer = load_tokenizer(recipe, str(path))
    model = load_model(recipe, str(path), tokenizer, "no")
    model.train()  # the trap shows in train mode, where a KV cache would still be created
    return model, tokenizer


def examples(tokenizer):
    texts = ["the quick brown fox jumps", "over the lazy dog and runs far away", "hello"]
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        out.append({"input_ids": ids, "labels": [IGNORE] + ids[1:]})
    return out


def test_packed_logits_equal_each_example_alone(model_and_tokenizer):
    import torch

    model, tokenizer = model_and_tokenizer
    rows = examples(tokenizer)
    [packed], _ = pack_examples(rows, capacity=64, seed=0)
    batch = Collator(tokenizer.pad_token_id)([packed])
    batch.pop(REAL_TOKENS)
    assert "attention_mask" not in batch
    with torch.no_grad():
        packed_logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        starts = _starts(packed["position_ids"])
        assert len(starts) == len(rows)
        for start, stop in zip(starts, [*starts[1:], len(packed["input_ids"])], strict=True):
            alone = model(input_ids=torch.tensor([packed["input_ids"][start:stop]])).logits[0]
            diff = (packed_logits[start:stop] - alone).abs().max().item()
            assert diff < 1e-4, f"example at {start} attends across the boundary (max diff {diff})"


def _starts(positions):
    return [i for i, p in enumerate(positions) if p == 0]


def test_packed_loss_equals_token_weighted_loss_of_examples(model_and_tokenizer):
    import torch

    model, tokenizer = model_and_tokenizer
    rows = examples(tokenizer)
    [packed], efficiency = pack_examples(rows, capacity=64, seed=0)
    assert efficiency == pytest.approx(sum(len(r["input_ids"]) for r in rows) / 64)
    collate = Collator(tokenizer.pad_token_id)
    with torch.no_grad():
        batch = collate([packed])
        batch.pop(REAL_TOKENS)
        packed_loss = model(**batch).loss.item()
        total, count = 0.0, 0
        for row in rows:
            single = collate([row])
            single.pop(REAL_TOKENS)
            n = sum(1 for label in row["labels"][1:] if label != IGNORE)
            total += model(**single).loss.item() * n
            count += n
    assert packed_loss == pytest.approx(total / count, abs=1e-5)


def test_padding_in_a_packed_batch_changes_nothing(model_and_tokenizer):
    import torch

    model, tokenizer = model_and_tokenizer
    rows, _ = pack_examples(examples(tokenizer), capacity=24, seed=1)
    assert len(rows) >= 2
    collate = Collator(tokenizer.pad_token_id)
    with torch.no_grad():
        together = collate(rows)
        real = int(together.pop(REAL_TOKENS))
        assert real == sum(len(r["input_ids"]) for r in rows)
        logits = model(input_ids=together["input_ids"], position_ids=together["position_ids"]).logits
        for index, row in enumerate(rows):
            alone = collate([row])
            alone.pop(REAL_TOKENS)
            single = model(input_ids=alone["input_ids"], position_ids=alone["position_ids"]).logits[0]
            assert (logits[index, : len(row["input_ids"])] - single).abs().max().item() < 1e-4


def test_pack_indices_respects_capacity_and_keeps_every_example():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(1, 300) for _ in range(2000)]
    bins = pack_indices(lengths, 512, seed=3)
    assert sorted(i for b in bins for i in b) == list(range(2000))
    assert all(sum(lengths[i] for i in b) <= 512 for b in bins)
    assert sum(lengths) / (len(bins) * 512) > 0.95
    assert pack_indices(lengths, 512, seed=3) == bins


def test_context_parallel_batches_pad_to_a_multiple_of_the_chunks_without_a_mask():
    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9, 10, 11, 12], "labels": [-100, 9, 10, 11, 12]}]
    plain = Collator(0)(rows)
    assert plain["input_ids"].shape[1] == 5 and "attention_mask" in plain  # no extra padding by default
    cp = Collator(0, multiple_of=4, mask=False)(rows)
    assert cp["input_ids"].shape[1] == 8 and "attention_mask" not in cp
    assert cp["labels"][0].tolist() == [5, 6, 7, -100, -100, -100, -100, -100]  # padding is never trained
