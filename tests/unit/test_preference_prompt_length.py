"""max_prompt_len: a longer prompt is dropped, or under excess_length_strategy: truncate keeps its last
max_prompt_len tokens (the ones next to the reply), as TRL's max_prompt_length did."""

from __future__ import annotations

import pytest
from tiny import load_tokenizer, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.loader import recipe_from_mapping
from llmtune.train.data.preference_rows import prepare_preference_data

GENERATION = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def prepare(tmp_path, tok, words, **keys):
    rows = [{"question": "Repeat " + " ".join(["word"] * n), "chosen": "ok", "rejected": "no"} for n in words]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    raw = {"base_model": "m", "rl": "dpo", "datasets": [{"path": str(path), "type": "chatml.intel"}],
           "chat_template": "chatml", "dataset_prepared_path": "", **keys}  # fmt: skip
    return prepare_preference_data(recipe_from_mapping(raw, tmp_path / "r.yaml", check_files=False).recipe, tok)


def count(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_truncate_keeps_the_end_of_a_prompt_over_max_prompt_len(tmp_path, tok):
    whole = sorted(prepare(tmp_path, tok, [1, 30]).train, key=lambda row: row["prompt"].count("word"))
    data = prepare(tmp_path, tok, [1, 30], max_prompt_len=24, excess_length_strategy="truncate")
    assert data.stats["dropped_long_prompt"] == 0 and data.stats["truncated_prompt"] == 1
    [short, long] = sorted(data.train, key=lambda row: row["prompt"].count("word"))
    assert short == whole[0]  # under the limit: untouched
    assert count(tok, whole[1]["prompt"]) > 24 and count(tok, long["prompt"]) == 24
    assert whole[1]["prompt"].endswith(long["prompt"]) and long["prompt"].endswith("word<|im_end|>\n" + GENERATION)
    assert (long["chosen"], long["rejected"]) == (whole[1]["chosen"], whole[1]["rejected"])


def test_drop_still_drops_and_says_truncate_would_keep_them(tmp_path, tok):
    data = prepare(tmp_path, tok, [1, 30], max_prompt_len=24)
    assert data.stats["dropped_long_prompt"] == 1 and len(data.train) == 1
    with pytest.raises(UserError) as caught:
        prepare(tmp_path, tok, [30], max_prompt_len=24)
    assert caught.value.hint == "raise sequence_len (or max_prompt_len), or set excess_length_strategy: truncate"
    with pytest.raises(UserError) as caught:  # truncate can't save a prompt past sequence_len: not suggested
        prepare(tmp_path, tok, [30], sequence_len=16, excess_length_strategy="truncate")
    assert caught.value.hint == "raise sequence_len (or max_prompt_len)"
