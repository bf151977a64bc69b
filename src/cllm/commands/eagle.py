"""`cllm eagle`: train an EAGLE draft head for a model (frozen) on its own greedy text, save it
beside the model and evaluate it; decoding with it stays exact.

The training is `cllm.training.eagle`'s (`eagle`, run as named steps that log what they do);
this module shows those lines and prints the summary. Exit status: 0, 1 when EAGLE's output
differed from greedy's on an evaluation prompt, 130 when Ctrl-C stopped the run (a rerun resumes).
"""

from __future__ import annotations

import time

from cllm.core.progress import echo_log
from cllm.training.eagle import EagleConfig as Config
from cllm.training.eagle import EagleResult, eagle


def run(config: Config) -> int:
    started = time.perf_counter()
    with echo_log("cllm.training", "cllm eagle: "):
        result = eagle(config)
    if result.stopped_at is not None:
        print(f"\ncllm eagle: stopped at step {result.stopped_at}; run the same command again to resume")
        return 130
    print_summary(result, time.perf_counter() - started)
    return 0 if result.evaluation is None or not result.evaluation["mismatches"] else 1


def print_summary(result: EagleResult, seconds: float) -> None:
    head, before, after, evaluation = result.drafter, result.before, result.after, result.evaluation
    size_mb = head.parameters_added() * head.fc.weight.element_size() / 1e6
    print(f"cllm eagle: one decoder layer, {head.parameters_added():,} parameters added ({size_mb:.1f} MB; "
          "sharing the model's embeddings and LM head)")
    print(f"  held-out loss {before['loss']:.3f} -> {after['loss']:.3f}; top-1 agreement "
          f"{before['agreement']:.2f} -> {after['agreement']:.2f}")
    if evaluation:
        tree = evaluation["tree"]
        print(f"  {evaluation['prompt_set']} x {evaluation['prompts']}: {evaluation['tokens_per_forward']:.2f} tokens "
              f"per forward (tree: {tree['nodes']} nodes, depth {tree['depth']}, top-k {tree['top_k']}; "
              f"{evaluation['mean_fed']:.1f} tokens fed per forward); "
              f"exact {evaluation['exact']}/{evaluation['prompts']}")
        if evaluation["mismatches"]:
            print(f"  NOT EXACT: {evaluation['mismatches']}")
    print(f"  -> {result.out} ({seconds:.0f} s)")
