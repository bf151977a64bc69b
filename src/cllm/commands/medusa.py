"""`cllm medusa`: train Medusa heads for a model (frozen) on its own greedy text, save them beside
it and evaluate them; decoding with them stays exact. `--joint` (Medusa-2) trains the model with
them and saves both as a new checkpoint, measured against the original.

The training is `cllm.training.medusa`'s (`medusa`, `medusa2`, run as named steps that log what they do);
this module shows those lines and prints the summary. Exit status: 0, 1 when Medusa's output
differed from greedy's on an evaluation prompt, 130 when Ctrl-C stopped the run (a rerun resumes).
"""

from __future__ import annotations

import time

from cllm.core.progress import echo_log
from cllm.training.medusa import MedusaConfig as Config
from cllm.training.medusa import MedusaResult, medusa, medusa2


def run(config: Config) -> int:
    started = time.perf_counter()
    with echo_log("cllm.training", "cllm medusa: "):
        result = medusa2(config) if config.joint else medusa(config)
    if result.stopped_at is not None:
        print(f"\ncllm medusa: stopped at step {result.stopped_at}; run the same command again to resume")
        return 130
    print_summary(result, time.perf_counter() - started)
    return 0 if result.evaluation is None or not result.evaluation.get("mismatches") else 1


def print_summary(result: MedusaResult, seconds: float) -> None:
    heads, before, after, evaluation = result.drafter, result.before, result.after, result.evaluation
    agree = " ".join(f"{a:.2f}" for a in after["agreement"])
    was = " ".join(f"{a:.2f}" for a in before["agreement"])
    print(f"cllm medusa: {heads.num_heads} heads, {heads.parameters_added():,} parameters added"
          f"{' (own projections)' if heads.own_projection else ' (sharing the LM head)'}")
    print(f"  held-out loss {before['loss']:.3f} -> {after['loss']:.3f}; top-1 agreement per head {was} -> {agree}")
    if "backbone_kl" in after:
        print(f"  model vs the original on held-out texts: KL {before['backbone_kl']:.4f} -> {after['backbone_kl']:.4f}"
              f" per position, same greedy token {after['model_agreement']:.1%}")
    if evaluation and "exact" in evaluation:
        speed = evaluation["speedup_vs_greedy"]
        print(f"  {evaluation['prompt_set']} x {evaluation['prompts']}: "
              f"{evaluation['tokens_per_forward']:.2f} tokens per "
              f"forward with a {evaluation['tree_nodes']}-node tree, {speed:.2f}x greedy's speed at "
              f"{evaluation['threads']} threads; exact {evaluation['exact']}/{evaluation['prompts']}")
        if evaluation["mismatches"]:
            print(f"  NOT EXACT: {evaluation['mismatches']}")
    if evaluation and "quality" in evaluation:
        q = evaluation["quality"]
        base, mine = q["original"], q["model"]
        print(f"  greedy text, {q['prompts']} prompts, original -> this model: looping {base['looping_rate']:.0%} -> "
              f"{mine['looping_rate']:.0%}, degenerate {base['degenerate_rate']:.0%} -> {mine['degenerate_rate']:.0%}"
              + (f", parses {base['parse_rate']:.0%} -> {mine['parse_rate']:.0%}" if base["parse_rate"] is not None
                 else "")
              + f"; same as the original's {mine['same_as_target']:.0%} of prompts, "
              f"{mine['token_agreement']:.0%} of tokens")
    print(f"  -> {result.out} ({seconds:.0f} s)")
