"""A causal LM whose next token is a scripted function of its context, known by hand.

It writes the token ids it is fed into a real DynamicCache as fake keys and reads its whole
context back from there, honouring the attention mask: a rollback or a hole that the engine
gets wrong changes what the mock sees, hence what it predicts. It also checks that every real
token's position id equals the number of tokens before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

JUNK = 1  # what a scripted model says after a wrong context


@dataclass(frozen=True)
class Script:
    """Row script: the prompt, the greedy continuation, and the continuation indices the model
    gets right even after a wrong context (these make stationary tokens)."""

    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    robust: frozenset[int] = frozenset()

    def next_token(self, context: Sequence[int]) -> int:
        k = len(context) - len(self.prompt)  # continuation index being predicted
        if k >= len(self.continuation):
            return JUNK
        correct = tuple(context) == self.prompt + self.continuation[:k]
        return self.continuation[k] if correct or k in self.robust else JUNK


def scripted_rule(*scripts: Script) -> Callable[[Sequence[int]], int]:
    """One rule for several rows: a row is recognised by its prompt's first token."""
    by_first = {s.prompt[0]: s for s in scripts}
    assert len(by_first) == len(scripts), "scripts need distinct first prompt tokens"
    return lambda context: by_first[context[0]].next_token(context)


class ScriptedLM(torch.nn.Module):
    def __init__(
        self, rule: Callable[[Sequence[int]], int], vocab_size: int = 128, max_positions: int = 512
    ):
        super().__init__()
        self.rule = rule
        self.vocab_size = vocab_size
        self.config = SimpleNamespace(max_position_embeddings=max_positions, vocab_size=vocab_size)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # gives the model a device and a dtype
        self.calls = 0

    def forward(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=True,
    ):
        self.calls += 1
        B, L = input_ids.shape
        fake = input_ids.float()[:, None, :, None]  # (B, 1, L, 1): a token id as a 1-dim key
        keys, _ = past_key_values.update(fake, fake, 0)
        tokens = keys[:, 0, :, 0].long().tolist()  # (B, S + L)
        S = len(tokens[0]) - L
        positions = position_ids.tolist()
        logits = torch.zeros(B, L, self.vocab_size)
        if attention_mask is not None and attention_mask.dim() == 4:  # a tree: keys per query
            rows = attention_mask[:, 0].bool().tolist()  # (B, L, S + L)
            for b in range(B):
                for i in range(L):
                    context = [t for t, m in zip(tokens[b], rows[b][i], strict=True) if m]
                    assert positions[b][i] == len(context) - 1, "position id != tokens before it"
                    logits[b, i, self.rule(context)] = 1.0
            return SimpleNamespace(logits=logits)
        mask = attention_mask.tolist() if attention_mask is not None else [[1] * (S + L)] * B
        for b in range(B):
            for i in range(L):
                if not mask[b][S + i]:
                    continue  # a padded query: its output is ignored
                context = [t for t, m in zip(tokens[b][: S + i + 1], mask[b], strict=False) if m]
                assert positions[b][i] == len(context) - 1, "position id != tokens before it"
                logits[b, i, self.rule(context)] = 1.0
        return SimpleNamespace(logits=logits)
