"""Token log-probabilities as OpenAI's responses carry them (`logprobs` of completions and chat).

The engine keeps each final token's log-probability and its top alternatives
(`cllm.decoding.logprobs.TokenLogprob`); here they are joined to the text: `Trail` follows a
request's tokens, knows where each token's text ends in the decoded text, and hands out the
entries of the tokens whose text has been released (streamed chunks carry the tokens they
complete), so that the entries of a whole response are those of the tokens of its text: the
EOS token's (no text) is left out, and a stop string cuts after the token it starts in.
`completions_logprobs` and `chat_logprobs` write OpenAI's two shapes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cllm.decoding.inputs import eos_set
from cllm.decoding.logprobs import TokenLogprob

WINDOW = 32  # tokens decoded again for each new one's offset, at most (plus the anchor)


@dataclass(frozen=True)
class Entry:
    """One token of a response: its text, where that starts in the response's text, its
    log-probability and its top alternatives as (text, log-probability)."""

    text: str
    offset: int
    logprob: float
    top: tuple[tuple[str, float], ...]


class Trail:
    """The log-probabilities of one request's tokens, against the text they decode to.

    A token's end offset is found by decoding a window of the last tokens, from an anchor token
    whose text was whole (no half UTF-8 character): the window's text minus the anchor's own is
    what the tokens after the anchor add (a tokenizer that drops a leading space decodes the
    anchor alike in both), so each new token costs a decode of at most `WINDOW` tokens."""

    def __init__(self, codec, eos: int | Iterable[int] | None) -> None:
        self.codec, self.eos = codec, eos_set(eos)  # the ids a reply ends at: no entry of their own
        self.scores: list[TokenLogprob] = []
        self.ends: list[int] = []  # per token: the length of the text of every token up to it
        self.taken = 0  # entries handed out so far (`take`)
        self._anchor = -1  # index of the anchor token (-1: none yet, the text's start)
        self._anchor_text = ""

    def add(self, scores: Sequence[TokenLogprob]) -> None:
        for score in scores:
            self.scores.append(score)
            start = self._anchor + 1 if self._anchor >= 0 else 0
            window = self.codec.decode([s.token for s in self.scores[max(self._anchor, 0) :]])
            base = self.ends[self._anchor] - len(self._anchor_text) if self._anchor >= 0 else 0
            self.ends.append(base + len(window))
            if len(self.scores) - start >= WINDOW and not window.endswith("\ufffd"):
                self._anchor = len(self.scores) - 1
                self._anchor_text = self.codec.decode([score.token])

    def _entry(self, i: int) -> Entry:
        score = self.scores[i]
        text = self.codec.decode([score.token])
        top = tuple((self.codec.decode([t]), lp) for t, lp in score.top)
        return Entry(text, self.ends[i - 1] if i else 0, score.logprob, top)

    def _shown(self, i: int) -> bool:
        return self.scores[i].token not in self.eos

    def _within(self, length: int, start: int = 0) -> int:
        """The end of the run of tokens from `start` whose text lies within `length` characters."""
        while start < len(self.scores) and self.ends[start] <= length:
            start += 1
        return start

    def take(self, released: int) -> list[Entry]:
        """The entries not taken yet of the tokens whose text lies within the first `released`
        characters (a stream's chunks so far)."""
        end = self._within(released, self.taken)
        entries = [self._entry(i) for i in range(self.taken, end) if self._shown(i)]
        self.taken = end
        return entries

    def whole(self, text_length: int) -> list[Entry]:
        """Every entry of a response whose text has `text_length` characters: the tokens whose
        text lies within it, then the one a stop string cut short (`take`'s are a prefix)."""
        end = self._within(text_length)
        if end < len(self.scores) and (self.ends[end - 1] if end else 0) < text_length:
            end += 1
        return [self._entry(i) for i in range(end) if self._shown(i)]


def completions_logprobs(entries: Sequence[Entry], offset: int = 0) -> dict:
    """/v1/completions' shape (`offset`: the characters sent before these entries' text)."""
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries], "text_offset": [e.offset + offset for e in entries]}


def chat_logprobs(entries: Sequence[Entry], top: int) -> dict:
    """/v1/chat/completions' shape (`top`: the alternatives asked for, `top_logprobs`)."""

    def token(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**token(e.text, e.logprob), "top_logprobs": [token(t, lp) for t, lp in e.top[:top]]}
                        for e in entries], "refusal": None}
