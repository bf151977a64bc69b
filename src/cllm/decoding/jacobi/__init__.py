"""Jacobi decoding with a KV cache and fast-forward commit: greedy (exactly greedy's output) or
lossless sampling (docs/method.md). One job per module:

- `rule`: the Jacobi update and its acceptance rule, pure (`jacobi_update`, `accepted_length`);
- `state`: one row's state (its block, final tokens, drafts in flight) and how one forward's
  outputs move it (`advance`, `open_blocks`);
- `drafters`: where drafts come from (the guesses, the drafts carried from the last forward,
  the n-gram pool, the draft table), each behind one small interface (`Drafter.propose`);
- `verifiers`: one batched forward and what each row keeps of it (linear greedy, speculative
  sampling, recycling's token trie, `cllm.decoding.tree`);
- `decoder`: the loop (`BatchDecoder`, its `steps()` generator, `jacobi_decode`).

The forward and its cache are a runtime's (`cllm.runtime`: a session's feed and keep); token ids
only, no tokenizers.
"""

from cllm.decoding.jacobi.decoder import BatchDecoder, StepEvent, jacobi_decode
from cllm.decoding.jacobi.drafters import DraftContext, Drafter, lookup_continuation, pool_candidates
from cllm.decoding.jacobi.rule import SOURCES, IterationEvent, accepted_length, jacobi_update

__all__ = [
    "SOURCES",
    "BatchDecoder",
    "DraftContext",
    "Drafter",
    "IterationEvent",
    "StepEvent",
    "accepted_length",
    "jacobi_decode",
    "jacobi_update",
    "lookup_continuation",
    "pool_candidates",
]
