"""What the bench reports per method, from token lists and counts (docs/method.md#counting,
docs/method.md#bench-json): speed, tokens per forward, how much of the text loops, agreement
with greedy; and the exactness promises, checked on every prompt.

A mismatch whose top-2 logit margin at the first differing token is under the tolerance is a
float near-tie (reported); any other breaks the promise (`ExactnessError`, once the report is
written).
"""

from __future__ import annotations

from typing import Any

import torch

from cllm.bench.config import CHECKPOINT_REFERENCES, ENGINE_JACOBI, OWN_AR, References
from cllm.bench.methods import Decoded, Method
from cllm.data.prompts import Prompt
from cllm.decoding import DecodeStats
from cllm.decoding.inputs import position_limit
from cllm.evaluation.text import ends_in_loop, is_degenerate


class ExactnessError(RuntimeError):
    """A method that promises greedy's tokens produced others (and not by a float near-tie)."""


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> float:
    """Token-level agreement: equal tokens at equal positions over the longer of each pair."""
    same = sum(sum(a == b for a, b in zip(x, y)) for x, y in zip(outputs, reference, strict=True))
    total = sum(max(len(x), len(y)) for x, y in zip(outputs, reference, strict=True))
    return same / total if total else 1.0


def exact_match(outputs: list[list[int]], reference: list[list[int]]) -> float:
    return sum(x == y for x, y in zip(outputs, reference, strict=True)) / max(len(outputs), 1)


def merge_stats(stats: list[DecodeStats]) -> DecodeStats:
    merged = DecodeStats()
    for s in stats:
        merged.forward_passes += s.forward_passes
        merged.new_tokens += s.new_tokens
        for name in ("accepted", "iterations_per_block", "fast_forwarded", "stationary", "fed"):
            getattr(merged, name).extend(getattr(s, name))
        for source, count in s.sources.items():
            merged.sources[source] = merged.sources.get(source, 0) + count
    return merged


def histogram(values: list[int]) -> dict[str, int]:
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return {str(k): counts[k] for k in sorted(counts)}  # JSON keys are strings


def method_metrics(decoded: list[Decoded], seconds: list[float], *, own_ar: list[list[int]],
                   target_ar: list[list[int]], jacobi: bool) -> dict[str, Any]:
    tokens = [d.tokens for d in decoded]
    new, forwards, total_s = sum(map(len, tokens)), sum(d.forward_passes for d in decoded), sum(seconds)
    accepted = [a for d in decoded for a in (d.accepted or [])]
    stats = merge_stats([d.stats for d in decoded]) if jacobi else None
    # a speed figure never stands alone: how much of this text is repetition (cllm.evaluation.text)
    looping = [ends_in_loop(t) for t in tokens]
    plain = [d for d, loops in zip(decoded, looping, strict=True) if not loops]
    plain_forwards = sum(d.forward_passes for d in plain)
    metrics: dict[str, Any] = {
        "tokens_per_second": new / total_s if total_s > 0 else 0.0,
        "tokens_per_forward": new / forwards if forwards else 0.0,
        "tokens_per_forward_not_looping": (sum(len(d.tokens) for d in plain) / plain_forwards
                                           if plain_forwards else None),
        "looping_rate": sum(looping) / len(looping) if looping else 0.0,
        "degenerate_rate": sum(map(is_degenerate, tokens)) / len(tokens) if tokens else 0.0,
        "speedup_vs_ar": 0.0,  # filled in once target_ar is known
        "exact_match_own_ar": exact_match(tokens, own_ar),
        "agreement_with_target": agreement(tokens, target_ar),
        "n_prompts": len(decoded),
        "new_tokens": new,
        "forward_passes": forwards,
        "seconds": total_s,
        "ms_per_forward": 1e3 * total_s / forwards if forwards else 0.0,
        "mean_fast_forwarded": stats.mean_fast_forwarded if stats else None,
        "stationary_tokens": stats.stationary_tokens if stats else None,
        "mean_iterations_per_block": stats.mean_iterations_per_block if stats else None,
        # tokens fed per forward after the prefill: what a step costs grows with it
        "mean_fed_tokens": stats.mean_fed if stats else None,
        "accepted_histogram": histogram(accepted) if all(d.accepted is not None for d in decoded) else None,
        # our engine: new tokens by where they came from (the one token per forward, verified
        # Jacobi outputs, recycled n-grams, the draft table, guesses): what made it fast
        "token_sources": dict(stats.sources) if stats else None,
    }
    if any(d.draft_forward_passes for d in decoded):
        metrics["draft_forward_passes"] = sum(d.draft_forward_passes for d in decoded)
    return metrics


@torch.inference_mode()
def top2_margin(model, context: list[int]) -> float | None:
    """Gap between the two largest next-token logits after `context` (plain full forward; a
    runtime's, a GGUF's: one session opened on it)."""
    limit = position_limit(model)
    if limit is not None and len(context) > limit:
        return None
    if isinstance(model, torch.nn.Module):
        logits = model(input_ids=torch.tensor([context], device=next(model.parameters()).device)).logits[0, -1]
    else:
        session = model.session()
        rows, forward = session.open([context])
        logits = forward.logits[0, -1]
        session.close(rows)
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def check_exact(model, prompts: list[Prompt], got: list[list[int]], expected: list[list[int]],
                tolerance: float) -> list[dict[str, Any]]:
    """Every prompt whose tokens differ: where, and whether it is a float near-tie."""
    mismatches = []
    for prompt, g, e in zip(prompts, got, expected, strict=True):
        if g == e:
            continue
        k = next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), min(len(g), len(e)))
        margin = top2_margin(model, prompt.ids + (e if k < len(e) else g)[:k])
        mismatches.append({"prompt_id": prompt.id, "first_difference": k, "top2_margin": margin,
                           "near_tie": margin is not None and margin < tolerance})
    return mismatches


def all_metrics(methods: list[Method], decoded: dict[str, list[Decoded]], seconds: dict[str, list[float]],
                refs: References = CHECKPOINT_REFERENCES) -> dict:
    """Per method metrics; speedups against `refs.ar` (target_ar; a GGUF's: llamacpp_ar), and
    the CLLM's also against its own AR."""
    outputs = {name: [d.tokens for d in per] for name, per in decoded.items()}
    results = {}
    for m in methods:
        own = outputs[refs.own(m.name)]
        results[m.name] = method_metrics(decoded[m.name], seconds[m.name], own_ar=own,
                                         target_ar=outputs[refs.ar], jacobi=m.name in ENGINE_JACOBI)
        results[m.name].update(m.added)
    base = results[refs.ar]["tokens_per_second"]
    for name, r in results.items():
        r["speedup_vs_ar"] = 1.0 if name == refs.ar else (r["tokens_per_second"] / base if base else 0.0)
        own_ar = OWN_AR.get(name)
        if own_ar and results.get(own_ar, {}).get("tokens_per_second"):
            r["speedup_vs_own_ar"] = r["tokens_per_second"] / results[own_ar]["tokens_per_second"]
    return results


def check_promises(methods: list[Method], prompts: list[Prompt], outputs: dict[str, list[list[int]]],
                   tolerance: float, refs: References = CHECKPOINT_REFERENCES) -> tuple[dict, list[dict]]:
    """Every method that promises greedy's tokens (`refs.exact`), on every prompt: (JSON
    summary, violations)."""
    exactness, violations = {}, []
    for m in methods:
        against = refs.exact.get(m.name)
        if against not in outputs:
            continue
        mismatches = check_exact(m.model, prompts, outputs[m.name], outputs[against], tolerance)
        exactness[m.name] = {"against": against, "mismatches": mismatches, "ok": all(x["near_tie"] for x in mismatches)}
        violations += [dict(x, method=m.name) for x in mismatches if not x["near_tie"]]
    return exactness, violations
