"""Named chat templates a recipe can pick with `chat_template: <name>`, and rendering with them.

Each template reproduces the public format of its model family (same special-token strings,
same whitespace) and is *prefix-stable*, which the label masking in formats.py relies on:

- rendering messages[:i] is a string prefix of rendering messages[:i+1];
- rendering messages[:i] with add_generation_prompt=True is a prefix of rendering
  messages[:i+1] when message i is from the assistant.

Where an original breaks this, the named template deviates minimally (see the notes per template).
No `{% generation %}` markers: masking works from prefixes, not from the tokenizer's tracker.
Nothing heavy is imported here; the tokenizer does the rendering.
"""

from __future__ import annotations

from llmtune.errors import UserError, did_you_mean

# Templates are written without newlines outside string literals, so Jinja's trim/lstrip settings
# cannot change them. r-strings keep "\n" as a Jinja escape inside Jinja string literals.

_CHATML = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Llama 3 / 3.1-style turns (no 3.1 "Cutting Knowledge Date" system preamble). BOS once, at the start.
_LLAMA3 = (
    r"{% if messages %}{{ bos_token }}{% endif %}"
    r"{% for message in messages %}"
    r"{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    r"{{ message['content'] | trim + '<|eot_id|>' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Mistral v0.3 ("[INST] user[/INST] answer</s>"). The original puts the system message into the
# *last* user turn, which moves it as turns are added; here it is folded into the *first* user turn.
# The original has no generation prompt (the answer follows "[/INST]" directly), nor does this one.
_MISTRAL = (
    r"{% set ns = namespace(system=none) %}"
    r"{% if messages and messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}"
    r"{{ bos_token }}"
    r"{% for message in messages %}"
    r"{% if message['role'] == 'user' %}"
    r"{% if ns.system is not none %}"
    r"{{ '[INST] ' + ns.system + '\n\n' + message['content'] + '[/INST]' }}{% set ns.system = none %}"
    r"{% else %}{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
    r"{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
    r"{% elif message['role'] != 'system' or not loop.first %}"
    r"{{ raise_exception('mistral: only user and assistant roles, with one leading system message') }}"
    r"{% endif %}"
    r"{% endfor %}"
)

# Gemma (2/3 text): "model" for the assistant; the system message goes at the start of the first
# user turn followed by a blank line, as Gemma 3's template does. Turns end with <end_of_turn>.
_GEMMA = (
    r"{% set ns = namespace(system=none) %}"
    r"{% if messages and messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}{% endif %}"
    r"{{ bos_token }}"
    r"{% for message in messages %}"
    r"{% if message['role'] == 'system' and loop.first %}"
    r"{% elif message['role'] in ['user', 'assistant'] %}"
    r"{% set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    r"{% set prefix = ns.system + '\n\n' if role == 'user' and ns.system is not none else '' %}"
    r"{% if role == 'user' %}{% set ns.system = none %}{% endif %}"
    r"{{ '<start_of_turn>' + role + '\n' + prefix + message['content'] | trim + '<end_of_turn>\n' }}"
    r"{% else %}{{ raise_exception('gemma: only user and assistant roles, with one leading system message') }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Phi-3 / 3.5 mini. The original appends eos_token after the last turn when there is no
# generation prompt; that trailing token vanishes once another turn is added, so it is left out
# (every turn already ends in <|end|>, which is what Phi-3 stops on). Like the original, no BOS.
_PHI_3 = (
    r"{% for message in messages %}"
    r"{% if message['role'] in ['system', 'user', 'assistant'] %}"
    r"{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# Qwen2.5: ChatML with a default system message when the conversation has none (no tool calls).
_QWEN_25 = (
    r"{% if messages and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    r"{% endif %}" + _CHATML
)

# Alpaca as a chat: the system message (or the classic Alpaca preamble) then
# "### Instruction:" / "### Response:" blocks separated by blank lines; answers end in eos_token.
# The blank line before each block belongs to that block, so earlier turns never change.
_ALPACA = (
    r"{% if messages %}{{ bos_token }}"
    r"{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    r"{% else %}{{ 'Below is an instruction that describes a task. "
    r"Write a response that appropriately completes the request.' }}{% endif %}"
    r"{% endif %}"
    r"{% for message in messages %}"
    r"{% if message['role'] == 'user' %}{{ '\n\n### Instruction:\n' + message['content'] }}"
    r"{% elif message['role'] == 'assistant' %}{{ '\n\n### Response:\n' + message['content'] + eos_token }}"
    r"{% elif message['role'] != 'system' or not loop.first %}"
    r"{{ raise_exception('alpaca: only user and assistant roles, with one leading system message') }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '\n\n### Response:\n' }}{% endif %}"
)

NAMED_TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "llama3": _LLAMA3,
    "mistral": _MISTRAL,
    "gemma": _GEMMA,
    "phi_3": _PHI_3,
    "qwen_25": _QWEN_25,
    "alpaca": _ALPACA,
}


def resolve_chat_template(name: str | None, jinja: str | None, tokenizer) -> str | None:
    """The Jinja text for a recipe's `chat_template` (and `chat_template_jinja`).

    None or 'tokenizer_default' -> the tokenizer's own template; 'jinja' -> `jinja`;
    a named template -> its text. Raises UserError when there is nothing to use.
    """
    if name is None or name == "tokenizer_default":
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):  # some tokenizers keep several named templates
            own = own.get("default")
        if not own:
            raise UserError(
                "the tokenizer has no chat template of its own (chat_template: tokenizer_default)",
                "set chat_template to one of "
                + ", ".join(NAMED_TEMPLATES)
                + ", or to 'jinja' with chat_template_jinja",
            )
        return own
    if name == "jinja":
        if not jinja or not jinja.strip():
            raise UserError("chat_template: jinja needs the template text", "set chat_template_jinja")
        return jinja
    if name in NAMED_TEMPLATES:
        return NAMED_TEMPLATES[name]
    guess = did_you_mean(name, [*NAMED_TEMPLATES, "tokenizer_default", "jinja"])
    raise UserError(
        f"unknown chat template '{name}'",
        f"did you mean '{guess}'?"
        if guess
        else "use one of " + ", ".join(NAMED_TEMPLATES) + ", 'tokenizer_default' or 'jinja'",
    )


def render(template: str, messages: list[dict], tokenizer, add_generation_prompt: bool = False) -> str:
    """Render `messages` as text with `template`, using the tokenizer's special tokens."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as error:
        raise UserError(
            f"the chat template failed on a conversation: {error}",
            "check the roles and order of the messages, or pick another chat_template",
        ) from error
