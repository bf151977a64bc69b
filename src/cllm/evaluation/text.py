"""What a teacher-forced loss does not show, measured on free-running text (token ids, EOS
removed): repetition, loops, where two texts part, and, for Python prompt sets, whether the
completed function parses.

- degenerate: one token repeated `DEGENERATE_RUN` (10)+ times in a row (the reference's filter);
- looping: the last 24 tokens repeat one pattern of at most 8 tokens ('_cache_cache_cache...');
- parses: prompt + completion, cut where the function ends, is valid Python with a body (the
  named prompt sets are Python function signatures + docstrings; a user's set is judged Python
  when its prompts are, see `is_python_set`).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from itertools import pairwise

DEGENERATE_RUN = 10  # the reference drops outputs repeating one token this many times in a row
LOOP_MIN_LENGTH, LOOP_MAX_PERIOD = 24, 8  # the tail that must repeat, and the longest pattern
PYTHON_SHARE = 0.8  # a prompt set is Python when this share of its prompts open a Python function


def is_degenerate(tokens: Sequence[int], run: int = DEGENERATE_RUN) -> bool:
    """True if one token repeats `run` or more times in a row."""
    count = 1
    for prev, cur in pairwise(tokens):
        count = count + 1 if cur == prev else 1
        if count >= run:
            return True
    return False


def ends_in_loop(ids: Sequence[int], *, max_period: int = LOOP_MAX_PERIOD,
                 min_length: int = LOOP_MIN_LENGTH) -> bool:
    """Whether the last `min_length` tokens repeat one pattern of at most `max_period` tokens,
    which the one-token degenerate test does not see."""
    tail = list(ids[-min_length:])
    if len(tail) < min_length:
        return False
    return any(all(tail[i] == tail[i - p] for i in range(p, len(tail))) for p in range(1, max_period + 1))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where two token lists differ (the shorter length if one is a
    prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def strip_eos(tokens: Sequence[int], eos: int | None) -> tuple[list[int], bool]:
    """The completion before its EOS, and whether the model stopped by itself."""
    tokens = list(tokens)
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos)], True
    return tokens, False


def cut_at_function_end(prompt: str, completion: str, *, finished: bool = False) -> str:
    """prompt + completion, cut where the function body ends: before the first non-blank
    completion line that starts at column 0 (the rest of the prompt's own last line never
    counts). If the body never ends, drop the unfinished last line (unless `finished`, i.e.
    the model stopped by itself)."""
    lines = completion.splitlines(keepends=True)
    kept = [] if prompt.endswith("\n") or not lines else [lines.pop(0)]
    for line in lines:
        if line.strip() and not line[0].isspace():
            return prompt + "".join(kept)
        kept.append(line)
    text = "".join(kept)
    if not finished and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return prompt + text


def function_parses(prompt: str, completion: str, *, finished: bool = False) -> bool:
    """Whether prompt + completion, cut at the end of the function, is valid Python whose last
    function has a body beyond its docstring (an empty body is not a completion)."""
    try:
        tree = ast.parse(cut_at_function_end(prompt, completion, finished=finished))
    except (SyntaxError, ValueError):
        return False
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not functions:
        return True
    body = functions[-1].body
    return len(body) > 1 or ast.get_docstring(functions[-1]) is None


def opens_a_python_function(prompt: str) -> bool:
    """Whether the prompt is a Python function's opening (signature, maybe a docstring) that a
    body completes: the prompt with `pass` as its body parses and defines a function."""
    lines = prompt.rstrip().splitlines()
    last = lines[-1] if lines else ""
    indent = last[: len(last) - len(last.lstrip())] + ("    " if last.rstrip().endswith(":") else "")
    try:
        tree = ast.parse(prompt.rstrip() + "\n" + indent + "pass\n")
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))


def is_python_set(prompts: Sequence[str]) -> bool:
    """Whether a prompt set's parse rate means something: most of its prompts open a Python
    function (the named sets all do)."""
    return bool(prompts) and sum(map(opens_a_python_function, prompts)) >= PYTHON_SHARE * len(prompts)
