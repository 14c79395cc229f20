"""Each dataset type yields exactly the expected labels, checked token by token."""

from __future__ import annotations

import pytest
from tiny import load_tokenizer, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.data import DatasetSpec
from llmtune.train.data.formats import ALPACA_NO_INPUT, IGNORE, FormatContext, RowError, format_for


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def run(tok, row, train_on_inputs=False, template=None, sequence_len=64, **spec):
    spec = DatasetSpec(path="x", **spec)
    ctx = FormatContext(tok, spec, train_on_inputs, sequence_len, template)
    return format_for(spec)(row, ctx)


def trained_text(tok, ids, labels):
    return tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])


def test_alpaca_masks_the_prompt(tok):
    [(ids, labels)] = run(tok, {"instruction": "Add 2 and 3", "input": "", "output": "5"}, type="alpaca")
    prompt = tok(ALPACA_NO_INPUT.format(instruction="Add 2 and 3"))["input_ids"]
    answer = tok("5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids == prompt + answer
    assert labels == [IGNORE] * len(prompt) + answer


def test_alpaca_train_on_inputs(tok):
    [(ids, labels)] = run(tok, {"instruction": "hi", "output": "yo"}, train_on_inputs=True, type="alpaca")
    assert labels == ids


def test_completion_trains_every_token_and_splits_long_text(tok):
    text = "the cat sat on the mat " * 30
    pieces = run(tok, {"text": text}, type="completion", sequence_len=32)
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    assert [i for piece, _ in pieces for i in piece] == ids
    assert all(len(p) <= 32 and p == lab for p, lab in pieces)


def test_input_output_segments(tok):
    row = {"segments": [{"text": "Q: 2+2?\n", "label": False}, {"text": "A: 4", "label": True}, {"text": "<|im_end|>", "label": True}]}
    [(ids, labels)] = run(tok, row, type="input_output")
    q = tok("Q: 2+2?\n", add_special_tokens=False)["input_ids"]
    a = tok("A: 4", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ids == q + a and labels == [IGNORE] * len(q) + a


def test_pretokenized_with_mask(tok):
    [(ids, labels)] = run(tok, {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "attention_mask": [1, 1, 1, 0]})
    assert ids == [5, 6, 7, 8] and labels == [-100, 6, 7, -100]


CONVERSATION = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Capital of France?"},
    {"from": "gpt", "value": "Paris."},
    {"from": "human", "value": "And Italy?"},
    {"from": "gpt", "value": "Rome."},
]


def chat(tok, **spec):
    row = {"conversations": CONVERSATION}
    spec = {"type": "chat_template", "field_messages": "conversations",
            "message_property_mappings": {"role": "from", "content": "value"}, **spec}  # fmt: skip
    return run(tok, row, template=tok.chat_template, sequence_len=256, **spec)[0]


def test_chat_template_trains_assistant_turns_and_their_eos(tok):
    ids, labels = chat(tok)
    pieces, current = [], []
    for i, label in zip(ids, labels, strict=True):
        if label != IGNORE:
            current.append(i)
        elif current:
            pieces.append(tok.decode(current))
            current = []
    if current:
        pieces.append(tok.decode(current))
    assert pieces == ["Paris.<|im_end|>", "Rome.<|im_end|>"]
    assert tok.decode(ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.parametrize(
    ("train_on_eos", "expected"),
    [("none", "Paris.Rome."), ("last", "Paris.Rome.<|im_end|>"), ("turn", "Paris.<|im_end|>Rome.<|im_end|>")],
)
def test_chat_template_train_on_eos(tok, train_on_eos, expected):
    ids, labels = chat(tok, train_on_eos=train_on_eos)
    assert trained_text(tok, ids, labels) == expected


def test_chat_template_all_eos_and_roles_to_train(tok):
    ids, labels = chat(tok, train_on_eos="all", roles_to_train=["assistant", "user"])
    text = trained_text(tok, ids, labels)
    assert text.count("<|im_end|>") == 5  # every turn's end, the system turn's too
    assert "Capital of France?" in text and "Be brief." not in text


def test_chat_template_roles_aliases_and_drop_system(tok):
    ids, _ = chat(tok, drop_system_message=True)
    assert "Be brief." not in tok.decode(ids)


def test_malformed_rows_name_file_and_line(tmp_path, tok):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}],
                                  "dataset_prepared_path": None}, tmp_path / "r.yaml", check_files=False).recipe  # fmt: skip
    with pytest.raises(UserError, match=r"d.jsonl line 2: missing field 'output'"):
        tokenize_with_cache(recipe, tok)
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", oops}\n')
    with pytest.raises(UserError, match=r"d.jsonl line 2: not valid JSON"):
        tokenize_with_cache(recipe, tok)


def test_zero_usable_examples_is_a_clear_error(tmp_path, tok):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "word " * 100, "output": "x"}])
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}],
                                  "sequence_len": 16, "dataset_prepared_path": None}, tmp_path / "r.yaml",
                                 check_files=False).recipe  # fmt: skip
    with pytest.raises(UserError, match="no usable training examples.*1 longer than sequence_len 16"):
        tokenize_with_cache(recipe, tok)


def test_cache_hit_does_no_tokenization(tmp_path, tok, monkeypatch):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data import prepare

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(20)])
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}],
                                  "dataset_prepared_path": str(tmp_path / "prep")}, tmp_path / "r.yaml",
                                 check_files=False).recipe  # fmt: skip
    first, stats = prepare.tokenize_with_cache(recipe, tok)
    assert stats["cache_hit"] is False
    calls = []
    monkeypatch.setattr(prepare, "tokenize_group", lambda *a, **k: calls.append(a) or [])
    second, stats = prepare.tokenize_with_cache(recipe, tok)
    assert stats["cache_hit"] is True and calls == []
    assert second == first
    # changing the data changes the key: no stale cache
    write_jsonl(path, [{"instruction": "new", "output": "data"}])
    monkeypatch.undo()
    third, stats = prepare.tokenize_with_cache(recipe, tok)
    assert stats["cache_hit"] is False and len(third["train"]) == 1


def test_jeopardy_prompts_as_axolotl_does_and_trains_what_is_the_answer(tok):
    from llmtune.train.data.formats import JEOPARDY

    row = {"question": "This river flows through Cairo", "category": "GEOGRAPHY", "answer": "the Nile"}
    [(ids, labels)] = run(tok, row, type="jeopardy")
    prompt = JEOPARDY.format(instruction=row["question"], input=row["category"])
    assert tok.decode(ids).startswith(prompt.split("\n")[0]) and "### Input:\nGEOGRAPHY" in tok.decode(ids)
    assert trained_text(tok, ids, labels).startswith("what is the Nile")
    [(ids, _)] = run(tok, {**row, "category": ""}, type="jeopardy")  # no category: Alpaca's prompt without input
    assert "### Input:" not in tok.decode(ids) and "describes a task" in tok.decode(ids)
    with pytest.raises(RowError, match="missing field 'answer'"):
        run(tok, {"question": "q", "category": "c"}, type="jeopardy")
