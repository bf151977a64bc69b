"""The lean runner's forward replayed from CUDA graphs (`LeanRunner.forward` on a GPU).

Why: on a GPU a decoding forward of a model up to a few billion parameters costs its kernel
launches and the Python that issues them, not arithmetic, whatever the fed tokens: replayed from
CUDA graphs it is one launch (`cllm profile --shape 1b`; `benchmarks/step_cost.md` has the
figures).

A graph fixes its tensors' addresses and shapes. So the graphs belong to a set of cache
buffers (a `GraphSet` per set) and are captured per fed shape (B rows, L tokens), the second time
that shape is fed to those buffers (a shape fed once runs eagerly: capturing costs about two
forwards). A graph reads the tokens, their positions, the slots they go to and the attention mask
from static input buffers the forward fills first, writes the new keys and values into the
cache's buffers at those slots (`index_copy_`), and attends over the buffers' whole capacity, the
mask hiding every slot past the fed ones. The layers are the runner's own
(`LeanRunner.layer_stack` on `ops.ModuleOps`). Slots nobody wrote are zeroed once (a masked slot's value still
enters the attention's sum, times 0; garbage that is NaN would not vanish). When a cache is
freed its buffers and their graphs go back to the runner (`Spares`) for the next cache of that
many rows and that capacity (rounded up to `capacity_for`), so one request after another replays
the same graphs; when a cache's buffers are reallocated (grown) their graphs are dropped.

A capture runs with Python's garbage collector paused: a graph freed by a collection in the
middle of a capture (another cache's, say) invalidates it. If a capture fails anyway, the
runner's forwards run eagerly from then on, and a warning says why.

Graphs run in inference mode, on CUDA, for forwards of up to `MAX_TOKENS` fed tokens; a weight
that moved (replaced, or the model moved) drops them, to be captured again. At most `MAX_GRAPHS`
per set of buffers (past that, new shapes run eagerly). A runtime made with `graphs=False` runs
without them; `cllm generate -v` says whether they run.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from cllm.runtime.lean.kv import LeanKV
from cllm.runtime.lean.ops import Appended, ModuleOps

# the runner these graphs replay (`lean.LeanRunner`, which imports this module: named, not imported)
LeanRunner = Any

MAX_TOKENS = 256  # B * L fed tokens up to which a forward is replayed from a graph (its logits stay allocated)
MAX_GRAPHS = 64  # graphs kept per cache at most
CAPTURE_AT = 2  # a shape is captured the time it is fed to a cache for the second time
SPARES_KEPT = 4  # freed caches' buffer sets a runner keeps for its next caches

log = logging.getLogger(__name__)


def capacity_for(slots: int) -> int:
    """The capacity of a cache's buffers where graphs run: a power of two, at least 512 (so that
    one request after another finds the same buffers)."""
    return max(512, 1 << (slots - 1).bit_length())


class CudaGraph:
    """`torch.cuda.CUDAGraph` behind the two calls the graph set makes. (Tests on a CPU stand in
    `EagerGraph`, which runs the same static forward at each replay.)"""

    def __init__(self, pool: Any) -> None:
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, forward: Any) -> Any:
        side = torch.cuda.Stream()  # warm-up and capture off the default stream, as torch's CUDA graph notes ask
        side.wait_stream(torch.cuda.current_stream())
        collecting = gc.isenabled()
        try:
            with torch.cuda.stream(side):
                forward()
                torch.cuda.synchronize()
                gc.disable()
                self.graph.capture_begin(pool=self.pool)
                try:
                    outputs = forward()
                finally:
                    self.graph.capture_end()
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream().wait_stream(side)
        return outputs

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A stand-in for `CudaGraph` on any device: `capture` runs the forward and keeps it,
    `replay` runs it again into the same output tensors."""

    def __init__(self, pool: Any = None) -> None:
        self.forward: Any = None
        self.outputs: Any = None

    def capture(self, forward: Any) -> Any:
        self.forward = forward
        self.outputs = forward()
        return self.outputs

    def replay(self) -> None:
        for out, new in zip(self.outputs, self.forward(), strict=True):
            out.copy_(new)


GRAPH_KIND: type = CudaGraph  # what `GraphSet` captures with (tests set `EagerGraph`)


class _Slots:
    """What the runner's layers append to inside a graph: the new keys and values go into the
    cache's buffers at the slots of a static index; every slot of the buffers is returned (the
    mask says which count)."""

    def __init__(self, buffers: list, rows: int, slots: torch.Tensor) -> None:
        self.buffers, self.rows, self.slots = buffers, rows, slots  # a cache's buffers, not the cache (freed apart)

    def append(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stored = self.buffers[0][i][: self.rows], self.buffers[1][i][: self.rows]
        stored[0].index_copy_(2, self.slots, keys)
        stored[1].index_copy_(2, self.slots, values)
        return stored


@dataclass
class _Captured:
    """One graph and its static inputs and outputs."""

    graph: Any
    ids: torch.Tensor  # (B, L)
    positions: torch.Tensor  # (B, L)
    slots: torch.Tensor  # (L,)
    mask: torch.Tensor  # (B, 1, L, capacity), bool
    logits: torch.Tensor  # (B, L, V)
    hidden: torch.Tensor  # (B, L, H)


class GraphSet:
    """The graphs of one cache's forwards, by fed shape (see the module docstring)."""

    def __init__(self) -> None:
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.seen: Counter = Counter()
        self.pool: Any = None
        self.where: tuple | None = None  # the buffers' addresses and shape the graphs were captured on
        self.weights: tuple | None = None

    def takes(self, rows: int, tokens: int) -> bool:
        """Whether a forward of this shape is (or will now be) replayed from a graph."""
        key = (rows, tokens)
        if key in self.graphs:
            return True
        if rows * tokens > MAX_TOKENS or len(self.graphs) >= MAX_GRAPHS:
            return False
        self.seen[key] += 1
        return self.seen[key] >= CAPTURE_AT

    def forward(self, runner: LeanRunner, kv: LeanKV, input_ids: torch.Tensor, position_ids: torch.Tensor,
                allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Logits (B, L, V) and the final norm's output (B, L, H) of the forward over `input_ids`
        (B, L) at `position_ids`, `allowed` the runner's boolean mask (B or 1, 1, L, S + L) or None
        (every slot), written to `kv` after its S used slots, as `LeanRunner.forward` computes them;
        None when the capture failed (nothing is written: the caller runs the forward eagerly)."""
        B, L = input_ids.shape
        S = kv.get_seq_length()
        kv.reserve(B, S + L)
        self._check(runner, kv)
        captured = self.graphs.get((B, L))
        fresh = captured is None
        if fresh:
            captured = self._static(kv, B, L)
        captured.ids.copy_(input_ids)
        captured.positions.copy_(position_ids)
        torch.arange(S, S + L, out=captured.slots)
        if allowed is None:
            captured.mask[..., : S + L].fill_(True)
        else:
            captured.mask[..., : S + L].copy_(allowed)
        captured.mask[..., S + L :].fill_(False)
        if fresh:
            try:
                self._capture(runner, kv, captured)
            except Exception as exc:  # noqa: BLE001 - CUDA's capture failures are many; eager forwards stay exact
                runner.graphs_failed = f"a CUDA graph capture failed ({str(exc).strip().splitlines()[0]})"
                log.warning("%s: decoding forwards run eagerly from now on", runner.graphs_failed)
                self.graphs.clear()
                return None
        captured.graph.replay()
        kv.extend(L)
        return captured.logits.clone(), captured.hidden.clone()

    def _check(self, runner: LeanRunner, kv: LeanKV) -> None:
        """Drop every graph when the cache's buffers moved (grown) or a weight moved; on a new set
        of buffers, zero every slot not in use (see the module docstring)."""
        where = tuple(b.data_ptr() for buffers in kv.buffers for b in buffers) + tuple(kv.buffers[0][0].shape)
        weights = runner.weight_addresses()
        if where == self.where and weights == self.weights:
            return
        self.graphs.clear()
        self.pool = torch.cuda.graph_pool_handle() if GRAPH_KIND is CudaGraph else None
        if where != self.where:
            kv.zero_unused()
        self.where, self.weights = where, weights

    @staticmethod
    def _static(kv: LeanKV, B: int, L: int) -> _Captured:
        device, capacity = kv.buffers[0][0].device, kv.buffers[0][0].shape[2]
        new = dict(dtype=torch.long, device=device)
        return _Captured(graph=None, ids=torch.zeros(B, L, **new), positions=torch.zeros(B, L, **new),
                         slots=torch.zeros(L, **new), logits=None, hidden=None,
                         mask=torch.zeros(B, 1, L, capacity, dtype=torch.bool, device=device))

    def _capture(self, runner: LeanRunner, kv: LeanKV, captured: _Captured) -> None:
        B, L = captured.ids.shape
        slots = _Slots(kv.buffers, B, captured.slots)

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            embedded = runner.embed(captured.ids)
            layout = ModuleOps(runner, B, L, runner.rope_module(embedded, captured.positions))
            attention = Appended(slots, captured.mask, runner.scale, runner.kv_heads != runner.heads)
            return runner.layer_stack(layout, attention, embedded, False)

        captured.graph = GRAPH_KIND(self.pool)
        captured.logits, captured.hidden = captured.graph.capture(forward)
        self.graphs[B, L] = captured


class Spares:
    """A runner's freed cache buffers with their graphs, for its next caches of the same rows and
    capacity: the `SPARES_KEPT` freed last (a GPU's memory is not held by every shape ever used)."""

    def __init__(self) -> None:
        self.kept: list[tuple[tuple[int, int], list, GraphSet]] = []  # oldest first

    def take(self, rows: int, capacity: int) -> tuple[list, GraphSet] | None:
        for i in range(len(self.kept) - 1, -1, -1):
            if self.kept[i][0] == (rows, capacity):
                _, buffers, graph_set = self.kept.pop(i)
                return buffers, graph_set
        return None

    def keep_when_freed(self, kv: LeanKV) -> None:
        """Take `kv`'s buffers and graphs back once `kv` is freed (the buffers it then has)."""
        weakref.finalize(kv, self._put, kv.buffers, kv.graphs)

    def _put(self, buffers: list, graph_set: GraphSet) -> None:
        first = buffers[0][0]
        self.kept.append(((first.shape[0], first.shape[2]), buffers, graph_set))
        del self.kept[:-SPARES_KEPT]


def why_not_graphs(runner: LeanRunner, weight: torch.Tensor) -> str | None:
    """Why the runner's forwards of this model are not replayed from CUDA graphs (None: they are)."""
    if GRAPH_KIND is CudaGraph and weight.device.type != "cuda":
        return "CUDA graphs run on a GPU only"
    if runner.graphs_failed:
        return runner.graphs_failed
    if runner.dynamic_rope:
        return "its RoPE scaling follows the sequence length (computed on the host per forward)"
    return None
