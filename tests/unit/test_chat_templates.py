"""Named chat templates: exact formats, prefix stability (label masking relies on it), resolution."""

from __future__ import annotations

import pytest
from tiny import load_tokenizer

from llmtune.errors import UserError
from llmtune.recipe.model import NAMED_CHAT_TEMPLATES
from llmtune.train.data.templates import NAMED_TEMPLATES, render, resolve_chat_template

SYSTEM = {"role": "system", "content": "Be brief."}
CHAT = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]
CONVERSATIONS = {"with_system": [SYSTEM, *CHAT], "without_system": CHAT}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def expected(name: str, bos: str, eos: str) -> str:
    """The exact rendering of [SYSTEM, *CHAT[:4]], written out by hand per format."""
    return {
        "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        "qwen_25": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n",
        "llama3": f"{bos}<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>",
        "mistral": f"{bos}[INST] Be brief.\n\nHi[/INST] Hello!{eos}[INST] What is 2+2?[/INST] 4{eos}",
        "gemma": f"{bos}<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
        "phi_3": f"{bos}<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
        "<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n4<|end|>\n",
        "alpaca": f"{bos}Be brief.\n\n### Instruction:\nHi\n\n### Response:\nHello!{eos}"
        f"\n\n### Instruction:\nWhat is 2+2?\n\n### Response:\n4{eos}",
    }[name]


def test_named_templates_match_the_recipe_schema():
    assert set(NAMED_TEMPLATES) == set(NAMED_CHAT_TEMPLATES) - {"tokenizer_default", "jinja"}


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_no_generation_markers(name):
    assert "generation %}" not in NAMED_TEMPLATES[name]


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_exact_rendering(tok, name):
    got = render(NAMED_TEMPLATES[name], [SYSTEM, *CHAT[:4]], tok)
    assert got == expected(name, tok.bos_token, tok.eos_token)


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_three_turns_render_every_message(tok, name):
    text = render(NAMED_TEMPLATES[name], [SYSTEM, *CHAT], tok)
    positions = [text.index(m["content"]) for m in [SYSTEM, *CHAT]]
    assert positions == sorted(positions)


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_prefix_stable(tok, name, conversation):
    template, messages = NAMED_TEMPLATES[name], CONVERSATIONS[conversation]
    for i in range(1, len(messages)):
        longer = render(template, messages[: i + 1], tok)
        assert longer.startswith(render(template, messages[:i], tok)), (name, i)
        if messages[i]["role"] == "assistant":
            prompt = render(template, messages[:i], tok, add_generation_prompt=True)
            assert longer.startswith(prompt), (name, i)


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_generation_prompt_opens_an_assistant_turn(tok, name):
    without = render(NAMED_TEMPLATES[name], [SYSTEM, CHAT[0]], tok)
    with_prompt = render(NAMED_TEMPLATES[name], [SYSTEM, CHAT[0]], tok, add_generation_prompt=True)
    assert with_prompt.startswith(without)
    header = {"chatml": "<|im_start|>assistant\n", "qwen_25": "<|im_start|>assistant\n",
              "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "mistral": "",
              "gemma": "<start_of_turn>model\n", "phi_3": "<|assistant|>\n", "alpaca": "\n\n### Response:\n"}[name]
    assert with_prompt[len(without):] == header


def test_defaults_without_a_system_message(tok):
    qwen = render(NAMED_TEMPLATES["qwen_25"], CHAT[:1], tok)
    assert qwen == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n")
    alpaca = render(NAMED_TEMPLATES["alpaca"], CHAT[:1], tok)
    assert alpaca == f"{tok.bos_token}### Instruction:\nHi"  # Axolotl's alpaca template: no preamble of its own
    assert render(NAMED_TEMPLATES["mistral"], CHAT[:2], tok) == f"{tok.bos_token}[INST] Hi[/INST] Hello!{tok.eos_token}"
    assert render(NAMED_TEMPLATES["gemma"], CHAT[:1], tok) == f"{tok.bos_token}<start_of_turn>user\nHi<end_of_turn>\n"


def test_unsupported_role_is_a_user_error(tok):
    with pytest.raises(UserError, match="mistral"):
        render(NAMED_TEMPLATES["mistral"], [*CHAT[:1], {"role": "tool", "content": "x"}], tok)


def test_resolve(tok):
    assert resolve_chat_template(None, None, tok) == tok.chat_template
    assert resolve_chat_template("tokenizer_default", None, tok) == tok.chat_template
    assert resolve_chat_template("jinja", "{{ messages }}", tok) == "{{ messages }}"
    for name, text in NAMED_TEMPLATES.items():
        assert resolve_chat_template(name, None, None) == text


def test_resolve_errors(tok):
    class NoTemplate:
        chat_template = None

    with pytest.raises(UserError, match="no chat template") as caught:
        resolve_chat_template("tokenizer_default", None, NoTemplate())
    assert "chatml" in caught.value.hint
    with pytest.raises(UserError, match="jinja"):
        resolve_chat_template("jinja", "  ", tok)
    with pytest.raises(UserError, match="unknown") as caught:
        resolve_chat_template("lama3", None, tok)
    assert "llama3" in caught.value.hint


@pytest.mark.parametrize(("conversation", "template"), [("chatml", "chatml"), ("llama3", "llama3")])
def test_sharegpt_conversations_write_what_the_named_template_writes(tok, conversation, template):
    """sharegpt's FastChat chatml and llama3 (Axolotl's own registrations) render a conversation with a system
    message exactly as the named chat template does (llama3: less the BOS, which the tokenizer adds)."""
    from llmtune.train.data.sharegpt import CONVERSATIONS as FASTCHAT
    from llmtune.train.data.sharegpt import turns

    messages = [(m["role"], m["content"], None) for m in CHAT[:4]]
    text = "".join(role + body for _, role, body, _ in turns(FASTCHAT[conversation], SYSTEM["content"], messages))
    rendered = render(NAMED_TEMPLATES[template], [SYSTEM, *CHAT[:4]], tok)
    assert text == rendered.removeprefix(tok.bos_token if template == "llama3" else "")
