"""The fields of one raw preference row, read as Axolotl's `rl:` dataset types read them: texts, labels, messages
under the dataset's field and role mappings, a conversation split into its history and last reply. Each reader
raises PreferenceRowError naming the field. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping

from llmtune.train.data.base import RowError

PROMPT_KEYS = ("prompt", "input", "question", "instruction")  # Axolotl's chatml.default looks in this order

DEFAULT_ROLES = {"user": ["user"], "assistant": ["assistant"], "system": ["system"], "tool": ["tool"]}


class PreferenceRowError(RowError):
    """A malformed preference row, with a hint on what to change."""


def _text(row: dict, name: str, key: str | None = None) -> str:
    value = row.get(name)
    if value is None:
        hint = f"set {key} to the field that holds it" if key else "pick the type whose fields match the data"
        raise PreferenceRowError(f"missing field '{name}' (row has: {', '.join(map(str, row)) or 'nothing'})", hint)
    if not isinstance(value, str):
        raise PreferenceRowError(f"field '{name}' should be text, not {type(value).__name__}")
    return value


def _system(row: dict, name: str = "system") -> list[dict]:
    value = _optional_text(row, name)
    return [{"role": "system", "content": value}] if value else []


def _optional_text(row: dict, name: str) -> str:
    value = row.get(name)
    if value is not None and not isinstance(value, str):
        raise PreferenceRowError(f"field '{name}' should be text, not {type(value).__name__}")
    return value or ""


def _label(row: dict, name: str, key: str | None = None) -> bool:
    value = row.get(name)
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if value is None:
        raise PreferenceRowError(f"missing field '{name}' (row has: {', '.join(map(str, row))})",
                                 f"set {key} to the field that holds it" if key else "KTO rows need a true/false label")  # fmt: skip
    raise PreferenceRowError(
        f"field '{name}' should be true or false, not {value!r}", "true marks a desirable completion"
    )


def _mappings(options: Mapping) -> tuple[str, str]:
    mappings = dict(options.get("message_property_mappings") or {})
    mappings.setdefault("role", options.get("message_field_role") or "role")
    mappings.setdefault("content", options.get("message_field_content") or "content")
    return mappings["role"], mappings["content"]


def _role_map(options: Mapping) -> dict[str, str]:
    roles = options.get("roles") or DEFAULT_ROLES
    # a target role also stands for itself, so `roles: {user: [human]}` still reads a "user" message
    mapping = {target: target for target in roles}
    mapping.update({source: target for target, sources in roles.items() for source in sources})
    return mapping


def _message(raw, where: str, options: Mapping, default_role: str | None = None) -> dict:
    role_key, content_key = _mappings(options)
    if not isinstance(raw, dict) or content_key not in raw or (role_key not in raw and default_role is None):
        raise PreferenceRowError(f"{where} should be a message with '{role_key}' and '{content_key}'",
                                 "set message_property_mappings to the message's keys")  # fmt: skip
    content = raw[content_key]
    if isinstance(content, list):  # [{"type": "text", "text": ...}]: TRL trains a completion whole, flags or not
        from llmtune.train.data.parts import joined_parts

        content = joined_parts(content, f"{where}.{content_key}")[0]
    if not isinstance(content, str):
        raise PreferenceRowError(f"{where}.{content_key} should be text, not {type(content).__name__}")
    roles = _role_map(options)
    role = raw.get(role_key, default_role)
    if role not in roles:
        raise PreferenceRowError(f"{where}.{role_key} is '{role}', not one of {', '.join(roles)}",
                                 "map it with roles: {user: [...], assistant: [...]}")  # fmt: skip
    return {"role": roles[role], "content": content}


def _conversation(row: dict, name: str, options: Mapping, key: str | None = None) -> list[dict]:
    value = row.get(name)
    if value is None:
        _text(row, name, key)  # raises the missing-field error
    if not isinstance(value, list) or not value:
        raise PreferenceRowError(f"field '{name}' should be a non-empty list of messages")
    return [_message(message, f"{name}[{index}]", options) for index, message in enumerate(value)]


def _reply_message(row: dict, name: str, options: Mapping, key: str | None = None) -> dict:
    """A reply given as text, as a message, or as a conversation whose last message is the reply."""
    value = row.get(name)
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict):
        reply = _message(value, name, options, default_role="assistant")
    elif isinstance(value, list) and value:
        reply = _message(value[-1], f"{name}[{len(value) - 1}]", options, default_role="assistant")
    elif value is None:
        raise PreferenceRowError(f"missing field '{name}' (row has: {', '.join(map(str, row))})",
                                 f"set {key} to the field that holds it" if key else None)  # fmt: skip
    else:
        raise PreferenceRowError(f"field '{name}' should be the reply: text, a message or a list of messages, "
                                 f"not {type(value).__name__}" + (" (empty)" if value == [] else ""))  # fmt: skip
    if reply["role"] != "assistant":
        raise PreferenceRowError(f"field '{name}' should end with the assistant's reply, not a {reply['role']} message")
    return reply


def _split(conversation: list[dict], name: str) -> tuple[list[dict], str]:
    """A whole conversation: the turns before the reply, and the reply."""
    if len(conversation) < 2 or conversation[-1]["role"] != "assistant":
        raise PreferenceRowError(f"field '{name}' should hold the conversation and end with the assistant's reply")
    return conversation[:-1], conversation[-1]["content"]


def _conversational(row: dict, names: tuple[str, ...]) -> bool:
    """Whether a passthrough row is in TRL's conversational shape (message lists) rather than text."""
    return any(isinstance(row.get(name), list) for name in names)


def _prompt_and_replies(row: dict, sides: tuple[str, ...], options: Mapping) -> tuple[list[dict], list[str]]:
    """A conversational row as TRL reads it: the prompt's messages and each side's reply (text, a message, or a list
    holding the one assistant message). Without a prompt, the sides are whole conversations and the messages they
    start with in common are the prompt (TRL's implicit prompt)."""

    def read(side: str) -> list[dict]:
        value = row.get(side)
        if isinstance(value, str):
            return [{"role": "assistant", "content": value}]
        if isinstance(value, dict):
            return [_message(value, side, options, default_role="assistant")]
        return _conversation(row, side, options)

    if row.get("prompt") is not None or len(sides) < 2:
        prompt, rests = _conversation(row, "prompt", options), {side: read(side) for side in sides}
    else:
        first, *others = conversations = [_conversation(row, side, options) for side in sides]
        shared = 0
        while all(shared < len(c) - 1 for c in conversations) and all(c[shared] == first[shared] for c in others):
            shared += 1
        if not shared:
            raise PreferenceRowError(f"fields {' and '.join(repr(s) for s in sides)} share no leading messages, so "
                                     "there is no prompt",
                                     "add a 'prompt' field, or start both with the same messages")  # fmt: skip
        prompt, rests = first[:shared], {side: c[shared:] for side, c in zip(sides, conversations, strict=True)}
    replies = []
    for side, rest in rests.items():
        if len(rest) != 1 or rest[0]["role"] != "assistant":
            roles = ", ".join(message["role"] for message in rest) or "nothing"
            raise PreferenceRowError(f"field '{side}' should hold one assistant reply after the prompt, not {roles}",
                                     "put the earlier turns in 'prompt' (or in both sides alike)")  # fmt: skip
        replies.append(rest[0]["content"])
    return prompt, replies
