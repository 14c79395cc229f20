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
