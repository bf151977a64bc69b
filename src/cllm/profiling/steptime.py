"""Timing one decoding step of k fed tokens, through the engine's own code path.

`cllm profile` and `cllm tune` share this: random-weight Llama-shaped models built from a config
in-process (no weights, no download), and three measurements after a cached prefix:

- causal step: `cache.feed` of k tokens, argmax at every position (the step's one device sync),
  `cache.commit` rolling all k back, so every step sees the same cache length (what a plain
  Jacobi step costs);
- tree step: the same through `cache.feed_tree` with a recycling trie of k tokens built by the
  engine's own `TokenTrie` (a block tail plus pool drafts sharing its root: the tree mask path);
- host time: `jacobi_decode` run for real, its wall clock minus the time inside the model's
  forward calls (device synced at each call's start and end, by forward hooks), per forward.
  That is the engine's Python around the model: tails, tries, acceptance, cache commits, the
  argmax and its copy to the host.

Timing follows gpt-fast: the device is synced before each clock read. Rounds are interleaved
over (path, k), so background load hits every k alike; min and median over rounds (a busy machine
only ever adds time). Nothing here prints or knows about the command line.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from cllm.core.errors import UserError, first_line
from cllm.core.machine import sync
from cllm.decoding import greedy_decode, jacobi_decode
from cllm.decoding.jacobi import TokenTrie
from cllm.modeling.shapes import LLAMA_SHAPES
from cllm.models import resolve_dtype
from cllm.runtime import hf_cache as kv
from cllm.runtime.lean import graphs
from cllm.runtime.lean import runner as lean

SHAPES = LLAMA_SHAPES  # named shapes: cllm.modeling.shapes
POSITIONS = 4096  # max_position_embeddings of the named shapes
MEMORY_MARGIN = 0.8  # a CPU model may take this fraction of the available memory at most


def shape_config(shape: str):
    """A transformers config for a named shape, a config.json file, or a checkpoint folder."""
    if shape in SHAPES:
        return LlamaConfig(**SHAPES[shape], max_position_embeddings=POSITIONS, initializer_range=0.02)
    path = Path(shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UserError(f"unknown shape {shape!r}: {', '.join(SHAPES)}, or a config.json / model folder")
    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # noqa: BLE001 - any failure to read it is the user's file
        raise UserError(f"cannot read model config {path}: {first_line(exc)}") from None


def parameter_count(config) -> int:
    """Parameters of the model `config` describes, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def available_memory() -> int | None:
    """Bytes of memory the system could give now (Linux MemAvailable), or None if unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def random_model(config, dtype: torch.dtype, device: torch.device, *, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised causal LM of `config`, allocated directly in `dtype` on `device`
    (a 7B model in bfloat16 never exists in float32). On the CPU, one that would not fit in the
    available memory is refused before anything is allocated."""
    n_params = parameter_count(config)
    need = n_params * torch.finfo(dtype).bits // 8
    free = available_memory() if device.type == "cpu" else None
    if free is not None and need > MEMORY_MARGIN * free:
        raise UserError(f"a {n_params / 1e9:.2f}B-parameter model in {str(dtype).removeprefix('torch.')} needs "
                        f"{need / 2**30:.1f} GiB; this machine has {free / 2**30:.1f} GiB available "
                        "(use --device cuda, a smaller --shape or --dtype)")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: torch sees no CUDA device here")
    return torch.device(name)


def default_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is not None:
        return resolve_dtype(dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tree_layout(k: int, tail: int = 4, width: int = 4) -> tuple[list[int], list[int], list[list[bool]]]:
    """A recycling trie of exactly k tokens, built by the engine's `TokenTrie`: a Jacobi tail of
    min(tail, k) tokens, then drafts of `width` tokens branching off the root until k are fed.
    Returns its token ids (arbitrary, distinct), position offsets and ancestor mask (k x k)."""
    first = min(tail, k)
    tail_tokens = list(range(first))
    drafts, next_id = [], first
    while first + width * len(drafts) < k:  # every draft has a fresh first token: no sharing
        drafts.append(list(range(next_id, next_id + width)))
        next_id += width
    trie = TokenTrie.build(tail_tokens, drafts, budget=k)
    assert len(trie.tokens) == k, (k, len(trie.tokens))
    return trie.tokens, trie.depth, trie.ancestor_rows(k)


@dataclass
class StepTimes:
    """Seconds per step, per path and k, over interleaved rounds (all rounds kept)."""

    ks: list[int]
    causal: dict[int, list[float]] = field(default_factory=dict)
    tree: dict[int, list[float]] = field(default_factory=dict)


def time_steps(model: torch.nn.Module, ks: Sequence[int], *, prefix: int, rounds: int, tree: bool = True,
               seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> StepTimes:
    """t(k) of the causal step (and the tree step) after `prefix` cached random tokens."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(vocab, (1, prefix), generator=g).to(device)  # (1, prefix)
    with torch.inference_mode():
        rc, _ = kv.prefill(model, prompt, torch.ones_like(prompt))
    ids = {k: torch.randint(vocab, (1, k), generator=g).to(device) for k in ks}  # (1, k) each
    trees = {}
    for k in ks if tree else ():
        tokens, depth, mask = tree_layout(k)
        trees[k] = (torch.tensor([tokens], device=device) % vocab, torch.tensor([depth]), torch.tensor([mask]))

    @torch.inference_mode()
    def causal_step(k: int) -> None:
        logits = kv.feed(model, rc, ids[k], fed=[k])  # (1, k, V)
        logits[0].argmax(-1).tolist()
        kv.commit(rc, keep=[0], fed=k)  # roll all k back: the next step sees the same cache

    @torch.inference_mode()
    def tree_step(k: int) -> None:
        tokens, offsets, mask = trees[k]
        logits = kv.feed_tree(model, rc, tokens, offsets, mask)  # (1, k, V)
        logits[0].argmax(-1).tolist()
        kv.commit_kept(rc, [[]], fed=k)

    steps = {"causal": causal_step, **({"tree": tree_step} if tree else {})}
    out = StepTimes(ks=list(ks))
    for name in steps:  # warm-up: every shape twice (allocator, kernels, autotuning)
        for k in ks:
            steps[name](k)
            steps[name](k)
    order = [(name, k) for name in steps for k in ks]
    for r in range(rounds):
        shift = r % len(order)  # rotate, so no k always follows the same neighbour
        for name, k in order[shift:] + order[:shift]:
            sync(device)
            t0 = clock()
            steps[name](k)
            sync(device)
            getattr(out, name).setdefault(k, []).append(clock() - t0)
    assert rc.lengths == [prefix], "a step did not roll the cache back"
    return out


def forward_paths(model: torch.nn.Module) -> list[str]:
    """The decoding forwards `model` can take, as `time_forwards` names them."""
    with lean.runner_enabled(True):
        runner = lean.runner_for(model)
    weight = model.get_input_embeddings().weight
    packs = runner is not None and lean.LeanRunner.feature_major(weight) and lean.PackedWeights.why_not(model) is None
    graphed = runner is not None and graphs.why_not_graphs(runner, weight) is None
    return (["compiled"] if lean.compiled(model) is not None else []) + (["lean"] if runner is not None else []) + (
        ["lean-mkl"] if packs else []) + (["lean-eager"] if graphed else []) + ["transformers"]


def time_forwards(model: torch.nn.Module, ks: Sequence[int], batches: Sequence[int], *, prefix: int,
                  rounds: int, seed: int = 0) -> dict[str, dict[int, dict[int, list[float]]]]:
    """Seconds of one causal decoding forward of k fed tokens per row, batch B, after `prefix`
    cached tokens, on each forward the model can take: {"compiled" (the lean runner's compiled
    forward, when `compiled.compile_runner` compiled it), "lean" (`cllm.runtime.lean.runner`'s eager
    forward, when it runs the model; on a GPU replayed from CUDA graphs), "lean-mkl" (the same on
    MKL's GEMM and the plain weights, where "lean" runs on packed ones), "lean-eager" (the same
    without CUDA graphs, where "lean" runs on them), "transformers": {B: {k: [seconds per round]}}}. Rounds
    are interleaved over (forward, B, k) and rotated; each step is rolled back, so every one
    sees the same cache."""
    device, vocab = next(model.parameters()).device, model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    paths = forward_paths(model)
    caches, ids = {}, {}
    for path in paths:
        for B in batches:
            prompt = torch.randint(vocab, (B, prefix), generator=torch.Generator().manual_seed(seed)).to(device)
            with lean.runner_enabled(path != "transformers"), torch.inference_mode():
                caches[path, B], _ = kv.prefill(model, prompt, torch.ones_like(prompt))
    for B in batches:
        for k in ks:
            ids[B, k] = torch.randint(vocab, (B, k), generator=g).to(device)

    @torch.inference_mode()
    def step(path: str, B: int, k: int) -> None:
        rc = caches[path, B]
        with lean.compiled_enabled(path == "compiled"), lean.packed_enabled(path != "lean-mkl"), \
                lean.graphs_enabled(path != "lean-eager"):
            logits = kv.feed(model, rc, ids[B, k], fed=[k] * B)  # (B, k, V)
        logits.argmax(-1).tolist()  # the step's one device sync
        kv.commit(rc, keep=[0] * B, fed=k)

    order = [(path, B, k) for path in paths for B in batches for k in ks]
    for key in order + order:  # warm-up: every shape twice
        step(*key)
    out: dict[str, dict[int, dict[int, list[float]]]] = {p: {B: {} for B in batches} for p in paths}
    for r in range(rounds):
        shift = r % len(order)
        for path, B, k in order[shift:] + order[:shift]:
            sync(device)
            t0 = time.perf_counter()
            step(path, B, k)
            sync(device)
            out[path][B].setdefault(k, []).append(time.perf_counter() - t0)
    return out


@dataclass
class HostTime:
    """Wall clock of a real `jacobi_decode` split into the model's forwards and the rest."""

    forwards: int
    total_s: float
    model_s: float

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * (self.total_s - self.model_s) / self.forwards


class _ForwardClock:
    """Forward hooks that add up the time spent inside the model's forward calls (synced)."""

    def __init__(self, model: torch.nn.Module, clock: Callable[[], float]):
        self.device, self.clock = next(model.parameters()).device, clock
        self.seconds, self.calls, self._t0 = 0.0, 0, 0.0
        self.handles = [model.register_forward_pre_hook(self._start), model.register_forward_hook(self._stop)]

    def _start(self, *_):
        sync(self.device)
        self._t0 = self.clock()

    def _stop(self, *_):
        sync(self.device)
        self.seconds += self.clock() - self._t0
        self.calls += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def time_host(model: torch.nn.Module, settings: dict[str, Any], *, prefix: int, new_tokens: int,
              repeats: int, seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> HostTime:
    """The engine's time outside the model per forward: `jacobi_decode(**settings)` on a random
    prompt of `prefix` tokens, the best (least host time per forward) of `repeats` runs."""
    device = next(model.parameters()).device
    prompt = torch.randint(model.config.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(seed))
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        timer = _ForwardClock(model, clock)
        try:
            sync(device)
            t0 = clock()
            jacobi_decode(model, prompt.to(device), max_new_tokens=new_tokens,
                          generator=torch.Generator().manual_seed(seed), **settings)
            sync(device)
            runs.append(HostTime(forwards=timer.calls, total_s=clock() - t0, model_s=timer.seconds))
        finally:
            timer.remove()
    return min(runs[1:] or runs, key=lambda run: run.host_ms_per_step)


def forward_ms(times: dict[str, dict[int, dict[int, list[float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """`time_forwards`' seconds as the reports keep them: {path: {"B": {"k": min ms}}}."""
    return {path: {str(B): {str(k): round(1e3 * min(s), 4) for k, s in per_k.items()} for B, per_k in per_b.items()}
            for path, per_b in times.items()}


def time_decodes(model: torch.nn.Module, *, prefix: int, new_tokens: int, repeats: int,
                 seed: int = 0) -> dict[str, Any]:
    """Single-request greedy decoding speed, tokens/s, on each forward the model can take:
    {"lean" (where the lean runner runs the model), "lean-eager" (the same without CUDA graphs, where
    "lean" runs on them), "transformers"}. `greedy_decode` of exactly
    `new_tokens` tokens (no EOS) after a random prompt of `prefix` tokens; the paths are
    interleaved over `repeats` rounds after a warm-up and the fastest round is kept. Returns
    {"tokens_per_second": {path: tok/s}, "same_tokens": whether every path decoded the same tokens}
    (in float32 they must; in bfloat16 a near-tie may flip)."""
    device, vocab = next(model.parameters()).device, model.config.vocab_size
    prompt = torch.randint(vocab, (1, prefix), generator=torch.Generator().manual_seed(seed)).to(device)
    paths = [path for path in forward_paths(model) if path in ("lean", "lean-eager", "transformers")]
    best: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    for r in range(repeats + 1):  # round 0 warms up
        for path in paths if r % 2 else paths[::-1]:
            with lean.runner_enabled(path != "transformers"), lean.graphs_enabled(path != "lean-eager"):
                sync(device)
                t0 = time.perf_counter()
                out = greedy_decode(model, prompt, max_new_tokens=new_tokens, eos_token_id=None)
                sync(device)
                seconds = time.perf_counter() - t0
            outputs.setdefault(path, out.new_tokens[0])
            if r:
                best[path] = min(best.get(path, float("inf")), seconds)
    return {"tokens_per_second": {path: new_tokens / seconds for path, seconds in best.items()},
            "same_tokens": len({tuple(o) for o in outputs.values()}) == 1}


def summary(times: list[float]) -> dict[str, float]:
    """min and median, in milliseconds."""
    return {"min_ms": 1e3 * min(times), "median_ms": 1e3 * statistics.median(times)}


def write_json(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
