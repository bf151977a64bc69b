"""`cllm export`: a checkpoint as one GGUF file for llama.cpp (`cllm.runtime.gguf` writes it),
quantized by llama.cpp's own quantizer when asked (`--quantize`), with its side folder
(`OUT.cllm/`: the tokenizer files, the draft table, the decode setting tuned on the llama.cpp
runtime) where `load_for_decoding("OUT.gguf")` finds them, and the draft table as llama.cpp's
static n-gram cache when asked (`--lookup-cache`).

The GGUF and its side folder are written whole into a staging folder beside the GGUF
(`.NAME.gguf.<random>.export/`: the unquantized file, the quantized one, the side folder),
then published side folder first and GGUF last, so that a GGUF present means its side folder
is complete. The staging folder is removed on any exit the process sees (an error, Ctrl-C,
SIGTERM); one a killed run left (SIGKILL) is removed by the next export to the same GGUF: its
marker names that GGUF and its lock is free (the lock dies with its process). Other temporary-
looking files beside the GGUF are not provably a cllm export's, and are reported, not removed."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from cllm.core.errors import UserError, first_line
from cllm.core.outputs import (
    Input,
    check_distinct,
    check_folder,
    check_new_file,
    claim_folder,
    read_marker,
    write_failures,
)
from cllm.models import (
    DECODE_DEFAULTS_LLAMACPP,
    DRAFT_TABLE,
    TOKENIZER_FILES,
    TOKENIZER_READS,
    fingerprint,
    load_draft_table,
    load_model,
    load_tokenizer,
    resolve_model_path,
    tokenizer_fingerprint,
)
from cllm.models.gguf import side_folder
from cllm.runtime.gguf import GgufSummary, import_gguf, write_gguf
from cllm.runtime.llamacpp import unavailable
from cllm.runtime.llamacpp_files import quantize
from cllm.serving.config import ExportConfig
from cllm.serving.lookup_cache import write_lookup_cache

log = logging.getLogger(__name__)

STAGING = ".export"  # the suffix of a staging folder (`.NAME.gguf.<random>.export`)
LOCK = "export.lock"  # in a staging folder: the GGUF it is for, locked while its export runs


def export_gguf(config: ExportConfig) -> GgufSummary:
    """Check the outputs and the inputs, then write the GGUF, its side folder and the lookup
    cache when asked."""
    import_gguf()  # before anything loads: a missing package is the first thing said
    if config.quantize and (reason := unavailable()) is not None:
        raise UserError(f"--quantize uses llama.cpp's quantizer: {reason}")
    path = resolve_model_path(config.model)
    model_input = [Input("--model", path)]
    side = side_folder(config.gguf)
    check_distinct([("--gguf", config.gguf), ("--lookup-cache", config.lookup_cache), ("the side folder", side)])
    out = check_new_file(config.gguf, force=config.force, flag="--gguf", what="GGUF file", inputs=model_input)
    check_folder(side, "export", force=config.force, flag=f"--gguf's side folder ({side.name})",
                 inputs=model_input)
    if config.lookup_cache and Path(config.lookup_cache).expanduser().resolve().is_relative_to(side.resolve()):
        # the side folder may not exist yet, so check_new_file's input check cannot see it
        raise UserError(f"--lookup-cache {config.lookup_cache} lies inside the side folder {side}: choose a path "
                        "outside it")
    table = load_draft_table(path, "auto")
    if config.lookup_cache:
        check_new_file(config.lookup_cache, force=config.force, flag="--lookup-cache", what="lookup cache",
                       inputs=[*model_input, Input("the side folder", side)])
        if table is None:
            raise UserError(f"--lookup-cache: {config.model} has no draft table (cllm drafts --model "
                            f"{config.model} builds one)")
    with write_failures(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        sweep_stale(out)
    model, tokenizer = load_model(path), load_tokenizer(path)
    source = {"model": str(config.model), "fingerprint": fingerprint(path),
              "tokenizer": tokenizer_fingerprint(path), **({"quantize": config.quantize} if config.quantize else {})}
    with write_failures(out), staging(out) as scratch:
        staged = scratch / "model.gguf"
        if config.quantize:
            summary = _write_quantized(model, tokenizer, staged, config, name=Path(path).name, source=source)
        else:
            summary = write_gguf(model, tokenizer, staged, out_type=config.out_type, name=Path(path).name,
                                 source=source)
        what = _write_side_folder(Path(path), scratch / "side", side, has_table=table is not None)
        _publish(scratch, out, side)
    summary = replace(summary, path=out,
                      side=f"wrote {side}/: {', '.join(what)} (load_for_decoding of the GGUF reads them there)")
    if table is not None and config.lookup_cache:
        with write_failures(Path(config.lookup_cache)):
            Path(config.lookup_cache).parent.mkdir(parents=True, exist_ok=True)
            kept = write_lookup_cache(table, config.lookup_cache)
        summary = replace(summary, lookup_cache=(
            f"wrote {config.lookup_cache}: the draft table's {kept:,} two-token contexts of {len(table):,} as "
            "llama.cpp's static n-gram cache (llama-lookup --lookup-cache-static)"))
    return summary


def _write_quantized(model, tokenizer, out: Path, config: ExportConfig, *, name: str, source: dict) -> GgufSummary:
    """The GGUF in --out-type beside `out` (in the staging folder), quantized from there to `out`."""
    plain = out.with_name("source.gguf")
    summary = write_gguf(model, tokenizer, plain, out_type=config.out_type, name=name, source=source)
    try:
        quantize(plain, out, config.quantize, threads=config.threads)
    except ValueError as exc:
        raise UserError(f"--quantize {config.quantize}: {first_line(exc)}") from None
    plain.unlink()  # the unquantized file can be the size of the float model
    return replace(summary, out_type=config.quantize, bytes=out.stat().st_size)


# ----------------------------------------------------------------------------------------------
# The staging folder: everything written before the GGUF appears


@contextmanager
def staging(out: Path) -> Iterator[Path]:
    """A new folder beside `out`, holding a marker naming `out` that this process keeps locked
    while the block runs; removed when the block ends, however it ends (SIGTERM included: it
    is raised as SystemExit here while the block runs in the main thread)."""
    folder = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=STAGING))
    try:
        with _sigterm_as_exit(), open(folder / LOCK, "w", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: free
            json.dump({"command": "export", "output": str(out.resolve()), "pid": os.getpid()}, lock)
            lock.flush()
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raised as SystemExit (status 143) while the block runs, so that its cleanup runs
    (the default action kills the process on the spot). Outside the main thread, no handler."""
    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def sweep_stale(out: Path) -> list[Path]:
    """Remove the staging folders that exports to `out` killed before their end left beside it
    (their marker names `out`, their lock is free); a UserError when one is in use (another
    export to `out` is running); log the other temporary-looking entries `.NAME.gguf.*`, which
    are not provably an export's. Returns the folders removed."""
    removed, unknown = [], []
    target = str(out.resolve())
    for entry in sorted(out.parent.glob(f".{out.name}.*")):
        if not (entry.is_dir() and entry.name.endswith(STAGING) and (entry / LOCK).is_file()):
            unknown.append(entry.name)
            continue
        with open(entry / LOCK, encoding="utf-8") as lock:
            try:
                marker = json.loads(lock.read() or "{}")
            except ValueError:
                marker = {}  # a run killed before it wrote its marker wrote nothing else either
            if marker.get("output", target) != target:
                unknown.append(entry.name)
                continue
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserError(f"--gguf {out}: another cllm export (pid {marker.get('pid', '?')}) is writing it "
                                "now: wait for it, or choose another path") from None
            shutil.rmtree(entry)
        removed.append(entry)
    if removed:
        log.info("removed %d staging folder(s) of killed exports of %s", len(removed), out)
    if unknown:
        log.warning("left beside %s, not provably a cllm export's (remove them when no export runs): %s", out,
                    ", ".join(unknown))
    return removed


def _publish(scratch: Path, out: Path, side: Path) -> None:
    """Move the staged side folder and GGUF into place: an old GGUF out of the way first (it
    may not stand beside a changing side folder), the side folder next, the GGUF last. An old
    side folder of an export is replaced whole; a foreign one (--force) is written into."""
    if out.exists() or out.is_symlink():
        os.replace(out, scratch / "old.gguf")
    if side.is_dir() and (read_marker(side) or {}).get("command") == "export":
        os.replace(side, scratch / "old.cllm")
    if side.exists():
        shutil.copytree(scratch / "side", side, dirs_exist_ok=True)
    else:
        os.replace(scratch / "side", side)
    os.replace(scratch / "model.gguf", out)


def _write_side_folder(model: Path, staged: Path, side: Path, *, has_table: bool) -> list[str]:
    """Copy what decodes with the GGUF (tokenizer files as they are, the draft table, the decode
    setting tuned on llama.cpp) into `staged`, the side folder `side` to be; returns what it
    wrote, in words."""
    with write_failures(side):
        claim_folder(staged, "export")
        copied = []
        for pattern in (*TOKENIZER_FILES, *TOKENIZER_READS, "chat_template.jinja", "generation_config.json"):
            for file in model.glob(pattern):
                if file.name != "config.json" and file.is_file():
                    shutil.copyfile(file, staged / file.name)
                    copied.append(file.name)
        what = ["the tokenizer"]
        if has_table:
            (staged / DRAFT_TABLE).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(model / DRAFT_TABLE, staged / DRAFT_TABLE)
            what.append("the draft table")
        defaults = model / DECODE_DEFAULTS_LLAMACPP
        if defaults.is_file():
            shutil.copyfile(defaults, staged / DECODE_DEFAULTS_LLAMACPP)
            what.append("the decode setting tuned on llama.cpp")
    return what
