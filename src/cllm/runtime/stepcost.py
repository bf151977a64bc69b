"""What a forward feeding k tokens to one row costs on a runtime, in one-token forwards: the
curve the engine's fed width is chosen by (`cllm.decoding.jacobi.width`).

`measure` times a chain feed of k tokens after a cached prefix of random tokens, every k
interleaved over a few rounds, and keeps each k's fastest (a second or two for a 135M model on
two CPU cores). `cached_costs` measures once per model, runtime setting and machine and keeps
the curve in the user's cache (`~/.cache/cllm/costs/`), so that later loads, and the decoding
they choose, are the same every time on this machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from cllm.core.machine import cpu_name, sync

log = logging.getLogger(__name__)

KS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # the fed widths timed; the others are interpolated
# the engine's own work per forward besides the runtime's (drafting, the tree, argmax, bookkeeping):
# about half a millisecond on the 2-core CPU here (cProfile of 512 one-token steps of SmolLM2 on
# llama.cpp); it weighs on a small model's step, whose forward takes about a millisecond
HOST_SECONDS = 0.0005
PREFIX = 128  # cached tokens before the timed feeds (clipped to the runtime's position limit)
ROUNDS = 3
VERSION = 2  # of the cached record: a changed measurement is measured again


def measure(runtime, *, ks: Sequence[int] = KS, prefix: int = PREFIX, rounds: int = ROUNDS, seed: int = 0,
            clock: Callable[[], float] = time.perf_counter) -> tuple[float, ...]:
    """c(k) = (t(k) + h) / (t(1) + h) for k = 1 .. ks[-1] (linear between the timed widths) on
    `runtime`, h the engine's own work per forward (`HOST_SECONDS`)."""
    limit = runtime.position_limit
    if limit is not None:
        prefix = max(1, min(prefix, limit - ks[-1]))
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(runtime.vocab_size, (prefix + ks[-1],), generator=g).tolist()
    session = runtime.session()
    with torch.inference_mode():
        rows, _ = session.open([tokens[:prefix]])
        best: dict[int, float] = {}
        for r in range(rounds + 1):  # round 0 warms every width up (buffers, kernels) and is not kept
            order = list(ks[r % len(ks) :]) + list(ks[: r % len(ks)])  # no width always after the same one
            for k in order:
                sync(runtime.device)
                t0 = clock()
                session.feed(rows, [tokens[prefix : prefix + k]]).logits[0, -1].max().item()
                sync(runtime.device)
                seconds = clock() - t0
                session.keep(rows, [[]])  # the next feed sees the same cache
                if r:
                    best[k] = min(best.get(k, seconds), seconds)
        session.close(rows)
    timed = [(best[k] + HOST_SECONDS) / (best[ks[0]] + HOST_SECONDS) for k in ks]
    costs = []
    for k in range(1, ks[-1] + 1):
        hi = next(i for i, kk in enumerate(ks) if kk >= k)
        if ks[hi] == k or hi == 0:
            costs.append(timed[hi])
        else:
            k0, k1 = ks[hi - 1], ks[hi]
            costs.append(timed[hi - 1] + (timed[hi] - timed[hi - 1]) * (k - k0) / (k1 - k0))
    # a wider forward never costs less than a narrower one: noise smoothed out
    return tuple(round(max(costs[: i + 1]), 4) for i in range(len(costs)))


def cache_dir() -> Path:
    """The user's cache of measured step costs (~/.cache/cllm/costs; CLLM_COSTS_DIR overrides)."""
    if os.environ.get("CLLM_COSTS_DIR"):
        return Path(os.environ["CLLM_COSTS_DIR"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cllm" / "costs"


def cached_costs(runtime, model: str, setting: str, *, folder: Path | None = None) -> tuple[float, ...]:
    """The step costs of `model` (an identity that changes when its weights do) on `runtime` in
    `setting` (threads, cache type, ...) on this machine: read from the cache, else measured now
    and written there. A cache that cannot be written only costs the next load a measurement."""
    key = {"version": VERSION, "model": model, "runtime": runtime.name, "setting": setting, "cpu": cpu_name(),
           "cores": os.cpu_count()}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json"
    path = (folder or cache_dir()) / name
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("key") == key and all(isinstance(c, (int, float)) and c > 0 for c in record["costs"]):
            return tuple(float(c) for c in record["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.info("measuring what a forward of k tokens costs on %s (once for this model and machine)", runtime.name)
    costs = measure(runtime)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "ks": list(range(1, len(costs) + 1)), "costs": list(costs)}),
                       encoding="utf-8")
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not keep the step costs in %s: %s", path.parent, exc)
    return costs
