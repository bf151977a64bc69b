"""What a teacher-forced loss does not show: the quality of a model's free-running greedy text,
and the gates a CLLM must pass against its target before its speed counts.

Per completion (token ids, EOS removed):

- degenerate: one token repeated `DEGENERATE_RUN` (10)+ times in a row (the reference's filter);
- looping: the last 24 tokens repeat one pattern of at most 8 tokens ('_cache_cache_cache...');
- parses: prompt + completion, cut where the function ends, is valid Python with a body
  (`cllm.data.prompts.function_parses`; the prompt sets are function signatures + docstrings).

Per model, against the target on the same prompts (`compare_models`): those rates; the target's
mean NLL of the model's greedy completions (how plausible the target finds them; the target's
own completions give the scale); the position of the first token where the model's greedy
text leaves the target's; plain-Jacobi tokens per forward at each block size, over all
completions and over those that do not loop (decoding a loop converges fast, so speed measured
on loops flatters a model that loops more); whether Jacobi reproduced greedy on every prompt; and
the validation loss over the whole stdlib-val split. `gates` turns that into pass/fail lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F

DEGENERATE_RUN = 10  # the reference drops outputs repeating one token this many times in a row
LOOP_MIN_LENGTH, LOOP_MAX_PERIOD = 24, 8  # the tail that must repeat, and the longest pattern
# the gates: a CLLM may loop at most LOOP_MARGIN more often than its target, degenerate at most
# DEGENERATE_MAX of the time, parse at most PARSE_MARGIN less often, and lose at most
# VAL_LOSS_MARGIN (relative) of validation loss
LOOP_MARGIN, DEGENERATE_MAX, PARSE_MARGIN, VAL_LOSS_MARGIN = 0.05, 0.03, 0.03, 0.03


def passes_text_gates(looping: float, degenerate: float, target_looping: float) -> bool:
    """The two gates on free-running text that a checkpoint must pass to be chosen."""
    return looping <= target_looping + LOOP_MARGIN and degenerate <= DEGENERATE_MAX


def is_degenerate(tokens: Sequence[int], run: int = DEGENERATE_RUN) -> bool:
    """True if one token repeats `run` or more times in a row."""
    count = 1
    for prev, cur in pairwise(tokens):
        count = count + 1 if cur == prev else 1
        if count >= run:
            return True
    return False


def ends_in_loop(ids: Sequence[int], *, max_period: int = LOOP_MAX_PERIOD,
                 min_length: int = LOOP_MIN_LENGTH) -> bool:
    """Whether the last `min_length` tokens repeat one pattern of at most `max_period` tokens,
    which the one-token degenerate test does not see."""
    tail = list(ids[-min_length:])
    if len(tail) < min_length:
        return False
    return any(all(tail[i] == tail[i - p] for i in range(p, len(tail))) for p in range(1, max_period + 1))


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first position where two token lists differ (the shorter length if one is a
    prefix of the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------------------------------------
# Prompts and completions


@dataclass(frozen=True)
class QualityPrompt:
    text: str
    ids: list[int]


def quality_prompts(name: str, tokenizer, *, count: int, max_new_tokens: int, context: int | None,
                    spread: bool = False) -> list[QualityPrompt]:
    """`count` prompts of a set (the first ones, or evenly spread over it with `spread`, as the
    target's model card picks its stdlib-val prompts), cut from the left to fit `context`."""
    from cllm.data.prompts import load_prompts

    prompts = list(load_prompts(name, limit=None if spread else count))
    if spread:
        prompts = [prompts[i * len(prompts) // count] for i in range(min(count, len(prompts)))]
    keep = context - max_new_tokens if context else None
    out = []
    for p in prompts:
        ids = tokenizer(p.text)["input_ids"]
        out.append(QualityPrompt(p.text, list(ids[-keep:] if keep else ids)))
    return out


def strip_eos(tokens: Sequence[int], eos: int | None) -> tuple[list[int], bool]:
    """The completion before its EOS, and whether the model stopped by itself."""
    tokens = list(tokens)
    if eos is not None and eos in tokens:
        return tokens[: tokens.index(eos)], True
    return tokens, False


@torch.no_grad()
def completion_nll(model, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                   batch_size: int = 8, pad_id: int = 0) -> float | None:
    """Mean nats/token `model` assigns to each completion after its prompt (all tokens pooled)."""
    from cllm.decoding.cache import accepts_logits_to_keep
    from cllm.modeling import losses
    from cllm.modeling.forwards import forward_blocks, rows_from_lists

    pairs = [(p, c) for p, c in zip(prompts, completions, strict=True) if c]
    total, count = 0.0, 0
    keep = accepts_logits_to_keep(model)
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        rows = rows_from_lists([p for p, _ in chunk], [c for _, c in chunk], pad_id)
        logits = forward_blocks(model, rows, logits_to_keep=keep).float()
        mask = rows.block_mask.bool().to(logits.device)
        total += float(losses.ar_loss(logits, rows.block_ids.to(logits.device), mask, normalizer=1))
        count += int(mask.sum())
    return total / count if count else None


# ---------------------------------------------------------------------------------------------
# One model's greedy text and Jacobi speed on one prompt set


@dataclass
class SetQuality:
    """One model on one prompt set (rates are fractions of prompts)."""

    prompts: int
    parse_rate: float
    degenerate_rate: float
    looping_rate: float
    target_nll: float | None  # the target's mean nats/token on this model's greedy completions
    first_divergence: float | None  # mean index where the greedy text leaves the target's
    token_agreement: float | None  # fraction of positions equal to the target's greedy text
    same_as_target: float | None  # fraction of completions equal to the target's, token for token
    tpf: dict[str, float] = field(default_factory=dict)  # block size -> plain-Jacobi TPF, all prompts
    tpf_not_looping: dict[str, float | None] = field(default_factory=dict)  # over non-looping ones
    jacobi_exact: dict[str, float] = field(default_factory=dict)  # block size -> Jacobi == greedy


def evaluate_set(model, target, prompts: Sequence[QualityPrompt], tokenizer, *, block_sizes: Sequence[int],
                 max_new_tokens: int, batch_size: int, pad_id: int, seed: int,
                 target_greedy: Sequence[Sequence[int]] | None) -> tuple[SetQuality, list[list[int]]]:
    """Greedy text and plain-Jacobi speed of `model` on `prompts`, judged by `target`; returns the
    measures and the greedy completions (raw, EOS kept) so the target's can be reused."""
    from cllm.data.prompts import function_parses
    from cllm.evaluation.heldout import EvalPrompt, decode_prompts

    eos = tokenizer.eos_token_id
    eval_prompts = [EvalPrompt(p.ids, []) for p in prompts]
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, eos_token_id=eos, pad_id=pad_id, seed=seed)
    greedy = decode_prompts(model, eval_prompts, method="greedy", **common)
    texts = [strip_eos(t, eos) for t in greedy.new_tokens]
    looping = [ends_in_loop(t) for t, _ in texts]
    parses = [function_parses(p.text, tokenizer.decode(t), finished=done)
              for p, (t, done) in zip(prompts, texts, strict=True)]
    result = SetQuality(
        prompts=len(prompts), parse_rate=_mean(parses) or 0.0,
        degenerate_rate=_mean(is_degenerate(t) for t, _ in texts) or 0.0, looping_rate=_mean(looping) or 0.0,
        target_nll=completion_nll(target, [p.ids for p in prompts], [t for t, _ in texts], batch_size=batch_size,
                                  pad_id=pad_id),
        first_divergence=None, token_agreement=None, same_as_target=None)
    if target_greedy is not None:
        pairs = list(zip(greedy.new_tokens, target_greedy, strict=True))
        result.first_divergence = _mean(first_divergence(a, b) for a, b in pairs)
        result.token_agreement = _mean(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
        result.same_as_target = _mean(a == b for a, b in pairs)
    for n in block_sizes:
        jacobi = decode_prompts(model, eval_prompts, method="jacobi", block_size=n, **common)
        key = str(n)
        result.jacobi_exact[key] = _mean(a == b for a, b in zip(jacobi.new_tokens, greedy.new_tokens, strict=True))
        result.tpf[key] = jacobi.tokens_per_forward
        kept = [(len(t), f) for t, f, loops in zip(jacobi.new_tokens, jacobi.forwards, looping, strict=True)
                if not loops]
        result.tpf_not_looping[key] = sum(t for t, _ in kept) / sum(f for _, f in kept) if kept else None
    return result, greedy.new_tokens


# ---------------------------------------------------------------------------------------------
# Target against model, and the gates


@dataclass
class QualitySettings:
    prompt_sets: dict[str, int] = field(default_factory=lambda: {"humaneval": 64, "stdlib-val": 100})
    block_sizes: list[int] = field(default_factory=lambda: [16, 32])
    max_new_tokens: int = 128
    batch_size: int = 8
    seed: int = 0
    val_loss: bool = True  # also the loss over the whole stdlib-val split
    spread: list[str] = field(default_factory=lambda: ["stdlib-val"])  # sets sampled evenly, not first N


def window_loss(model, windows: torch.Tensor, bf16: bool) -> torch.Tensor:
    """The language-model loss (`cllm pretrain` trains on it): mean next-token cross-entropy (nats/token)
    over (B, T + 1) windows."""
    x, y = windows[:, :-1], windows[:, 1:]  # (B, T) each
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(input_ids=x, use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def stream_loss(model, stream: torch.Tensor, context: int, batch_tokens: int = 4096) -> float:
    """Mean nats/token over consecutive, non-overlapping windows covering the whole stream."""
    n, batch_size = (len(stream) - 1) // context, max(1, batch_tokens // context)
    starts = torch.arange(n) * context
    windows = stream[starts[:, None] + torch.arange(context + 1)]  # (n, context + 1)
    model.eval()
    total = sum(window_loss(model, chunk, False).item() * len(chunk) for chunk in windows.split(batch_size))
    return total / n


def validation_loss(model, tokenizer) -> float:
    """Mean nats/token over the whole stdlib-val split, in windows of the model's context."""
    from cllm.data.corpus import load_corpus
    from cllm.data.tokenizer import token_stream
    from cllm.decoding.inputs import position_limit

    stream = token_stream(load_corpus("validation"), tokenizer)
    context = min(position_limit(model) or 1024, 1024) - 1
    return stream_loss(model, stream, context)


def compare_models(models: dict, tokenizer, settings: QualitySettings, *, pad_id: int,
                   target: str = "target", progress=None) -> dict:
    """Every model of `models` (name -> model, the target among them under `target`) on every
    prompt set, judged against the target. Returns {"settings", "sets": {set: {name: SetQuality
    as a dict}}, "val_loss": {name: float}}, JSON-ready."""
    from dataclasses import asdict

    from cllm.decoding.inputs import position_limit

    if target not in models:
        raise ValueError(f"models must include the target under {target!r}")
    judge = models[target]
    order = [target] + [name for name in models if name != target]
    result: dict = {"settings": asdict(settings), "sets": {}, "val_loss": {}}
    for set_name, count in settings.prompt_sets.items():
        prompts = quality_prompts(set_name, tokenizer, count=count, max_new_tokens=settings.max_new_tokens,
                                  context=position_limit(judge), spread=set_name in settings.spread)
        per_model, target_greedy = {}, None
        for name in order:
            quality, greedy = evaluate_set(
                models[name], judge, prompts, tokenizer, block_sizes=settings.block_sizes,
                max_new_tokens=settings.max_new_tokens, batch_size=settings.batch_size, pad_id=pad_id,
                seed=settings.seed, target_greedy=target_greedy)
            target_greedy = greedy if name == target else target_greedy
            per_model[name] = asdict(quality)
            if progress:
                progress(f"{set_name}: {name} done")
        result["sets"][set_name] = per_model
    if settings.val_loss:
        for name in order:
            result["val_loss"][name] = validation_loss(models[name], tokenizer)
    return result


@dataclass(frozen=True)
class Gate:
    name: str
    value: float | None
    bar: str
    passed: bool


def gates(result: dict, model: str, *, target: str = "target", tpf_bars: dict[str, float] | None = None) -> list[Gate]:
    """The quality and speed gates of a CLLM against its target, pooled over the prompt sets:
    loop rate at most the target's + 5 points, degenerate at most 3%, parse rate at least the
    target's - 3 points, whole-split validation loss within 3%, and plain-Jacobi tokens per
    forward over non-looping completions at least `tpf_bars` (block size -> bar; default
    2.0 at n = 16 and 2.3 at n = 32)."""
    tpf_bars = tpf_bars if tpf_bars is not None else {"16": 2.0, "32": 2.3}
    out = []
    loop_m, loop_t = pooled(result, model, "looping_rate"), pooled(result, target, "looping_rate")
    bar = loop_t + LOOP_MARGIN
    out.append(Gate("looping", loop_m, f"<= {bar:.3f} (target {loop_t:.3f} + {LOOP_MARGIN})", loop_m <= bar))
    degenerate = pooled(result, model, "degenerate_rate")
    out.append(Gate("degenerate", degenerate, f"<= {DEGENERATE_MAX:.3f}", degenerate <= DEGENERATE_MAX))
    parse_m, parse_t = pooled(result, model, "parse_rate"), pooled(result, target, "parse_rate")
    bar = parse_t - PARSE_MARGIN
    out.append(Gate("parses", parse_m, f">= {bar:.3f} (target {parse_t:.3f} - {PARSE_MARGIN})", parse_m >= bar))
    vm, vt = result["val_loss"].get(model), result["val_loss"].get(target)
    if vm is not None and vt is not None:
        bar = vt * (1 + VAL_LOSS_MARGIN)
        out.append(Gate("validation loss", vm, f"<= {bar:.3f} (target {vt:.3f} + {VAL_LOSS_MARGIN:.0%})", vm <= bar))
    for n, bar in tpf_bars.items():
        tpf = pooled(result, model, "tpf_not_looping", n)
        if tpf is not None:
            out.append(Gate(f"TPF n={n}, not looping", tpf, f">= {bar}", tpf >= bar))
    return out


def pooled(result: dict, model: str, key: str, block_size: str | None = None) -> float | None:
    """`model`'s measure `key` (under `block_size` for the per-block-size ones) over all prompt
    sets: the sets' values weighted by their prompt counts; None where a set has no value."""
    values = []
    for per_model in result["sets"].values():
        value = per_model[model][key]
        value = value.get(block_size) if block_size is not None else value
        if value is None:
            return None
        values.append((value, per_model[model]["prompts"]))
    return sum(v * w for v, w in values) / sum(w for _, w in values)


def gates_table(result: dict, models: Sequence[str], *, target: str = "target") -> str:
    """Markdown: one row per measure and prompt set (and over all sets, where there are several),
    one column per model, then the validation loss."""
    lines = ["| measure | set | " + " | ".join(models) + " |", "|---|---|" + "---|" * len(models)]

    def cell(value, digits=3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [("parses", "parse_rate"), ("degenerate", "degenerate_rate"), ("looping", "looping_rate"),
            ("target NLL of greedy text", "target_nll"), ("first divergence from target", "first_divergence"),
            ("token agreement with target", "token_agreement")]
    for set_name, per_model in result["sets"].items():
        for label, key in rows:
            lines.append(f"| {label} | {set_name} | " + " | ".join(cell(per_model[m][key]) for m in models) + " |")
        for n in result["settings"]["block_sizes"]:
            lines.append(f"| Jacobi TPF n={n}, all / not looping | {set_name} | " + " | ".join(
                f"{cell(per_model[m]['tpf'][str(n)], 2)} / {cell(per_model[m]['tpf_not_looping'][str(n)], 2)}"
                for m in models) + " |")
            lines.append(f"| Jacobi == greedy n={n} | {set_name} | " + " | ".join(
                f"{per_model[m]['jacobi_exact'][str(n)]:.0%}" for m in models) + " |")
    if len(result["sets"]) > 1:
        everything = "all sets (weighted by prompts)"
        for label, key in rows:
            lines.append(f"| {label} | {everything} | " + " | ".join(
                cell(pooled(result, m, key)) for m in models) + " |")
        for n in result["settings"]["block_sizes"]:
            lines.append(f"| Jacobi TPF n={n}, all / not looping | {everything} | " + " | ".join(
                f"{cell(pooled(result, m, 'tpf', str(n)), 2)} / {cell(pooled(result, m, 'tpf_not_looping', str(n)), 2)}"
                for m in models) + " |")
    if result["val_loss"]:
        lines.append("| validation loss, whole stdlib-val | | " + " | ".join(
            cell(result["val_loss"].get(m)) for m in models) + " |")
    return "\n".join(lines)

