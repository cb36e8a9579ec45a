"""FxpipeError: the one base class of every error fxpipe raises for its user (partition, memory and pipe)."""
from __future__ import annotations

__all__ = ["FxpipeError", "first_line"]


class FxpipeError(Exception):
    """An error fxpipe raises on purpose; its message names the constraint, the values and the fix.

    Each subclass also derives from the built-in kind it stands for (ValueError for a bad
    request, TypeError for a bad type, RuntimeError for failed communication), so callers may
    catch either `FxpipeError` or the built-in class.
    """


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message, at most `limit` characters ('' when it has none)."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else ""
