"""The verdict of a bench table, in one line: what made the speed, read off the table itself.

Two gains are told apart, each measured inside the same run:

- **drafting**: the untrained target on the engine (`target_lookahead`: Jacobi + recycled
  n-grams + its draft table) against plain greedy decoding of the same target (`target_ar`);
- **consistency training**: the CLLM on the same engine settings (`cllm_jacobi`) against that
  same drafting target (`target_lookahead`); plain Jacobi on both (`cllm_jacobi_plain` against
  `target_jacobi`) shows what training did to the model by itself.

Each figure stands beside tokens per forward and the looping / degenerate shares of the text
(a model that loops decodes fast). Nothing here is hard-coded: a table where the CLLM loses
says so. The advice for a user's own model points at `benchmarks/distill_ablations.md`.
"""

from __future__ import annotations

from typing import Any

# a ratio within TIE of 1 is "about level": a few prompts' timings move by that much
TIE = 0.05
ADVICE = ("on your own model, expect most of a small model's gain from drafting (`cllm generate`'s default); "
          "consistency training's gain grows with scale (the paper's 2.4-3.4x are 7B models on GPUs; "
          "benchmarks/distill_ablations.md has what it does at 5M)")


def _text(m: dict[str, Any]) -> str:
    """Tokens per forward, looping and degenerate shares of one method's row."""
    return (f"{m['tokens_per_forward']:.2f} tok/fwd, looping {m['looping_rate']:.0%}, "
            f"degenerate {m['degenerate_rate']:.0%}")


def _compare(ratio: float) -> str:
    if ratio >= 1 + TIE:
        return "added"
    if ratio <= 1 - TIE:
        return "lost"
    return "about level"


def verdict(methods: dict[str, dict[str, Any]]) -> str | None:
    """One line saying what made the speed in this bench table (`methods`: the bench JSON's
    `methods`), drafting against consistency training, with the numbers it read; None when the
    table lacks `target_ar` and `target_lookahead`, the two rows drafting is measured by."""
    ar, drafted = methods.get("target_ar"), methods.get("target_lookahead")
    if ar is None or drafted is None or not ar.get("tokens_per_second"):
        return None
    drafting = drafted["tokens_per_second"] / ar["tokens_per_second"]
    parts = [f"drafting: the target on the engine ran {drafting:.2f}x its greedy decoding "
             f"({drafted['tokens_per_second']:.1f} vs {ar['tokens_per_second']:.1f} tok/s; {_text(drafted)})"]
    cllm = methods.get("cllm_jacobi")
    if cllm is None:
        lead = "verdict: the speed here is drafting (no CLLM in this table)"
        return f"{lead}; {parts[0]}; {ADVICE}"
    training = cllm["tokens_per_second"] / drafted["tokens_per_second"]
    word = _compare(training)
    said = {"added": f"added {training:.2f}x on top", "lost": f"lost ground ({training:.2f}x)",
            "about level": f"was about level ({training:.2f}x)"}[word]
    parts.append(f"consistency training {said}: the CLLM on the same engine ran {cllm['tokens_per_second']:.1f} "
                 f"vs the target's {drafted['tokens_per_second']:.1f} tok/s ({_text(cllm)})")
    plain_cllm, plain_target = methods.get("cllm_jacobi_plain"), methods.get("target_jacobi")
    if plain_cllm is not None and plain_target is not None:
        parts.append(f"plain Jacobi {plain_cllm['tokens_per_forward']:.2f} vs {plain_target['tokens_per_forward']:.2f}"
                     " tok/fwd (CLLM vs target)")
    # which of the two made more of the speed, as factors of target_ar's tokens/s
    if word == "added" and training > drafting:
        lead = "verdict: consistency training made most of the speed here"
    elif word == "added":
        lead = "verdict: drafting made most of the speed here, consistency training added to it"
    else:
        lead = "verdict: drafting made the speed here, not consistency training"
    return f"{lead}; " + "; ".join(parts) + f"; {ADVICE}"
