"""What a decoding step of k fed tokens costs on this machine, at real model sizes (`cllm profile`).

No trained weights: a random-initialised Llama-shaped model (the embedded target's shape, ~1B,
~7B, or any config.json) is built in-process in the chosen dtype, and the engine's own path is
timed after a cached prefix (`cllm.profiling.steptime`: cache feed and commit, the tree mask of a
recycling trie, the engine's host time per step). Random weights cost what trained ones do;
they only make the engine's host-time runs accept other drafts than a trained model would.

From t(k) the cost model (`cllm.profiling.costs`) predicts each method's tokens/s at the tokens
per forward (TPF) it is given: TPF / t(k), and its speedup over AR, TPF x t(1) / t(k). Read a
method at the row of the tokens it feeds per forward (`cllm bench` reports both).

    cllm profile --shape small --device cpu --threads 1
    cllm profile --shape 7b --device cuda --out benchmarks/step-cost-h200
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from cllm.core.config import config_to_dict
from cllm.core.errors import UserError, first_line
from cllm.core.machine import machine_info, resolve_device
from cllm.core.outputs import check_folder, claim_folder
from cllm.decoding import RECOMMENDED
from cllm.profiling.config import ProfileConfig, parse_tpf  # noqa: F401 (re-exported)
from cllm.profiling.costs import speedup_vs_ar, tokens_per_second
from cllm.profiling.steptime import (
    default_dtype,
    forward_ms,
    parameter_count,
    random_model,
    shape_config,
    summary,
    time_decodes,
    time_forwards,
    time_host,
    time_steps,
    write_json,
)
from cllm.runtime import Runtime, open_runtime

log = logging.getLogger(__name__)

HOST_REPEATS = 2  # runs of each host-time decode after a warm-up (the least host time kept)
PROFILE_JSON, PROFILE_TABLE = "profile.json", "profile.md"  # written in --out


@dataclass
class StepTiming:
    """One k: step times (ms), ratios against k = 1, host time, predictions per method."""

    k: int
    min_ms: float
    median_ms: float
    ratio: float  # t(k)/t(1), min over rounds
    ratio_median: float
    tree_min_ms: float | None = None
    tree_ratio: float | None = None  # tree t(k) / causal t(1)
    host_jacobi_ms: float | None = None  # engine host ms per step, plain Jacobi at n = k
    host_engine_ms: float | None = None  # the same, RECOMMENDED with a budget of k fed tokens
    # method -> {"tokens_per_second": TPF / t(k), "speedup_vs_ar": TPF x t(1) / t(k)}
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class StepProfile:
    """What `cllm profile` measured, as written to profile.json."""

    model: dict[str, Any]  # shape, parameters, dtype, device, prefix
    machine: dict[str, Any]
    tpf: dict[str, float]
    rows: list[StepTiming]
    config: dict[str, Any] = field(default_factory=dict)
    # one causal forward, ms (min over rounds): {path: {batch: {k: ms}}}, keys as strings (JSON)
    forwards: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    # single-request greedy decoding: {"new_tokens", "tokens_per_second": {path: tok/s}, "same_tokens"}
    decode: dict[str, Any] = field(default_factory=dict)

    @property
    def ks(self) -> list[int]:
        return [r.k for r in self.rows]

    @property
    def ratios(self) -> list[float]:
        return [r.ratio for r in self.rows]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepProfile:
        return cls(**{**data, "rows": [StepTiming(**r) for r in data["rows"]]})


def host_settings(k: int) -> dict[str, dict[str, Any]]:
    """The two engine settings whose host time is measured at k fed tokens."""
    engine = {**RECOMMENDED, "block_size": min(RECOMMENDED["block_size"], k), "recycle_budget": k}
    return {"jacobi": {"block_size": k, "recycle": 0}, "engine": engine}


def measure(runtime: Runtime, ks: list[int], *, prefix: int, repeats: int, tree: bool = True,
            host_tokens: int = 32, tpf: dict[str, float] | None = None, seed: int = 0) -> list[StepTiming]:
    """Every k's timing on `runtime`: step times and ratios, host time per step, predictions at
    `tpf`."""
    times = time_steps(runtime, ks, prefix=prefix, rounds=repeats, tree=tree, seed=seed)
    t1, t1_median = min(times.causal[1]), summary(times.causal[1])["median_ms"] / 1e3
    rows = []
    for k in ks:
        s = summary(times.causal[k])
        row = StepTiming(k=k, min_ms=s["min_ms"], median_ms=s["median_ms"], ratio=min(times.causal[k]) / t1,
                  ratio_median=s["median_ms"] / 1e3 / t1_median)
        if tree:
            row.tree_min_ms = summary(times.tree[k])["min_ms"]
            row.tree_ratio = min(times.tree[k]) / t1
        if host_tokens:
            for name, settings in host_settings(k).items():
                host = time_host(runtime, settings, prefix=prefix, new_tokens=host_tokens, repeats=HOST_REPEATS,
                                 seed=seed)
                setattr(row, f"host_{name}_ms", host.host_ms_per_step)
        tk = min(times.causal[k])
        row.predicted = {name: {"tokens_per_second": tokens_per_second(t, tk),
                                "speedup_vs_ar": speedup_vs_ar(t, t1, tk)}
                         for name, t in (tpf or {}).items()}
        rows.append(row)
    return rows


def parameters(n: int) -> str:
    """5.31M, 1.24B: a parameter count for a title."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _fmt(x: float | None, digits: int = 2) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def markdown(p: StepProfile) -> str:
    """The table: one row per k."""
    m = p.model
    head = (f"{m['shape']} ({parameters(m['parameters'])} parameters), {m['dtype']}, {m['device']}, "
            f"{m['prefix']} cached tokens; torch {p.machine['torch']}, {p.machine['threads']} "
            f"thread{'s' if p.machine['threads'] != 1 else ''}, "
            f"load average {p.machine['load_average_1min']}"
            + (f", {p.machine['gpu']}" if "gpu" in p.machine and m["device"] == "cuda" else "")
            + (f"; {m['forward']}" if "forward" in m else ""))
    cols = ["k", "t(k) ms (min)", "t(k) ms (median)", "t(k)/t(1)", "tree t(k) ms", "tree t(k)/t(1)",
            "host ms/step, Jacobi n=k", "host ms/step, engine budget k"]
    cols += [f"{name} (TPF {t:g}) tok/s, x AR" for name, t in p.tpf.items()]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in p.rows:
        cells = [str(r.k), _fmt(r.min_ms, 3), _fmt(r.median_ms, 3), _fmt(r.ratio), _fmt(r.tree_min_ms, 3),
                 _fmt(r.tree_ratio), _fmt(r.host_jacobi_ms, 3), _fmt(r.host_engine_ms, 3)]
        cells += [f"{v['tokens_per_second']:,.1f}, {v['speedup_vs_ar']:.2f}x" for v in r.predicted.values()]
        lines.append("| " + " | ".join(cells) + " |")
    if p.forwards:
        ks = sorted({int(k) for per_b in p.forwards.values() for per_k in per_b.values() for k in per_k})
        lines += ["", f"One causal forward of k fed tokens per row, batch B, after {m['prefix']} cached tokens, ms "
                  "(min over the rounds), on each forward the model can take:", "",
                  "| forward | B | " + " | ".join(f"k = {k}" for k in ks) + " |", "|" + "---|" * (len(ks) + 2)]
        lines += ["| " + " | ".join([path, B, *(_fmt(per_k.get(str(k)), 3) for k in ks)]) + " |"
                  for path, per_b in p.forwards.items() for B, per_k in per_b.items()]
    if p.decode:
        d = p.decode
        same = "the same tokens" if d["same_tokens"] else "different tokens (outside float32 a near-tie can flip)"
        lines += ["", f"Single-request greedy decoding, {d['new_tokens']} new tokens after a {m['prefix']}-token "
                  f"prompt (prefill included), the fastest of the rounds; the paths decoded {same}:", "",
                  "| forward | tokens/s |", "|---|---|"]
        lines += [f"| {path} | {tps:,.1f} |" for path, tps in d["tokens_per_second"].items()]
    return "\n".join(lines) + "\n"


def profile(config: ProfileConfig) -> StepProfile:
    """Build the model, time every k, write OUT/profile.json and OUT/profile.md; returns the profile."""
    if config.out is not None:
        check_folder(config.out, "profile")
    device = resolve_device(config.device)
    dtype = default_dtype(config.dtype, device)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    model_config = shape_config(config.shape)
    limit = getattr(model_config, "max_position_embeddings", None)
    most = max(max(config.k), config.host_tokens, config.decode_tokens)
    if limit is not None and config.prefix + most > limit:
        raise UserError(f"--prefix {config.prefix} + {most} tokens exceeds the "
                        f"model's position limit {limit}: lower --prefix")
    n_params = parameter_count(model_config)
    log.info("building a random %s model (%s parameters, %s, %s)", config.shape, parameters(n_params),
             str(dtype).removeprefix("torch."), device)
    model = random_model(model_config, dtype, device, seed=config.seed)
    log.info("timing k = %s after %d cached tokens, %d rounds%s", ", ".join(map(str, config.k)), config.prefix,
             config.repeats, f", then host time ({config.host_tokens} tokens per decode)" if config.host_tokens else "")
    tpf = parse_tpf(config.tpf)
    try:
        runtime = open_runtime(model, config.runtime)
    except ValueError as e:
        raise UserError(f"--runtime {config.runtime}: {first_line(e)}") from None
    runtime.prepare()
    rows = measure(runtime, config.k, prefix=config.prefix, repeats=config.repeats, tree=config.tree,
                   host_tokens=config.host_tokens, tpf=tpf, seed=config.seed)
    forward = runtime.describe()
    forwards, decode = {}, {}
    if config.forward_batches:
        log.info("timing one forward per path at batch %s", ", ".join(map(str, config.forward_batches)))
        forwards = forward_ms(time_forwards(model, config.k, config.forward_batches, prefix=config.prefix,
                                            rounds=config.repeats, seed=config.seed))
    if config.decode_tokens:
        log.info("timing a %d-token greedy decode per path", config.decode_tokens)
        decode = {"new_tokens": config.decode_tokens,
                  **time_decodes(model, prefix=config.prefix, new_tokens=config.decode_tokens, repeats=HOST_REPEATS,
                                 seed=config.seed)}
    result = StepProfile(
        model={"shape": config.shape, "parameters": n_params, "dtype": str(dtype).removeprefix("torch."),
               "device": device.type, "prefix": config.prefix, "forward": forward},
        machine=machine_info(device), tpf=tpf, rows=rows, config=config_to_dict(config), forwards=forwards,
        decode=decode)
    if config.out is not None:
        out = claim_folder(config.out, "profile")
        write_json(result.to_dict(), out / PROFILE_JSON)
        (out / PROFILE_TABLE).write_text(markdown(result))
    return result
