"""The llama.cpp runtime: a GGUF model decoding through llama.cpp's own forward, by
llama-cpp-python's low-level API (the one adapter between cllm and `llama_cpp`, version-checked).

The protocol maps onto llama.cpp's sequences:

- a row is a sequence of llama.cpp's KV memory (one context per runtime, its cells shared by
  every session; `kv_unified`, so that one token may belong to several sequences);
- `feed` is one `llama_decode` for every row of the session: token i of a row at its position,
  in the row's sequence, logits out for every fed token;
- a tree is fed with its branches as sequences: each leaf but the first gets a sequence of its
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
import logging
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
from transformers import BatchEncoding

from cllm.runtime.protocol import Forward, check_tree

LLAMA_CPP_RANGE = ("0.3.36", "0.4")  # the low-level API relied on below (llama_memory_*, kv_unified)
INSTALL = "pip install 'cllm[llamacpp]'"
CONTEXT = 8192  # KV cells shared by a runtime's rows, by default
UBATCH = 512  # tokens llama.cpp computes at once (llama.cpp's default; a longer decode is sliced)
# llama.cpp sequences of a runtime: a row's own, and one per tree leaf past the first while it is
# fed (rows that cannot have as many get smaller trees: `tree_leaves`). llama.cpp checks every
# pair of them on every decode, so one request at a time wants few; a server, llama.cpp's most.
SEQUENCES = 64
# `cllm export --quantize` types: llama.cpp's own quantizer, by the names its llama-quantize takes
QUANT_TYPES = {"q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q6_k": 18, "q5_k_m": 17, "q4_k_m": 15,
               "q4_k_s": 14, "q3_k_m": 12, "q2_k": 10, "f16": 1, "bf16": 32}


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


def _api():
    """The `llama_cpp` module, once it is known to be one this adapter was written against."""
    reason = unavailable()
    if reason is not None:
        raise ValueError(f"the llamacpp runtime cannot run: {reason}")
    import llama_cpp

    if not getattr(_api, "ready", False):
        llama_cpp.llama_backend_init()
        # llama.cpp's own log, silent: llama-cpp-python's callback prints its warnings as errors
        logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
        _api.ready = True
    return llama_cpp


def quantize(source: str | os.PathLike, out: str | os.PathLike, kind: str, *, threads: int = 0) -> None:
    """Write `source` (a GGUF file) quantized to `kind` (`QUANT_TYPES`) at `out`, with llama.cpp's
    own quantizer; a ValueError when it fails."""
    if kind not in QUANT_TYPES:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANT_TYPES)}")
    llama_cpp = _api()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = QUANT_TYPES[kind], threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise ValueError(f"llama.cpp could not quantize {source} to {kind}")


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


class LlamaCppRuntime:
    """A GGUF file on llama.cpp's forward (`Runtime`). `threads`: llama.cpp's threads (0: its
    default); `context`: KV cells shared by every open row of every session, tree drafts
    included; `f32_cache`: an f32 KV cache (the default; False: llama.cpp's f16, half the
    memory, whose attention rounds differently with the number of fed tokens: a wide forward's
    logits then differ from a one-token forward's by up to ~0.06 on a q8_0 file here);
    `extra_buffers`: llama.cpp's repacked and AMX weight buffers (`use_extra_bufts`), off by
    default: its AMX matrix multiply crashed (a segfault) on quantized models on an Intel Xeon
    with AMX (llama-cpp-python 0.3.36). A ValueError names why the file cannot be loaded."""

    name = "llamacpp"
    offers_hidden = False
    device = torch.device("cpu")

    def __init__(self, path: str | os.PathLike, *, threads: int = 0, context: int = CONTEXT,
                 sequences: int = SEQUENCES, f32_cache: bool = True, extra_buffers: bool = False,
                 why: str = "asked for") -> None:
        llama_cpp = self._llama_cpp = _api()
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"no GGUF file at {self.path}")
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = extra_buffers
        self._model = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path} (not a GGUF model it knows)")
        ftype = llama_cpp.llama_model_ftype(self._model)
        self.f32_cache = f32_cache
        self.seq_max = min(sequences, int(llama_cpp.llama_max_parallel_sequences()))
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cparams.n_batch = context  # one decode takes any feed that fits the cells
        cparams.n_ubatch = min(UBATCH, context)  # computed in slices of this many tokens (its buffers scale with it)
        cparams.n_seq_max = self.seq_max
        cparams.kv_unified = True  # one token in several sequences (a tree's shared prefix)
        cparams.n_threads = cparams.n_threads_batch = threads or os.cpu_count() or 1
        cache_type = llama_cpp.GGML_TYPE_F32 if self.f32_cache else llama_cpp.GGML_TYPE_F16
        cparams.type_k = cparams.type_v = cache_type
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise ValueError(f"llama.cpp could not make a context of {context} cells for {self.path}")
        self._finalizer = weakref.finalize(self, _free, llama_cpp, self._ctx, self._model)
        self.memory = llama_cpp.llama_get_memory(self._ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.position_limit = min(int(llama_cpp.llama_model_n_ctx_train(self._model)), context)
        self.context, self.threads = context, cparams.n_threads
        self.ftype = llama_cpp.llama_ftype_name(ftype).decode()  # "all F32", "Q8_0", ...
        self.forwards = 0
        self.why = why
        self._free_seqs = list(range(self.seq_max - 1, -1, -1))  # sequence ids no row or branch holds
        self._batch = _Batch(llama_cpp, 64, 4)

    # -- sequences and decodes, for the sessions

    def take_seqs(self, n: int) -> list[int]:
        if n > len(self._free_seqs):
            raise ValueError(f"llama.cpp has {self.seq_max} sequences, and this feed needs {n} more than are free "
                             "(fewer rows at once, or fewer recycled drafts per row)")
        return [self._free_seqs.pop() for _ in range(n)]

    def give_seqs(self, seqs: Sequence[int]) -> None:
        for s in seqs:
            self._llama_cpp.llama_memory_seq_rm(self.memory, s, -1, -1)
        self._free_seqs.extend(seqs)

    def seq_rm(self, seq: int, start: int, end: int = -1) -> None:
        self._llama_cpp.llama_memory_seq_rm(self.memory, seq, start, end)

    def seq_cp(self, source: int, target: int, start: int, end: int = -1) -> None:
        self._llama_cpp.llama_memory_seq_cp(self.memory, source, target, start, end)

    def batch(self, tokens: int, seq_max: int) -> _Batch:
        """The batch arrays, grown to hold `tokens` tokens of up to `seq_max` sequences each."""
        b = self._batch
        if tokens > b.capacity or seq_max > b.seq_max:
            self._batch = b = _Batch(self._llama_cpp, max(tokens, b.capacity), max(seq_max, b.seq_max))
        return b

    def decode(self, n_tokens: int, outputs: int) -> torch.Tensor:
        """`llama_decode` over the first `n_tokens` of the batch; the logits (outputs, V) of the
        tokens marked, in batch order."""
        b = self._batch
        b.struct.n_tokens = n_tokens
        status = self._llama_cpp.llama_decode(self._ctx, b.struct)
        if status != 0:
            why = (f"its {self.context} KV cells are full (fewer rows, or a larger context)" if status == 1
                   else f"llama_decode returned {status}")
            raise RuntimeError(f"llama.cpp could not run a forward of {n_tokens} tokens: {why}")
        self.forwards += 1
        view = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(self._ctx), shape=(outputs, self.vocab_size))
        return torch.from_numpy(view.copy())  # llama.cpp's buffer is rewritten by the next decode

    # -- the protocol

    def session(self) -> LlamaCppSession:
        return LlamaCppSession(self)

    def prepare(self) -> None:
        """Nothing to ready: llama.cpp plans its graph per decode."""

    def compile(self, *, batches: bool = True) -> str | None:
        return "llama.cpp's forward is compiled C/C++ already"

    def describe(self) -> str:
        version = installed_version("llama-cpp-python")
        return (f"llama.cpp (llama-cpp-python {version}) on {self.path.name}, {self.ftype}, {self.threads} threads, "
                f"{'f32' if self.f32_cache else 'f16'} KV cache ({self.why})")


def _free(llama_cpp, ctx, model) -> None:
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


@dataclass
class _Row:
    seq: int  # the row's own sequence
    length: int  # its entries (the position of its next token)
    fed: int = 0  # tokens of the last feed not yet kept or dropped
    leaves: list[int] = field(default_factory=list)  # a tree feed's branch sequences (leaf 1, 2, ...)
    first: list[int] = field(default_factory=list)  # a tree feed: per fed token, a sequence it belongs to


class LlamaCppSession:
    """Rows decoding together on a `LlamaCppRuntime`, one llama.cpp sequence each (module
    docstring)."""

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
        seqs = rt.take_seqs(len(prompts))
        total = sum(len(p) for p in prompts)
        b = rt.batch(total, 1)
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
            logits = rt.decode(total, outputs)
        except RuntimeError:
            rt.give_seqs(seqs)
            raise
        self.forwards += 1
        ids = list(range(self._next, self._next + len(prompts)))
        self._next += len(prompts)
        for i, prompt, seq in zip(ids, prompts, seqs, strict=True):
            self._rows[i] = _Row(seq, len(prompt))
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
        layouts = [None] * len(rows) if parents is None else [_tree(p, len(t)) for p, t in zip(parents, tokens,
                                                                                                strict=True)]
        rt = self.runtime
        fed = [len(t) for t in tokens]
        total = sum(fed)
        b = rt.batch(total, max((len(lay.leaves) for lay in layouts if lay is not None), default=1))
        at = 0
        try:
            for r, toks, lay in zip(rows, tokens, layouts, strict=True):
                row = self._rows[r]
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
            logits = rt.decode(total, total)
        except (RuntimeError, ValueError):
            for r in rows:
                self._drop_fed(self._rows[r])
            raise
        self.forwards += 1
        width = max(fed)
        if all(f == width for f in fed):
            return Forward(logits.view(len(rows), width, rt.vocab_size))
        out = logits.new_zeros(len(rows), width, rt.vocab_size)
        at = 0
        for i, f in enumerate(fed):
            out[i, :f] = logits[at : at + f]
            at += f
        return Forward(out)

    def _lay_tree(self, row: _Row, lay: _Tree, b: _Batch, at: int) -> None:
        """A row's tree into the batch from `at`: the leaves past the first get sequences that
        hold the row's past, every token the sequences of the leaves below it."""
        extra = self.runtime.take_seqs(len(lay.leaves) - 1)
        for s in extra:
            self.runtime.seq_cp(row.seq, s, 0, row.length)
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
            if not row.leaves and not row.first:  # a chain: its first len(k) entries
                if k != list(range(len(k))):
                    raise ValueError(f"row {r} keeps {k} of a chain feed: its first entries only")
                self.runtime.seq_rm(row.seq, row.length + len(k))
            elif k:
                source = row.first[k[-1]]  # a sequence the whole kept path belongs to
                if source != row.seq:
                    self.runtime.seq_rm(row.seq, row.length)
                    self.runtime.seq_cp(source, row.seq, row.length, row.length + len(k))
                else:
                    self.runtime.seq_rm(row.seq, row.length + len(k))
            else:
                self.runtime.seq_rm(row.seq, row.length)
            self.runtime.give_seqs(row.leaves)
            row.length += len(k)
            row.fed, row.leaves, row.first = 0, [], []

    def _drop_fed(self, row: _Row) -> None:
        if row.fed:
            self.runtime.seq_rm(row.seq, row.length)
            self.runtime.give_seqs(row.leaves)
            row.fed, row.leaves, row.first = 0, [], []

    def rewind(self, rows: Sequence[int], lengths: Sequence[int]) -> None:
        for r, n in zip(rows, lengths, strict=True):
            row = self._rows[r]
            self._drop_fed(row)
            if n < row.length:
                self.runtime.seq_rm(row.seq, n)
                row.length = n

    def close(self, rows: Sequence[int]) -> None:
        for r in rows:
            row = self._rows.pop(r, None)
            if row is not None:
                self._drop_fed(row)
                self.runtime.give_seqs([row.seq])

    def rows(self) -> list[int]:
        return list(self._rows)

    def length(self, row: int) -> int:
        return self._rows[row].length

    def tree_leaves(self, rows: int) -> int | None:
        """Each leaf past the first holds a free sequence while its tree is fed: the free ones
        shared out over `rows` rows."""
        return 1 + len(self.runtime._free_seqs) // max(rows, 1)

    def __del__(self) -> None:
        try:
            self.close(list(self._rows))
        except Exception:  # noqa: BLE001 - the runtime may be gone at interpreter exit
            pass


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


class LlamaCppTokenizer:
    """A GGUF file's own tokenizer (llama.cpp's), as far as cllm's commands use a Hugging Face
    one: callable (`input_ids`, `attention_mask`, `return_tensors`), `encode`, `decode`,
    `eos_token_id` / `bos_token_id` / `pad_token_id`, `len()`. For a GGUF without the side
    folder `cllm export` writes (which holds the model's own tokenizer)."""

    chat_template = None

    def __init__(self, runtime: LlamaCppRuntime) -> None:
        self._llama_cpp, self._vocab, self._runtime = runtime._llama_cpp, runtime.vocab, runtime
        eos, bos = self._llama_cpp.llama_vocab_eos(self._vocab), self._llama_cpp.llama_vocab_bos(self._vocab)
        self.eos_token_id = eos if eos >= 0 else None
        self.bos_token_id = bos if bos >= 0 else None
        self.pad_token_id = self.eos_token_id
        self.name_or_path = str(runtime.path)
        self._add_bos = bool(self._llama_cpp.llama_vocab_get_add_bos(self._vocab))

    def __len__(self) -> int:
        return self._runtime.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        while True:
            tokens = (ctypes.c_int32 * size)()
            n = self._llama_cpp.llama_tokenize(self._vocab, data, len(data), tokens, size,
                                               add_special_tokens and self._add_bos, True)
            if n >= 0:
                return list(tokens[:n])
            size = -n

    def __call__(self, text: str | list[str], return_tensors: str | None = None, add_special_tokens: bool = True,
                 **_: object):
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, add_special_tokens) for t in texts]
        if return_tensors is not None and len({len(i) for i in ids}) > 1:
            raise ValueError("prompts of different lengths: tokenize them one at a time")
        data = {"input_ids": ids if not isinstance(text, str) else ids[0]}
        data["attention_mask"] = [[1] * len(i) for i in ids] if not isinstance(text, str) else [1] * len(ids[0])
        if return_tensors is not None and isinstance(text, str):
            data = {k: [v] for k, v in data.items()}
        return BatchEncoding(data, tensor_type=return_tensors)

    def decode(self, ids, skip_special_tokens: bool = False, **_: object) -> str:
        """Each token's piece, as llama.cpp's tools print them (`llama_detokenize` would also
        apply llama.cpp's clean-up of spaces for some vocabularies, which the text never had)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):
            raise ValueError("decode takes one sequence of ids")
        lib, vocab, out = self._llama_cpp, self._vocab, bytearray()
        size = 64
        buf = ctypes.create_string_buffer(size)
        for token in ids:
            if skip_special_tokens and lib.llama_vocab_is_control(vocab, token):
                continue
            n = lib.llama_token_to_piece(vocab, token, buf, size, 0, not skip_special_tokens)
            if n < 0:  # a longer piece: a buffer that holds it
                size = -n
                buf = ctypes.create_string_buffer(size)
                n = lib.llama_token_to_piece(vocab, token, buf, size, 0, not skip_special_tokens)
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")
