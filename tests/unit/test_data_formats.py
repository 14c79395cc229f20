"""Each dataset type yields exactly the expected labels, checked token by token."""

from __future__ import annotations

import pytest
from tiny import load_tokenizer, pieces, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.data import CONVERSATIONS, LEGACY_TYPES, DatasetSpec
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
    row = {
        "segments": [
            {"text": "Q: 2+2?\n", "label": False},
            {"text": "A: 4", "label": True},
            {"text": "<|im_end|>", "label": True},
        ]
    }
    [(ids, labels)] = run(tok, row, type="input_output")
    q = tok("Q: 2+2?\n", add_special_tokens=False)["input_ids"]
    a = tok("A: 4", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert ids == q + a and labels == [IGNORE] * len(q) + a


def test_input_output_segments_without_a_label_flag_are_row_errors(tok):
    """Axolotl reads segment["label"] (a KeyError without one); llmtune trained such a segment, prompt and all, and
    a label of "no" too (a non-empty string)."""
    for segment, said in (({"text": "Q: hi\n"}, r"segments\[0\] has no 'label'"),
                          ({"text": "Q: hi\n", "label": "no"}, r"segments\[0\] has label 'no'")):  # fmt: skip
        with pytest.raises(RowError, match=said):
            run(tok, {"segments": [segment, {"text": "A", "label": True}]}, type="input_output")


def test_pretokenized_with_mask(tok):
    [(ids, labels)] = run(tok, {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "attention_mask": [1, 1, 1, 0]})
    assert ids == [5, 6, 7, 8] and labels == [-100, 6, 7, -100]
    # an id the embeddings don't have failed in training (IndexError; on a GPU, a device-side assert)
    size = len(tok)
    for row, said in (({"input_ids": [1, 5, size]}, f"input_ids\\[2\\] is {size}, not one of this tokenizer's"),
                      ({"input_ids": [1, -3]}, "input_ids\\[1\\] is -3"),
                      ({"input_ids": [1, 5], "labels": [-100, size + 7]}, f"labels\\[1\\] is {size + 7}")):  # fmt: skip
        with pytest.raises(RowError, match=said):
            run(tok, row)


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
    assert pieces(tok, ids, labels) == ["Paris.<|im_end|>", "Rome.<|im_end|>"]
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


@pytest.mark.parametrize("name", ["mistral_v1", "mistral_v2v3"])
def test_a_template_that_puts_a_space_before_the_answer_trains_its_first_word(tok, name):
    # byte-level BPE fuses that space with the first word (" Paris"): the token overlaps the answer and trains, as
    # Axolotl's find_turn labels it; it used to start one character early and was masked ("P" lost on every row)
    from llmtune.train.data.templates import FAMILY_TEMPLATES

    row = {"messages": [{"role": "user", "content": "Capital of France?"},
                        {"role": "assistant", "content": "Paris is."}]}  # fmt: skip
    [(ids, labels)] = run(tok, row, template=FAMILY_TEMPLATES[name], sequence_len=256, type="chat_template")
    assert [piece.strip() for piece in pieces(tok, ids, labels)] == [f"Paris is.{tok.eos_token}"]


def test_chat_template_train_on_inputs_trains_every_turn_not_the_headers(tok):
    # Axolotl: every turn becomes trainable (should_train), headers stay masked, the ends follow train_on_eos
    ids, labels = chat(tok, train_on_eos="last")
    assert pieces(tok, ids, labels) == ["Paris.", "Rome.<|im_end|>"]
    row = {"conversations": CONVERSATION}
    spec = {"type": "chat_template", "field_messages": "conversations", "train_on_eos": "turn",
            "message_property_mappings": {"role": "from", "content": "value"}}  # fmt: skip
    [(ids, labels)] = run(tok, row, train_on_inputs=True, template=tok.chat_template, sequence_len=256, **spec)
    trained = pieces(tok, ids, labels)
    assert trained[0] == "Be brief.<|im_end|>" and "Paris.<|im_end|>" in trained and "Rome.<|im_end|>" in trained
    assert not any("<|im_start|>" in piece or "assistant" in piece for piece in trained)


def test_a_message_that_reads_like_its_header_and_an_empty_answer(tok):
    # the user's text "user" is also in its header: the content is labelled, not the header
    row = {"messages": [{"role": "user", "content": "user"}, {"role": "assistant", "content": "assistant"}]}
    [(ids, labels)] = run(tok, row, template=tok.chat_template, sequence_len=256, type="chat_template",
                          roles_to_train=["user", "assistant"])  # fmt: skip
    assert pieces(tok, ids, labels) == ["user<|im_end|>", "assistant<|im_end|>"]
    assert labels[ids.index(tok.convert_tokens_to_ids("<|im_start|>")) + 1] == IGNORE  # the header's "user"
    # an empty answer trains nothing (Axolotl finds no turn), not its end marker and the newline after it
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                        {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Yes."}]}  # fmt: skip
    [(ids, labels)] = run(tok, row, template=tok.chat_template, sequence_len=256, type="chat_template")
    assert pieces(tok, ids, labels) == ["Yes.<|im_end|>"]


def test_chat_template_roles_aliases_and_drop_system(tok):
    ids, _ = chat(tok, drop_system_message=True)
    assert "Be brief." not in tok.decode(ids)


def test_malformed_rows_name_file_and_line(tmp_path, tok):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    path = tmp_path / "d.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n')
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}],
                                  "dataset_prepared_path": ""}, tmp_path / "r.yaml", check_files=False).recipe  # fmt: skip
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
                                  "sequence_len": 16, "dataset_prepared_path": ""}, tmp_path / "r.yaml",
                                 check_files=False).recipe  # fmt: skip
    with pytest.raises(UserError, match="no usable training examples.*1 longer than sequence_len 16") as caught:
        tokenize_with_cache(recipe, tok)
    assert "raise sequence_len" in caught.value.hint and "roles_to_train" not in caught.value.hint


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
    """Alpaca's prompt with the category as input: the Jeopardy preamble Axolotl's prompter declares is read by
    nothing in any release."""
    from llmtune.train.data.formats import ALPACA_WITH_INPUT

    row = {"question": "This river flows through Cairo", "category": "GEOGRAPHY", "answer": "the Nile"}
    [(ids, labels)] = run(tok, row, type="jeopardy")
    prompt = ALPACA_WITH_INPUT.format(instruction=row["question"], input=row["category"])
    assert tok.decode(ids).startswith(prompt) and "Jeopardy" not in tok.decode(ids)
    assert trained_text(tok, ids, labels).startswith("what is the Nile")
    [(ids, _)] = run(tok, {**row, "category": ""}, type="jeopardy")  # no category: Alpaca's prompt without input
    assert "### Input:" not in tok.decode(ids) and "describes a task" in tok.decode(ids)
    with pytest.raises(RowError, match="missing field 'answer'"):
        run(tok, {"question": "q", "category": "c"}, type="jeopardy")
    with pytest.raises(RowError, match="missing field 'category'"):
        run(tok, {"question": "q", "answer": "a"}, type="jeopardy")


# --- Axolotl's older formats: every era's dataset types, checked by decoding exactly what is labelled ---


def sharegpt_row(rows=CONVERSATION):
    return {"conversations": [dict(m) for m in rows]}


# The whole rendering and the labelled runs, per FastChat template (the fixture's EOS is <|im_end|>). As in
# Axolotl: the role prefix (less trailing whitespace) is masked, the rest of an assistant turn trains, then EOS.
SHAREGPT_EXPECTED = {
    "chatml": ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of France?<|im_end|>\n"
               "<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd Italy?<|im_end|>\n"
               "<|im_start|>assistant\nRome.<|im_end|>\n", ["\nParis.<|im_end|>\n", "\nRome.<|im_end|>\n"]),
    "vicuna_v1.1": ("Be brief. USER: Capital of France? ASSISTANT: Paris.</s><|im_end|>USER: And Italy? "
                    "ASSISTANT: Rome.</s><|im_end|>", [" Paris.</s><|im_end|>", " Rome.</s><|im_end|>"]),
    "llama-2": ("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nCapital of France?[/INST] Paris.<|im_end|>"
                "<s> [INST] And Italy?[/INST] Rome.<|im_end|>", [" Paris.<|im_end|>", " Rome.<|im_end|>"]),
    "llama3": ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user"
               "<|end_header_id|>\n\nCapital of France?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
               "Paris.<|eot_id|><|im_end|><|start_header_id|>user<|end_header_id|>\n\nAnd Italy?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nRome.<|eot_id|><|im_end|>",
               ["\n\nParis.<|eot_id|><|im_end|>", "\n\nRome.<|eot_id|><|im_end|>"]),
    "mistral": ("[INST]  Be brief.\nCapital of France?[/INST] Paris.<|im_end|>[INST] And Italy?[/INST] "
                "Rome.<|im_end|>", [" Paris.<|im_end|>", " Rome.<|im_end|>"]),
    "zephyr": ("<|system|>\nBe brief.</s>\n<|user|>\nCapital of France?</s>\n<|assistant|>\nParis.</s>\n<|im_end|>"
               "<|user|>\nAnd Italy?</s>\n<|assistant|>\nRome.</s>\n<|im_end|>",
               ["\nParis.</s>\n<|im_end|>", "\nRome.</s>\n<|im_end|>"]),
}  # fmt: skip


@pytest.mark.parametrize("conversation", sorted(SHAREGPT_EXPECTED))
def test_sharegpt_conversation_renders_and_labels_only_gpt_turns(tok, conversation):
    [(ids, labels)] = run(tok, sharegpt_row(), type="sharegpt", conversation=conversation, sequence_len=512)
    text, trained = SHAREGPT_EXPECTED[conversation]
    assert tok.decode(ids) == text
    assert pieces(tok, ids, labels) == trained


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_every_conversation_trains_the_answers_and_nothing_the_user_wrote(tok, conversation):
    rows = CONVERSATION[1:] if conversation == "gemma" else CONVERSATION  # gemma's template has no system turn
    [(ids, labels)] = run(tok, sharegpt_row(rows), type="sharegpt", conversation=conversation, sequence_len=512)
    trained = "".join(pieces(tok, ids, labels))
    assert "Paris." in trained and "Rome." in trained and trained.count(tok.eos_token) >= 2  # each answer ends
    for prompt in [m["value"] for m in rows if m["from"] != "gpt"]:
        assert prompt in tok.decode(ids) and prompt not in trained


def test_conversation_names_match_the_recipe_schema():
    from llmtune.train.data.sharegpt import CONVERSATIONS as TEMPLATES

    assert set(CONVERSATIONS) == set(TEMPLATES)


def test_sharegpt_default_is_vicuna_and_the_old_spellings_are_the_same_format(tok):
    expected = run(tok, sharegpt_row(), type="sharegpt", conversation="vicuna_v1.1", sequence_len=512)
    for kind in ("sharegpt", "sharegpt:chat", "sharegpt_simple"):
        assert run(tok, sharegpt_row(), type=kind, sequence_len=512) == expected, kind
    # no system message: vicuna's own system prompt, masked
    [(ids, labels)] = run(tok, sharegpt_row(CONVERSATION[1:]), type="sharegpt", sequence_len=512)
    assert (
        tok.decode(ids).startswith("A chat between a curious user")
        and pieces(tok, ids, labels)[0] == " Paris.</s><|im_end|>"
    )


@pytest.mark.parametrize(
    ("kind", "row"),
    [
        (
            "sharegpt.load_role",
            {"conversations": [{"role": "human", "value": "Capital of France?"}, {"role": "gpt", "value": "Paris."}]},
        ),
        (
            "sharegpt.load_guanaco",
            {
                "conversations": [
                    {"role": "prompter", "text": "Capital of France?"},
                    {"role": "assistant", "text": "Paris."},
                ]
            },
        ),
        (
            "sharegpt.load_ultrachat",
            {
                "messages": [
                    {"role": "user", "content": "Capital of France?"},
                    {"role": "assistant", "content": "Paris."},
                ]
            },
        ),
        (
            "sharegpt",
            {
                "conversations": [
                    {"role": "user", "content": "Capital of France?"},
                    {"role": "assistant", "content": "Paris."},
                ]
            },
        ),
    ],
)
def test_sharegpt_loaders_read_their_row_shapes(tok, kind, row):
    [(ids, labels)] = run(tok, row, type=kind, conversation="chatml", sequence_len=512)
    assert pieces(tok, ids, labels) == ["\nParis.<|im_end|>\n"]
    assert "<|im_start|>user\nCapital of France?<|im_end|>" in tok.decode(ids)


def test_sharegpt_jokes(tok):
    [(ids, labels)] = run(tok, {"title": "Cats", "text": "A cat walks in.", "explanation": "Because."}, type="sharegpt_jokes",
                          conversation="chatml", sequence_len=512)  # fmt: skip
    assert pieces(tok, ids, labels) == ["\nCats A cat walks in.<|im_end|>\n", "\nBecause.<|im_end|>\n"]
    assert "Tell me a joke." in tok.decode(ids)


def test_sharegpt_field_human_field_model_roles_and_weight(tok):
    row = {"conversations": [{"from": "asker", "value": "Capital of France?"}, {"from": "bot", "value": "Paris."},
                             {"from": "asker", "value": "And Italy?"}, {"from": "bot", "value": "Rome.", "weight": 0}]}  # fmt: skip
    [(ids, labels)] = run(tok, row, type="sharegpt", conversation="chatml", field_human="asker", field_model="bot",
                          sequence_len=512)  # fmt: skip
    assert pieces(tok, ids, labels) == ["\nParis.<|im_end|>\n"]  # weight 0: Rome. is masked
    row = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "tool", "value": "42"},
            {"from": "gpt", "value": "It is 42."},
        ]
    }
    [(ids, labels)] = run(tok, row, type="sharegpt", conversation="chatml", sequence_len=512)
    assert "<|im_start|>tool\n42<|im_end|>" in tok.decode(ids) and pieces(tok, ids, labels) == [
        "\nIt is 42.<|im_end|>\n"
    ]
    [(ids, labels)] = run(
        tok, row, type="sharegpt", conversation="chatml", roles={"output": ["tool"]}, sequence_len=512
    )
    assert pieces(tok, ids, labels) == ["\n42<|im_end|>\n", "\nIt is 42.<|im_end|>\n"]
    with pytest.raises(RowError, match="neither human nor gpt"):
        run(tok, row, type="sharegpt", conversation="llama-2", sequence_len=512)
    with pytest.raises(RowError, match="at least two messages"):
        run(tok, {"conversations": [{"from": "human", "value": "Hi"}]}, type="sharegpt")


def test_sharegpt_train_on_inputs_trains_everything(tok):
    [(ids, labels)] = run(tok, sharegpt_row(), train_on_inputs=True, type="sharegpt", conversation="chatml",
                          sequence_len=512)  # fmt: skip
    assert labels == ids


# type, row, the full text (EOS is <|im_end|>), the labelled text
ALPACA_ROW = {"instruction": "Add the numbers", "input": "2 3", "output": "5"}
SYS = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
SYS_IN = ("Below is an instruction that describes a task, paired with an input that provides further context. Write a "
          "response that appropriately completes the request.")  # fmt: skip
CHAT_SYS = ("Below is an instruction from a USER that describes a task. The ASSISTANT writes a response that "
            "appropriately and concisely completes the request.\n\n")  # fmt: skip
CONTEXT = "Use the following contextual information to concisely answer the question.\n"
LEGACY_CASES = [
    ("alpaca:chat", ALPACA_ROW, f"SYSTEM: {SYS_IN}\nUSER: Add the numbers\n2 3\nASSISTANT:5", "5"),
    ("alpaca:chatml", {"instruction": "Hi", "output": "Yo"},
     f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo", "Yo"),
    ("alpaca:phi", {"instruction": "Hi", "output": "Yo"}, f"<|system|>\n{SYS}<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nYo", "Yo"),
    ("alpaca_chat", {"instruction": "Hi", "output": "Yo"}, f"SYSTEM: {SYS}\nUSER: Hi\nASSISTANT:Yo", "Yo"),
    ("alpaca_chat.load_qa", {"question": "Why?", "answer": "Because"}, f"SYSTEM: {CHAT_SYS}\nUSER: Why?\nASSISTANT:Because",
     "Because"),
    ("alpaca_chat.load_concise", {"instruction": "Hi", "output": "Yo"}, f"SYSTEM: {CHAT_SYS}\nUSER: Hi\nASSISTANT:Yo", "Yo"),
    ("alpaca_chat.load_camel_ai", {"message_1": "Hi", "message_2": "Yo"}, f"SYSTEM: {CHAT_SYS}\nUSER: Hi\nASSISTANT:Yo", "Yo"),
    ("alpaca_chat.load_no_prompt", {"instruction": "Hi", "output": "Yo"}, "USER: Hi\nASSISTANT:Yo", "Yo"),
    ("alpaca_instruct", {"instruction": "Hi", "output": "Yo"}, f"{SYS}\n\n### Instruction:\nHi\n\n### Response:\nYo", "Yo"),
    ("alpaca_instruct.load_no_prompt", {"instruction": "Hi", "output": "Yo"}, "### Instruction:\nHi\n\n### Response:\nYo", "Yo"),
    ("alpaca_w_system", {"system": "Be kind.", "instruction": "Hi", "output": "Yo"}, "SYSTEM: Be kind.\nUSER: Hi\nASSISTANT:Yo", "Yo"),
    ("alpaca_w_system.load_instruct", {"system": "Be kind.", "instruction": "Hi", "input": "x", "output": "Yo"},
     "Be kind.\n\n### Instruction:\nHi\n\n### Input:\nx\n\n### Response:\nYo", "Yo"),
    ("alpaca_w_system.load_open_orca", {"system_prompt": "Be kind.", "question": "Hi", "response": "Yo"},
     "### System:\nBe kind.\n### Human:\nHi\n### Assistant:\nYo", "Yo"),
    ("alpaca_w_system.load_open_orca_chatml", {"system_prompt": "Be kind.", "question": "Hi", "response": "Yo"},
     "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo", "Yo"),
    ("orcamini", {"system_prompt": "Be kind.", "question": "Hi", "response": "Yo"},
     "### System:\nBe kind.\n\n### User:\nHi\n\n### Response:\nYo", "Yo"),
    ("oasst", {"INSTRUCTION": "Hi", "RESPONSE": "Yo"}, f"{SYS}\n\n### Instruction:\nHi\n\n### Response:\nYo", "Yo"),
    ("oasst:chat", {"INSTRUCTION": "Hi", "RESPONSE": "Yo"}, f"SYSTEM: {SYS}\nUSER: Hi\nASSISTANT:Yo", "Yo"),
    ("gpteacher", {"instruction": "Hi", "input": "x", "response": "Yo"},
     f"{SYS_IN}\n\n### Instruction:\nHi\n\n### Input:\nx\n\n### Response:\nYo", "Yo"),
    ("explainchoice", {"question": "Pick", "choices": ["a", "b"], "explanation": "a, since"},
     'Choose the answer that best answers the question. Explain your reasoning.\n\n\n### Instruction:\nPick\n\n'
     '### Input:\n- "a"\n- "b"\n\n### Response:\na, since', "a, since"),
    ("concisechoice", {"question": "Pick", "choices": ["a", "b"], "solution": "a"},
     'Choose the answer that best answers the question. Be concise in your response.\n\nUSER: Pick\n- "a"\n- "b"\n'
     "ASSISTANT:a", "a"),
    ("summarizetldr", {"article": "Long text.", "summary": "Short."},
     "USER: Summarize the following article as a TL;DR.\nLong text.\nASSISTANT:Short.", "Short."),
    ("context_qa", {"article": "Sky is blue.", "question": "Colour?", "answer": "Blue"},
     f"SYSTEM: {CONTEXT}\nUSER: Sky is blue.\n===\nColour?\nASSISTANT:Blue", "Blue"),
    ("context_qa.load_v2", {"context": "Sky is blue.", "question": "Colour?", "answer": "Blue"},
     "Context: Sky is blue.\nQuestion: Colour?\nAnswer: Blue", "Answer: Blue"),
    ("context_qa.load_404", {"article": "Sky is blue.", "unanswerable_question": "Price?"},
     f"SYSTEM: {CONTEXT}\nUSER: Sky is blue.\n===\nPrice?\nASSISTANT:The context provided does not contain any "
     "information about your inquiry. Therefore, I'm unable to answer your question based on the given context.",
     "The context provided does not contain any information about your inquiry. Therefore, I'm unable to answer "
     "your question based on the given context."),
    ("reflection:chat", {"instruction": "Hi", "output": "O", "reflection": "R", "corrected": "C"},
     None, "\nTHOUGHT: O\nASSISTANT REFLECTION: R\nASSISTANT:"),
    ("reflection", {"instruction": "Hi", "output": "O", "reflection": "R", "corrected": "C"},
     None, "### Thought:\nO\n\n### Agent Reflection:\nR\n\n### Final Response:\nC"),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "row", "text", "answer"), LEGACY_CASES, ids=[c[0] for c in LEGACY_CASES])
def test_legacy_instruction_formats_label_only_the_answer_and_eos(tok, kind, row, text, answer):
    [(ids, labels)] = run(tok, row, type=kind, sequence_len=1024)
    if text is not None:
        assert tok.decode(ids) == text + tok.eos_token
    assert pieces(tok, ids, labels) == [answer + tok.eos_token]


def test_alpaca_chat_conversation_picks_the_prompt_style(tok):
    [(ids, _)] = run(tok, {"instruction": "Hi", "output": "Yo"}, type="alpaca_chat", conversation="chatml")
    assert tok.decode(ids).startswith("<|im_start|>system\n")


def test_user_defined_format_as_axolotl_read_it(tok):
    form = {"field_instruction": "q", "field_output": "a", "format": "[INST] {instruction} {input} [/INST]",
            "no_input_format": "[INST] {instruction} [/INST]", "system_prompt": "Be kind.",
            "system_format": "<<SYS>>{system}<</SYS>>"}  # fmt: skip
    [(ids, labels)] = run(tok, {"q": "Hi", "a": "Yo"}, type=form)
    assert tok.decode(ids) == "<<SYS>>Be kind.<</SYS>>[INST] Hi [/INST]Yo" + tok.eos_token
    assert pieces(tok, ids, labels) == ["Yo" + tok.eos_token]
    # the row's `system` field wins over system_prompt; with an input, `format` is used
    [(ids, _)] = run(tok, {"q": "Hi", "input": "x", "a": "Yo", "system": "Row says."}, type=form)
    assert tok.decode(ids).startswith("<<SYS>>Row says.<</SYS>>[INST] Hi x [/INST]Yo")
    # Axolotl's defaults for what the mapping leaves out
    [(ids, labels)] = run(tok, {"instruction": "Hi", "output": "Yo"}, type={"field_system": "none"})
    assert tok.decode(ids) == "Hi Yo" + tok.eos_token and pieces(tok, ids, labels) == ["Yo" + tok.eos_token]


def test_chat_template_with_the_older_field_names(tok):
    row = {"dialog": [{"speaker": "system", "text": "Be brief."}, {"speaker": "asker", "text": "Capital of France?"},
                      {"speaker": "bot", "text": "Paris."}, {"speaker": "asker", "text": "And Italy?"},
                      {"speaker": "bot", "text": "Rome."}]}  # fmt: skip
    spec = {"type": "chat_template", "field_messages": "dialog", "message_field_role": "speaker",
            "message_field_content": "text", "roles": {"user": ["asker"], "assistant": ["bot"]}}  # fmt: skip
    [(ids, labels)] = run(tok, row, template=tok.chat_template, sequence_len=256, **spec)
    assert pieces(tok, ids, labels) == ["Paris.<|im_end|>", "Rome.<|im_end|>"]
    [(ids, labels)] = run(tok, row, template=tok.chat_template, sequence_len=256, roles_to_train=["user"],
                          train_on_eos="none", **spec)  # fmt: skip
    assert pieces(tok, ids, labels) == ["Capital of France?", "And Italy?"]


@pytest.mark.parametrize("kind", [*LEGACY_TYPES, "sharegpt:chat", "sharegpt_simple", "sharegpt_simple.load_role",
                                  "alpaca:chat", "alpaca:chatml", "alpaca:phi", "alpaca:instruct", "oasst:chat", "gpteacher:chatml",
                                  "reflection:chat", "explainchoice:chat"])  # fmt: skip
def test_every_legacy_type_validates_and_has_a_converter(kind):
    spec = DatasetSpec(path="x", type=kind)
    assert format_for(spec) is not None
    assert spec.type == {"sharegpt:chat": "sharegpt", "sharegpt_simple": "sharegpt", "alpaca:instruct": "alpaca",
                         "sharegpt_simple.load_role": "sharegpt.load_role"}.get(kind, kind)  # fmt: skip


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "sharegpt", "conversation": "vicuna_v9"}, "conversation\n.*'vicuna_v9' is not one of"),
        ({"type": "alpaca_chat", "conversation": "vicuna_v1.1"}, "prompt style"),
        ({"type": "alpaca:bogus"}, "prompt style is one of"),
        ({"type": "sharegpt.load_multirole"}, "Axolotl's dataset type 'sharegpt.load_multirole' is not supported"),
        ({"type": "sharegtp"}, "unknown dataset type 'sharegtp'"),
        ({"type": "sharegpt", "shards": 2, "shards_idx": 2}, "shards_idx 2 needs shards above it"),
    ],
)
def test_legacy_settings_are_checked(spec, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        DatasetSpec(path="x", **spec)


def test_malformed_sharegpt_row_names_file_and_line(tmp_path, tok):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    path = write_jsonl(tmp_path / "chats.jsonl", [sharegpt_row(), {"conversations": [{"from": "human"}]}])
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "sharegpt",
                                  "conversation": "chatml"}], "dataset_prepared_path": ""}, tmp_path / "r.yaml",
                                 check_files=False).recipe  # fmt: skip
    with pytest.raises(UserError, match=r"chats.jsonl line 2: conversations\[0\] needs 'from' and a 'value' string"):
        tokenize_with_cache(recipe, tok)


def test_builder_path_with_local_data_files_and_shards_idx(tmp_path):
    from llmtune.train.data.sources import read_rows, reads_with_datasets

    path = write_jsonl(tmp_path / "d.jsonl", [{"n": i} for i in range(6)])
    spec = DatasetSpec(path="json", data_files=[str(path)], type="completion", shards=3, shards_idx=1)
    assert not reads_with_datasets(spec)  # local JSON lines: read here, line by line, without `datasets`
    rows = list(read_rows(spec, "datasets[0]"))
    # the rows Axolotl keeps: datasets' shuffle by the recipe's seed, then the contiguous shard, in that order
    from datasets import Dataset

    for seed, shards, index in ((42, 3, 1), (7, 4, 3), (42, 4, 0)):
        rows = list(read_rows(spec.model_copy(update={"shards": shards, "shards_idx": index}), "datasets[0]", seed=seed))
        kept = Dataset.from_list([{"n": i} for i in range(6)]).shuffle(seed=seed).shard(num_shards=shards, index=index)
        assert [row["n"] for row, _ in rows] == kept["n"] and len(kept) == 6 // shards + (index < 6 % shards)
    assert all(where.endswith(f"d.jsonl line {row['n'] + 1}") for row, where in rows)
    assert reads_with_datasets(DatasetSpec(path="csv", data_files=[str(path)], type="completion"))
    assert reads_with_datasets(DatasetSpec(path="json", data_files=["missing.jsonl"], type="completion"))


def test_sharegpt_chatml_default_system_and_default_system_message(tmp_path, tok):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    [(ids, labels)] = run(tok, sharegpt_row(CONVERSATION[1:3]), type="sharegpt", conversation="chatml")
    assert tok.decode(ids).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user")
    assert pieces(tok, ids, labels) == ["\nParis.<|im_end|>\n"]

    path = write_jsonl(tmp_path / "d.jsonl", [sharegpt_row(CONVERSATION[1:3])])

    def first_text(**keys):
        recipe = recipe_from_mapping({"base_model": "m", "datasets": [{"path": str(path), "type": "sharegpt",
                                      "conversation": "chatml"}], "dataset_prepared_path": "", **keys},
                                     tmp_path / "r.yaml", check_files=False).recipe  # fmt: skip
        groups, _ = tokenize_with_cache(recipe, tok)
        return tok.decode(groups["train"][0]["input_ids"])

    # Axolotl re-registered its chatml template with default_system_message when chat_template was chatml
    assert first_text(chat_template="chatml", default_system_message="Answer in French.").startswith(
        "<|im_start|>system\nAnswer in French.<|im_end|>\n"
    )
    assert "You are a helpful assistant." in first_text(default_system_message="Answer in French.")


def test_a_list_of_names_reads_each_configuration(monkeypatch):
    import datasets

    from llmtune.train.data.sources import read_rows

    calls = []

    def fake_load(path, name=None, **kwargs):
        calls.append((path, name, kwargs["split"]))
        return [{"text": f"{name}-{i}"} for i in range(2)]

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    spec = DatasetSpec(path="org/code", name=["ruby", "python"], split="train", type="completion")
    rows = list(read_rows(spec, "datasets[0]"))
    assert calls == [("org/code", "ruby", "train"), ("org/code", "python", "train")]
    assert [row["text"] for row, _ in rows] == ["ruby-0", "ruby-1", "python-0", "python-1"]
    assert rows[2][1] == "org/code python (train) row 0"


def test_llama2_chat_trains_each_answer_and_its_eos_text(tok):
    [(ids, labels)] = run(tok, sharegpt_row(), type="llama2_chat", sequence_len=512)
    assert tok.decode(ids) == ("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nCapital of France?[/INST] Paris. </s><s>"
                               "[INST] And Italy? [/INST] Rome. </s><s>")  # fmt: skip
    assert [p.strip() for p in pieces(tok, ids, labels)] == ["Paris. </s>", "Rome. </s>"]
    [(ids, _)] = run(tok, sharegpt_row(CONVERSATION[1:4]), type="llama2_chat", sequence_len=512)
    assert "You are a helpful, respectful and honest assistant." in tok.decode(ids)  # Llama 2's default system
    assert "And Italy?" not in tok.decode(ids)  # a trailing question has no answer to train


def test_metharme_trains_the_generation_and_three_eos(tok):
    [(ids, labels)] = run(tok, {"prompt": "<|user|>Hi<|model|>", "generation": "Hello"}, type="metharme")
    assert pieces(tok, ids, labels) == ["Hello" + tok.eos_token * 3]


def test_pygmalion_trains_bot_turns(tok):
    row = {"conversations": [{"role": "system", "value": "A cat.\n<START>"}, {"role": "human", "value": "Hi"},
                             {"role": "bot", "value": "Meow"}]}  # fmt: skip
    [(ids, labels)] = run(tok, row, type="pygmalion")
    assert tok.decode(ids) == "<|system|>Persona: A cat.<|user|> Hi<|model|> Meow" + tok.eos_token
    assert pieces(tok, ids, labels) == [" Meow" + tok.eos_token]


def test_creative_acr_loaders(tok):
    row = {"instruction": "Why is the sky blue?", "answer": "Dunno", "revision": "Rayleigh scattering.",
           "scores": {"refusal": 2}, "critiques": {"refusal": {"explanation": "refused"}}}  # fmt: skip
    [(ids, labels)] = run(tok, row, type="creative_acr.load_answer", sequence_len=1024)
    assert tok.decode(ids).startswith("Answer the following question in a comprehensive")
    assert pieces(tok, ids, labels) == ["Rayleigh scattering." + tok.eos_token]
    [(ids, labels)] = run(tok, row, type="creative_acr.load_critique", sequence_len=1024)
    assert pieces(tok, ids, labels) == ["refusal: 2\nrefusal:\n  explanation: refused\n" + tok.eos_token]
    assert tok.decode(ids).endswith(
        "Question: Why is the sky blue?\nAnswer: Dunno\n\nASSISTANT:" + pieces(tok, ids, labels)[0]
    )
    [(ids, labels)] = run(tok, row, type="creative_acr.load_revise", sequence_len=1024)
    assert pieces(tok, ids, labels) == ["Rayleigh scattering." + tok.eos_token]
    assert "Evaluation:\nrefusal: 2\n" in tok.decode(ids)


def test_sharegpt_glaive_rows(tok):
    row = {"system": "SYSTEM: You can call get_time.", "chat": "USER: What time is it? ASSISTANT: <functioncall> "
           "get_time <|endoftext|> FUNCTION RESPONSE: 12:00 ASSISTANT: It is noon. <|endoftext|>"}  # fmt: skip
    [(ids, labels)] = run(tok, row, type="sharegpt.load_glaive", sequence_len=512)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou can call get_time.<|im_end|>\n<|im_start|>user\nWhat time is it?")
    assert "<|im_start|>tool\n12:00<|im_end|>" in text  # the function's answer is rendered and masked
    trained = pieces(tok, ids, labels)
    assert trained == ["\n<functioncall> get_time <|endoftext|><|im_end|>\n" + tok.eos_token,
                       "\nIt is noon. <|endoftext|><|im_end|>\n" + tok.eos_token]  # fmt: skip


def test_sharegpt_roles_with_chat_template_keys(tok):
    row = {"conversations": [{"from": "asker", "value": "Hi"}, {"from": "bot", "value": "Yo"}]}
    [(ids, labels)] = run(
        tok, row, type="sharegpt", conversation="chatml", roles={"user": ["asker"], "assistant": ["bot"]}
    )
    assert pieces(tok, ids, labels) == ["\nYo<|im_end|>\n"] and "<|im_start|>user\nHi" in tok.decode(ids)


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "sharegpt", "conversation": "chatml"},
        {"type": "sharegpt.load_ultrachat"},
        {"type": "sharegpt", "field_messages": "dialog", "roles": {"output": ["tool"]}},
        {"type": "alpaca:chat"},
        {"type": "alpaca_chat", "conversation": "chatml"},
        {"type": {"field_instruction": "q", "format": "[INST] {instruction} [/INST]"}},
    ],
)
def test_a_dataset_entry_reloads_from_the_plan_as_it_was(spec):
    """The ranks read the recipe back from plan.json (every key, defaults included): the entry must not change."""
    first = DatasetSpec(path="x", **spec)
    again = DatasetSpec.model_validate(first.model_dump(mode="json"))
    assert again == first
    assert again.field_messages == first.field_messages != ("messages" if spec["type"] == "sharegpt" else None)


def test_excess_length_strategy_raise_names_the_row(tmp_path, tok):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "a", "output": "b"},
                                              {"instruction": "word " * 100, "output": "x"}])  # fmt: skip
    raw = {"base_model": "m", "datasets": [{"path": str(path), "type": "alpaca"}], "sequence_len": 80,
           "excess_length_strategy": "raise", "dataset_prepared_path": ""}  # fmt: skip
    recipe = recipe_from_mapping(raw, tmp_path / "r.yaml", check_files=False).recipe
    with pytest.raises(UserError, match=r"d.jsonl line 2: \d+ tokens, longer than sequence_len 80 .*raise") as caught:
        tokenize_with_cache(recipe, tok)
    assert "\n" not in caught.value.message and "truncate" in caught.value.hint
    recipe = recipe_from_mapping({**raw, "sequence_len": 512}, tmp_path / "r.yaml", check_files=False).recipe
    groups, stats = tokenize_with_cache(recipe, tok)  # nothing too long: nothing raised
    assert len(groups["train"]) == 2


END_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} [END]\n{% endfor %}"


@pytest.mark.parametrize("keys, why", [
    ({}, "is 5 tokens to this tokenizer"),
    ({"tokens": ["[END]"]}, "not a special one"),
    ({"tokens": ["[END]"], "special_tokens": {"additional_special_tokens": ["[END]"]}}, None),
    ({"tokens": ["[END]"], "eot_tokens": ["[END]"]}, None),
    ({"datasets": [{"path": "d.jsonl", "type": "chat_template", "train_on_eos": "none"}]}, None),  # asked for
])  # fmt: skip
def test_a_turn_terminator_that_never_trains_is_said_once(tmp_path, keys, why, capsys):
    from tiny import TOKENIZER_DIR

    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache
    from llmtune.train.model.load import load_tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "user", "content": "Hi"},
                                                             {"role": "assistant", "content": "Hello"}]}] * 2)
    datasets = [{**spec, "path": str(path)} for spec in keys.pop("datasets", [{"type": "chat_template"}] * 2)]
    raw = {"base_model": str(TOKENIZER_DIR), "datasets": datasets, "chat_template": "jinja",
           "chat_template_jinja": END_TEMPLATE, "dataset_prepared_path": "", **keys}  # fmt: skip
    recipe = recipe_from_mapping(raw, tmp_path / "r.yaml", check_files=False).recipe
    tokenizer = load_tokenizer(recipe, str(TOKENIZER_DIR))
    assert len(tokenizer.encode("[END]", add_special_tokens=False)) == (1 if "tokens" in keys else 5)
    groups, _ = tokenize_with_cache(recipe, tokenizer)
    notes = [line for line in capsys.readouterr().err.splitlines() if "[END]" in line]
    end_trained = any(label != IGNORE and tokenizer.decode([label]) == "[END]"
                      for label in groups["train"][0]["labels"])  # fmt: skip
    if why is None:
        assert notes == []
        assert end_trained == ("train_on_eos" not in str(datasets))
        return
    assert len(notes) == 1 and why in notes[0] and "eot_tokens: ['[END]']" in notes[0]  # once for both datasets
    assert not end_trained


# Qwen3's way (Axolotl's qwen3.jinja does the same): an answer before the last question loses its reasoning, the
# turns after it get a thinking block (empty when there is none), and `<think>` inside a content is split out.
QWEN3_LIKE = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}"
    "{%- endif %}{%- endfor %}{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set content = m.content %}"
    "{%- set reasoning = m.reasoning_content or '' %}{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content"
    " + '<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n' }}{%- endif %}"
)


@pytest.mark.parametrize(
    ("second", "expected"),
    [
        ({"role": "assistant", "content": "a2"}, ["a1<|im_end|>", "a2<|im_end|>"]),  # (not the empty block)
        ({"role": "assistant", "content": "<think>r2</think>a2"}, ["a1<|im_end|>", "r2\n</think>\n\na2<|im_end|>"]),
        ({"role": "assistant", "content": "a2", "reasoning_content": "r2"}, ["a1<|im_end|>",
                                                                             "r2\n</think>\n\na2<|im_end|>"]),
    ],
)  # fmt: skip
def test_a_template_that_renders_earlier_turns_differently_later_trains_every_answer(tok, second, expected):
    """Rendering turn by turn can't place these labels (an earlier answer changes once a question follows); they are
    found in the whole conversation instead, as Axolotl does: every answer trains, the last with its reasoning."""
    messages = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>r1</think>a1"},
                {"role": "user", "content": "q2"}, second]  # fmt: skip
    [(ids, labels)] = run(tok, {"messages": messages}, template=QWEN3_LIKE, sequence_len=256, type="chat_template")
    assert tok.decode(ids).startswith("<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>")
    assert pieces(tok, ids, labels) == expected


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}{% for m in messages %}"
    "<|im_start|>{{ m.role }}\n{% if m.tool_calls %}CALL {{ m.tool_calls | tojson }}{% endif %}{{ m.content }}"
    "{% if m.name %} ({{ m.name }}){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_tool_calls_and_a_system_column_reach_the_template_and_tool_calls_train(tok):
    """What Axolotl passes to the chat template: the row's `tools` (a list or its JSON text), every other key of a
    message (tool_calls, name, ...), and the row's `system` first where the conversation has none. An assistant turn
    that only calls a tool trains its call."""
    call = [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    row = {"system": "Be brief.", "tools": '[{"type": "function", "function": {"name": "weather"}}]',
           "messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": call},
                        {"role": "tool", "content": "sunny", "name": "weather"},
                        {"role": "assistant", "content": "Sunny."}]}  # fmt: skip
    [(ids, labels)] = run(tok, row, template=TOOLS_TEMPLATE, sequence_len=512, type="chat_template")
    text = tok.decode(ids)
    assert text.startswith('<|im_start|>system\nTOOLS [{"type": "function", "function": {"name": "weather"}}]')
    assert "<|im_start|>system\nBe brief.<|im_end|>" in text and "sunny (weather)<|im_end|>" in text
    assert pieces(tok, ids, labels) == [f"CALL {__import__('json').dumps(call)}<|im_end|>", "Sunny.<|im_end|>"]
    with pytest.raises(RowError, match="'tools' is text but not JSON"):
        run(tok, {**row, "tools": "[{"}, template=TOOLS_TEMPLATE, sequence_len=512, type="chat_template")


def test_message_training_flags_read_as_axolotl_reads_them_and_mapped_reasoning_trains(tok):
    """message_field_training takes 0/1 as false/true (a parquet or pandas export); a key message_property_mappings
    renames (thought -> reasoning_content) reaches the template and trains with its answer."""
    messages = [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "Bad", "train": 0},
                {"from": "user", "value": "again"}, {"from": "assistant", "value": "Good", "train": 1}]  # fmt: skip
    spec = {"type": "chat_template", "message_property_mappings": {"role": "from", "content": "value"},
            "message_field_training": "train"}  # fmt: skip
    [(ids, labels)] = run(tok, {"messages": messages}, template=tok.chat_template, sequence_len=256, **spec)
    assert pieces(tok, ids, labels) == ["Good<|im_end|>"]
    thinking = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"  # noqa: E501
    mapped = {"role": "from", "content": "value", "reasoning_content": "thought"}
    row = {"messages": [{"from": "user", "value": "hi"}, {"from": "assistant", "value": "ok", "thought": "hmm"}]}
    [(ids, labels)] = run(tok, row, template=thinking, sequence_len=256, type="chat_template",
                          message_property_mappings=mapped)  # fmt: skip
    assert pieces(tok, ids, labels) == ["<think>hmm</think>ok<|im_end|>"]


@pytest.mark.parametrize(("kind", "instead"), [("sharegpt:chatml", "type: sharegpt with conversation: chatml"),
                                               ("chat_template:llama3", "type: chat_template with chat_template: llama3"),
                                               ("completion:chatml", "type: completion")])  # fmt: skip
def test_a_prompt_style_suffix_on_a_type_that_has_none_is_refused_with_what_to_write(kind, instead):
    """Axolotl read `:style` on alpaca-style types only (and `sharegpt:chat` as sharegpt); llmtune used to drop the
    suffix silently (sharegpt:chatml trained in vicuna's format)."""
    with pytest.raises(ValueError, match=instead):
        DatasetSpec(path="x", type=kind)
    assert DatasetSpec(path="x", type="sharegpt:chat").type == "sharegpt"


def test_a_single_file_is_one_split_and_missing_builder_files_are_named(tmp_path):
    """A single file (or path: json with data_files) is the one split 'train', as `datasets` reads it: another split
    is refused (before, the whole file was read: test_datasets' split: test was the training data). A data_files
    name that doesn't exist is named at validation, not reported later as a hub dataset that can't be loaded."""
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.sources import read_rows

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(4)])
    for spec in (DatasetSpec(path=str(path), type="completion", split="test"),
                 DatasetSpec(path="json", data_files=[str(path)], type="completion", split="test")):  # fmt: skip
        with pytest.raises(UserError, match=r"datasets\[0\].split: 'test': .* is read as one split, 'train'"):
            list(read_rows(spec, "datasets[0]"))
    sliced = DatasetSpec(path=str(path), type="completion", split="train[50%:]")
    assert [row["text"] for row, _ in read_rows(sliced, "datasets[0]")] == ["row 2", "row 3"]
    mapping = {"base_model": str(tmp_path), "datasets": [{"path": "json", "data_files": str(tmp_path / "none.jsonl"),
                                                          "type": "completion"}]}  # fmt: skip
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"datasets\[0\].data_files: .*none.jsonl does not exist"):
        recipe_from_mapping(mapping, tmp_path / "r.yaml")
    # and a single file's other split is named when the recipe is read (validate), not first when data is read
    mapping["test_datasets"] = [{"path": str(path), "type": "completion", "split": "test"}]
    mapping["datasets"] = [{"path": str(path), "type": "completion"}]
    with pytest.raises(UserError, match=r"r.yaml: test_datasets\[0\].split: 'test': .* is read as one split"):
        recipe_from_mapping(mapping, tmp_path / "r.yaml")


@pytest.mark.parametrize(("key", "value", "words"), [
    ("format", "<|user|>\n{instruction}\n{context}</s>", "{context} is never filled: only {instruction} and {input}"),
    ("no_input_format", "{instruction} {output}", "{output} is never filled"),
    ("system_format", "<sys>{prompt}</sys>", "{prompt} is never filled: only {system}"),
    ("format", "{instruction} {", "is not a format string"),
])  # fmt: skip
def test_a_custom_format_with_a_placeholder_never_filled_is_refused_when_the_recipe_is_read(key, value, words):
    from pathlib import Path

    from llmtune.recipe.loader import recipe_from_mapping

    raw = {"base_model": "x/y", "datasets": [{"path": "d.jsonl", "type": {"field_instruction": "q", key: value}}]}
    with pytest.raises(UserError, match=rf"datasets\[0\]\.type\.{key}") as caught:
        recipe_from_mapping(raw, Path("r.yaml"), check_files=False)
    assert words in caught.value.message
    fine = {**raw["datasets"][0]["type"], key: "{{literal}} " + ("{system}" if key == "system_format" else "{input}")}
    recipe_from_mapping({**raw, "datasets": [{"path": "d.jsonl", "type": fine}]}, Path("r.yaml"), check_files=False)


def test_a_number_where_text_is_read_is_its_digits_and_a_csv_s_empty_cell_is_missing(tok):
    """A CSV reader types a column of numbers as numbers (and an empty cell in it as NaN): the answer 4 was a row
    error ('should be str, not int') in a file that is fine."""
    [(ids, labels)] = run(tok, {"instruction": "2+2?", "output": 4}, type="alpaca")
    assert pieces(tok, ids, labels) == ["4" + tok.eos_token]
    [(ids, _)] = run(tok, {"instruction": "2+2?", "input": float("nan"), "output": 4.5}, type="alpaca")  # input optional: left out
    assert "### Input" not in tok.decode(ids) and tok.decode(ids).endswith("4.5" + tok.eos_token)
    with pytest.raises(RowError, match="should be str, not bool"):
        run(tok, {"instruction": "2+2?", "output": True}, type="alpaca")


def test_an_empty_answer_trains_nothing_and_an_answer_ending_in_eos_gets_no_second(tok):
    """As Axolotl tokenizes an answer: empty, nothing (the row is dropped: it had trained the EOS alone, teaching
    the model to answer with nothing); already ending in the EOS, no second one."""
    [(_, labels)] = run(tok, {"instruction": "Say nothing", "output": ""}, type="alpaca")
    assert set(labels) == {IGNORE}
    [(ids, labels)] = run(tok, {"instruction": "Greet", "output": f"Hello{tok.eos_token}"}, type="alpaca")
    assert ids[-1] == tok.eos_token_id and ids[-2] != tok.eos_token_id
    assert trained_text(tok, ids, labels) == f"Hello{tok.eos_token}"


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t | tojson }}{% endfor %}\n{% endif %}{% for m in messages %}"
    "<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": "
    "\"{{ tc.function.name }}\", \"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tool_calls_tools_and_messages_stored_as_json_text_reach_the_template_as_objects(tok):
    """OpenAI-style rows keep a call's arguments (and often the tools, or the whole conversation) as JSON text: a
    template's `tojson` wrote them as an escaped string, and the model trained to produce that. Parsed, as Axolotl
    parses them."""
    import json

    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_w", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "get_w", "parameters": '{"type": "object"}'}}]
    for row in ({"messages": messages, "tools": tools}, {"messages": json.dumps(messages), "tools": json.dumps(tools)}):
        [(ids, labels)] = run(tok, row, template=TOOL_TEMPLATE, sequence_len=256, type="chat_template")
        text = tok.decode(ids)
        assert '"parameters": {"type": "object"}' in text
        assert '<tool_call>{"name": "get_w", "arguments": {"city": "Paris"}}</tool_call>' in trained_text(tok, ids, labels)
    with pytest.raises(RowError, match=r"messages\[1\].tool_calls\[0\].function.arguments is text but not JSON"):
        bad = [messages[0], {**messages[1], "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]}]
        run(tok, {"messages": bad}, template=TOOL_TEMPLATE, sequence_len=256, type="chat_template")


def test_a_loader_function_written_after_a_colon_is_pointed_to_its_dot():
    with pytest.raises(ValueError, match="did you mean alpaca_chat.load_qa"):
        DatasetSpec(path="x", type="alpaca_chat:load_qa")
    assert DatasetSpec(path="x", type="alpaca:chatml").type == "alpaca:chatml"  # a prompt style keeps its colon


def test_a_local_path_that_is_gone_is_named_not_looked_up_on_the_hub(tmp_path):
    """A run's data file deleted before `llmtune eval`: it said "could not load hub dataset '/abs/path'"."""
    from llmtune.train.data.sources import read_rows

    gone = tmp_path / "gone.jsonl"
    with pytest.raises(UserError, match=rf"datasets\[0\]: {gone} does not exist"):
        next(read_rows(DatasetSpec(path=str(gone), type="alpaca"), "datasets[0]"))
