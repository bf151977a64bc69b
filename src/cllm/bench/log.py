"""What `cllm bench` has measured so far, on disk as it is measured: OUT/progress.jsonl.

A crash or a Ctrl-C keeps every (method, prompt) decode finished before it, every sweep point
and every validation loss; the same command (same models, same measuring settings) then
resumes: it measures only what is missing and writes the report from the lot. A run whose
settings differ starts afresh, and the older file is kept under another name (never
overwritten). The first line is a header holding the run's key; each later line one record:

  {"kind": "decode", "method", "prompt_id", "prompt_ids", "tokens", "forward_passes",
   "accepted", "stats", "draft_forward_passes", "seconds": [one per round]}
  {"kind": "sweep", "role", "n", "result", "violations"}
  {"kind": "value", "name", "value"}

A line cut short by a kill is ignored (its record is measured again).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
from pathlib import Path
from typing import Any

from cllm.core.outputs import claim_folder
from cllm.core.runs import append_jsonl
from cllm.decoding import DecodeStats

PROGRESS = "progress.jsonl"
# settings that do not change what a (method, prompt) decode or a sweep point measures
NOT_IN_KEY = ("out", "json", "methods", "sweep_block_sizes", "prompts", "max_prompts", "val_set", "val_prompts",
              "val_tokens", "trajectory_prompt", "tie_tolerance", "resume", "quality", "quality_timeout")


def run_key(settings: dict[str, Any], fingerprints: dict[str, str], versions: dict[str, str]) -> str:
    """A hash of what the measurements depend on: the settings, the models' weights, versions."""
    kept = {k: v for k, v in settings.items() if k not in NOT_IN_KEY}
    blob = json.dumps({"settings": kept, "models": fingerprints, "versions": versions}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class BenchLog:
    """The records of one run key, loaded from and appended to `path`."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.decodes: dict[tuple[str, str], dict] = {}
        self.sweeps: dict[tuple[str, int], dict] = {}
        self.values: dict[str, Any] = {}
        self.reused = 0  # decodes taken from an earlier run
        self.note: str | None = None  # what happened to an earlier file

    @classmethod
    def open(cls, out: str | Path, key: str, *, resume: bool = True) -> BenchLog:
        out = claim_folder(out, "bench")
        log = cls(out / PROGRESS, key)
        if log.path.is_file():
            records = _read(log.path)
            if resume and records and records[0].get("kind") == "header" and records[0].get("key") == key:
                log._load(records[1:])
                return log
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            kept = log.path.with_name(f"progress-{stamp}.jsonl")
            log.path.rename(kept)
            why = "--resume false" if resume is False else "other settings or models"
            log.note = f"{log.path} held an earlier run ({why}): kept as {kept.name}, measuring afresh"
        append_jsonl(log.path, {"kind": "header", "key": key,
                                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")})
        return log

    def _load(self, records: list[dict]) -> None:
        for r in records:
            try:
                if r.get("kind") == "decode":
                    self.decodes[(r["method"], r["prompt_id"])] = r
                elif r.get("kind") == "sweep":
                    self.sweeps[(r["role"], int(r["n"]))] = r
                elif r.get("kind") == "value":
                    self.values[r["name"]] = r["value"]
            except (KeyError, TypeError, ValueError):  # a damaged record: measured again
                continue

    def decode(self, method: str, prompt_id: str, prompt_ids: list[int]) -> dict | None:
        """The recorded decode of `prompt_id` by `method`, if its prompt tokens are the same."""
        record = self.decodes.get((method, prompt_id))
        return record if record is not None and record["prompt_ids"] == list(prompt_ids) else None

    def add_decode(self, method: str, prompt_id: str, prompt_ids: list[int], decoded: Any,
                   seconds: list[float]) -> None:
        record = {"kind": "decode", "method": method, "prompt_id": prompt_id, "prompt_ids": list(prompt_ids),
                  "tokens": decoded.tokens, "forward_passes": decoded.forward_passes, "accepted": decoded.accepted,
                  "stats": dataclasses.asdict(decoded.stats) if decoded.stats is not None else None,
                  "draft_forward_passes": decoded.draft_forward_passes, "seconds": seconds}
        self.decodes[(method, prompt_id)] = record
        append_jsonl(self.path, record)

    def add_sweep(self, role: str, n: int, result: dict, violations: list[dict]) -> None:
        record = {"kind": "sweep", "role": role, "n": n, "result": result, "violations": violations}
        self.sweeps[(role, n)] = record
        append_jsonl(self.path, record)

    def add_value(self, name: str, value: Any) -> None:
        self.values[name] = value
        append_jsonl(self.path, {"kind": "value", "name": name, "value": value})


def stats_from(record: dict | None) -> DecodeStats | None:
    return DecodeStats(**record) if record is not None else None


def _read(path: Path) -> list[dict]:
    """The file's records (JSON objects); a line cut short by a kill, or anything that is not a
    record, is left out (what it held is measured again)."""
    records = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
