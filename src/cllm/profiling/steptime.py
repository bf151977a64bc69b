"""Timing one decoding step of k fed tokens, through the engine's own code path: a runtime's
session (`cllm.runtime`), as the decoders drive it.

`cllm profile` and `cllm tune` share this: random-weight Llama-shaped models built from a config
in-process (no weights, no download), and three measurements after a cached prefix:

- causal step: one `feed` of k tokens as a chain, argmax at every position (the step's one
  device sync), `keep` of none of them, so every step sees the same cache length (what a plain
  Jacobi step costs);
- tree step: the same with a recycling trie of k tokens built by the engine's own `tree.Tree`
  (a block tail plus pool drafts sharing its root: the tree mask path);
- host time: `jacobi_decode` run for real, its wall clock minus the time inside the runtime's
  forwards (its sessions' `open` and `feed`, device synced at each one's start and end), per
  forward. That is the engine's Python around the forward: tails, tries, acceptance, what the
  session keeps, the argmax and its copy to the host.

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
from cllm.decoding.argmax import argmax
from cllm.decoding.tree import Tree
from cllm.modeling.shapes import LLAMA_SHAPES
from cllm.models import resolve_dtype
from cllm.runtime import Runtime, open_runtime
from cllm.runtime.lean import LeanRuntime, why_not
from cllm.runtime.lean.packed import PackedWeights
from cllm.runtime.lean.runner import LeanRunner

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


def default_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is not None:
        return resolve_dtype(dtype)
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def tree_layout(k: int, tail: int = 4, width: int = 4) -> tuple[list[int], list[int]]:
    """A recycling trie of exactly k tokens, built by the engine's `tree.Tree`: a Jacobi tail of
    min(tail, k) tokens, then drafts of `width` tokens branching off the root until k are fed.
    Returns its token ids (arbitrary, distinct) and its parent list."""
    first = min(tail, k)
    tail_tokens = list(range(first))
    drafts, next_id = [], first
    while first + width * len(drafts) < k:  # every draft has a fresh first token: no sharing
        drafts.append(list(range(next_id, next_id + width)))
        next_id += width
    tree = Tree.trie(tail_tokens, drafts, budget=k)
    assert len(tree.tokens) == k, (k, len(tree.tokens))
    return tree.tokens, tree.parent


@dataclass
class StepTimes:
    """Seconds per step, per path and k, over interleaved rounds (all rounds kept)."""

    ks: list[int]
    causal: dict[int, list[float]] = field(default_factory=dict)
    tree: dict[int, list[float]] = field(default_factory=dict)


def time_steps(runtime: Runtime, ks: Sequence[int], *, prefix: int, rounds: int, tree: bool = True,
               seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> StepTimes:
    """t(k) of the causal step (and the tree step) after `prefix` cached random tokens, on
    `runtime` (a model: its "auto" runtime)."""
    runtime = open_runtime(runtime) if isinstance(runtime, torch.nn.Module) else runtime
    device, vocab = runtime.device, runtime.vocab_size
    g = torch.Generator().manual_seed(seed)
    session = runtime.session()
    with torch.inference_mode():
        rows, _ = session.open([torch.randint(vocab, (prefix,), generator=g).tolist()])
    ids = {k: torch.randint(vocab, (k,), generator=g).tolist() for k in ks}
    trees = {k: tree_layout(k) for k in ks} if tree else {}

    @torch.inference_mode()
    def causal_step(k: int) -> None:
        argmax(session.feed(rows, [ids[k]]).logits[0]).tolist()
        session.keep(rows, [[]])  # roll all k back: the next step sees the same cache

    @torch.inference_mode()
    def tree_step(k: int) -> None:
        tokens, parents = trees[k]
        argmax(session.feed(rows, [[t % vocab for t in tokens]], parents=[parents]).logits[0]).tolist()
        session.keep(rows, [[]])

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
    assert session.length(rows[0]) == prefix, "a step did not roll the cache back"
    session.close(rows)
    return out


def forward_runtimes(model: torch.nn.Module, compiled: LeanRuntime | None = None) -> dict[str, Runtime]:
    """The decoding forwards `model` can take, by the name `time_forwards` gives them: "compiled"
    (`compiled`, a lean runtime whose forward was compiled), "lean" (the lean runtime, when it runs
    the model: readied as `load_for_decoding` readies it; on a GPU replayed from CUDA graphs),
    "lean-mkl" (the same on MKL's GEMM and the plain weights, where "lean" runs on packed ones),
    "lean-eager" (the same without CUDA graphs, where "lean" runs on them), "transformers"."""
    out: dict[str, Runtime] = {"compiled": compiled} if compiled is not None else {}
    if why_not(model) is None:
        out["lean"] = open_runtime(model, "lean")
        out["lean"].prepare()
        weight = model.get_input_embeddings().weight
        if LeanRunner.feature_major(weight) and PackedWeights.why_not(model) is None:
            out["lean-mkl"] = open_runtime(model, "lean", packed=False)
        if out["lean"].runner.why_not_graphs() is None:
            out["lean-eager"] = open_runtime(model, "lean", graphs=False)
    out["transformers"] = open_runtime(model, "transformers")
    return out


def time_forwards(model: torch.nn.Module | None, ks: Sequence[int], batches: Sequence[int], *, prefix: int,
                  rounds: int, seed: int = 0, compiled: LeanRuntime | None = None,
                  extra: dict[str, Runtime] | None = None) -> dict[str, dict[int, dict[int, list[float]]]]:
    """Seconds of one causal decoding forward of k fed tokens per row, batch B, after `prefix`
    cached tokens, on each forward the model can take (`forward_runtimes`; none for no model)
    and each of `extra` (path -> a runtime of the same model, e.g. llama.cpp's): {path: {B: {k:
    [seconds per round]}}}. Rounds are interleaved over (forward, B, k) and rotated, the torch
    forwards' apart from `extra`'s; each step is rolled back, so every one sees the same cache."""
    g = torch.Generator().manual_seed(seed)
    runtimes = {**(forward_runtimes(model, compiled) if model is not None else {}), **(extra or {})}
    vocab = min(runtime.vocab_size for runtime in runtimes.values())
    sessions, ids = {}, {}
    for path, runtime in runtimes.items():
        for B in batches:
            prompt = torch.randint(vocab, (B, prefix), generator=torch.Generator().manual_seed(seed)).tolist()
            session = runtime.session()
            with torch.inference_mode():
                sessions[path, B] = (session, session.open(prompt)[0])
    for B in batches:
        for k in ks:
            ids[B, k] = torch.randint(vocab, (B, k), generator=g).tolist()

    @torch.inference_mode()
    def step(path: str, B: int, k: int) -> None:
        session, rows = sessions[path, B]
        argmax(session.feed(rows, ids[B, k]).logits).tolist()  # the step's one device sync
        session.keep(rows, [[]] * B)

    out: dict[str, dict[int, dict[int, list[float]]]] = {p: {B: {} for B in batches} for p in runtimes}
    # the torch forwards interleaved, then the others: llama.cpp's threads spin a while after
    # each of its forwards and would slow whichever torch step came next
    for group in ([p for p in runtimes if p not in (extra or {})], list(extra or {})):
        order = [(path, B, k) for path in group for B in batches for k in ks]
        for key in order + order:  # warm-up: every shape twice
            step(*key)
        for r in range(rounds):
            shift = r % max(len(order), 1)
            for path, B, k in order[shift:] + order[:shift]:
                device = runtimes[path].device
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


class _Timed:
    """A runtime whose sessions add up the time spent in their forwards (`open`, `feed`; the
    device synced at each one's start and end), answering everything else as the runtime."""

    def __init__(self, runtime: Runtime, clock: Callable[[], float]) -> None:
        self.runtime, self.clock = runtime, clock
        self.seconds, self.calls = 0.0, 0

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def session(self):
        session = self.runtime.session()

        def timed(call):
            def forward(*args, **kwargs):
                sync(self.runtime.device)
                t0 = self.clock()
                out = call(*args, **kwargs)
                sync(self.runtime.device)
                self.seconds += self.clock() - t0
                self.calls += 1
                return out
            return forward

        session.open, session.feed = timed(session.open), timed(session.feed)
        return session


def time_host(runtime: Runtime, settings: dict[str, Any], *, prefix: int, new_tokens: int,
              repeats: int, seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> HostTime:
    """The engine's time outside the runtime's forwards per forward: `jacobi_decode(**settings)`
    on a random prompt of `prefix` tokens, the best (least host time per forward) of `repeats`
    runs."""
    runtime = open_runtime(runtime) if isinstance(runtime, torch.nn.Module) else runtime
    prompt = torch.randint(runtime.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(seed))
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        timed = _Timed(runtime, clock)
        sync(runtime.device)
        t0 = clock()
        jacobi_decode(timed, prompt, max_new_tokens=new_tokens, generator=torch.Generator().manual_seed(seed),
                      **settings)
        sync(runtime.device)
        runs.append(HostTime(forwards=timed.calls, total_s=clock() - t0, model_s=timed.seconds))
    return min(runs[1:] or runs, key=lambda run: run.host_ms_per_step)


def forward_ms(times: dict[str, dict[int, dict[int, list[float]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """`time_forwards`' seconds as the reports keep them: {path: {"B": {"k": min ms}}}."""
    return {path: {str(B): {str(k): round(1e3 * min(s), 4) for k, s in per_k.items()} for B, per_k in per_b.items()}
            for path, per_b in times.items()}


def time_decodes(model: torch.nn.Module, *, prefix: int, new_tokens: int, repeats: int,
                 seed: int = 0) -> dict[str, Any]:
    """Single-request greedy decoding speed, tokens/s, on each forward the model can take:
    {"lean" (where the lean runtime runs the model), "lean-eager" (the same without CUDA graphs,
    where "lean" runs on them), "transformers"}. `greedy_decode` of exactly `new_tokens` tokens
    (no EOS) after a random prompt of `prefix` tokens; the paths are interleaved over `repeats`
    rounds after a warm-up and the fastest round is kept. Returns {"tokens_per_second": {path:
    tok/s}, "same_tokens": whether every path decoded the same tokens} (in float32 they must; in
    bfloat16 a near-tie may flip)."""
    device, vocab = next(model.parameters()).device, model.config.vocab_size
    prompt = torch.randint(vocab, (1, prefix), generator=torch.Generator().manual_seed(seed))
    runtimes = {path: runtime for path, runtime in forward_runtimes(model).items()
                if path in ("lean", "lean-eager", "transformers")}
    best: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    paths = list(runtimes)
    for r in range(repeats + 1):  # round 0 warms up
        for path in paths if r % 2 else paths[::-1]:
            sync(device)
            t0 = time.perf_counter()
            out = greedy_decode(runtimes[path], prompt, max_new_tokens=new_tokens, eos_token_id=None)
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
