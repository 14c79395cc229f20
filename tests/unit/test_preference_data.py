"""Preference data (rl: dpo/ipo/orpo/simpo/kto): each Axolotl type turns a row shaped as Axolotl's docs show into
exactly the strings TRL takes, the prompt never inside a reply; malformed rows and unknown types are one-line
errors naming the file, the row and the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny import load_tokenizer, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.data import DatasetSpec
from llmtune.train.data.preference import (
    KTO_TYPES,
    PAIR_TYPES,
    PreferenceContext,
    context_for,
    convert_rows,
    converter_for,
)
from llmtune.train.data.sources import read_rows
from llmtune.train.data.templates import ALL_TEMPLATES

# ChatML as the fixture tokenizer's own template writes it, which is also what Axolotl's chatml.* types hard-code
SYS = "<|im_start|>system\nBe brief.<|im_end|>\n"
USER = "<|im_start|>user\nCapital of France?<|im_end|>\n<|im_start|>assistant\n"
# Llama 3 (llmtune's named template; the fixture's bos token is <|endoftext|>)
L3_PROMPT = (
    "<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nCapital of France?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
)
PARIS, LYON = "Paris.<|im_end|>", "Lyon.<|im_end|>"
ASK = {"role": "user", "content": "Capital of France?"}
SYSTEM = {"role": "system", "content": "Be brief."}


def said(text):
    return {"role": "assistant", "content": text}


# (type, row as Axolotl's docs/rlhf.qmd shows it, expected prompt)
PAIR_ROWS = [
    ("chatml.intel", {"system": "Be brief.", "question": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
     SYS + USER),
    ("chatml.icr", {"system": "Be brief.", "input": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."},
     SYS + USER),
    ("chatml.prompt_pairs", {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}, USER),
    ("chatml.argilla", {"system": "Be brief.", "instruction": "Capital of France?", "chosen_response": "Paris.",
                        "rejected_response": "Lyon."}, SYS + USER),
    ("chatml", {"system": "", "prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}, USER),
    ("chatml.ultra", {"system": "Be brief.", "prompt": "Capital of France?", "chosen": [ASK, said("Paris.")],
                      "rejected": [ASK, said("Lyon.")]}, SYS + USER),
    ("chatml.argilla_chat", {"chosen": [ASK, said("Paris.")], "rejected": [ASK, said("Lyon.")]}, USER),
    ("chat_template.default", {"messages": [SYSTEM, ASK], "chosen": said("Paris."), "rejected": said("Lyon.")},
     SYS + USER),
    ("chat_template.argilla_chat", {"chosen": [ASK, said("Paris.")], "rejected": [ASK, said("Lyon.")]}, USER),
    ("chat_template.argilla", {"system": "Be brief.", "prompt": "Capital of France?",
                               "chosen": [{"role": "user", "content": "ignored"}, said("Paris.")],
                               "rejected": [{"role": "user", "content": "ignored"}, said("Lyon.")]}, SYS + USER),
]  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def bare_tok():
    """A tokenizer without a chat template of its own (a base model's)."""
    tokenizer = load_tokenizer()
    tokenizer.chat_template = None
    return tokenizer


def convert(tok, rl, kind, row, template=None, **options):
    return converter_for(rl, kind)(row, context_for(rl, kind, tok, template, options))


@pytest.mark.parametrize(("kind", "row", "prompt"), PAIR_ROWS, ids=[case[0] for case in PAIR_ROWS])
def test_pair_types_give_the_prompt_and_replies_axolotl_writes(tok, kind, row, prompt):
    assert convert(tok, "dpo", kind, row) == {"prompt": prompt, "chosen": PARIS, "rejected": LYON}


@pytest.mark.parametrize(("kind", "row", "prompt"), PAIR_ROWS, ids=[case[0] for case in PAIR_ROWS])
def test_the_prompt_is_not_in_a_reply_and_prompt_plus_reply_is_the_whole_conversation(tok, kind, row, prompt):
    out = convert(tok, "dpo", kind, row)
    for reply, text in (("chosen", "Paris."), ("rejected", "Lyon.")):
        assert "<|im_start|>" not in out[reply] and "Capital of France?" not in out[reply]
        history = [SYSTEM, ASK] if prompt.startswith(SYS) else [ASK]
        whole = tok.apply_chat_template([*history, said(text)], tokenize=False)
        assert out["prompt"] + out[reply] == whole.rstrip()


def test_llama3_twins_use_the_models_template_not_hard_coded_llama3(tok):
    row = {"system": "Be brief.", "question": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}
    assert convert(tok, "dpo", "llama3.intel", row) == convert(tok, "dpo", "chatml.intel", row)


def test_the_recipes_template_wins_over_the_type_family(tok):
    row = {"system": "Be brief.", "question": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}
    out = convert(tok, "dpo", "chatml.intel", row, template=ALL_TEMPLATES["llama3"])
    assert out == {"prompt": L3_PROMPT, "chosen": "Paris.<|eot_id|>", "rejected": "Lyon.<|eot_id|>"}


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_without_a_model_template_the_type_family_names_it(bare_tok, family):
    row = {"system": "Be brief.", "prompt": "Capital of France?", "chosen": [ASK, said("Paris.")],
           "rejected": [ASK, said("Lyon.")]}  # fmt: skip
    out = convert(bare_tok, "dpo", f"{family}.ultra", row)
    end = "<|im_end|>" if family == "chatml" else "<|eot_id|>"
    assert out == {"prompt": SYS + USER if family == "chatml" else L3_PROMPT, "chosen": "Paris." + end,
                   "rejected": "Lyon." + end}  # fmt: skip


# marks the last user message only while it is last: the prompt is not a prefix of the whole conversation
SHIFTY = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.last and m['role'] == 'user' %} (answer now){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_the_prompt_once_a_reply_follows_still_gives_only_the_reply(tok):
    row = {"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}
    out = convert(tok, "dpo", "chatml.prompt_pairs", row, template=SHIFTY)
    prompt = "<|im_start|>user\nCapital of France? (answer now)<|im_end|>\n<|im_start|>assistant\n"
    assert out == {"prompt": prompt, "chosen": PARIS, "rejected": LYON}


def test_chat_template_types_need_a_template(bare_tok):
    row = {"messages": [ASK], "chosen": "Paris.", "rejected": "Lyon."}
    with pytest.raises(UserError, match="no chat template"):
        convert(bare_tok, "dpo", "chat_template.default", row)


def test_chat_template_default_reads_the_recipes_fields_mappings_and_roles(tok):
    row = {"conversation": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Capital of France?"}],
           "good": [{"from": "gpt", "value": "Paris."}], "bad": "Lyon."}  # fmt: skip
    out = convert(tok, "dpo", "chat_template.default", row, field_messages="conversation", field_chosen="good",
                  field_rejected="bad", message_property_mappings={"role": "from", "content": "value"},
                  roles={"user": ["human"], "assistant": ["gpt"], "system": ["system"]})  # fmt: skip
    assert out == {"prompt": SYS + USER, "chosen": PARIS, "rejected": LYON}
    # messages given as text are the user's
    out = convert(tok, "dpo", "chat_template", {"messages": "Capital of France?", "chosen": "Paris.", "rejected": "x"})
    assert out["prompt"] == USER


def test_a_multi_turn_history_is_all_prompt(tok):
    history = [ASK, said("Paris."), {"role": "user", "content": "And Italy?"}]
    row = {"chosen": [*history, said("Rome.")], "rejected": [*history, said("Milan.")]}
    out = convert(tok, "orpo", "chat_template.argilla_chat", row)
    assert out == {"prompt": USER + "Paris.<|im_end|>\n<|im_start|>user\nAnd Italy?<|im_end|>\n"
                   "<|im_start|>assistant\n", "chosen": "Rome.<|im_end|>", "rejected": "Milan.<|im_end|>"}  # fmt: skip


def test_user_defined_writes_the_fields_into_the_formats_without_a_template(tok):
    kind = {"field_prompt": "q", "field_system": "sys", "field_chosen": "good", "field_rejected": "bad",
            "prompt_format": "{system}\n### Q: {prompt}\n### A:", "chosen_format": " {chosen}</s>",
            "rejected_format": " {rejected}</s>"}  # fmt: skip
    row = {"sys": "Be brief.", "q": "Capital of {France}?", "good": "Paris.", "bad": "Lyon."}
    assert convert(tok, "simpo", kind, row) == {
        "prompt": "Be brief.\n### Q: Capital of {France}?\n### A:",
        "chosen": " Paris.</s>",
        "rejected": " Lyon.</s>",
    }
    # no system in the row: {system} is empty, as in Axolotl
    row = {"q": "Hi", "good": "a", "bad": "b"}
    assert convert(tok, "dpo", kind, row)["prompt"] == "\n### Q: Hi\n### A:"
    # the defaults: the fields as they are
    row = {"prompt": "Hi", "chosen": "a", "rejected": "b"}
    assert convert(tok, "dpo", "user_defined", row) == row


def test_user_defined_keys_and_formats_are_checked_up_front(tok):
    with pytest.raises(UserError) as err:
        context_for("dpo", {"prompt_format": "{prompt} {question}"}, tok, None, label="datasets[1]")
    assert err.value.one_line() == (
        "datasets[1].type.prompt_format uses {question}; it can use {prompt}, {system} "
        "(hint: write {{ and }} for literal braces)"
    )
    with pytest.raises(UserError) as err:
        context_for("dpo", {"feild_chosen": "good"}, tok, None)
    assert err.value.one_line() == (
        "datasets[0].type.feild_chosen is not a user_defined key for rl: dpo (hint: did you mean 'field_chosen'?)"
    )
    with pytest.raises(UserError, match="field_label"):
        context_for("dpo", {"field_label": "ok"}, tok, None)  # a KTO key, not a pair one


KTO_ROW = {"system": "Be brief.", "prompt": "Capital of France?", "completion": "Paris.", "label": True}


def test_kto_types_give_prompt_completion_and_label(tok, bare_tok):
    assert convert(tok, "kto", "chatml.ultra", KTO_ROW) == {"prompt": SYS + USER, "completion": PARIS, "label": True}
    assert convert(tok, "kto", "llama3.ultra", {**KTO_ROW, "label": False}) == {
        "prompt": SYS + USER,
        "completion": PARIS,
        "label": False,
    }  # the model's template
    assert convert(bare_tok, "kto", "llama3.ultra", KTO_ROW) == {
        "prompt": L3_PROMPT,
        "completion": "Paris.<|eot_id|>",
        "label": True,
    }
    kind = {"field_prompt": "q", "field_completion": "a", "field_label": "good", "prompt_format": "Q: {prompt}\nA:",
            "completion_format": " {completion}"}  # fmt: skip
    assert convert(tok, "kto", kind, {"q": "Hi", "a": "yo", "good": 0}) == {
        "prompt": "Q: Hi\nA:",
        "completion": " yo",
        "label": False,
    }


def rows_file(tmp_path, rows):
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    return path, list(read_rows(DatasetSpec(path=str(path)), "datasets[0]"))


def first_error(tok, tmp_path, rl, kind, rows, **options) -> str:
    path, read = rows_file(tmp_path, rows)
    ctx = context_for(rl, kind, tok, None, options)
    with pytest.raises(UserError) as err:
        list(convert_rows(read, converter_for(rl, kind), ctx, "datasets[0]", kind))
    return err.value.one_line().replace(str(path), "FILE")


GOOD = {"question": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."}


@pytest.mark.parametrize(
    ("rl", "kind", "bad_row", "options", "message"),
    [
        ("dpo", "chatml.intel", {"prompt": "Q", "chosen": "a", "rejected": "b"}, {},
         "FILE line 2: missing field 'question' (row has: prompt, chosen, rejected) (datasets[0].type is chatml.intel)"
         " (hint: pick the type whose fields match the data)"),
        ("dpo", "chatml.intel", {**GOOD, "chosen": ["Paris."]}, {},
         "FILE line 2: field 'chosen' should be text, not list (datasets[0].type is chatml.intel) (hint: fix the row, "
         "or set the dataset's type/fields to match the data)"),
        ("dpo", "chat_template.default", {"messages": [{"role": "human", "content": "Q"}], "chosen": "a",
                                          "rejected": "b"}, {},
         "FILE line 2: messages[0].role is 'human', not one of user, assistant, system, tool (datasets[0].type is "
         "chat_template.default) (hint: map it with roles: {user: [...], assistant: [...]})"),
        ("dpo", "chat_template.default", {"messages": [ASK], "chosen": "a"}, {"field_rejected": "worse"},
         "FILE line 2: missing field 'worse' (row has: messages, chosen) (datasets[0].type is chat_template.default) "
         "(hint: set field_rejected to the field that holds it)"),
        ("dpo", "chatml.ultra", {"prompt": "Q", "chosen": [ASK, said("a")], "rejected": [said("b"), ASK]}, {},
         "FILE line 2: field 'rejected' should end with the assistant's reply, not a user message (datasets[0].type "
         "is chatml.ultra) (hint: fix the row, or set the dataset's type/fields to match the data)"),
        ("orpo", "chat_template.argilla_chat", {"chosen": [ASK, said("a")],
                                                "rejected": [{"role": "user", "content": "Other?"}, said("b")]}, {},
         "FILE line 2: fields 'chosen' and 'rejected' differ before their last message (datasets[0].type is "
         "chat_template.argilla_chat) (hint: both should hold the same conversation up to the reply)"),
        ("kto", "chatml.ultra", {"prompt": "Q", "completion": "a", "label": "yes"}, {},
         "FILE line 2: field 'label' should be true or false, not 'yes' (datasets[0].type is chatml.ultra) "
         "(hint: true marks a desirable completion)"),
        ("kto", {"field_label": "ok"}, {"prompt": "Q", "completion": "a"}, {},
         "FILE line 2: missing field 'ok' (row has: prompt, completion) (datasets[0].type is user_defined.default) "
         "(hint: set type.field_label to the field that holds it)"),
    ],
    ids=["missing", "wrong-kind", "unknown-role", "renamed-field", "reply-not-last", "histories-differ", "label",
         "kto-user-label"],
)  # fmt: skip
def test_a_malformed_row_is_one_line_naming_file_row_and_field(tok, tmp_path, rl, kind, bad_row, options, message):
    first = GOOD if rl != "kto" else {"prompt": "Q", "completion": "a", "label": True, "ok": True}
    if kind == "chat_template.default":
        first = {"messages": [ASK], "chosen": "a", "rejected": "b", "worse": "c"}
    elif kind in ("chatml.ultra",) and rl == "dpo":
        first = {"prompt": "Q", "chosen": [ASK, said("a")], "rejected": [ASK, said("b")]}
    elif kind == "chat_template.argilla_chat":
        first = {"chosen": [ASK, said("a")], "rejected": [ASK, said("b")]}
    assert first_error(tok, tmp_path, rl, kind, [first, bad_row], **options) == message


def test_good_rows_convert_in_order(tok, tmp_path):
    _, read = rows_file(tmp_path, [GOOD, {**GOOD, "chosen": "Lyon?"}])
    ctx = PreferenceContext(tok, None)
    out = list(convert_rows(read, converter_for("dpo", "chatml.intel"), ctx, "datasets[0]", "chatml.intel"))
    assert [row["chosen"] for row in out] == [PARIS, "Lyon?<|im_end|>"]


def test_an_unknown_type_lists_the_known_ones_with_a_guess():
    with pytest.raises(UserError) as err:
        converter_for("dpo", "chatml.intell", "datasets[2]")
    line = err.value.one_line()
    assert line.startswith("datasets[2].type 'chatml.intell' is not a preference type for rl: dpo; known: ")
    assert line.endswith("(hint: did you mean 'chatml.intel'?)")
    assert all(name in line for name in PAIR_TYPES)
    with pytest.raises(UserError) as err:  # a pair type is not a KTO one
        converter_for("kto", "chat_template.default")
    assert "known: " + ", ".join(KTO_TYPES) + " (hint:" in err.value.one_line()


def test_axolotls_type_spellings_resolve():
    assert converter_for("dpo", "chatml") is PAIR_TYPES["chatml.default"]
    assert converter_for("dpo", "chat_template") is PAIR_TYPES["chat_template.default"]
    assert converter_for("ipo", {"field_prompt": "q"}) is PAIR_TYPES["user_defined.default"]
    assert converter_for("kto", "user_defined") is KTO_TYPES["user_defined.default"]
    assert converter_for("dpo", None) is PAIR_TYPES["passthrough"]


def test_importing_it_leaves_torch_and_transformers_out():
    code = (
        "import sys, llmtune.train.data.preference; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
