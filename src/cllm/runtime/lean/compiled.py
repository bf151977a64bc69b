"""The lean runner's compiled forward: the whole decoding forward of a few fed tokens (every
layer's norms, projections, rotation, cache write, attention and MLP, then the final norm and the
LM head) as one graph compiled ahead of time by AOTInductor, the weights frozen in and the cache
buffers written in place.

Why: on a CPU, Inductor's own GEMM kernels stream the frozen weights faster than MKL's GEMM at
the few tokens a decoding step feeds, and one graph per forward leaves no eager work between the
layers (`benchmarks/README.md`, the compiled run of `engines-cpu/`). Compiled ahead of time, a forward is one call into
the compiled library: no Dynamo frame, no Python wrapper around the kernels. From about 8 rows MKL
and Inductor are both bound by arithmetic.

`compile_runner(runner)` builds it once per model, machine and torch (minutes on a small CPU)
and keeps the package in the compile cache (`cache_dir()`: `$CLLM_COMPILE_CACHE`,
else `~/.cache/cllm/compiled`); a later process with the same weights loads it in seconds.
There is a graph for one batch row and, unless told not to, one for two rows or more;
each takes any count of fed tokens from two (one token runs padded to two) and any cache length.
`LeanRunner.forward` then runs it for forwards of up to `runner.COMPILED_MAX_TOKENS` fed tokens in
inference mode, while the weights are the ones compiled. `why_not_compiled` says where it cannot
run.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch._inductor  # AOTInductor's package builder and loader
import torch.nn.functional as F

from cllm.runtime.lean import ops
from cllm.runtime.lean.kernels import additive_mask
from cllm.runtime.lean.kv import LeanKV
from cllm.runtime.lean.runner import COMPILED_MAX_TOKENS, LeanRunner, why_not

COMPILE_MIN_TORCH = (2, 6)  # AOTInductor's packages, and Inductor's CPU GEMM template with a dynamic token count
CACHE_ENV = "CLLM_COMPILE_CACHE"
# Inductor's settings while the forward compiles: the weights frozen into the graph (packed for
# Inductor's own GEMM kernels, which at a few rows stream them several times faster than MKL's
# GEMM here), the kernels chosen by measuring them
_INDUCTOR = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP"}
# A package is written under a `.partial.pt2` name in the last seconds of its build; one left
# untouched this long is what a killed build left behind
PARTIAL_STALE_SECONDS = 3600
_PARTIAL_NAME = re.compile(r"[0-9a-f]{40}\.\d+\.partial\.pt2")  # `_build`'s: <fingerprint>.<pid>.partial.pt2


def cache_dir() -> Path:
    """Where compiled forwards are kept: `$CLLM_COMPILE_CACHE`, else `$XDG_CACHE_HOME/cllm/compiled`
    (`~/.cache/cllm/compiled`). Each package holds its model's weights (packed): delete the folder
    to reclaim the space; a forward missing from it is compiled again. What a killed build left
    (`*.partial.pt2`) the next build deletes (`sweep_partials`)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cllm" / "compiled"


def where_note() -> str:
    """A line for a command about to compile: where its forward comes from, and what a first
    build costs (it would otherwise be a silent minute or two)."""
    return (f"the compiled forward is loaded from {cache_dir()}, or built there first "
            "(once per model, machine and torch: a minute or two on 2 cores)")


class Indexed:
    """The compiled forward's attention: each layer's new keys and values written into the cache
    buffers at (`rows`, `slots`) by `index_put_`, then attention over the first T slots as
    products and sums rather than matrix products, so that Inductor generates it (its CPU GEMM
    template takes constant weights only). `mask` (B, L, T) is additive."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], rows: torch.Tensor, slots: torch.Tensor,
                 mask: torch.Tensor, scale: float) -> None:
        heads = torch.arange(keys[0].shape[1], device=rows.device)
        self.keys, self.values, self.scale = keys, values, scale
        self.where = (rows[:, None, None], heads[None, :, None], slots[None, None, :])  # (B, H_kv, L)
        self.mask = mask[:, None, None]  # (B, 1, 1, L, T)

    def __call__(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        B, heads, L, D = q.shape
        H_kv, T = k.shape[1], self.mask.shape[-1]
        self.keys[i].index_put_(self.where, k)
        self.values[i].index_put_(self.where, v)
        K, V = self.keys[i][:B, :, None, :T], self.values[i][:B, :, None, :T]  # (B, H_kv, 1, T, D)
        q = q.reshape(B, H_kv, heads // H_kv, L, D)  # query head h reads kv head h // group
        scores = (q[..., None, :] * K[:, :, :, None]).sum(-1) * self.scale + self.mask  # (B, H_kv, group, L, T)
        weights = torch.softmax(scores, dim=-1)
        return (weights[..., None] * V[:, :, :, None]).sum(-2).reshape(B, heads, L, D)


class _Forward(torch.nn.Module):
    """The runner's forward as one graph: x (B, L, hidden) embedded tokens, cos and sin (B, L, D) at
    their positions, an additive mask (B, L, T) over the first T cache slots, cache rows `rows`
    (B,) and slots `slots` (L,) where the new keys and values go (written in place into
    `keys[i]` / `values[i]`, (R, H_kv, C, D) each). Returns logits and the final norm's output,
    (B, L, ...) each: the runner's own layers (`ops.decoder_layers` on `ops.ModuleOps`), attention
    `Indexed`."""

    def __init__(self, runner: LeanRunner) -> None:
        super().__init__()
        self.layers, self.norm, self.lm_head = runner.layers, runner.norm, runner.lm_head  # the model's own
        self.head_dim, self.heads, self.kv_heads = runner.head_dim, runner.heads, runner.kv_heads
        self.qk_norm, self.silu, self.scale = runner.qk_norm, runner.silu, runner.scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                rows: torch.Tensor, slots: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, _ = mask.shape
        layout = ops.ModuleOps(self, B, L, (cos, sin))
        x = ops.decoder_layers(layout, self.layers, x, Indexed(keys, values, rows, slots, mask, self.scale))
        return layout.final(self, x, False)


def _examples(runner: LeanRunner, batch_rows: bool) -> tuple[tuple, dict]:
    """Example inputs of `_Forward` and the sizes left free: fed tokens L from 2, cache slots T
    from 2, cache rows R from 2 and capacity C from 2, and (`batch_rows`) batch rows B from 2;
    else one batch row. (The example sizes differ from each other, so that none is taken for
    another, and from 0 and 1, which would be fixed into the graph.)"""
    weight = runner.embed.weight
    B, L, T, R, C, D = (2 if batch_rows else 1), 3, 5, 4, 7, runner.head_dim
    layers = len(runner.layers)
    new = weight.new_zeros
    x, cos, sin, mask = new(B, L, weight.shape[1]), new(B, L, D), new(B, L, D), new(B, L, T)
    rows, slots = torch.arange(B, device=weight.device), torch.arange(T - L, T, device=weight.device)
    keys, values = ([new(R, runner.kv_heads, C, D) for _ in range(layers)] for _ in range(2))
    tokens, seen, cache_rows, capacity, batch_dim = (torch.export.Dim(name, min=2) for name in
                                                     ("tokens", "seen", "rows", "capacity", "batch"))
    batch = {0: batch_dim} if batch_rows else {}
    buffer = {0: cache_rows, 2: capacity}
    shapes = {"x": {**batch, 1: tokens}, "cos": {**batch, 1: tokens}, "sin": {**batch, 1: tokens},
              "mask": {**batch, 1: tokens, 2: seen}, "rows": batch or None, "slots": {0: tokens},
              "keys": [buffer] * layers, "values": [buffer] * layers}
    return (x, cos, sin, mask, rows, slots, keys, values), shapes


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every weight's name, shape, dtype and bytes (read once per `compile_runner`)."""
    digest = hashlib.blake2b(digest_size=20)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def fingerprint(model: torch.nn.Module, batch_rows: bool, weights: str | None = None) -> str:
    """The compile cache's key for one graph of `model`: everything the package depends on (the
    model's config and its weights, `weights_digest` unless given, the graph's code, Inductor's
    settings, torch, the CPU's vector unit, the thread count the kernels were built for)."""
    code = "".join(inspect.getsource(part) for part in (_Forward, Indexed, _examples, ops.decoder_layers,
                                                          ops.ModuleOps, ops._Shape))
    facts = {"config": model.config.to_dict(), "code": code, "inductor": _INDUCTOR, "torch": torch.__version__,
             "cpu": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
             "batch_rows": batch_rows, "weights": weights or weights_digest(model)}
    return hashlib.blake2b(json.dumps(facts, sort_keys=True, default=str).encode(), digest_size=20).hexdigest()


@contextmanager
def _quiet() -> Iterator[None]:
    """torch's own deprecation notices from inside export and the package loader (about its
    internals, nothing a user can act on) kept off the user's terminal."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|copyreg)")
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch")
        yield


def sweep_partials(folder: Path, stale: float = PARTIAL_STALE_SECONDS) -> list[Path]:
    """Delete the partial packages `_build` wrote in `folder` (`<fingerprint>.<pid>.partial.pt2`)
    untouched for `stale` seconds (builds killed while writing; each as large as a package);
    returns them. A build in progress, here or on another machine sharing the folder, writes its
    file within seconds and is left alone; files of other names are never touched."""
    removed = []
    for partial in folder.glob("*.partial.pt2"):
        if not _PARTIAL_NAME.fullmatch(partial.name):
            continue
        try:
            if time.time() - partial.stat().st_mtime > stale:
                partial.unlink()
                removed.append(partial)
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    return removed


def _build(runner: LeanRunner, batch_rows: bool, path: Path) -> None:
    """Export the forward and compile it into the package `path`, written whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(path.parent)
    inputs, shapes = _examples(runner, batch_rows)
    with torch.inference_mode(), _quiet():
        program = torch.export.export(_Forward(runner).eval(), inputs, dynamic_shapes=shapes)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        with _quiet():
            torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=_INDUCTOR)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _load(path: Path) -> Any:
    with _quiet():
        return torch._inductor.aoti_load_package(str(path))


def _graph(model: torch.nn.Module, runner: LeanRunner, batch_rows: bool,
           weights: str | None = None) -> tuple[Any, bool]:
    """One compiled graph of `model`: loaded from the compile cache when it holds it, else built
    (and kept there; in a temporary folder when the cache cannot be written). Returns the graph
    and whether it came from the cache."""
    path = cache_dir() / f"{fingerprint(model, batch_rows, weights)}.pt2"
    if path.is_file():
        try:
            return _load(path), True
        except Exception:  # noqa: BLE001 - a damaged package is built again
            path.unlink(missing_ok=True)
    try:
        _build(runner, batch_rows, path)
        return _load(path), False
    except OSError:  # the cache cannot be written: build where it can, for this process
        with tempfile.TemporaryDirectory(prefix="cllm-compiled-") as folder:
            scratch = Path(folder) / path.name
            _build(runner, batch_rows, scratch)
            return _load(scratch), False


class CompiledForward:
    """A runner's forward (`_Forward`) compiled ahead of time with the weights frozen in, for one
    batch row (`one_row`) and, when asked, for two or more (`rows`; else None, and batches run
    eagerly): it runs while the model's weights are the ones compiled (`current`); once a weight
    changes (training, `.to()`), the runner's eager forward runs."""

    def __init__(self, runner: LeanRunner, model: torch.nn.Module, batches: bool) -> None:
        start = time.perf_counter()
        weights = weights_digest(model)  # both graphs' keys: the weights are read once
        self.one_row, cached = _graph(model, runner, batch_rows=False, weights=weights)
        self.rows: Any = None
        if batches:
            self.rows, cached_rows = _graph(model, runner, batch_rows=True, weights=weights)
            cached = cached and cached_rows
        self.seconds = time.perf_counter() - start  # what compiling (or loading) took
        self.cached = cached  # every graph came from the compile cache
        # where each weight lives (module, name): read there at each check, so a replaced weight
        # shows, without walking the module tree in every forward
        self._slots = [(m, name) for m in model.modules() for name, p in m.named_parameters(recurse=False)]
        self._stamp = self._weights()

    @property
    def origin(self) -> str:
        """How this forward came to be, for a log line: "compiled in S s" or "loaded from the
        compile cache in S s"."""
        return f"{'loaded from the compile cache' if self.cached else 'compiled'} in {self.seconds:.1f} s"

    def _weights(self) -> tuple[tuple[int, int], ...]:
        """Where each of the model's weights is now and how often it was changed in place (a
        weight replaced, or changed by an optimizer step, changes this)."""
        return tuple((p.data_ptr(), p._version) for p in (m._parameters[name] for m, name in self._slots))

    def current(self) -> bool:
        """Whether the weights are still the ones compiled in."""
        return self._weights() == self._stamp

    def takes(self, rows: int, tokens: int) -> bool:
        """Whether a forward of `tokens` fed tokens per row over `rows` batch rows runs here: a
        graph for that many rows was compiled, and it feeds at most `COMPILED_MAX_TOKENS` (one
        token a row runs as two)."""
        return (rows == 1 or self.rows is not None) and rows * max(tokens, 2) <= COMPILED_MAX_TOKENS

    def __call__(self, runner: LeanRunner, kv: LeanKV, embedded: torch.Tensor,
                 position_ids: torch.Tensor, allowed: torch.Tensor | None,
                 last_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of `LeanRunner.forward` (same arguments, `allowed` its boolean mask or None):
        logits (B, L', V) and the final norm's output (B, L', hidden). One fed token per row runs
        padded to two: the second, at the same position, sees only its own slot, one past the
        cache's new length (so nothing reads it), and its outputs are dropped."""
        B, L, H = embedded.shape
        S = kv.get_seq_length()
        cos, sin = runner.rope_tokens(embedded, position_ids, S + L)  # (B * L, D)
        allowed = embedded.new_ones(B, L, S + L, dtype=torch.bool) if allowed is None \
            else allowed.expand(B, 1, L, S + L)[:, 0]
        cos, sin = cos.view(B, L, -1), sin.view(B, L, -1)
        if L == 1:
            embedded, cos, sin = (t.expand(B, 2, -1) for t in (embedded, cos, sin))
            allowed = F.pad(allowed, (0, 1, 0, 1))
            allowed[:, 1, S + 1] = True
        width = allowed.shape[1]
        mask = additive_mask(allowed, embedded)
        kv.reserve(max(B, 2), S + width)  # the new slots, and two rows (the graphs take two and more)
        x, cos, sin = (t.contiguous() for t in (embedded, cos, sin))
        rows = torch.arange(B, device=x.device)
        slots = torch.arange(S, S + width, device=x.device)
        graph = self.one_row if B == 1 else self.rows
        logits, x = graph(x, cos, sin, mask, rows, slots, kv.buffers[0], kv.buffers[1])
        kv.extend(L)
        logits, x = logits.view(B, width, -1)[:, :L], x.view(B, width, -1)[:, :L]
        return (logits[:, -1:], x[:, -1:]) if last_only else (logits, x)


def why_not_compiled(model: torch.nn.Module) -> str | None:
    """Why the runner's forward cannot be compiled for `model` (None: it can)."""
    reason = why_not(model)
    if reason is not None:
        return reason
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        dtype = str(weight.dtype).removeprefix("torch.")
        return (f"the compiled forward runs float32 on a CPU only (measured faster there), "
                f"not {dtype} on {weight.device.type}")
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if release < COMPILE_MIN_TORCH:
        needed = ".".join(map(str, COMPILE_MIN_TORCH))
        return f"the compiled forward needs torch >= {needed} (this is {torch.__version__})"
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "no C++ compiler on PATH (Inductor builds its kernels with one)"
    return None


def compile_runner(runner: LeanRunner, *, batches: bool = True) -> str | None:
    """Compile the runner's forward now, or load it from the compile cache (`cache_dir()`) where an
    earlier process compiled it for these weights (`--compile -v` says how long either took): its
    forwards of up to `COMPILED_MAX_TOKENS` fed tokens then
    run it. `batches`: also the graph for two batch rows or more (a server's batches); without
    it, they run eagerly. Returns None when done (or already done for these weights), else why
    not; the eager runner then stays."""
    model = runner.model()
    reason = why_not_compiled(model)
    if reason is not None:
        return reason
    if runner.compiled is not None and runner.compiled.current() and (runner.compiled.rows is not None or not batches):
        return None
    try:
        runner.compiled = CompiledForward(runner, model, batches)
    except Exception as exc:  # noqa: BLE001 - export's and Inductor's failures are many and deep: the eager runner stays
        text = str(exc).strip()
        return f"compiling failed: {text.splitlines()[0] if text else type(exc).__name__}"
    return None
