"""The gates a CLLM must pass against its target before its speed counts, and the comparison
they read: every model's greedy text and plain-Jacobi speed on held-out prompt sets.

Per model, against the target on the same prompts (`compare_models`): the rates of
`cllm.evaluation.text` (parse rates only on Python sets); the target's mean NLL of the model's
greedy completions (how plausible the target finds them; the target's own completions give the
scale); the position of the first token where the model's greedy text leaves the target's;
plain-Jacobi tokens per forward at each block size, over all completions and over those that do
not loop (decoding a loop converges fast, so speed measured on loops flatters a model that loops
more); whether Jacobi reproduced greedy on every prompt; and, optionally, the loss over the
whole stdlib-val split. `gates` turns that into pass/fail lines.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from cllm.data.prompts import Prompt
from cllm.decoding.inputs import position_limit
from cllm.evaluation.heldout import decode_prompts, heldout_prompts, tokens_per_forward_not_looping
from cllm.evaluation.lm_loss import lm_loss, validation_loss
from cllm.evaluation.text import (
    ends_in_loop,
    first_divergence,
    function_parses,
    is_degenerate,
    is_python_set,
    strip_eos,
)

# the gates: a CLLM may loop at most LOOP_MARGIN more often than its target, degenerate at most
# DEGENERATE_MAX of the time, parse at most PARSE_MARGIN less often, and lose at most
# VAL_LOSS_MARGIN (relative) of validation loss
LOOP_MARGIN, DEGENERATE_MAX, PARSE_MARGIN, VAL_LOSS_MARGIN = 0.05, 0.03, 0.03, 0.03


def passes_text_gates(looping: float, degenerate: float, target_looping: float) -> bool:
    """The two gates on free-running text that a checkpoint must pass to be chosen."""
    return looping <= target_looping + LOOP_MARGIN and degenerate <= DEGENERATE_MAX


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


@dataclass
class SetQuality:
    """One model on one prompt set (rates are fractions of prompts)."""

    prompts: int
    parse_rate: float | None  # None: the prompt set is not Python
    degenerate_rate: float
    looping_rate: float
    target_nll: float | None  # the target's mean nats/token on this model's greedy completions
    first_divergence: float | None  # mean index where the greedy text leaves the target's
    token_agreement: float | None  # fraction of positions equal to the target's greedy text
    same_as_target: float | None  # fraction of completions equal to the target's, token for token
    tpf: dict[str, float] = field(default_factory=dict)  # block size -> plain-Jacobi TPF, all prompts
    tpf_not_looping: dict[str, float | None] = field(default_factory=dict)  # over non-looping ones
    jacobi_exact: dict[str, float] = field(default_factory=dict)  # block size -> Jacobi == greedy


def evaluate_set(model, target, prompts: Sequence[Prompt], tokenizer, *, block_sizes: Sequence[int],
                 max_new_tokens: int, batch_size: int, pad_id: int, seed: int,
                 target_greedy: Sequence[Sequence[int]] | None) -> tuple[SetQuality, list[list[int]]]:
    """Greedy text and plain-Jacobi speed of `model` on `prompts`, judged by `target`; returns the
    measures and the greedy completions (raw, EOS kept) so the target's can be reused."""
    eos = tokenizer.eos_token_id
    common = dict(max_new_tokens=max_new_tokens, batch_size=batch_size, eos_token_id=eos, pad_id=pad_id, seed=seed)
    greedy = decode_prompts(model, prompts, method="greedy", **common)
    texts = [strip_eos(t, eos) for t in greedy.new_tokens]
    looping = [ends_in_loop(t) for t, _ in texts]
    parses = ([function_parses(p.text, tokenizer.decode(t), finished=done)
               for p, (t, done) in zip(prompts, texts, strict=True)]
              if is_python_set([p.text for p in prompts]) else None)
    result = SetQuality(
        prompts=len(prompts), parse_rate=(_mean(parses) or 0.0) if parses is not None else None,
        degenerate_rate=_mean(is_degenerate(t) for t, _ in texts) or 0.0, looping_rate=_mean(looping) or 0.0,
        target_nll=lm_loss(target, [p.ids for p in prompts], [t for t, _ in texts], batch_size=batch_size,
                           pad_id=pad_id),
        first_divergence=None, token_agreement=None, same_as_target=None)
    if target_greedy is not None:
        pairs = list(zip(greedy.new_tokens, target_greedy, strict=True))
        result.first_divergence = _mean(first_divergence(a, b) for a, b in pairs)
        result.token_agreement = _mean(x == y for a, b in pairs for x, y in zip(a, b, strict=False))
        result.same_as_target = _mean(a == b for a, b in pairs)
    for n in block_sizes:
        jacobi = decode_prompts(model, prompts, method="jacobi", block_size=n, **common)
        key = str(n)
        result.jacobi_exact[key] = _mean(a == b for a, b in zip(jacobi.new_tokens, greedy.new_tokens, strict=True))
        result.tpf[key] = jacobi.tokens_per_forward
        result.tpf_not_looping[key] = tokens_per_forward_not_looping(jacobi, looping)
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


def compare_models(models: dict, tokenizer, settings: QualitySettings, *, pad_id: int,
                   target: str = "target", progress=None) -> dict:
    """Every model of `models` (name -> model, the target among them under `target`) on every
    prompt set, judged against the target. Returns {"settings", "sets": {set: {name: SetQuality
    as a dict}}, "val_loss": {name: float}}, JSON-ready."""
    if target not in models:
        raise ValueError(f"models must include the target under {target!r}")
    judge = models[target]
    order = [target] + [name for name in models if name != target]
    result: dict = {"settings": asdict(settings), "sets": {}, "val_loss": {}}
    for set_name, count in settings.prompt_sets.items():
        prompts = heldout_prompts(set_name, tokenizer, count=count, max_new_tokens=settings.max_new_tokens,
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
            result["val_loss"][name] = validation_loss(models[name], tokenizer)[0]
    return result


def measures_line(result: dict) -> str:
    """Which held-out sets a comparison used and which measures apply to each (parse rates only
    to Python sets), in one line."""
    parts = []
    for set_name, per_model in result["sets"].items():
        first = next(iter(per_model.values()))
        python = "Python, parse rate measured" if first["parse_rate"] is not None else "not Python, no parse rate"
        parts.append(f"{set_name} ({first['prompts']} prompts, {python})")
    return ("held-out sets: " + "; ".join(parts) + "; measured: greedy loop / degenerate rates, Jacobi tokens per "
            "forward, agreement with the target" + (", stdlib-val loss" if result["val_loss"] else ""))


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
    parse_m = pooled(result, model, "parse_rate", measured_only=True)
    parse_t = pooled(result, target, "parse_rate", measured_only=True)
    if parse_m is not None and parse_t is not None:  # Python prompt sets only
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


def pooled(result: dict, model: str, key: str, block_size: str | None = None, *,
           measured_only: bool = False) -> float | None:
    """`model`'s measure `key` (under `block_size` for the per-block-size ones) over all prompt
    sets: the sets' values weighted by their prompt counts; None where a set has no value (with
    `measured_only`, such sets are left out, and None only when no set has one)."""
    values = []
    for per_model in result["sets"].values():
        value = per_model[model][key]
        value = value.get(block_size) if block_size is not None else value
        if value is None and not measured_only:
            return None
        if value is not None:
            values.append((value, per_model[model]["prompts"]))
    return sum(v * w for v, w in values) / sum(w for _, w in values) if values else None


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



# ---------------------------------------------------------------------------------------------
# What a failed gate asks a user to change


def gate_advice(name: str) -> str:
    """One line of advice for a failed gate, from what it measures (the distill / train flags
    that move it). Speed gates ask for more or larger training; text gates for a gentler one."""
    if name.startswith("TPF"):
        return ("plain Jacobi makes too few tokens per forward: train on more trajectories (more --prompts / "
                "--max-prompts) or longer (--max-steps), or collect a larger block (--block-size 32); on a small "
                "model most speed comes from drafting (`cllm generate`'s default), not from training")
    return {
        "looping": ("its greedy text ends in loops more often than the target's: train shorter (--max-steps) or at a "
                    "lower --lr, and keep the distillation terms that hold it to the target (--kd-weight, "
                    "--rollout-prompts)"),
        "degenerate": ("its greedy text repeats one token 10+ times: train shorter or at a lower --lr; if `collect` "
                       "warned that most blocks were dropped, the target itself repeats on these prompts"),
        "parses": ("its code parses less often than the target's: it drifted from the target; train shorter or at a "
                   "lower --lr, with text of your domain (--ar-text)"),
        "validation loss": ("it models text worse than the target: more weight on real text (--ar-text, "
                            "--kd-weight), or train shorter"),
    }.get(name, "see the evaluation table")


def gates_verdict(results: Sequence[Gate | dict]) -> list[str]:
    """The verdict on a CLLM's gates: one line saying how many failed and which, then one line
    of advice per failed gate (none when every gate passed)."""
    items = [g if isinstance(g, Gate) else Gate(**g) for g in results]
    failed = [g for g in items if not g.passed]
    if not failed:
        return [f"gates: all {len(items)} passed"]
    lines = [f"gates: {len(failed)} of {len(items)} failed ({', '.join(g.name for g in failed)}): the CLLM is kept, "
             "but check it before using it"]
    for g in failed:
        value = "-" if g.value is None else f"{g.value:.3f}"
        lines.append(f"  {g.name} {value}, needs {g.bar}: {gate_advice(g.name)}")
    return lines
