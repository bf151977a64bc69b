"""Text in, text out as it becomes final: the one place that joins a tokenizer to the
token-level decoders (`cllm.decoding`). `cllm generate`, `cllm chat`, the HTTP server and its
scheduler all decode through it, so that they produce the same text:

- "jacobi": greedy Jacobi decoding; text is emitted as soon as its tokens are final (after
  every step of the engine's `BatchDecoder`);
- "ar": greedy autoregressive decoding, token by token: the Jacobi engine with n = 1, which is
  greedy decoding exactly (one token per forward);
- Medusa heads (`heads=`, `cllm medusa`): greedy Medusa decoding, each forward's final tokens
  emitted as they come;
- an EAGLE head (`eagle=`, `cllm eagle`): greedy EAGLE decoding, likewise;
- temperature > 0 (with top-p / top-k): lossless sampling on the same engines: Jacobi sampling
  verifies its drafts with the speculative-sampling rule, so its text has exactly the law of
  autoregressive sampling ("ar" = n = 1); reproducible with a seed.

Text is detokenized incrementally (`TextStream`, a window of the last tokens per step): a chunk
is released only when it cannot change any more (no half UTF-8 character at its end, no possible
start of a stop string). Output is cut at the first stop string and decoding stops there: the
loop over the decoder's steps breaks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from cllm.core.errors import UserError, first_line
from cllm.core.seeds import seeded_generator
from cllm.decoding import BatchDecoder, IterationEvent
from cllm.decoding.draft_table import DraftTable
from cllm.decoding.inputs import eos_set
from cllm.decoding.rivals import eagle as eagle_rival
from cllm.decoding.rivals.medusa import medusa_steps, resolve_tree
from cllm.decoding.stats import DecodeStats
from cllm.models.chat import end_of_turn_ids
from cllm.runtime import Runtime
from cllm.serving.logprobs import Trail
from cllm.serving.params import METHODS, DecodeParams  # noqa: F401 (METHODS re-exported)


class TextCodec:
    """A tokenizer behind a lock (fast tokenizers must not be used by two threads at once), and
    the ids a reply ends at (`eos_ids`: its EOS and the model's end-of-turn tokens,
    `cllm.models.chat.end_of_turn_ids`): decoding stops after any of them."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.eos_ids: frozenset[int] = end_of_turn_ids(tokenizer)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        with self._lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_ids(self, messages: Sequence[dict]) -> list[int]:
        """The prompt for the assistant's next turn: the chat template when the tokenizer has
        one, else the plain concatenation of every message's text (a base model continues it).
        Messages the template refuses (its `raise_exception`: roles out of order...) are a
        one-line UserError."""
        if not self.has_chat_template:
            return self.encode("".join(m["content"] for m in messages))
        with self._lock:
            try:
                text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - whatever the template raises on these messages
                raise UserError(f"the chat template cannot write these messages: {first_line(exc)}") from None
            # the template writes any BOS itself
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class TextStream:
    """Token ids in, final text out (`on_text(chunk)`), cut at the first stop string.

    Each feed decodes only a window of the last tokens, not the whole text: the window starts
    at the previous cut, a token where the text was whole (no half UTF-8 character), so the
    text before it never changes, and the window's text past the tokens it has already
    released is the new text. A feed then costs about the same at the 10th token as at the
    10,000th. A tokenizer that rewrites text across tokens (`clean_up_tokenization_spaces`) is
    decoded whole every time instead; `finish` decodes the whole text once."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = (), on_text=None) -> None:
        self.codec, self.stop, self.on_text = codec, tuple(stop), on_text
        self.tokens: list[int] = []
        self.text = ""  # released so far
        self.stopped = False  # a stop string was seen
        self._windowed = not getattr(codec.tokenizer, "clean_up_tokenization_spaces", False)
        self._settled = ""  # the text of tokens[: self._cut]
        self._start = self._cut = 0  # the window is tokens[self._start :], settled up to self._cut
        self._head = ""  # tokens[self._start : self._cut] decoded alone: how the window's text starts

    def feed(self, tokens: Sequence[int]) -> None:
        if self.stopped:
            return
        self.tokens.extend(tokens)
        full = self._decoded()
        hits = [i for i in (full.find(s, max(0, len(self.text) - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self._release(full[: max(min(hits), len(self.text))])
            return
        end = len(full.rstrip("\ufffd"))  # a trailing U+FFFD may be half a UTF-8 character
        end -= _held_back(full[:end], self.stop)
        self._release(full[:end])

    def finish(self) -> None:
        """Release whatever was held back: decoding is over."""
        if not self.stopped:
            self._release(self.codec.decode(self.tokens))

    def _decoded(self) -> str:
        """The text of every token so far, as decoding them all at once gives it (while the text
        before the cut reads otherwise, the text up to the cut: nothing after it is whole yet)."""
        if not self._windowed:
            return self.codec.decode(self.tokens)
        window = self.codec.decode(self.tokens[self._start :])
        if not window.startswith(self._head):  # byte fallback renders a run of byte tokens as
            return self._settled  # U+FFFD while the run's last character is unfinished
        new = window[len(self._head) :]
        cut = len(self.tokens)
        if new and not new.endswith("\ufffd"):  # a new cut: the text is whole here
            self._settled += new
            self._start, self._cut = self._cut, cut
            self._head = self.codec.decode(self.tokens[self._start : self._cut])
            return self._settled
        return self._settled + new

    def _release(self, upto: str) -> None:
        if len(upto) > len(self.text) and upto.startswith(self.text):
            chunk, self.text = upto[len(self.text) :], upto
            if self.on_text is not None:
                self.on_text(chunk)


def _held_back(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that could be the start of a stop string."""
    longest = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest


@dataclass
class Completion:
    text: str  # cut at the first stop string
    tokens: list[int]  # new tokens decoded (the EOS or end of turn included if produced)
    prompt_tokens: int
    forward_passes: int  # model calls, prefill included
    seconds: float  # wall clock of the decode
    finish_reason: str  # "stop" (EOS, an end of turn or a stop string) or "length"
    method: str  # DecodeParams.label
    # with `DecodeParams.logprobs`: per token of `text` (EOS left out), what `cllm.serving.logprobs` reads
    logprobs: list | None = None

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / self.forward_passes if self.forward_passes else 0.0

    def summary(self) -> str:
        return (f"[{self.method}] {len(self.tokens)} tokens · {self.forward_passes} forward passes · "
                f"{self.tokens_per_forward:.2f} tokens/forward · {self.tokens_per_second:.1f} tokens/s"
                f" · finish: {self.finish_reason}")


def complete(
    model: torch.nn.Module | Runtime,
    codec: TextCodec,
    prompt_ids: Sequence[int],
    params: DecodeParams,
    *,
    on_text: Callable[[str], None] | None = None,
    on_iteration: Callable[[IterationEvent], None] | None = None,
    cancelled: Callable[[], bool] | None = None,
    draft_table: DraftTable | None = None,
    heads: torch.nn.Module | None = None,
    eagle: torch.nn.Module | None = None,
) -> Completion:
    """Decode one prompt, calling `on_text` with each final chunk of text.

    Args:
        model: a runtime (`cllm.runtime`), or a causal LM in eval mode (on its "auto" runtime).
        codec: its tokenizer.
        prompt_ids: the prompt's token ids (non-empty).
        params: method, budget, stop strings, sampling.
        on_text: gets the text as it becomes final; the chunks add up to `Completion.text`.
        on_iteration: the Jacobi engine's hook, for trajectories (greedy methods only).
        cancelled: polled after every step; True stops decoding (e.g. the client went away).
        draft_table: the model's draft table (`cllm drafts`) for Jacobi decoding, or None.
        heads: Medusa heads (`cllm.models.load_heads`): greedy Medusa decoding instead of
            `params.method` (its default tree; `on_iteration` is not called).
        eagle: an EAGLE head (`cllm.models.load_eagle`): greedy EAGLE decoding instead of
            `params.method`, likewise (not with `heads`).
    """
    stream = TextStream(codec, params.stop, on_text)
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)  # (1, T)
    start = time.perf_counter()
    trail = None if params.logprobs is None else Trail(codec, codec.eos_ids)
    if heads is not None and eagle is not None:
        raise ValueError("decode with Medusa heads or an EAGLE head, not both")
    if heads is not None:
        if trail is not None:
            raise ValueError("logprobs come from the Jacobi engine's forwards, not Medusa decoding's")
        forward_passes = _decode_medusa(model, heads, input_ids, params, stream, codec.eos_ids, cancelled)
    elif eagle is not None:
        if trail is not None:
            raise ValueError("logprobs come from the Jacobi engine's forwards, not EAGLE decoding's")
        forward_passes = _decode_eagle(model, eagle, input_ids, params, stream, codec.eos_ids, cancelled)
    else:
        forward_passes = _decode(model, input_ids, params, stream, codec.eos_ids, on_iteration,
                                 cancelled, draft_table, trail)
    seconds = time.perf_counter() - start
    stream.finish()
    ended = stream.stopped or (bool(stream.tokens) and stream.tokens[-1] in codec.eos_ids)
    return Completion(
        text=stream.text, tokens=stream.tokens, prompt_tokens=len(prompt_ids),
        forward_passes=forward_passes, seconds=seconds,
        finish_reason="stop" if ended else "length",
        method="medusa" if heads is not None else "eagle" if eagle is not None else params.label,
        logprobs=None if trail is None else trail.whole(len(stream.text)),
    )


def _decode(model, input_ids, params, stream, eos, on_iteration, cancelled, draft_table, trail=None) -> int:
    """Jacobi (or AR: n = 1) on the engine, one step at a time; the tokens each step made final
    go to the text stream at once (and their log-probabilities to `trail`). Returns the forward
    passes, the prefill included."""
    decoder = BatchDecoder(model, eos_token_id=eos, on_iteration=on_iteration, **decoder_kwargs(params, draft_table))
    with torch.inference_mode():
        (row,) = decoder.add(input_ids, max_new_tokens=params.max_new_tokens, logprobs=params.logprobs,
                             generator=seeded_generator(params.seed, decoder.runtime.device))
        decoder.raise_error([row])
        stream.feed(decoder.tokens(row))  # the prefill's token

        def more() -> bool:
            return not (decoder.done(row) or stream.stopped or (cancelled is not None and cancelled()))

        if more():
            for event in decoder.steps():
                decoder.raise_error([row])
                stream.feed(event.new_tokens[row])
                if not more():
                    break
        if trail is not None:
            trail.add(decoder.logprobs(row))
    return decoder.forward_passes(row)


@torch.inference_mode()
def _decode_medusa(model, heads, input_ids, params, stream, eos, cancelled) -> int:
    """Greedy Medusa decoding, each forward's final tokens streamed as they come. Returns the
    forward passes, the prefill included."""
    stats = DecodeStats()
    steps = medusa_steps(model, heads, input_ids, None, resolve_tree(heads, None),
                         max_new_tokens=params.max_new_tokens, eos=eos_set(eos), stats=stats)
    for tokens in steps:
        stream.feed(tokens)
        if stream.stopped or (cancelled is not None and cancelled()):
            break
    return stats.forward_passes


@torch.inference_mode()
def _decode_eagle(model, head, input_ids, params, stream, eos, cancelled) -> int:
    """Greedy EAGLE decoding (the head's saved tree), each forward's final tokens streamed as
    they come. Returns the target's forward passes, the prefill included."""
    stats = DecodeStats()
    nodes, depth, top_k = eagle_rival.resolve_tree(head, None, None, None)
    steps = eagle_rival.eagle_steps(model, head, input_ids, None, nodes=nodes, depth=depth, top_k=top_k,
                                    max_new_tokens=params.max_new_tokens, eos=eos_set(eos), stats=stats)
    for tokens in steps:
        stream.feed(tokens)
        if stream.stopped or (cancelled is not None and cancelled()):
            break
    steps.close()  # the target's session is closed now, not when the generator is collected
    return stats.forward_passes


def decoder_kwargs(params: DecodeParams, draft_table: DraftTable | None = None) -> dict:
    """The keyword arguments `BatchDecoder` (or `jacobi_decode`) takes to decode as `params`
    says, all but the budget and the generator: "ar" is the engine with n = 1 and no drafts;
    sampling keeps one block in flight."""
    jacobi, sampling = params.method == "jacobi", params.temperature > 0
    engine = params.engine if jacobi else replace(params.engine, block_size=1, recycle=0)
    if sampling or not jacobi:
        engine = replace(engine, blocks_in_flight=1)
    return dict(
        config=engine,
        temperature=params.temperature,
        top_p=params.top_p if sampling and params.top_p < 1 else None,
        top_k=params.top_k if sampling else None,
        draft_table=draft_table if jacobi else None,
    )
