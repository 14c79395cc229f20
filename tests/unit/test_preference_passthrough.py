"""Preference rows with no type in TRL's conversational shapes (message lists for prompt and replies, an implicit
prompt, KTO's prompt/completion lists) render with the chat template exactly as the chat_template.default rows that
say the same thing."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny import load_tokenizer, write_jsonl

from llmtune.errors import UserError
from llmtune.train.data.preference import context_for, converter_for
from llmtune.train.data.templates import ALL_TEMPLATES

SYSTEM = {"role": "system", "content": "Be brief."}
ASK = {"role": "user", "content": "Capital of France?"}
HELLO = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def said(text):
    return {"role": "assistant", "content": text}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def convert(tok, rl, kind, row, template=None, **options):
    return converter_for(rl, kind)(row, context_for(rl, kind, tok, template, options))


@pytest.mark.parametrize("template", [None, "llama3"])
@pytest.mark.parametrize("history", [[ASK], [SYSTEM, ASK], [*HELLO, ASK]], ids=["one", "system", "multi-turn"])
def test_conversational_passthrough_rows_equal_chat_template_default(tok, template, history):
    template = ALL_TEMPLATES[template] if template else None
    typed = convert(tok, "dpo", "chat_template.default",
                    {"messages": history, "chosen": said("Paris."), "rejected": said("Lyon.")}, template)  # fmt: skip
    explicit = {"prompt": history, "chosen": [said("Paris.")], "rejected": [said("Lyon.")]}
    implicit = {"chosen": [*history, said("Paris.")], "rejected": [*history, said("Lyon.")]}
    assert convert(tok, "dpo", None, explicit, template) == typed
    assert convert(tok, "dpo", None, implicit, template) == typed
    assert convert(tok, "dpo", "passthrough", implicit, template) == typed
    end = "<|eot_id|>" if template else "<|im_end|>"
    assert typed["chosen"] == "Paris." + end and typed["prompt"].count("Capital of France?") == 1
    kto = convert(tok, "kto", None, {"prompt": history, "completion": [said("Paris.")], "label": True}, template)
    assert kto == {"prompt": typed["prompt"], "completion": typed["chosen"], "label": True}


def test_text_passthrough_rows_are_unchanged(tok):
    row = {"prompt": "P", "chosen": "a", "rejected": "b"}
    assert convert(tok, "dpo", None, row) == row
    assert convert(tok, "kto", None, {"prompt": "P", "completion": "a", "label": 0}) == \
        {"prompt": "P", "completion": "a", "label": False}  # fmt: skip


def test_message_mappings_and_roles_apply_to_conversational_rows(tok):
    row = {"chosen": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}],
           "rejected": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Lyon."}]}
    options = {"message_property_mappings": {"role": "from", "content": "value"},
               "roles": {"user": ["human"], "assistant": ["gpt"]}}  # fmt: skip
    typed = convert(tok, "dpo", "chat_template.default", {"messages": [ASK], "chosen": "Paris.", "rejected": "Lyon."})
    assert convert(tok, "dpo", None, row, **options) == typed


@pytest.mark.parametrize(
    ("rl", "row", "message"),
    [
        ("dpo", {"chosen": [ASK, said("a")], "rejected": [{"role": "user", "content": "Other?"}, said("b")]},
         "fields 'chosen' and 'rejected' share no leading messages, so there is no prompt"),
        ("dpo", {"prompt": [ASK], "chosen": [said("a"), ASK, said("b")], "rejected": [said("c")]},
         "field 'chosen' should hold one assistant reply after the prompt, not assistant, user, assistant"),
        ("kto", {"completion": [said("a")], "label": True}, "missing field 'prompt'"),
        ("kto", {"prompt": [ASK], "completion": [ASK], "label": True},
         "field 'completion' should hold one assistant reply after the prompt, not user"),
    ],
    ids=["no-shared-prompt", "several-turns", "kto-no-prompt", "kto-not-assistant"],
)  # fmt: skip
def test_conversational_rows_that_cant_be_split_are_refused_naming_the_field(tok, tmp_path, rl, row, message):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.preference_rows import prepare_preference_data

    path = write_jsonl(tmp_path / "d.jsonl", [row])
    recipe = recipe_from_mapping({"base_model": "m", "rl": rl, "datasets": [{"path": str(path)}],
                                  "dataset_prepared_path": ""}, Path("r.yaml"), check_files=False).recipe  # fmt: skip
    with pytest.raises(UserError) as caught:
        prepare_preference_data(recipe, tok)
    assert caught.value.message.startswith(f"{path} line 1: {message}")
    assert "\n" not in caught.value.one_line()
