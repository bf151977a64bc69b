"""Option text that means "nothing": `--cllm none`, `--ar-text ''`, `--out none`, `--draft-table off`."""

from __future__ import annotations

from collections.abc import Sequence

OFF = ("", "none", "null", "false")


def is_off(value: str | None, words: Sequence[str] = OFF) -> bool:
    """Whether an option's text is one of `words` (blanks around it and case ignored); None is not.

    Each option keeps the words it has always taken: `OFF` for model and text options, fewer
    where a word could be a real file name (`--out false` writes to ./false).
    """
    return value is not None and value.strip().lower() in words
