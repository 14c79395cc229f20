"""Axolotl's sharegpt-era recipes train as written: `type: sharegpt` with `conversation: chatml`, and that era's
`gradient_checkpointing: offload` (checkpointing, the layer inputs held in CPU memory on a GPU),
one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from harness import llmtune, losses, read_metrics
from tiny import load_tokenizer, write_jsonl

pytestmark = pytest.mark.integration

WORDS = ["apple", "river", "stone", "cloud", "green", "happy", "seven", "light"]


def conversations() -> list[dict]:
    """Two-turn ShareGPT chats, the first with a system message."""
    rows = []
    for word in WORDS:
        rows.append({"conversations": [
            {"from": "system", "value": "Repeat what you are asked to."},
            {"from": "human", "value": f"Say {word}"}, {"from": "gpt", "value": f"{word} {word}"},
            {"from": "human", "value": "Again"}, {"from": "gpt", "value": word},
        ]})  # fmt: skip
    return rows


def test_sharegpt_chatml_trains_with_only_the_gpt_turns_labelled(make_recipe, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", conversations() * 2)
    recipe = make_recipe("sharegpt", datasets=[{"path": str(data), "type": "sharegpt", "conversation": "chatml"}],
                         max_steps=3, gradient_checkpointing="offload")  # fmt: skip
    result = llmtune("train", recipe, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = read_metrics(recipe)
    history = losses(metrics)
    assert metrics["steps"] == 3 and all(math.isfinite(loss) for loss in history), history
    # read as today's Axolotl reads it, and the plan says what the rehearsal does with the offload (the offload
    # itself: tests/unit/test_activation_offload.py on CPU; on a GPU, tests/gpu)
    assert "gradient_checkpointing: offload: read as gradient_checkpointing: true with activation_offloading" in (
        result.stderr
    )
    assert "activation offloading: not on the CPU rehearsal" in result.stderr

    # the examples the run trained on, from its tokenized cache: only the gpt turns (with <|im_end|>) are labelled
    from llmtune.train.data.rows import TokenRows

    prepared = Path(yaml.safe_load(recipe.read_text())["dataset_prepared_path"])
    [cache] = [p for p in prepared.iterdir() if (p / "train").is_dir()]
    rows = TokenRows.load(cache / "train")
    assert len(rows) == 2 * len(WORDS)
    tok = load_tokenizer()
    answers = set()
    for row in rows:
        text = tok.decode(row["input_ids"])
        assert text.startswith("<|im_start|>system\nRepeat what you are asked to.<|im_end|>\n<|im_start|>user\nSay ")
        runs, current = [], []
        for token, label in zip(row["input_ids"], row["labels"], strict=True):
            if label != -100:
                current.append(token)
            elif current:
                runs.append(tok.decode(current))
                current = []
        runs += [tok.decode(current)] if current else []
        word = runs[-1].strip().removesuffix("<|im_end|>")
        assert runs == [f"\n{word} {word}<|im_end|>\n", f"\n{word}<|im_end|>\n"], runs
        answers.add(word)
    assert answers == set(WORDS)
