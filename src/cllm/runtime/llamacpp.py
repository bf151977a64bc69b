"""The llama.cpp runtime: a GGUF model decoding through llama.cpp's own forward, by
llama-cpp-python's low-level API (with `llamacpp_files`, the one adapter between cllm and
`llama_cpp`, version-checked: `checked_api`).

The protocol maps onto llama.cpp's sequences. A runtime holds one or two contexts on its model,
each a layout of llama.cpp's KV memory:

- unified (always): every row's cells in one pool, so that one token may belong to several
  sequences (a tree's shared prefix, below); each fed token's attention runs over every row's
  cells, masked, which grows dear as rows are added;
- streams (`streams=N`, a server's): each row a stream of its own (llama.cpp's non-unified
  cache, as llama-server's slots), attending to its own cells only; a token belongs to one
  sequence, so such a row verifies a chain, not a tree (`tree_leaves` 1: the engine puts its
  best recycled draft in the tail's place). llama.cpp computes the rows of one decode together
  when their sequence ids run consecutively and each feeds as many tokens, so ids are handed out
  lowest first and the batch is laid out in id order.

A row alone opens unified (its tree buys most at one row); rows opening beside others open in
streams, and a unified row is moved into one when they do (its entries copied, `move_in`), so
that a busy server runs one decode a step. A forward of rows in both is one decode per context.

In both:

- a row is a sequence;
- `feed` is one `llama_decode` for every row of the session in a context: token i of a row at
  its position, in the row's sequence, logits out for every fed token;
- a (unified) tree is fed with its branches as sequences: each leaf but the first gets a sequence of its
  own (a copy of the row's entries so far, which costs llama.cpp a bit per cell, no data) and
  every fed token belongs to the sequences of the leaves below it (the row's own for those on
  the first leaf's path). llama.cpp lets a token attend to the cells of its first sequence at
  positions up to its own: exactly its ancestors, itself and the row's past;
- `keep` removes a row's other fed entries from its sequence (`llama_memory_seq_rm`); after a
  tree, the kept path's cells join the row's sequence (`llama_memory_seq_cp`) and the branch
  sequences are dropped, which frees every cell no sequence holds any more;
- `rewind` and `close` remove a sequence's entries past a length, or all of them.

Nothing is stored on the Python side but each row's sequence id and length. The batch handed to
`llama_decode` is a `llama_batch` over numpy arrays this module owns (filled by slices, not one
ctypes write per token).

Exactness: llama.cpp's greedy decoding of the same GGUF file (`llama_cpp.Llama.generate` with
`top_k=1`) is the reference. A quantized file is exact to its own greedy decoding up to
near-ties (llama.cpp rounds activations to 8 bits, and the order its attention sums cells moves
a logit by a rounding step now and then), and is not the float model it came from.
"""

from __future__ import annotations

import ctypes
import heapq
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path

import numpy as np
import torch
from packaging.version import Version

from cllm.runtime import llamacpp_log
from cllm.runtime.gguf_check import check_gguf
from cllm.runtime.protocol import Forward, check_tree

LLAMA_CPP_RANGE = ("0.3.36", "0.4")  # the low-level API relied on below (llama_memory_*, kv_unified)
INSTALL = "pip install 'cllm[llamacpp]'"
CONTEXT = 8192  # KV cells shared by a runtime's rows, by default (unified)
ROW_CONTEXT = 4096  # KV cells per row at most, by default (streams: the model's trained context if shorter)
UBATCH = 512  # tokens llama.cpp computes at once (llama.cpp's default; a longer decode is sliced)
# llama.cpp sequences of a runtime: a row's own, and one per tree leaf past the first while it is
# fed (rows that cannot have as many get smaller trees: `tree_leaves`). llama.cpp checks every
# pair of them on every decode, so one request at a time wants few; a server, llama.cpp's most.
SEQUENCES = 64



def unavailable() -> str | None:
    """Why the llama.cpp runtime cannot run here, in one line; None when it can."""
    try:
        version = installed_version("llama-cpp-python")
        import llama_cpp  # noqa: F401 - a build whose library fails to load is unavailable too
    except (ImportError, PackageNotFoundError, OSError) as exc:
        return f"llama-cpp-python is not usable here ({type(exc).__name__}; {INSTALL})"
    low, high = LLAMA_CPP_RANGE
    if not Version(low) <= Version(version) < Version(high):
        return f"llama-cpp-python {version} is outside the tested range >= {low}, < {high}"
    return None


def checked_api():
    """The `llama_cpp` module, once it is known to be one this adapter was written against."""
    reason = unavailable()
    if reason is not None:
        raise ValueError(f"the llamacpp runtime cannot run: {reason}")
    import llama_cpp

    if not getattr(checked_api, "ready", False):
        llama_cpp.llama_backend_init()
        llamacpp_log.install(llama_cpp)  # llama.cpp's log to Python's, its errors kept for the one-line refusals
        checked_api.ready = True
    return llama_cpp


class _Batch:
    """A `llama_batch` over arrays owned here: token, position, how many sequences and which,
    and whether its logits are wanted, per token (`seq_max` sequences at most per token)."""

    def __init__(self, llama_cpp, capacity: int, seq_max: int) -> None:
        self.capacity, self.seq_max = capacity, seq_max
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq = np.ones(capacity, dtype=np.int32)
        self.seq = np.zeros((capacity, seq_max), dtype=np.int32)
        self.logits = np.ones(capacity, dtype=np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        base, stride = self.seq.ctypes.data, seq_max * 4
        self._seq_ptrs = (int32_p * capacity)(*[ctypes.cast(base + i * stride, int32_p) for i in range(capacity)])
        self.struct = llama_cpp.llama_batch(
            n_tokens=0, token=self.token.ctypes.data_as(int32_p), embd=None, pos=self.pos.ctypes.data_as(int32_p),
            n_seq_id=self.n_seq.ctypes.data_as(int32_p), seq_id=self._seq_ptrs,
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)))


class _Context:
    """One llama.cpp context on the runtime's model, in one layout: its KV memory, its free
    sequence ids (a heap: lowest first, so that busy streams run consecutively) and the batch
    arrays its decodes read."""

    def __init__(self, llama_cpp, model, *, cells: int, sequences: int, streams: bool, threads: int,
                 f32_cache: bool, path: Path) -> None:
        self._llama_cpp, self.streams = llama_cpp, streams
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = cells  # one decode takes any feed that fits the cells
        cparams.n_ubatch = min(UBATCH, cells)  # computed in slices of this many tokens (its buffers scale with it)
        cparams.n_seq_max = sequences
        cparams.kv_unified = not streams  # unified: one token in several sequences (a tree's shared prefix)
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_F32 if f32_cache else llama_cpp.GGML_TYPE_F16
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not self.ctx:
            raise ValueError(f"llama.cpp could not make a context of {cells} cells for {path}")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.cells = int(llama_cpp.llama_n_ctx(self.ctx))  # llama.cpp rounds a stream's cells up to 256
        self.row_cells = self.cells // sequences if streams else self.cells
        self.seq_max = sequences
        self.free = list(range(sequences))  # sequence ids no row or branch holds
        self.rows: set[_Row] = set()  # the open rows whose entries are here, of every session
        self.batch = _Batch(llama_cpp, 64, 4)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            what = "rows at once" if self.streams else "rows at once, or fewer recycled drafts per row"
            raise ValueError(f"llama.cpp has {self.seq_max} sequences, and this needs {n} more than are free "
                             f"(fewer {what})")
        return [heapq.heappop(self.free) for _ in range(n)]

    def give(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self._llama_cpp.llama_memory_seq_rm(self.memory, s, -1, -1)
            heapq.heappush(self.free, s)

    def seq_rm(self, seq: int, start: int, end: int = -1) -> None:
        self._llama_cpp.llama_memory_seq_rm(self.memory, seq, start, end)

    def seq_cp(self, source: int, target: int, start: int, end: int = -1) -> None:
        self._llama_cpp.llama_memory_seq_cp(self.memory, source, target, start, end)

    def move_in(self, row: _Row) -> bool:
        """Copy a unified row's entries into a free stream here, which becomes the row's
        sequence; False, the row left where it was, when llama.cpp does not take them.

        `llama_state_seq_get_data` writes a header (a magic number, the sequence id), its
        context's stream count, then per stream the sequence's cells; a unified context has one
        stream, and a context of N streams reads N (those of other streams empty), so the copy
        gets N as its count and N - 1 empty streams after the row's (`llama_context::
        state_seq_get_data`, `llama_kv_cache::state_write` / `state_read`, llama.cpp of 0.3.36)."""
        lib, source = self._llama_cpp, row.ctx
        if not self.free or source.streams or not self.streams:
            return False
        size = lib.llama_state_seq_get_size(source.ctx, row.seq)
        data = (ctypes.c_ubyte * size)()
        written = lib.llama_state_seq_get_data(source.ctx, data, size, row.seq)
        header = 8  # the magic number and the sequence id
        if written < header + 4 or int.from_bytes(bytes(data[header : header + 4]), "little") != 1:
            return False
        blob = (bytes(data[:header]) + self.seq_max.to_bytes(4, "little") + bytes(data[header + 4 : written])
                + bytes(4 * (self.seq_max - 1)))
        seq = self.take(1)[0]
        copied = (ctypes.c_ubyte * len(blob)).from_buffer_copy(blob)
        if lib.llama_state_seq_set_data(self.ctx, copied, len(blob), seq) != len(blob):
            self.give([seq])
            return False
        source.give([row.seq])
        source.rows.discard(row)
        row.ctx, row.seq = self, seq
        self.rows.add(row)
        return True

    def grow(self, tokens: int, seq_max: int) -> _Batch:
        """The batch arrays, grown to hold `tokens` tokens of up to `seq_max` sequences each."""
        b = self.batch
        if tokens > b.capacity or seq_max > b.seq_max:
            self.batch = b = _Batch(self._llama_cpp, max(tokens, b.capacity), max(seq_max, b.seq_max))
        return b

    def decode(self, n_tokens: int, outputs: int, vocab_size: int) -> torch.Tensor:
        """`llama_decode` over the first `n_tokens` of the batch; the logits (outputs, V) of the
        tokens marked, in batch order."""
        b = self.batch
        b.struct.n_tokens = n_tokens
        status = self._llama_cpp.llama_decode(self.ctx, b.struct)
        if status != 0:
            why = (f"its {self.row_cells} KV cells {'per row ' if self.streams else ''}are full (fewer rows, or a "
                   "larger context)" if status == 1 else f"llama_decode returned {status}")
            raise RuntimeError(f"llama.cpp could not run a forward of {n_tokens} tokens: {why}")
        view = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(self.ctx), shape=(outputs, vocab_size))
        return torch.from_numpy(view.copy())  # llama.cpp's buffer is rewritten by the next decode


class LlamaCppRuntime:
    """A GGUF file on llama.cpp's forward (`Runtime`). `threads`: llama.cpp's threads (0: its
    default); `context`: KV cells of the unified layout, shared by its rows and their tree
    drafts; `sequences`: its sequences (a row's own and one per tree leaf past the first);
    `streams`: 0, every row unified; N, a server's: also a stream per row for N rows of
    `row_context` cells each (default: `ROW_CONTEXT`, or the model's trained context when
    shorter), where a row opens when others are open (`open`); `f32_cache`: the KV cache's type,
    f32 (True) or llama.cpp's default f16 (False); None, the default: f32 for a file of f32
    weights, else f16, so that greedy decoding here gives the tokens of llama.cpp's own greedy
    decoding of a quantized file (`Llama.generate`, its default context) and of an f32 file
    given `type_k = type_v = f32`. `batch_invariant`: a wide forward's logits equal a one-token
    forward's but for their last bits, taken only with f32 weights and cache. llama.cpp computes
    a forward of several tokens on other kernels than one of one (llamafile's GEMM, not a dot
    product per token), and 8-bit activations (quantized files) or an f16 cache turn those last
    bits into other tokens now and then (`scripts/width_numerics.py`); `extra_buffers`: llama.cpp's
    repacked and AMX weight buffers (`use_extra_bufts`), off by default: its AMX matrix multiply crashed (a segfault) on
    quantized models on an Intel Xeon with AMX (llama-cpp-python 0.3.36). A ValueError names why
    the file cannot be loaded."""

    name = "llamacpp"
    offers_hidden = False
    step_costs: tuple[float, ...] | None = None  # measured by `cllm.runtime.stepcost`, when asked
    device = torch.device("cpu")

    def __init__(self, path: str | os.PathLike, *, threads: int = 0, context: int = CONTEXT,
                 sequences: int = SEQUENCES, streams: int = 0, row_context: int | None = None,
                 f32_cache: bool | None = None, extra_buffers: bool = False, why: str = "asked for") -> None:
        llama_cpp = self._llama_cpp = checked_api()
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"no GGUF file at {self.path}")
        most = int(llama_cpp.llama_max_parallel_sequences())
        if not 0 <= streams <= most:
            raise ValueError(f"streams must be 0..{most}, got {streams}")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = extra_buffers
        check_gguf(self.path)  # the header values llama.cpp asserts on (an assert aborts the process)
        with llamacpp_log.errors() as errors:
            self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path}: {errors.reason() or 'not a GGUF model it knows'}")
        contexts: list = []  # llama.cpp's, freed with the model
        self._finalizer = weakref.finalize(self, _free, llama_cpp, contexts, self._model)
        trained = int(llama_cpp.llama_model_n_ctx_train(self._model))
        self.threads = threads or os.cpu_count() or 1
        self.ftype = llama_cpp.llama_ftype_name(llama_cpp.llama_model_ftype(self._model)).decode()  # "all F32", ...
        if f32_cache is None:
            f32_cache = self.ftype == "all F32"
        self.batch_invariant = f32_cache and self.ftype == "all F32"
        self.f32_cache, self.streams = f32_cache, streams
        made = dict(threads=self.threads, f32_cache=f32_cache, path=self.path)
        self._unified = _Context(llama_cpp, self._model, cells=context, sequences=min(sequences, most),
                                 streams=False, **made)
        contexts.append(self._unified.ctx)
        self._streams = None
        if streams:
            per_row = row_context or min(trained, ROW_CONTEXT)
            self._streams = _Context(llama_cpp, self._model, cells=streams * per_row, sequences=streams,
                                     streams=True, **made)
            contexts.append(self._streams.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.context = self._unified.cells
        self.row_context = min(c.row_cells for c in (self._unified, self._streams) if c is not None)
        self.position_limit = min(trained, self.row_context)
        self.max_rows = streams or None  # a server's rows at most; unified only: as many as its sequences hold
        self.forwards = 0
        self.why = why

    def context_for(self, rows: int) -> _Context:
        """Where `rows` new rows open (between forwards): alone, unified (a tree per step);
        beside other rows, a stream each when there are streams, the unified rows moved into
        streams too (one decode a step, every row's attention over its own cells)."""
        streams, unified = self._streams, self._unified
        if streams is None or len(unified.rows) + len(streams.rows) + rows <= 1:
            return unified
        for row in sorted(unified.rows, key=lambda row: row.seq):
            if len(streams.free) <= rows or row.fed:
                break
            streams.move_in(row)
        return streams if len(streams.free) >= rows else unified

    # -- the protocol

    def session(self) -> LlamaCppSession:
        return LlamaCppSession(self)

    def prepare(self) -> None:
        """Nothing to ready: llama.cpp plans its graph per decode."""

    def compile(self, *, batches: bool = True) -> str | None:
        return "llama.cpp's forward is compiled C/C++ already"

    def describe(self) -> str:
        version = installed_version("llama-cpp-python")
        layout = (f"unified for a row alone, else a stream per row ({self.streams} rows)" if self.streams
                  else "unified")
        return (f"llama.cpp (llama-cpp-python {version}) on {self.path.name}, {self.ftype}, {self.threads} threads, "
                f"{'f32' if self.f32_cache else 'f16'} KV cache, {layout} ({self.why})")


def _free(llama_cpp, contexts, model) -> None:
    for ctx in contexts:
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


@dataclass(eq=False)  # in sets by identity
class _Row:
    ctx: _Context  # the context holding its entries
    seq: int  # the row's own sequence there
    length: int  # its entries (the position of its next token)
    fed: int = 0  # tokens of the last feed not yet kept or dropped
    leaves: list[int] = field(default_factory=list)  # a tree feed's branch sequences (leaf 1, 2, ...)
    first: list[int] = field(default_factory=list)  # a tree feed: per fed token, a sequence it belongs to


class LlamaCppSession:
    """Rows decoding together on a `LlamaCppRuntime`, one llama.cpp sequence each (module
    docstring); a forward is one `llama_decode` per context its rows are in."""

    def __init__(self, runtime: LlamaCppRuntime) -> None:
        self.runtime = runtime
        self.forwards = 0
        self._rows: dict[int, _Row] = {}
        self._next = 0

    def open(self, prompts: Sequence[Sequence[int]], *, hidden: bool = False,
             every: bool = False) -> tuple[list[int], Forward]:
        if hidden:
            raise ValueError("the llamacpp runtime offers no hidden states (Medusa and EAGLE run on transformers' "
                             "or the lean runtime)")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every row opens with a prompt of at least one token")
        rt = self.runtime
        ctx = rt.context_for(len(prompts))
        seqs = ctx.take(len(prompts))
        total = sum(len(p) for p in prompts)
        b = ctx.grow(total, 1)
        at, outputs = 0, 0
        for prompt, seq in zip(prompts, seqs, strict=True):
            n = len(prompt)
            b.token[at : at + n] = prompt
            b.pos[at : at + n] = np.arange(n)
            b.n_seq[at : at + n] = 1
            b.seq[at : at + n, 0] = seq
            b.logits[at : at + n] = 1 if every else 0
            b.logits[at + n - 1] = 1
            outputs += n if every else 1
            at += n
        try:
            logits = ctx.decode(total, outputs, rt.vocab_size)
        except RuntimeError:
            ctx.give(seqs)
            raise
        rt.forwards += 1
        self.forwards += 1
        ids = list(range(self._next, self._next + len(prompts)))
        self._next += len(prompts)
        for i, prompt, seq in zip(ids, prompts, seqs, strict=True):
            self._rows[i] = row = _Row(ctx, seq, len(prompt))
            ctx.rows.add(row)
        if not every:
            return ids, Forward(logits[:, None])
        width = max(len(p) for p in prompts)  # left-padded to the longest prompt
        out = logits.new_zeros(len(prompts), width, rt.vocab_size)
        at = 0
        for r, prompt in enumerate(prompts):
            out[r, width - len(prompt) :] = logits[at : at + len(prompt)]
            at += len(prompt)
        return ids, Forward(out)

    def feed(self, rows: Sequence[int], tokens: Sequence[Sequence[int]], *,
             parents: Sequence[Sequence[int]] | None = None, hidden: bool = False) -> Forward:
        if hidden:
            raise ValueError("the llamacpp runtime offers no hidden states")
        if sorted(rows) != sorted(self._rows):
            raise ValueError(f"a forward feeds every open row once: open {sorted(self._rows)}, fed {sorted(rows)}")
        if min((len(t) for t in tokens), default=0) < 1:
            raise ValueError("every fed row needs at least one token")
        for r in rows:
            self._drop_fed(self._rows[r])  # a feed never kept is forgotten
        rt = self.runtime
        layouts = [None] * len(rows) if parents is None else [_tree(p, len(t)) for p, t in zip(parents, tokens,
                                                                                                strict=True)]
        for i, r in enumerate(rows):
            lay = layouts[i]
            if self._rows[r].ctx.streams and lay is not None:  # a stream holds a chain: a one-leaf tree
                if len(lay.leaves) > 1:
                    raise ValueError("a row in a llama.cpp stream of its own verifies a chain, not a tree")
                layouts[i] = None
        fed = [len(t) for t in tokens]
        width = max(fed)
        out = None
        try:
            for ctx in {self._rows[r].ctx: None for r in rows}:  # a decode per context, rows in sequence order
                mine = sorted((i for i, r in enumerate(rows) if self._rows[r].ctx is ctx),
                              key=lambda i: self._rows[rows[i]].seq)
                seqs = [self._rows[rows[i]].seq for i in mine]
                gaps = _gaps(ctx, seqs, [fed[i] for i in mine])
                total = sum(fed[i] for i in mine)
                b = ctx.grow(total + len(gaps) * fed[mine[0]],
                             max((len(layouts[i].leaves) for i in mine if layouts[i] is not None), default=1))
                at = 0
                for i in _merged(mine, seqs, gaps):
                    if i < 0:  # a free stream's filler: the decode's streams run consecutively
                        n = fed[mine[0]]
                        b.token[at : at + n], b.logits[at : at + n] = 0, 0
                        b.pos[at : at + n] = np.arange(n)
                        b.n_seq[at : at + n], b.seq[at : at + n, 0] = 1, -1 - i
                        at += n
                        continue
                    row, toks, lay = self._rows[rows[i]], tokens[i], layouts[i]
                    n = len(toks)
                    b.token[at : at + n] = toks
                    b.logits[at : at + n] = 1
                    if lay is None:
                        b.pos[at : at + n] = np.arange(row.length, row.length + n)
                        b.n_seq[at : at + n] = 1
                        b.seq[at : at + n, 0] = row.seq
                    else:
                        self._lay_tree(row, lay, b, at)
                    row.fed = n
                    at += n
                try:
                    logits = ctx.decode(at, total, rt.vocab_size)
                finally:
                    for seq in gaps:
                        ctx.seq_rm(seq, -1)
                if len(mine) == len(rows) and mine == list(range(len(rows))) and all(f == width for f in fed):
                    out = logits.view(len(rows), width, rt.vocab_size)
                    break
                if out is None:
                    out = logits.new_zeros(len(rows), width, rt.vocab_size)
                at = 0
                for i in mine:
                    out[i, : fed[i]] = logits[at : at + fed[i]]
                    at += fed[i]
        except (RuntimeError, ValueError):
            for r in rows:
                self._drop_fed(self._rows[r])
            raise
        rt.forwards += 1
        self.forwards += 1
        return Forward(out)

    def _lay_tree(self, row: _Row, lay: _Tree, b: _Batch, at: int) -> None:
        """A row's tree into the batch from `at`: the leaves past the first get sequences that
        hold the row's past, every token the sequences of the leaves below it."""
        extra = row.ctx.take(len(lay.leaves) - 1)
        for s in extra:
            row.ctx.seq_cp(row.seq, s, 0, row.length)
        row.leaves = extra
        seq_of_leaf = [row.seq, *extra]
        n = len(lay.depth)
        b.pos[at : at + n] = row.length + np.asarray(lay.depth)
        for i, below in enumerate(lay.below):
            b.n_seq[at + i] = len(below)
            b.seq[at + i, : len(below)] = [seq_of_leaf[leaf] for leaf in below]
        row.first = [seq_of_leaf[below[0]] for below in lay.below]

    def keep(self, rows: Sequence[int], kept: Sequence[Sequence[int]]) -> None:
        for r, k in zip(rows, kept, strict=True):
            row = self._rows[r]
            k = list(k)
            if not row.fed:
                raise ValueError("keep follows a feed")
            if k and (k[0] != 0 or k[-1] >= row.fed):
                raise ValueError(f"row {r} keeps {k} of {row.fed} fed entries: a chain from the first")
            ctx = row.ctx
            if not row.leaves and not row.first:  # a chain: its first len(k) entries
                if k != list(range(len(k))):
                    raise ValueError(f"row {r} keeps {k} of a chain feed: its first entries only")
                ctx.seq_rm(row.seq, row.length + len(k))
            elif k:
                source = row.first[k[-1]]  # a sequence the whole kept path belongs to
                if source != row.seq:
                    ctx.seq_rm(row.seq, row.length)
                    ctx.seq_cp(source, row.seq, row.length, row.length + len(k))
                else:
                    ctx.seq_rm(row.seq, row.length + len(k))
            else:
                ctx.seq_rm(row.seq, row.length)
            ctx.give(row.leaves)
            row.length += len(k)
            row.fed, row.leaves, row.first = 0, [], []

    def _drop_fed(self, row: _Row) -> None:
        if row.fed:
            row.ctx.seq_rm(row.seq, row.length)
            row.ctx.give(row.leaves)
            row.fed, row.leaves, row.first = 0, [], []

    def rewind(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        for r, n in zip(rows, lengths, strict=True):
            row = self._rows[r]
            self._drop_fed(row)
            if n < row.length:
                row.ctx.seq_rm(row.seq, n)
                row.length = n

    def close(self, rows: Sequence[int]) -> None:
        for r in rows:
            row = self._rows.pop(r, None)
            if row is not None:
                self._drop_fed(row)
                row.ctx.give([row.seq])
                row.ctx.rows.discard(row)

    def rows(self) -> list[int]:
        return list(self._rows)

    def length(self, row: int) -> int:
        return self._rows[row].length

    def tree_leaves(self, rows: Sequence[int]) -> list[int | None]:
        """A row in a stream of its own: a chain. Unified: each leaf past the first holds a free
        sequence while its tree is fed, the free ones shared out over the unified rows fed."""
        unified = [r for r in rows if not self._rows[r].ctx.streams]
        share = 1 + len(self.runtime._unified.free) // max(len(unified), 1)
        return [1 if self._rows[r].ctx.streams else share for r in rows]

    def __del__(self) -> None:
        try:
            self.close(list(self._rows))
        except Exception:  # noqa: BLE001 - the runtime may be gone at interpreter exit
            pass


def _gaps(ctx: _Context, seqs: Sequence[int], fed: Sequence[int]) -> list[int]:
    """The free streams between the lowest and the highest of `seqs` (sorted) when every row
    feeds as many tokens: filled with as many of no one's tokens, the decode's streams run
    consecutively and llama.cpp computes them in one pass, of the same shape from step to step
    (its graph reused), where a gap would split it in two. None in a unified context, or where
    another session's row holds the gap."""
    if not ctx.streams or len(set(fed)) != 1 or not seqs:
        return []
    free = set(ctx.free)
    return [s for s in range(seqs[0] + 1, seqs[-1]) if s in free]


def _merged(mine: Sequence[int], seqs: Sequence[int], gaps: Sequence[int]) -> list[int]:
    """The feed's entries in sequence order: row indices (`mine`, whose sequences are `seqs`,
    sorted), and -1 - s for the filler of free stream s."""
    entries = sorted([*zip(seqs, mine, strict=True), *((s, -1 - s) for s in gaps)])
    return [i for _, i in entries]


@dataclass
class _Tree:
    depth: list[int]  # per fed token: its depth (0: a child of the row's last entry)
    below: list[list[int]]  # per fed token: the leaves (indices into `leaves`) of its subtree, first leaf first
    leaves: list[int]  # the fed tokens no other token has as parent, in order


def _tree(parents: Sequence[int], n: int) -> _Tree:
    """A fed tree's depths and, per token, the leaves below it."""
    if len(parents) != n:
        raise ValueError(f"{n} fed tokens and {len(parents)} parents")
    check_tree(parents)
    depth: list[int] = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    has_child = [False] * n
    for p in parents:
        if p >= 0:
            has_child[p] = True
    leaves = [i for i in range(n) if not has_child[i]]
    below: list[list[int]] = [[] for _ in range(n)]
    for leaf_index, leaf in enumerate(leaves):
        i = leaf
        while i >= 0:
            below[i].append(leaf_index)
            i = parents[i]
    return _Tree(depth, below, leaves)
