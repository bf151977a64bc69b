"""Timing the methods (gpt-fast's habits): every method first decodes the warm-up prompt(s),
untimed; then, prompt after prompt, `repeats` rounds in which every method decodes it in turn,
the order rotated per prompt and round (interleaved: a noisy neighbour hurts all methods alike);
the device is synced before each clock read; per (method, prompt) the median over rounds.

With a `BenchLog` (`cllm.bench.log`), each prompt's decodes are recorded as soon as they are
measured, and those an earlier run of the same settings recorded are taken from it instead.
"""

from __future__ import annotations

import statistics
import time

import torch

from cllm.bench.log import BenchLog, stats_from
from cllm.bench.methods import Decoded, Method
from cllm.core.machine import sync
from cllm.core.progress import Progress
from cllm.data.prompts import Prompt


def timed(method: Method, prompt: Prompt, device: torch.device) -> tuple[Decoded, float]:
    """One decode, wall clock between two device syncs."""
    for counter in method.counters:
        counter.reset()
    sync(device)
    t0 = time.perf_counter()
    decoded = method.run(prompt)
    sync(device)
    return decoded, time.perf_counter() - t0


def _from_record(record: dict) -> Decoded:
    return Decoded(record["tokens"], record["forward_passes"], record["accepted"], stats_from(record["stats"]),
                   record["draft_forward_passes"])


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def eta_text(done: int, total: int, elapsed: float) -> str:
    """Where the timed decodes stand: (method, prompt) pairs done and left, time elapsed, and the
    time left at the pace so far (pairs an earlier run recorded cost nothing and are not counted)."""
    text = f"{done}/{total} method x prompt decodes done, {total - done} left · {_duration(elapsed)} elapsed"
    if done and done < total:
        text += f", about {_duration(elapsed / done * (total - done))} to go"
    return text


def measure(methods: list[Method], prompts: list[Prompt], *, repeats: int, warmup: int,
            device: torch.device, progress: Progress | None = None,
            log: BenchLog | None = None) -> tuple[dict[str, list[Decoded]], dict[str, list[float]]]:
    """Warm-up, then per prompt `repeats` interleaved rounds of every method. Returns, per
    method, each prompt's decode (from round 1; later rounds must reproduce it) and its median
    seconds. With a `log`, each prompt's decodes are recorded once measured, and those already
    recorded (an earlier run of the same settings) are taken from it instead."""
    progress = progress or Progress.off()
    recorded = {(m.name, p.id): log.decode(m.name, p.id, p.ids) if log else None for m in methods for p in prompts}
    pending = [m for m in methods if any(recorded[m.name, p.id] is None for p in prompts)]
    if pending and warmup:
        with progress.stage("warm-up", min(warmup, len(prompts)) * len(pending),
                            detail=f"{len(pending)} methods, untimed") as stage:
            for prompt in prompts[:warmup]:
                for method in pending:
                    timed(method, prompt, device)
                    stage.advance()
    decoded: dict[str, list[Decoded]] = {m.name: [] for m in methods}
    seconds: dict[str, list[float]] = {m.name: [] for m in methods}
    detail = f"{len(prompts)} prompts x {len(methods)} methods x {repeats} rounds, interleaved"
    fresh_total = sum(r is None for r in recorded.values())  # the decodes this run times
    fresh_done, bench_start = 0, time.perf_counter()
    with progress.stage("bench", len(prompts) * len(methods) * repeats, detail=detail) as stage:
        for i, prompt in enumerate(prompts):
            began = time.perf_counter()
            todo = [m for m in methods if recorded[m.name, prompt.id] is None]
            times: dict[str, list[float]] = {m.name: [] for m in todo}
            fresh: dict[str, Decoded] = {}
            for r in range(repeats):
                shift = (i + r) % len(todo) if todo else 0  # round-robin: each method leads in turn
                for method in todo[shift:] + todo[:shift]:
                    out, dt = timed(method, prompt, device)
                    times[method.name].append(dt)
                    if r == 0:
                        fresh[method.name] = out
                    elif out.tokens != fresh[method.name].tokens:
                        raise RuntimeError(f"{method.name} is not deterministic on prompt {prompt.id!r}")
                    stage.advance()
            for method in methods:
                record = recorded[method.name, prompt.id]
                if record is None:
                    record = {"seconds": times[method.name]}
                    if log is not None:
                        log.add_decode(method.name, prompt.id, prompt.ids, fresh[method.name], times[method.name])
                    decoded[method.name].append(fresh[method.name])
                else:
                    stage.advance(repeats)
                    decoded[method.name].append(_from_record(record))
                seconds[method.name].append(statistics.median(record["seconds"]))
            fresh_done += len(todo)
            stage.note(f"{prompt.id}: " + (f"{len(todo)} methods x {repeats} rounds in "
                                            f"{time.perf_counter() - began:.1f} s" if todo else "recorded earlier")
                       + " · " + eta_text(fresh_done, fresh_total, time.perf_counter() - bench_start))
    if log is not None:
        log.reused += sum(r is not None for r in recorded.values())
    return decoded, seconds
