"""The one exception a user's mistake raises, and the one-line form every error takes."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; the CLI prints it as one line, without a traceback."""


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def json_problem(exc: ValueError) -> str:
    """What is wrong with a JSON text, in words a user can act on ("a raw tab or newline inside
    a string at line 1, column 37: write it as \\t or \\n"), from `json`'s decode error."""
    msg, line, column = getattr(exc, "msg", None), getattr(exc, "lineno", None), getattr(exc, "colno", None)
    if msg is None:
        return first_line(exc)
    where = f"line {line}, column {column}" if line and line > 1 else f"column {column}"
    if msg.startswith("Invalid control character"):
        return f"a raw tab or newline inside a string at {where}: write it as \\t or \\n"
    if msg.startswith("Expecting value"):
        return f"no JSON value at {where} (an empty field, a trailing comma, or text that is not JSON?)"
    if msg.startswith("Extra data"):
        return f"more than one JSON value at {where} (one object per line in .jsonl files)"
    if msg.startswith("Unterminated string"):
        return f"a string that never ends, starting at {where}"
    return f"{msg.removesuffix(' at')[:1].lower()}{msg.removesuffix(' at')[1:]} at {where}"
