"""Named chat templates a recipe can pick with `chat_template: <name>`, and rendering with them.

Each template reproduces the public format of its model family (same special-token strings,
same whitespace) and is *prefix-stable*, which the label masking in formats.py relies on:

- rendering messages[:i] is a string prefix of rendering messages[:i+1];
- rendering messages[:i] with add_generation_prompt=True is a prefix of rendering
  messages[:i+1] when message i is from the assistant.

Where an original breaks this, the named template deviates minimally (see the notes per template). One
exception: qwen3 leaves out an earlier answer's reasoning once a question follows, as Qwen3 does; its labels
are placed in the whole conversation (turns.turns_in_full), as for a tokenizer's own Qwen3 template.
No `{% generation %}` markers: masking works from prefixes, not from the tokenizer's tracker.
Nothing heavy is imported here; the tokenizer does the rendering.
"""

from __future__ import annotations

import weakref

from llmtune.errors import UserError, did_you_mean

# Templates are written without newlines outside string literals, so Jinja's trim/lstrip settings
# cannot change them. r-strings keep "\n" as a Jinja escape inside Jinja string literals.

_CHATML = (
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Qwen3 / Qwen3.5: ChatML whose assistant turns after the last question open with their reasoning,
# "<think>\n{reasoning}\n</think>\n\n" (earlier answers' reasoning is left out, as the original leaves it out at
# inference). Deviation: no empty <think> block on a turn without reasoning (the original writes one on the last).
_QWEN3 = (
    r"{% set ns = namespace(last_query=-1) %}"
    r"{% for message in messages %}{% if message['role'] == 'user' %}{% set ns.last_query = loop.index0 %}"
    r"{% endif %}{% endfor %}"
    r"{% for message in messages %}"
    r"{{ '<|im_start|>' + message['role'] + '\n' }}"
    r"{% if message['role'] == 'assistant' and loop.index0 > ns.last_query and message['reasoning_content'] is string"
    r" and message['reasoning_content'] %}"
    r"{{ '<think>\n' + message['reasoning_content'].strip('\n') + '\n</think>\n\n' }}{% endif %}"
    r"{{ message['content'] + '<|im_end|>' + '\n' }}"
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
# (every turn already ends in <|end|>, which is what Phi-3 stops on). Phi-3's starts with the BOS, Phi-3.5's
# doesn't, as in Axolotl's two files.
_PHI_35 = (
    r"{% for message in messages %}"
    r"{% if message['role'] in ['system', 'user', 'assistant'] %}"
    r"{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    r"{% endif %}"
    r"{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_PHI_3 = r"{% if messages %}{{ bos_token }}{% endif %}" + _PHI_35

# Qwen2.5: ChatML with a default system message when the conversation has none (no tool calls).
_QWEN_25 = (
    r"{% if messages and messages[0]['role'] != 'system' %}"
    r"{{ '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}"
    r"{% endif %}" + _CHATML
)

# Alpaca as a chat, as Axolotl's alpaca template: the BOS, a leading system message as it is (no preamble of
# its own), then "### Instruction:" / "### Response:" blocks separated by blank lines; answers end in eos_token.
# The blank line before each block belongs to that block, so earlier turns never change.
_ALPACA = (
    r"{% if messages %}{{ bos_token }}{% endif %}"
    r"{% for message in messages %}"
    r"{% if not loop.first %}{{ '\n\n' }}{% endif %}"
    r"{% if message['role'] == 'system' and loop.first %}{{ message['content'] }}"
    r"{% elif message['role'] == 'user' %}{{ '### Instruction:\n' + message['content'] }}"
    r"{% elif message['role'] == 'assistant' %}{{ '### Response:\n' + message['content'] + eos_token }}"
    r"{% else %}{{ raise_exception('alpaca: only user and assistant roles, with one leading system message') }}"
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


def _literal(text: str) -> str:
    """A Jinja expression for `text`, where {bos} and {eos} stand for the tokenizer's tokens."""
    parts = []
    for piece in text.replace("{bos}", "\0bos\0").replace("{eos}", "\0eos\0").split("\0"):
        if piece in ("bos", "eos"):
            parts.append(f"{piece}_token")
        elif piece:
            parts.append("'" + piece.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'")
    return " + ".join(parts) or "''"


def turns_template(
    name: str,
    roles: dict[str, tuple[str, str]],
    start: str = "",
    fold_system: bool = False,
    default_system: str | None = None,
    generation: str | None = None,
    trim: bool = False,
) -> str:
    """A prefix-stable template where each message is prefix + content + suffix of its role.

    fold_system: a leading system message goes at the start of the first user turn, then a blank line.
    default_system: rendered as the system turn when the conversation has none.
    generation: the generation prompt (default: the assistant prefix).
    """
    content = "message['content'] | trim" if trim else "message['content']"
    parts = ["{% set ns = namespace(system=none) %}"]
    if start:
        parts.append("{% if messages %}{{ " + _literal(start) + " }}{% endif %}")
    if fold_system:
        parts.append("{% if messages and messages[0]['role'] == 'system' %}{% set ns.system = messages[0]['content'] %}"
                     "{% endif %}")  # fmt: skip
    if default_system is not None:
        prefix, suffix = roles["system"]
        parts.append("{% if messages and messages[0]['role'] != 'system' %}{{ "
                     + _literal(prefix + default_system + suffix) + " }}{% endif %}")  # fmt: skip
    parts.append("{% for message in messages %}")
    branches = ["{% if message['role'] == 'system' and loop.first %}" if fold_system else "{% if false %}"]
    for role, (prefix, suffix) in roles.items():
        if fold_system and role == "system":
            continue
        body = content
        if fold_system and role == "user":
            body = f"(ns.system + '\\n\\n' if ns.system is not none else '') + {content}"
        text = "{{ " + _literal(prefix) + " + " + body + " + " + _literal(suffix) + " }}"
        reset = "{% set ns.system = none %}" if fold_system and role == "user" else ""
        branches.append("{% elif message['role'] == '" + role + "' %}" + text + reset)
    allowed = ", ".join(r for r in roles if not (fold_system and r == "system"))
    branches.append(
        "{% else %}{{ raise_exception('"
        + name
        + ": only "
        + allowed
        + (" roles, with one leading system message" if fold_system else " roles")
        + "') }}{% endif %}"
    )
    parts += [*branches, "{% endfor %}"]
    prompt = roles["assistant"][0] if generation is None else generation
    parts.append("{% if add_generation_prompt %}{{ " + _literal(prompt) + " }}{% endif %}")
    return "".join(parts)


def _headers(open_: str, close: str, end: str, assistant: str = "assistant") -> dict[str, tuple[str, str]]:
    return {role: (open_ + shown + close, end) for role, shown in
            (("system", "system"), ("user", "user"), ("assistant", assistant))}  # fmt: skip


_COHERE = {
    "system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
    "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
    "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
}
_COMMAND_A = {**_COHERE, "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_RESPONSE|>",
                                       "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>")}  # fmt: skip
_MISTRAL_TEKKEN = {"user": ("[INST]", "[/INST]"), "assistant": ("", "{eos}")}
_GEMMA4 = _headers("<|turn>", "\n", "<turn|>\n", assistant="model")

# Axolotl's other named templates, as their model families format text conversations. Deviations, all for
# prefix stability or reproducibility: a system message is folded into the *first* user turn (Mistral's
# originals move it to the last one); no date-stamped or vendor preambles (Llama 3.2 vision, Mistral v7,
# Command A, Metharme); no empty <think> blocks or thought channels (Qwen3, EXAONE 4, Gemma 4; Qwen3's reasoning is rendered); every
# assistant turn ends in eos_token where the original ends only the last one (Metharme, LLaVA).
FAMILY_TEMPLATES: dict[str, str] = {
    "mistral_v1": turns_template("mistral_v1", {"user": (" [INST] ", " [/INST]"), "assistant": (" ", "{eos}")},
                                 start="{bos}", fold_system=True, generation=""),
    "mistral_v2v3": turns_template("mistral_v2v3", {"user": ("[INST] ", "[/INST]"), "assistant": (" ", "{eos}")},
                                   start="{bos}", fold_system=True, generation=""),
    "mistral_v3_tekken": turns_template("mistral_v3_tekken", _MISTRAL_TEKKEN, start="{bos}", fold_system=True),
    "pixtral": turns_template("pixtral", _MISTRAL_TEKKEN, start="{bos}", fold_system=True),
    "mistral_v7_tekken": turns_template("mistral_v7_tekken", {"system": ("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
                                        **_MISTRAL_TEKKEN}, start="{bos}"),
    "cohere": turns_template("cohere", _COHERE, start="{bos}"),
    "aya": turns_template("aya", _COHERE, start="{bos}"),
    "command_a": turns_template("command_a", _COMMAND_A, start="{bos}"),
    "command_a_tool_use": turns_template("command_a_tool_use", _COMMAND_A, start="{bos}"),
    "command_a_rag": turns_template("command_a_rag", _COMMAND_A, start="{bos}"),
    "llama3_2_vision": _LLAMA3,
    "llama4": turns_template("llama4", _headers("<|header_start|>", "<|header_end|>\n\n", "<|eot|>"),
                             start="{bos}", trim=True),
    "phi_35": _PHI_35,
    "deepseek_v2": turns_template("deepseek_v2", {"system": ("", "\n\n"), "user": ("<｜User｜>", ""),
                                  "assistant": ("<｜Assistant｜>", "{eos}")}, start="{bos}"),
    "deepseek_v3": turns_template("deepseek_v3", {"system": ("", ""), "user": ("<｜User｜>", ""),
                                  "assistant": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")}, start="{bos}"),
    "jamba": turns_template("jamba", _headers("<|bom|><|", "|> ", "<|eom|>"), start="{bos}", default_system="",
                            generation="<|bom|><|assistant|>"),
    "qwen3": _QWEN3,
    "qwen3_5": _QWEN3,
    "nemotron_h": _CHATML,
    "qwen2_vl": turns_template("qwen2_vl", _headers("<|im_start|>", "\n", "<|im_end|>\n"),
                               default_system="You are a helpful assistant."),
    "falcon_h1": turns_template("falcon_h1", _headers("<|im_start|>", "\n", "<|im_end|>\n"), start="{bos}"),
    "exaone": turns_template("exaone", {"system": ("[|system|]", "[|endofturn|]\n"), "user": ("[|user|]", "\n"),
                             "assistant": ("[|assistant|]", "[|endofturn|]\n")}, default_system=""),
    "exaone4": turns_template("exaone4", _headers("[|", "|]\n", "[|endofturn|]\n"), default_system=None),
    "metharme": turns_template("metharme", {"system": ("<|system|>", ""), "user": ("<|user|>", ""),
                               "assistant": ("<|model|>", "{eos}")}, start="{bos}"),
    "llava": turns_template("llava", {"system": ("", " "), "user": ("USER: ", " "),
                            "assistant": ("ASSISTANT: ", "{eos} ")}, generation="ASSISTANT:"),
    "gemma3": _GEMMA,
    "gemma3n": _GEMMA,
    "gemma4": turns_template("gemma4", _GEMMA4, start="{bos}"),
    "gemma4_unified": turns_template("gemma4_unified", _GEMMA4, start="{bos}"),
}  # fmt: skip
ALL_TEMPLATES = {**NAMED_TEMPLATES, **FAMILY_TEMPLATES}
FALLBACK_PREFIX = "tokenizer_default_fallback_"


def resolve_chat_template(name: str | None, jinja: str | None, tokenizer) -> str | None:
    """The Jinja text for a recipe's `chat_template` (and `chat_template_jinja`).

    None or 'tokenizer_default' -> the tokenizer's own template; 'jinja' -> `jinja`;
    a named template -> its text; 'tokenizer_default_fallback_<name>' -> the tokenizer's own, else <name>.
    Raises UserError when there is nothing to use.
    """
    if name is not None and name.startswith(FALLBACK_PREFIX):
        own = getattr(tokenizer, "chat_template", None)
        if isinstance(own, dict):
            own = own.get("default")
        return own or resolve_chat_template(name.removeprefix(FALLBACK_PREFIX), jinja, tokenizer)
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
    if name in ALL_TEMPLATES:
        return ALL_TEMPLATES[name]
    guess = did_you_mean(name, [*ALL_TEMPLATES, "tokenizer_default", "jinja"])
    raise UserError(
        f"unknown chat template '{name}'",
        f"did you mean '{guess}'?"
        if guess
        else "use one of " + ", ".join(NAMED_TEMPLATES) + ", 'tokenizer_default' or 'jinja'",
    )


# tokenizer -> the chat_template_kwargs of the recipe it was loaded for
_TEMPLATE_KWARGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def use_template_kwargs(tokenizer, kwargs: dict | None) -> None:
    """The recipe's chat_template_kwargs for every rendering with this tokenizer (load_tokenizer calls it)."""
    _TEMPLATE_KWARGS[tokenizer] = dict(kwargs or {})


def template_kwargs(tokenizer) -> dict:
    """The chat_template_kwargs of the recipe this tokenizer was loaded for ({} for any other)."""
    try:
        return dict(_TEMPLATE_KWARGS.get(tokenizer, {}))
    except TypeError:  # an object that can't be weakly referenced (a stand-in tokenizer): no recipe loaded it
        return {}


def render(template: str, messages: list[dict], tokenizer, add_generation_prompt: bool = False,
           tools: list | None = None) -> str:  # fmt: skip
    """Render `messages` as text with `template`, using the tokenizer's special tokens (and `tools`, the row's tool
    definitions, where it has them)."""
    from jinja2.exceptions import TemplateError

    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            **({"tools": tools} if tools else {}), **template_kwargs(tokenizer),
        )  # fmt: skip
    except TemplateError as error:
        raise UserError(
            f"the chat template failed on a conversation: {error}",
            "check the roles and order of the messages, or pick another chat_template",
        ) from error


PROBE_TOOL = "llmtune_probe_tool"  # a function name no template writes unless it renders the call or the tool
_TOOL_RENDERING: dict[tuple, tuple[bool, bool]] = {}


def tool_rendering(template: str, tokenizer) -> tuple[bool, bool]:
    """(whether `template` renders an assistant's tool_calls, whether it renders the row's tools), found by rendering
    a probe conversation: llmtune's own templates, and many written for plain chat, drop both without a word."""
    key = (template, getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None),
           repr(template_kwargs(tokenizer)))  # fmt: skip
    if key not in _TOOL_RENDERING:
        function = {"name": PROBE_TOOL, "description": "", "parameters": {"type": "object", "properties": {}}}
        call = {"id": "call0", "type": "function", "function": {"name": PROBE_TOOL, "arguments": {}}}
        question = {"role": "user", "content": "q"}
        calls = [question, {"role": "assistant", "content": "", "tool_calls": [call]}]
        _TOOL_RENDERING[key] = (_shows_probe(template, calls, tokenizer, None),
                                _shows_probe(template, [question], tokenizer, [{"type": "function",
                                                                               "function": function}]))  # fmt: skip
    return _TOOL_RENDERING[key]


def _shows_probe(template: str, messages: list[dict], tokenizer, tools) -> bool:
    try:
        return PROBE_TOOL in render(template, messages, tokenizer, tools=tools)
    except Exception:  # a template that refuses the probe renders no tool call either
        return False


PROBE_THINKING = "llmtune probe reasoning"
_THINKING_RENDERING: dict[tuple, bool] = {}


def renders_thinking(template: str, tokenizer, key: str) -> bool:
    """Whether `template` writes an assistant's reasoning (its message key `key`) into the conversation: a template
    for plain chat drops it without a word, and the turn then trains on its answer alone."""
    cache = (template, key, getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None),
             repr(template_kwargs(tokenizer)))  # fmt: skip
    if cache not in _THINKING_RENDERING:
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: PROBE_THINKING}]
        try:
            _THINKING_RENDERING[cache] = PROBE_THINKING in render(template, messages, tokenizer)
        except Exception:  # a template that refuses the probe: the rows will say why
            _THINKING_RENDERING[cache] = True
    return _THINKING_RENDERING[cache]
