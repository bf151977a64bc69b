"""Which of the lean runner's float32 CPU forwards is fastest at each width, on this machine.

The runner (`cllm.runtime.lean.runner`) computes a float32 CPU forward three ways, each exact (token
for token transformers' greedy output, its logits equal to float32 rounding):

- "packed": on oneDNN-packed copies of the weights (`packed.PackedWeights`), token-major;
- "gemm": feature-major on MKL's GEMM and the model's own weights (`W @ X`);
- "rows": token-major on the model's own weights (transformers' `X @ W^T`).

Which one is fastest depends on the CPU and on the tokens a forward feeds (on the 2-core AMD
Zen 4 of `benchmarks/engines-cpu/` the packed weights won at every width, on a 2-core Intel Xeon
the token-major one at few tokens: `cllm generate -v` prints a machine's plan). So `measure` times each
at a few widths when a model is readied for decoding (`LeanRunner.prepare`), and the runner then
takes, for a forward of M fed tokens (all rows together), the path measured fastest at the
first measured width of at least M (`Plan.path`). Without a plan the runner computes on the
packed weights.

The LM head weighs most in a small model's forward (a third of the embedded model's weights),
and its best kernel differs again (MKL's `X @ W^T` or oneDNN's packed copy, by width). So a
"rows" forward computes its logits on the kernel `measure_head` found fastest at its width
(`LeanRunner.head_plan`).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cllm.runtime.lean.packed import PackedWeights, packed_linear

PATHS = ("packed", "gemm", "rows")
HEAD_PATHS = ("packed", "rows")  # the LM head of a "rows" forward: its packed copy, or F.linear on its weight
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # fed tokens timed: a decoding step's, then batches' and prefills'
PREFIX = 128  # cached tokens before each timed forward
ROUNDS = 3  # interleaved timed rounds, after one untimed; a path's time at a width is its fastest forward
REPEATS = 2  # forwards in a row per path and width, the first untimed (its weights are then in the CPU's caches,
# as in a decode, whose steps mostly take one path)

MARGIN = 0.1  # another path than the fastest overall is taken at a width where it is this much faster

@dataclass(frozen=True)
class Plan:
    """The fastest path at each measured width, and the times it was chosen from."""

    widths: tuple[int, ...]  # ascending
    paths: tuple[str, ...]  # the fastest at each width
    ms: dict[str, tuple[float, ...]]  # per path: its fastest time at each width, milliseconds

    @classmethod
    def from_times(cls, ms: dict[str, dict[int, float]]) -> Plan:
        """The plan of measured times, {path: {width: ms}}, every path at the same widths: the path
        fastest over all widths together, and at a width another only where it is more than
        `MARGIN` faster (timings are noisy, and a forward switching paths finds less of its
        weights in the CPU's caches).
        """
        widths = tuple(sorted(next(iter(ms.values()))))
        overall = min(ms, key=lambda p: sum(ms[p].values()))
        chosen = tuple(fastest if ms[fastest][w] < (1 - MARGIN) * ms[overall][w] else overall
                       for w in widths for fastest in [min(ms, key=lambda p: ms[p][w])])
        return cls(widths, chosen, {p: tuple(times[w] for w in widths) for p, times in ms.items()})

    def path(self, tokens: int) -> str:
        """The path for a forward of `tokens` fed tokens: the fastest at the first measured width
        of at least `tokens` (the widest's beyond it)."""
        return self.paths[min(bisect.bisect_left(self.widths, tokens), len(self.widths) - 1)]

    def describe(self) -> str:
        """The plan in words: 'rows at 1-4, gemm at 5-16, packed at 17+ fed tokens'."""
        parts, low = [], 1
        for i, path in enumerate(self.paths):
            if i + 1 < len(self.paths) and self.paths[i + 1] == path:
                continue
            high = self.widths[i]
            span = f"{low}+" if i + 1 == len(self.paths) else str(low) if low == high else f"{low}-{high}"
            parts.append(f"{path} at {span}")
            low = high + 1
        return ", ".join(parts) + " fed tokens"


def _fastest(run: Callable[[str, int], None], paths: Sequence[str], widths: Sequence[int], rounds: int,
             clock: Callable[[], float]) -> Plan:
    """The plan of `run(path, width)`'s fastest times: interleaved rounds whose order rotates,
    `REPEATS` calls in a row per path and width, the first of them (and round 0) untimed."""
    order = [(w, p) for w in widths for p in paths]
    best = {p: dict.fromkeys(widths, float("inf")) for p in paths}
    for r in range(rounds + 1):
        shift = r % len(order)
        for w, path in order[shift:] + order[:shift]:
            for i in range(REPEATS):
                t0 = clock()
                run(path, w)
                seconds = clock() - t0
                if r and i:
                    best[path][w] = min(best[path][w], 1000 * seconds)
    return Plan.from_times(best)


def measure(runner: Any, paths: Sequence[str], *, widths: Sequence[int] = WIDTHS,
            prefix: int = PREFIX, rounds: int = ROUNDS,
            clock: Callable[[], float] = time.perf_counter) -> Plan:
    """Times one forward of each of `paths` at each of `widths` fed tokens (one row, causal, after
    `prefix` random cached tokens; rolled back after each) and returns the plan of the fastest
    (`_fastest`). `runner`: a `runner.LeanRunner`."""
    embed = runner.embed.weight
    vocab, device = embed.shape[0], embed.device
    g = torch.Generator().manual_seed(0)
    ids = {w: torch.randint(vocab, (1, w), generator=g).to(device) for w in widths}
    positions = {w: torch.arange(prefix, prefix + w, device=device)[None] for w in widths}

    def forward(path: str, w: int) -> None:
        runner.path = path
        runner.forward(kv, ids[w], positions[w], None)
        kv.crop(prefix)

    given = runner.path
    try:
        with torch.inference_mode():
            kv = runner.new_cache(1, prefix + max(widths))
            runner.forward(kv, torch.randint(vocab, (1, prefix), generator=g).to(device),
                           torch.arange(prefix, device=device)[None], None)
            return _fastest(forward, paths, widths, rounds, clock)
    finally:
        runner.path = given


def measure_head(head: torch.nn.Linear, packed: PackedWeights, *, widths: Sequence[int] = WIDTHS,
                 rounds: int = ROUNDS, clock: Callable[[], float] = time.perf_counter) -> Plan:
    """Times the LM head alone on each of `HEAD_PATHS` at each of `widths` rows, as `measure`
    times forwards, and returns the plan of the fastest."""
    g = torch.Generator().manual_seed(0)
    xs = {w: torch.randn(w, head.in_features, generator=g).to(head.weight) for w in widths}
    kernels = {"packed": lambda x: packed_linear(x, packed.head), "rows": lambda x: F.linear(x, head.weight, head.bias)}
    with torch.inference_mode():
        return _fastest(lambda path, w: kernels[path](xs[w]), HEAD_PATHS, widths, rounds, clock)
