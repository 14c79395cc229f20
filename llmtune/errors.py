"""The one exception type for mistakes a user can fix.

The CLI prints a `UserError` as a single line (message, then hint) and exits 2;
anything else is an internal error and may show a traceback.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem in the user's input (recipe, flags, files, data), with a hint."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def one_line(self) -> str:
        text = self.message.strip().replace("\n", " ")
        if self.hint:
            text += f" (hint: {self.hint.strip()})"
        return text


def did_you_mean(name: str, candidates: Iterable[str]) -> str | None:
    """The closest known name to a misspelt one, or None."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


DAMAGED = ("SafetensorError", "JSONDecodeError", "UnicodeDecodeError", "HeaderTooLarge", "EOFError")


def damaged(path, err: BaseException) -> UserError:
    """A model, adapter or run file that can't be read (truncated by a copy, a full disk, an interrupted save)."""
    reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
    earlier = "; an earlier checkpoint may still be whole (llmtune checkpoint RUN lists them)"
    return UserError(f"{path} can't be read ({reason}): it is damaged or incompletely written",
                     "copy or save it again" + (earlier if "checkpoint-" in str(path) else ""))  # fmt: skip


class reading:  # noqa: N801 - used as a context manager: `with reading(path):`
    """Turns a damaged file's read error (safetensors' header errors, malformed JSON, cut-off text) into one line
    naming the file; other errors pass through."""

    def __init__(self, path) -> None:
        self.path = path

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, err, _trace) -> bool:
        if err is not None and not isinstance(err, UserError) and kind.__name__ in DAMAGED:
            raise damaged(self.path, err) from None
        return False
