"""The strict base every recipe section builds on."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from llmtune.errors import did_you_mean

# Names users write for a key, which spelling distance alone would match with another (lora_rank ~ local_rank)
MEANT = {"lora_rank": "lora_r", "rank": "lora_r", "lora_dim": "lora_r", "lr": "learning_rate",
         "max_seq_length": "sequence_len", "max_seq_len": "sequence_len", "epochs": "num_epochs",
         "batch_size_per_device": "micro_batch_size", "per_device_train_batch_size": "micro_batch_size"}  # fmt: skip


def key_guess(key: str, known: list[str]) -> str | None:
    """The known key a user most likely meant by `key`, or None."""
    return MEANT.get(key) if MEANT.get(key) in known else did_you_mean(key, known)


def unknown_key_message(key: Any, known: list[str]) -> str:
    if not isinstance(key, str):
        return f"key {key!r} is not a string"
    guess = key_guess(key, known)
    text = f"unknown key '{key}'"
    return text + (f"; did you mean '{guess}'?" if guess else "")


class Section(BaseModel):
    """A pydantic model that refuses keys it does not define, with a did-you-mean."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)  # .inf and .nan: no setting

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = list(cls.model_fields)
            for key in data:
                if key not in cls.model_fields:
                    raise ValueError(unknown_key_message(key, known))
            # Axolotl recipes write `key:` (null) to mean "the default".
            data = {k: v for k, v in data.items() if v is not None or cls.model_fields[k].is_required()}
        return data


def empty_to_none(value: Any) -> Any:
    """YAML writes 'nothing' as null, '' or 'none'; treat them alike."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    return value


def jinja_text(value: str | None, key: str) -> str | None:
    """chat_template_jinja as the template text: Axolotl (v0.11.0 on) also takes a path to a .jinja file there."""
    from pathlib import Path

    if not isinstance(value, str) or "\n" in value or "{" in value:
        return value
    try:
        path = Path(value.strip()).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError, RuntimeError, UnicodeDecodeError):  # not a name any file system takes: the text
        return value
    if path.suffix in (".jinja", ".j2", ".jinja2"):
        raise ValueError(f"{key}: {value} is not a file (a path to a .jinja file, or the template text itself)")
    return value


def jinja_syntax(text: str, key: str) -> None:
    """A chat template that doesn't parse is the key's error at validate (it was each row's, at preprocess). Parsed
    as transformers compiles templates: loop controls, and the {% generation %} blocks of assistant masks."""
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(line)

    try:
        jinja2.Environment(extensions=[Generation, jinja2.ext.loopcontrols]).parse(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{key}: the template doesn't parse: {err.message} (its line {err.lineno})") from None


def unfilled_placeholder(value: str, field: str) -> str | None:
    """Why a custom format string would fail at the first row (str.format), or None: only {instruction} and {input}
    are filled in a prompt format, {system} in system_format."""
    import string

    filled = ("system",) if field == "system_format" else ("instruction", "input")
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(value) if name is not None]
    except ValueError as err:
        return f"{value!r} is not a format string ({err}); write a literal brace as {{{{ or }}}}"
    wrong = next((name for name in names if name not in filled), None)
    shown = " and ".join(f"{{{name}}}" for name in filled)
    return (
        None
        if wrong is None
        else f"{{{wrong}}} is never filled: only {shown} are (a literal brace is written {{{{ or }}}})"
    )
