"""Jacobi trajectory records: schema, Parquet shards, meta.json, validation and batching.

A trajectory directory holds

    meta.json                    what produced the records (see `TrajectoryMeta`)
    config.json                  the resolved `cllm collect` config of the latest run
    shard-r000-00000.parquet     records; r = process index, then that process's shard counter

Settings live in meta.json, never in file names. One record per (prompt, block):

    prompt_id, prompt_index      the prompt's id and its position in the prompt set
    block_index                  0-based block counter within the prompt's continuation
    prompt_len                   prefix_ids[:prompt_len] are the (unpadded) prompt ids, as the
                                 target's tokenizer encodes the prompt (its own special tokens)
    prefix_ids                   prompt ids + the fixed points of the earlier blocks
    states                       the Jacobi trajectory: states[0] = initial guess, states[-1] =
                                 fixed point, consecutive duplicates removed. When EOS ends the
                                 block early every state is cut to the fixed point's length.
    fixed_point                  the block's fixed point (== greedy decoding of the prefix)
    labels                       the prompt's whole ground-truth continuation (the reference),
                                 tokenized on its own without special tokens (no EOS appended),
                                 the same on every record of the prompt; None when the prompt has
                                 no reference. AR target: prefix_ids[:prompt_len] + labels.
    augmented_states             extra states made by copying fixed-point tokens into real ones
                                 (`cllm.training.collect.augment_states`), kept apart so that `states`
                                 stays a true trajectory whose neighbours are real Jacobi updates
                                 (LC loss). Empty unless collected with --augment.

Token columns are Parquet list<int32>. All records of a prompt live in one shard, and each
shard's footer lists the prompt ids it completes (also those whose records were all dropped as
degenerate), so a resumed collection knows what is done without reading record data. Shards are
written to a temporary file and renamed, so a shard is either whole or absent. Reading checks
Parquet page checksums, the schema and every record's invariants: a damaged shard raises
`TrajectoryError`, never a wrong batch.

This module knows nothing about models or decoding; it stores and serves token ids.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from cllm.core.errors import UserError, first_line, json_problem
from cllm.core.outputs import PARTIAL, replacing

SCHEMA_VERSION = 1
META_FILE = "meta.json"

SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64(), nullable=False),
        pa.field("block_index", pa.int32(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("prefix_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("states", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("fixed_point", pa.list_(pa.int32()), nullable=False),
        pa.field("labels", pa.list_(pa.int32()), nullable=True),
        pa.field("augmented_states", pa.list_(pa.list_(pa.int32())), nullable=False),
    ]
)
_SHARD_RE = re.compile(r"^shard-r(\d{3,})-(\d{5,})\.parquet$")


class TrajectoryError(UserError):
    """A trajectory directory or shard that is missing, damaged or from other settings."""


@dataclass(frozen=True)
class TrajectoryRecord:
    prompt_id: str
    prompt_index: int
    block_index: int
    prompt_len: int
    prefix_ids: list[int]
    states: list[list[int]]
    fixed_point: list[int]
    labels: list[int] | None = None
    augmented_states: list[list[int]] = field(default_factory=list)

    def check(self) -> None:
        """Raise ValueError unless the record keeps the invariants of the module docstring."""
        n = len(self.fixed_point)
        if n == 0 or not self.states:
            raise ValueError("empty fixed point or trajectory")
        if any(len(s) != n for s in self.states) or any(len(s) != n for s in self.augmented_states):
            raise ValueError("a state's length differs from the fixed point's")
        if list(self.states[-1]) != list(self.fixed_point):
            raise ValueError("the last state is not the fixed point")
        if self.block_index < 0 or not 0 < self.prompt_len <= len(self.prefix_ids):
            raise ValueError("bad block_index or prompt_len")
        if any(t < 0 for row in self.token_rows() for t in row):
            raise ValueError("a negative token id")

    def fits(self, meta: TrajectoryMeta) -> None:
        """Raise ValueError unless a collect with `meta`'s settings could have written the record:
        its block at most `block_size` tokens, every earlier block of its prompt a whole one (only
        a prompt's last block is cut short, by EOS or the budget)."""
        if len(self.fixed_point) > meta.block_size:
            raise ValueError(f"a block of {len(self.fixed_point)} tokens, more than the block size {meta.block_size}")
        if len(self.prefix_ids) != self.prompt_len + self.block_index * meta.block_size:
            raise ValueError(f"block {self.block_index} follows {len(self.prefix_ids) - self.prompt_len} generated "
                             f"tokens, not {self.block_index} blocks of {meta.block_size}")

    def token_rows(self) -> Iterator[list[int]]:
        """Every list of token ids the record holds."""
        yield self.prefix_ids
        yield self.fixed_point
        yield from self.states
        yield from self.augmented_states
        if self.labels is not None:
            yield self.labels


@dataclass(frozen=True)
class TrajectoryMeta:
    """What produced a trajectory directory. A resumed collection must match it exactly,
    except for the informational fields in `INFORMATIONAL`."""

    model: str  # as given by the user (informational)
    model_fingerprint: str
    tokenizer_fingerprint: str
    block_size: int
    max_new_tokens: int
    guess: str
    dtype: str
    seed: int
    prompts: str  # prompt set name or path (informational)
    prompts_fingerprint: str
    text_field: str
    augment: bool
    eos_token_id: int | None
    pad_token_id: int
    cllm_version: str
    schema_version: int = SCHEMA_VERSION
    drop_loops: bool = False  # records dropped from a prompt's first looping block on

    INFORMATIONAL = ("model", "prompts")

    def digest(self) -> str:
        """A short hash of the settings (all but the informational fields): written into every
        shard, so that a shard of another collect is never read as this one's."""
        settings = {k: v for k, v in asdict(self).items() if k not in self.INFORMATIONAL}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]

    def mismatches(self, other: TrajectoryMeta) -> list[str]:
        """`key: here != there` for every setting that differs."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name not in self.INFORMATIONAL and a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    with replacing(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def write_meta(directory: str | Path, meta: TrajectoryMeta) -> Path:
    path = Path(directory) / META_FILE
    _atomic_write_bytes(path, (json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n").encode())
    return path


def read_meta(directory: str | Path) -> TrajectoryMeta:
    """The directory's meta.json; a missing, malformed or other-schema file is a TrajectoryError."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        raise TrajectoryError(f"no {META_FILE} in {directory}: not a trajectory directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise TrajectoryError(f"cannot parse {path}: {json_problem(exc)}") from None
    except OSError as exc:
        raise TrajectoryError(f"cannot read {path}: {first_line(exc)}") from None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        found = data.get("schema_version") if isinstance(data, dict) else None
        raise TrajectoryError(
            f"{path} has trajectory schema version {found!r}; this cllm reads {SCHEMA_VERSION}"
        )
    names = {f.name for f in fields(TrajectoryMeta)}
    optional = {f.name for f in fields(TrajectoryMeta) if f.default is not MISSING}  # added later
    if not set(data) <= names or names - optional - set(data):
        raise TrajectoryError(f"{path} has unexpected or missing keys: {sorted(set(data) ^ names)}")
    return TrajectoryMeta(**data)


# ---------------------------------------------------------------------------------------------
# Shards


def shard_name(process_index: int, seq: int) -> str:
    return f"shard-r{process_index:03d}-{seq:05d}.parquet"


def list_shards(directory: str | Path) -> list[Path]:
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _SHARD_RE.match(p.name))


def next_shard_seq(directory: str | Path, process_index: int) -> int:
    """One past the highest shard counter this process index has used in `directory`."""
    seqs = [int(m[2]) for p in list_shards(directory) if (m := _SHARD_RE.match(p.name))
            and int(m[1]) == process_index]
    return max(seqs, default=-1) + 1


def remove_partial_files(directory: str | Path) -> int:
    """Delete temporary files left by a killed writer; returns how many."""
    partial = [p for p in Path(directory).glob(f".*{PARTIAL}") if p.is_file()]
    for p in partial:
        p.unlink()
    return len(partial)


def write_shard(
    path: str | Path,
    records: Sequence[TrajectoryRecord],
    *,
    completed_prompt_ids: Sequence[str],
    dropped: int = 0,
    meta: TrajectoryMeta | None = None,
) -> Path:
    """Write records atomically (temp file + rename). The footer records which prompts this
    shard completes, so resuming never needs to read record data, and the digest of the
    collect's settings (`meta`), so that no other collect's shard passes for one of its own."""
    path = Path(path)
    for r in records:
        r.check()
    columns = {f.name: [getattr(r, f.name) for r in records] for f in SCHEMA}
    table = pa.Table.from_pydict(columns, schema=SCHEMA)
    table = table.replace_schema_metadata(
        {
            "cllm.schema_version": str(SCHEMA_VERSION),
            "cllm.completed_prompt_ids": json.dumps(list(completed_prompt_ids)),
            "cllm.num_records": str(len(records)),
            "cllm.dropped": str(dropped),
            **({"cllm.meta_digest": meta.digest()} if meta is not None else {}),
        }
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_page_checksum=True)
    _atomic_write_bytes(path, sink.getvalue().to_pybytes())
    return path


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    completed_prompt_ids: list[str]
    num_records: int
    dropped: int
    meta_digest: str | None = None  # of the collect's settings (None: a shard of an older cllm)


def _damaged(path: Path, why: object) -> TrajectoryError:
    first = first_line(why) if isinstance(why, BaseException) else str(why)
    return TrajectoryError(f"damaged trajectory shard {path}: {first} (delete it to recollect)")


def read_shard_info(path: str | Path) -> ShardInfo:
    """The shard's footer: cheap (no record data is read)."""
    path = Path(path)
    try:
        schema = pq.read_schema(path)
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes pyarrow raise
        raise _damaged(path, exc) from None
    try:
        meta = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
        if int(meta["cllm.schema_version"]) != SCHEMA_VERSION:
            raise ValueError(f"schema version {meta['cllm.schema_version']}")
        ids = json.loads(meta["cllm.completed_prompt_ids"])
        return ShardInfo(path, list(ids), int(meta["cllm.num_records"]), int(meta["cllm.dropped"]),
                         meta.get("cllm.meta_digest"))
    except (KeyError, ValueError, TypeError) as exc:
        raise _damaged(path, f"bad footer metadata ({exc})") from None


def completed_prompt_ids(directory: str | Path) -> set[str]:
    done: set[str] = set()
    for path in list_shards(directory):
        done.update(read_shard_info(path).completed_prompt_ids)
    return done


def set_aside_damaged_shards(directory: str | Path) -> list[Path]:
    """Read every shard whole (footer, page checksums, every record); a damaged one is renamed
    `<name>.damaged`, so that no reader sees it and a resumed collection decodes its prompts
    again. Returns the new names."""
    moved = []
    for path in list_shards(directory):
        try:
            read_shard(path)
        except TrajectoryError:
            moved.append(path.rename(path.with_name(path.name + ".damaged")))
    return moved


def read_shard(path: str | Path, meta: TrajectoryMeta | None = None) -> list[TrajectoryRecord]:
    """All records of one shard, fully validated; with `meta` (its folder's meta.json), also that
    the shard was written by that collect and each record fits its settings."""
    path = Path(path)
    info = read_shard_info(path)
    if meta is not None and info.meta_digest not in (None, meta.digest()):
        raise TrajectoryError(f"trajectory shard {path} was written by a collect with other settings than its "
                              f"folder's {META_FILE}: move it to its own folder, or delete it")
    try:
        table = pq.read_table(path, page_checksum_verification=True)
    except Exception as exc:  # noqa: BLE001 - whatever a damaged file makes pyarrow raise
        raise _damaged(path, exc) from None
    if not table.schema.equals(SCHEMA, check_metadata=False):
        raise _damaged(path, "unexpected columns or types")
    if table.num_rows != info.num_records:
        raise _damaged(path, f"{table.num_rows} rows, footer says {info.num_records}")
    records = []
    for row in table.to_pylist():
        try:
            record = TrajectoryRecord(**row)
            record.check()
            if meta is not None:
                record.fits(meta)
        except (TypeError, ValueError) as exc:
            raise _damaged(path, f"bad record {row.get('prompt_id')!r}/{row.get('block_index')}: {exc}") from None
        records.append(record)
    return records


class TrajectoryReader:
    """Reads a trajectory directory: validates meta.json, then serves records or batches.

    Args:
        directory: what `cllm collect --out` wrote.
        expect: settings the caller relies on, e.g. ``{"block_size": 16}``; any difference
            from meta.json is a TrajectoryError.
    """

    def __init__(self, directory: str | Path, *, expect: dict | None = None):
        self.directory = Path(directory)
        self.meta = read_meta(self.directory)
        for key, value in (expect or {}).items():
            if getattr(self.meta, key, object()) != value:
                raise TrajectoryError(
                    f"{self.directory} has {key}={getattr(self.meta, key, None)!r}, expected {value!r}"
                )
        self.shards = list_shards(self.directory)

    def __len__(self) -> int:
        return sum(read_shard_info(p).num_records for p in self.shards)

    def __iter__(self) -> Iterator[TrajectoryRecord]:
        """Records shard by shard (streaming; order depends on how the data was collected)."""
        for path in self.shards:
            yield from read_shard(path, self.meta)

    def records(self) -> list[TrajectoryRecord]:
        """All records in canonical order (prompt set order, then block), whatever the number
        of processes or resumes that wrote them. A (prompt, block) found twice is an error."""
        records = sorted(self, key=lambda r: (r.prompt_index, r.block_index))
        for a, b in zip(records, records[1:], strict=False):
            if (a.prompt_id, a.block_index) == (b.prompt_id, b.block_index):
                raise TrajectoryError(
                    f"{self.directory}: prompt {a.prompt_id!r} block {a.block_index} is in two shards"
                )
        return records

    def batches(
        self,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        include_augmented: bool = False,
        drop_last: bool = False,
    ) -> Iterator[TrajectoryBatch]:
        """`TrajectoryBatch`es of all records (held in memory), in canonical order or shuffled
        by `seed`: the same batches however the directory was collected."""
        records = self.records()
        order = torch.arange(len(records))
        if shuffle:
            order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed))
        for start in range(0, len(records), batch_size):
            chunk = [records[i] for i in order[start : start + batch_size].tolist()]
            if drop_last and len(chunk) < batch_size:
                break
            yield collate(chunk, pad_id=self.meta.pad_token_id, include_augmented=include_augmented)


def read_records(directory: str | Path) -> list[TrajectoryRecord]:
    return TrajectoryReader(directory).records()


# ---------------------------------------------------------------------------------------------
# Batches for training


@dataclass
class TrajectoryBatch:
    """Padded tensors for B records. The prefix is LEFT-padded and the block RIGHT-padded, so
    ``torch.cat([prefix_ids, states[:, j]], 1)`` is one contiguous sequence per row whose
    attention mask is ``torch.cat([prefix_mask, block_mask], 1)``. Padding uses meta.pad_token_id.
    """

    prompt_ids: list[str]
    block_index: torch.Tensor  # (B,)
    prefix_ids: torch.Tensor  # (B, P) left-padded
    prefix_mask: torch.Tensor  # (B, P) 1 on real tokens
    prompt_lengths: torch.Tensor  # (B,) the prompt is the first prompt_len real prefix tokens
    states: torch.Tensor  # (B, S, N) right-padded; states[b, num_states[b]-1] is the fixed point
    num_states: torch.Tensor  # (B,)
    fixed_point: torch.Tensor  # (B, N) right-padded
    block_lengths: torch.Tensor  # (B,) real tokens of the block (< block size at EOS / budget)
    labels: torch.Tensor | None  # (B, L) right-padded ground truth, None if no record has labels
    label_lengths: torch.Tensor | None  # (B,)

    @property
    def block_mask(self) -> torch.Tensor:  # (B, N)
        n = self.fixed_point.shape[1]
        return (torch.arange(n)[None, :] < self.block_lengths[:, None]).long()


def _pad(rows: Sequence[Sequence[int]], pad_id: int, *, left: bool = False) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            t = torch.as_tensor(list(r), dtype=torch.long)
            if left:
                out[i, width - len(r) :] = t
            else:
                out[i, : len(r)] = t
    return out


def collate(
    records: Sequence[TrajectoryRecord], *, pad_id: int, include_augmented: bool = False
) -> TrajectoryBatch:
    """Pad records into a `TrajectoryBatch`. With `include_augmented`, a record's augmented
    states are placed before its fixed point (for GC sampling; they break LC adjacency)."""
    if not records:
        raise ValueError("cannot collate an empty list of records")
    trajectories = [
        (r.states[:-1] + r.augmented_states + r.states[-1:]) if include_augmented else r.states
        for r in records
    ]
    n = max(len(r.fixed_point) for r in records)
    s = max(len(t) for t in trajectories)
    states = torch.full((len(records), s, n), pad_id, dtype=torch.long)  # (B, S, N)
    for b, traj in enumerate(trajectories):
        states[b, : len(traj), : len(traj[0])] = torch.as_tensor(traj, dtype=torch.long)
    has_labels = any(r.labels is not None for r in records)
    labels = [r.labels or [] for r in records]
    return TrajectoryBatch(
        prompt_ids=[r.prompt_id for r in records],
        block_index=torch.tensor([r.block_index for r in records]),
        prefix_ids=_pad([r.prefix_ids for r in records], pad_id, left=True),
        prefix_mask=_pad([[1] * len(r.prefix_ids) for r in records], 0, left=True),
        prompt_lengths=torch.tensor([r.prompt_len for r in records]),
        states=states,
        num_states=torch.tensor([len(t) for t in trajectories]),
        fixed_point=_pad([r.fixed_point for r in records], pad_id),
        block_lengths=torch.tensor([len(r.fixed_point) for r in records]),
        labels=_pad(labels, pad_id) if has_labels else None,
        label_lengths=torch.tensor([len(x) for x in labels]) if has_labels else None,
    )
