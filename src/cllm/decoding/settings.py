"""The Jacobi engine's settings: one frozen dataclass, each default and each check in one place.

`jacobi_decode` and `BatchDecoder` take a `JacobiConfig` (or its fields as keywords); the
commands (`generate`, `chat`, `serve`, `bench`) embed one, and `cllm.core.config` flattens it into
the same flags as the command's own (`--block-size`, `--recycle`, ...). Speed only: every
setting leaves greedy output unchanged and sampling's law exact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Literal

GUESSES = ("prompt", "repeat", "random", "lookup")
LOOKUP_NGRAM = 3  # the "lookup" guess and the n-gram pool match the last 3, else 2, else 1 tokens


@dataclass(frozen=True)
class JacobiConfig:
    """How the engine decodes. The defaults are the paper's plain Jacobi decoding (n = 16, no
    drafts); `RECOMMENDED_CONFIG` is the CLI's faster setting.

    block_size: n, the tokens solved together (>= 1; 1 is greedy decoding).
    guess: how a block's unknown tokens start: "prompt" (uniform over the row's own prompt
        tokens, the reference's default), "repeat" (the block's first token), "random"
        (uniform over the vocabulary), "lookup" (what followed the last 1-3 tokens where
        they occurred before in the prompt or output, the rest as "prompt").
    recycle: n-gram recycling: per iteration, verify up to this many drafts from an n-gram
        pool (the prompt, the output so far, earlier Jacobi states) beside the Jacobi tail in
        the same forward, as branches of a tree attention mask; the furthest reaching branch
        is kept. 0 = off. The output stays greedy's. When sampling, the first pool draft
        replaces the Jacobi drafts instead (one branch; the law stays exact).
    recycle_width: tokens per pool draft at most. Greedy recycling allows that many after
        a 3-token match, half as many after a 2-token match, a quarter after a 1-token one
        (a forward's cost grows with its tokens, and shorter matches are right less often).
    recycle_min_ngram: a pool draft must continue a match of at least this many tokens
        (1-3). 2, the default, skips drafts found from the last token alone: on a CPU, where
        every fed token costs, they were accepted too rarely to pay for themselves.
    recycle_budget: tokens a row feeds per forward at most when recycling: the tail whole,
        then the drafts' new tokens until the budget is spent (a draft is cut there); None
        (or 0, stored as None): no limit. 24 suits a CPU, where the last drafts of a large
        trie rarely pay for their tokens; a GPU affords more.
    blocks_in_flight: multi-block decoding (greedy only): with k > 1, the drafts of the
        next k - 1 blocks are fed behind the current block's tail and refined by the same
        forwards, so a block starts from refined drafts, and tokens can become final across
        the block boundary. 1 = one block at a time (the paper).
    adaptive: greedy, on a runtime that knows what a forward of k tokens costs
        (`Runtime.step_costs`, measured by `load_for_decoding`): each row feeds, per forward,
        the width (1 up to the budget) whose tokens made final per cost are best so far
        (`jacobi.width.Width`), down to one token (plain decoding) where drafts do not pay.
        Speed only. Without step costs, or when sampling, the width is the budget's.
    exact: greedy, on a runtime whose wide forwards round differently from one-token forwards
        (`Runtime.batch_invariant` False: llama.cpp on a quantized file): feed one token per
        forward, so that the text is greedy decoding's token for token (the drafts off). False:
        verify drafts there too, faster where they pay, the text then greedy's up to near-ties.
    """

    block_size: int = field(default=16, metadata={"help": "Jacobi block size n: tokens solved together (1: greedy "
        "decoding; 4 with recycling suits a CPU, a GPU affords 16-32)"})
    guess: Literal["prompt", "repeat", "random", "lookup"] = field(default="prompt", metadata={"help": "how a block's "
        "unknown tokens start: tokens sampled from the prompt (the reference), repeat the block's first token, random "
        "vocabulary, or lookup (what followed the same 1-3 tokens earlier)"})
    recycle: int = field(default=0, metadata={"help": "n-gram recycling: pool drafts (prompt, output, earlier Jacobi "
        "states) verified beside the block per forward as a token trie; exact (0: the paper's plain Jacobi; when "
        "sampling, the first draft replaces the block's)"})
    recycle_width: int = field(default=16, metadata={"help": "tokens per pool draft at most (after a 3-token match; "
        "half after a 2-token one)"})
    recycle_min_ngram: int = field(default=2, metadata={"help": "a pool draft must continue a match of at least this "
        f"many tokens (1-{LOOKUP_NGRAM})"})
    recycle_budget: int | None = field(default=24, metadata={"help": "with recycling: tokens fed per row per forward "
        "at most, the block's tail then drafts (0: no limit; a GPU affords more)"})
    blocks_in_flight: int = field(default=1, metadata={"help": "greedy: blocks drafted at once (multi-block decoding: "
        "the next blocks' drafts ride behind the current one); exact"})
    exact: bool = field(default=True, metadata={"help": "greedy, on a runtime whose wide forwards round differently "
        "(llama.cpp on a quantized file): one token per forward, the text greedy's token for token (--exact false: "
        "verify drafts there too, the text greedy's up to near-ties)"})
    adaptive: bool = field(default=False, metadata={"help": "greedy: each row feeds per forward the width (1 token "
        "up to the budget) that has made the most tokens per step cost, from the runtime's measured step cost "
        "(down to plain decoding where drafts do not pay)"})

    def __post_init__(self) -> None:
        if self.recycle_budget == 0:
            object.__setattr__(self, "recycle_budget", None)
        _check_int("block_size", self.block_size, 1)
        if self.guess not in GUESSES:
            raise ValueError(f"unknown guess {self.guess!r} (--guess); expected one of {', '.join(GUESSES)}")
        _check_int("recycle", self.recycle, 0)
        _check_int("recycle_width", self.recycle_width, 1)
        _check_int("recycle_min_ngram", self.recycle_min_ngram, 1, LOOKUP_NGRAM)
        if self.recycle_budget is not None:
            _check_int("recycle_budget", self.recycle_budget, 0)
        _check_int("blocks_in_flight", self.blocks_in_flight, 1)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as `jacobi_decode` keywords."""
        return asdict(self)


# A temperature below float32's smallest normal number decodes greedily: the logits, divided by
# it in float32, would overflow to -inf beside the maximum's 0 / t (or, below ~1.4e-45, t itself
# rounds to 0 and the division is 0 / 0), and at any temperature this small the law is a point
# mass on the most likely token anyway (but for exact ties, which greedy breaks to the first).
GREEDY_BELOW = 2.0**-126  # torch.finfo(torch.float32).tiny, written out: no torch here


def is_greedy(temperature: float | None) -> bool:
    """Whether a temperature decodes greedily: None, 0, or below `GREEDY_BELOW`."""
    return temperature is None or 0 <= temperature < GREEDY_BELOW


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f"from {lo} to {hi}" if hi is not None else f">= {lo}"
        flag = "--" + name.replace("_", "-")
        raise ValueError(f"{name} ({flag}) must be an int {bound}, got {value!r}")


# The setting `cllm generate / chat / serve / bench` decode with by default: the fastest measured
# on the 2-core CPU here (benchmarks/). On a GPU, where a wide step costs about a narrow one, a
# larger block and no budget may pay (block_size=16, recycle_budget=None); `cllm tune` measures.
RECOMMENDED_CONFIG = JacobiConfig(block_size=4, recycle=8, recycle_width=16, recycle_min_ngram=2,
                                  recycle_budget=24, blocks_in_flight=1, adaptive=True)
# The same as `jacobi_decode` keywords: `jacobi_decode(model, ids, **RECOMMENDED, draft_table=table)`.
RECOMMENDED = MappingProxyType({k: v for k, v in RECOMMENDED_CONFIG.as_kwargs().items() if k != "guess"})
