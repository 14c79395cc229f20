"""chat_template rows the template can't show as written are refused, naming the row and the way out: tool calls
and tool definitions a plain-chat template drops, messages under other keys, roles_to_train naming a source role."""

from __future__ import annotations

import pytest
from tiny import load_tokenizer, write_jsonl

from llmtune.errors import UserError
from llmtune.recipe.data import DatasetSpec
from llmtune.train.data.formats import IGNORE, FormatContext, RowError, format_for
from llmtune.train.data.templates import ALL_TEMPLATES, tool_rendering

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
CALL = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "x"}}}]
WEATHER = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "", "tool_calls": CALL},
           {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]  # fmt: skip
# renders tool calls and tool definitions
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS {{ tools | tojson }}<|im_end|>\n{% endif %}{% for m in messages %}"
    "<|im_start|>{{ m.role }}\n{% if m.tool_calls %}CALL {{ m.tool_calls | tojson }}{% endif %}{{ m.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALLS_ONLY = TOOLS_TEMPLATE.replace("{% if tools %}", "{% if false %}")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def run(tok, row, template, name=None, **spec):
    spec = DatasetSpec(path="x", type="chat_template", **spec)
    return format_for(spec)(row, FormatContext(tok, spec, False, 512, template, template_name=name))


def prepare(tmp_path, rows, **keys):
    from llmtune.recipe.loader import recipe_from_mapping
    from llmtune.train.data.prepare import tokenize_with_cache

    path = write_jsonl(tmp_path / "d.jsonl", rows)
    dataset = {"path": str(path), "type": "chat_template", **keys.pop("dataset", {})}
    recipe = recipe_from_mapping({"base_model": "m", "datasets": [dataset], "sequence_len": 512,
                                  "dataset_prepared_path": "", **keys}, tmp_path / "r.yaml",
                                 check_files=False).recipe  # fmt: skip
    return tokenize_with_cache(recipe, load_tokenizer())


@pytest.mark.parametrize("name", ["qwen_25", "llama3", "chatml", "mistral_v3_tekken", "tokenizer_default"])
def test_a_tool_call_the_named_template_drops_is_refused_naming_the_row_and_the_way_out(tmp_path, name):
    """qwen_25 used to render the call as an empty assistant turn and train it ('<|im_end|>' alone)."""
    row = {"tools": TOOLS, "messages": WEATHER}
    with pytest.raises(UserError) as caught:
        prepare(tmp_path, [row], chat_template=name, dataset={"field_tools": "tools"})
    line = caught.value.one_line()
    assert "\n" not in line
    assert line.startswith(f"{tmp_path / 'd.jsonl'} line 1: message 1 (assistant) has tool_calls, which "
                           f"chat_template {name} does not render")  # fmt: skip
    assert "chat_template: tokenizer_default with a tokenizer whose template renders tools" in caught.value.hint
    assert "chat_template: jinja with a chat_template_jinja" in caught.value.hint


def test_tool_definitions_alone_are_refused_where_the_template_drops_them(tok):
    row = {"tools": TOOLS, "messages": [WEATHER[0], {"role": "assistant", "content": "Let me see."}]}
    with pytest.raises(RowError, match=r"the row has tool definitions \('tools'\), which chat_template llama3 does "
                                       "not render"):  # fmt: skip
        run(tok, row, ALL_TEMPLATES["llama3"], "llama3")
    with pytest.raises(RowError, match="tool definitions"):
        run(tok, {**row, "messages": WEATHER}, CALLS_ONLY, "jinja")
    [(ids, labels)] = run(tok, {"messages": WEATHER}, CALLS_ONLY, "jinja")  # no definitions: the calls render
    assert 'CALL [{"type": "function"' in tok.decode(ids)


def test_a_template_that_renders_tools_trains_the_call_and_rows_without_tools_are_unchanged(tok):
    [(ids, labels)] = run(tok, {"tools": TOOLS, "messages": WEATHER}, TOOLS_TEMPLATE, "jinja")
    trained = tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE])
    assert trained.startswith('CALL [{"type": "function", "function": {"name": "get_weather"')
    assert trained.endswith("<|im_end|>It is sunny.<|im_end|>")
    plain = {"messages": [WEATHER[0], {"role": "assistant", "content": "It is sunny."}]}
    [(ids, labels)] = run(tok, plain, ALL_TEMPLATES["qwen_25"], "qwen_25")
    assert tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE]) == \
        "It is sunny.<|im_end|>"  # fmt: skip


def test_tool_rendering_is_found_by_rendering(tok):
    assert tool_rendering(TOOLS_TEMPLATE, tok) == (True, True)
    assert tool_rendering(CALLS_ONLY, tok) == (True, False)
    assert tool_rendering(ALL_TEMPLATES["qwen_25"], tok) == (False, False)
    assert tool_rendering(ALL_TEMPLATES["mistral"], tok) == (False, False)


SHAREGPT = [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}]


def test_sharegpt_messages_without_mappings_name_their_keys_and_the_mapping(tmp_path):
    with pytest.raises(UserError) as caught:
        prepare(tmp_path, [{"conversations": SHAREGPT}], dataset={"field_messages": "conversations"})
    assert caught.value.message.startswith(f"{tmp_path / 'd.jsonl'} line 1: conversations[0] needs 'role' and "
                                           "'content' (it has: from, value)")  # fmt: skip
    assert caught.value.hint == "set message_property_mappings: {role: from, content: value} (human is read as user)"


def test_unknown_role_values_get_a_roles_suggestion(tok):
    row = {"messages": [{"speaker": "USER", "text": "hi"}, {"speaker": "BOT", "text": "yo"}]}
    with pytest.raises(RowError) as caught:
        run(tok, row, tok.chat_template)
    assert str(caught.value) == "messages[0] needs 'role' and 'content' (it has: speaker, text)"
    assert caught.value.hint == ("set message_property_mappings: {role: speaker, content: text}, and roles: "
                                 "{user: [...], assistant: [...]} to say what 'USER' is")  # fmt: skip


def test_roles_to_train_names_source_or_mapped_roles_as_axolotl_maps_them(tmp_path, tok):
    """Axolotl (from v0.6.0) maps each roles_to_train entry as it maps a row's roles: `[gpt]` and `[assistant]`
    train the same turns; a dataset's own `roles:` map counts too (refused before, as naming a source role)."""
    mapped = {"field_messages": "conversations", "message_property_mappings": {"role": "from", "content": "value"}}
    for roles, extra in (["gpt"], {}), (["assistant"], {}), (["bot"], {"roles": {"assistant": ["gpt", "bot"]}}):
        folder = tmp_path / "_".join(roles) / str(bool(extra))
        folder.mkdir(parents=True)
        groups, _ = prepare(folder, [{"conversations": SHAREGPT}], dataset={**mapped, "roles_to_train": roles, **extra})
        [example] = groups["train"]
        trained = [i for i, label in zip(example["input_ids"], example["labels"], strict=True) if label != IGNORE]
        assert tok.decode(trained) == "Paris.<|im_end|>", roles  # (bot: llmtune's alias of assistant)
    folder = tmp_path / "human"
    folder.mkdir()
    groups, _ = prepare(folder, [{"conversations": SHAREGPT}], dataset={**mapped, "roles_to_train": ["human"]})
    [example] = groups["train"]
    trained = [i for i, label in zip(example["input_ids"], example["labels"], strict=True) if label != IGNORE]
    assert "Paris" not in tok.decode(trained) and tok.decode(trained)  # the user turn, not the reply
