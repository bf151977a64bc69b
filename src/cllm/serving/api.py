"""OpenAI request bodies checked and turned into prompts and `DecodeParams` (pure: no HTTP, no
model). Every mistake a client can make is an `ApiError` with OpenAI's error shape, raised
before any decoding starts, so a stream never opens on a request that cannot run.

Prompt length is checked twice: first in characters, against a bound that no prompt of
`max_prompt_tokens` tokens can exceed (`PromptLimits.max_chars`), so that an over-long text is
refused without being tokenized; then in tokens, after tokenizing (off the event loop).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import dataclass

from cllm.decoding.settings import JacobiConfig
from cllm.serving.completion import METHODS, DecodeParams

ROLES = ("system", "developer", "user", "assistant")
MAX_CHOICES = 16  # `n`: choices per request, each a row of its own
MAX_LOGPROBS = 20  # alternatives per token (`top_logprobs`; completions' `logprobs`), as OpenAI's chat


class ApiError(Exception):
    """A request the server refuses, with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class PromptLimits:
    """What the server accepts (from `ServeConfig`) and what the model holds."""

    max_prompt_tokens: int
    max_tokens_limit: int
    default_max_tokens: int
    context: int | None  # the model's positions, when its config says
    vocab_size: int
    # the longest text a prompt of max_prompt_tokens tokens can be: tokens x the longest
    # token's characters, x 4 when the tokenizer normalizes (it may compose characters)
    max_chars: int

    @classmethod
    def for_tokenizer(cls, tokenizer, *, max_prompt_tokens: int, max_tokens_limit: int,
                      default_max_tokens: int, context: int | None, vocab_size: int) -> PromptLimits:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(p) for p in pieces if isinstance(p, str)), default=1)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        composes = backend is None or backend.normalizer is not None  # byte-level BPE: none
        return cls(max_prompt_tokens, max_tokens_limit, default_max_tokens, context, vocab_size,
                   max_chars=max_prompt_tokens * max(longest, 1) * (4 if composes else 1))


def _number(body: dict, name: str, default, *, lo: float, hi: float, integer: bool = False):
    value = body.get(name)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ApiError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value}", param=name)
    return value


def check_text(text: str, param: str) -> str:
    """`text` if it can be encoded as UTF-8 (JSON lets a lone surrogate such as \\ud800 through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"'{param}' is not valid Unicode text (a lone surrogate at character {exc.start})",
                       param=param) from None
    return text


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(check_text(s, "stop") for s in stop)


# OpenAI fields this server does not implement: (name, the types OpenAI gives it, its values that
# ask for nothing). Each is checked for its type first (`n: true`, `n: 1.0` and `logprobs: "yes"`
# are mistakes, never read as their defaults), then refused when it asks for something.
_UNSUPPORTED = (
    ("echo", (bool,), (False,)),
    ("suffix", (str,), ("",)),
    ("presence_penalty", (int, float), (0,)),
    ("frequency_penalty", (int, float), (0,)),
    ("logit_bias", (dict,), ({},)),
)
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object"}


def _unsupported(body: dict) -> None:
    for name, types, default in _UNSUPPORTED:
        value = body.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            kinds = " or ".join(dict.fromkeys(_TYPE_NAMES[t] for t in types if not (t is float and int in types)))
            raise ApiError(400, f"'{name}' must be {kinds}", param=name)
        if not any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in default):  # 0 is not false
            only = f" (only {name} = {json.dumps(default[0])} is)" if default else ""
            raise ApiError(400, f"'{name}' = {json.dumps(value)} is not supported{only}", param=name)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or
                                not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object whose 'include_usage' is a boolean",
                       param="stream_options")


def check_body(body, served_names: set[str], served_id: str) -> dict:
    """The fields every request shares: a JSON object, `model`, `stream`."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model_name = body.get("model")
    if model_name is not None and not isinstance(model_name, str):
        raise ApiError(400, "'model' must be a string", param="model")
    if model_name is not None and model_name not in served_names:
        raise ApiError(404, f"the model '{model_name}' does not exist; this server serves '{served_id}'",
                       param="model", code="model_not_found")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise ApiError(400, "'stream' must be true or false", param="stream")
    return body


def _typed(body: dict, name: str, kind: type):
    """`body[name]` if it is of `kind` (None when absent); a bool is no int here."""
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise ApiError(400, f"'{name}' must be {_TYPE_NAMES[kind]}", param=name)
    return value


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token a request wants with its tokens' log-probabilities
    (None: no log-probabilities). Chat: `logprobs: true` and `top_logprobs: k`; completions:
    `logprobs: k`."""
    if chat:
        wanted, top = _typed(body, "logprobs", bool), _number(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS,
                                                              integer=True)
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    if body.get("top_logprobs") is not None:
        raise ApiError(400, "completions take 'logprobs': k (the alternatives per token), not 'top_logprobs'",
                       param="top_logprobs")
    return _number(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS, integer=True)


def choices(body: dict) -> int:
    """`n`, the choices to return (1 to `MAX_CHOICES`). `best_of` (completions: pick the best n
    of best_of by log-probability) is not supported beyond n: only best_of = n is accepted."""
    n = _number(body, "n", 1, lo=1, hi=MAX_CHOICES, integer=True)
    best_of = _typed(body, "best_of", int)
    if best_of is not None and best_of != n:
        raise ApiError(400, f"'best_of' = {best_of} is not supported (only best_of = n, here {n}: each choice is "
                       "returned; ask for n choices and rank them by their logprobs)", param="best_of")
    return n


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed`: choice 0 has the request's own
    (the answer of n = 1), the others one derived from it (a 64-bit hash), so a seeded request
    with n choices reproduces itself."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def parse_params(body: dict, limits: PromptLimits, n_prompt: int, *, method: str, engine: JacobiConfig,
                 max_tokens_key: str = "max_tokens", chat: bool = False) -> DecodeParams:
    """The decode settings of a request whose prompt has `n_prompt` tokens. A request without
    a seed gets a fresh random one (OpenAI's behaviour: unseeded samples differ)."""
    _unsupported(body)
    if n_prompt > limits.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {n_prompt} tokens; this server accepts at most "
                       f"{limits.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
    if limits.context is not None and n_prompt >= limits.context:
        raise ApiError(400, f"the prompt has {n_prompt} tokens: the model's context of {limits.context} tokens "
                       "leaves no room for a completion", param="prompt", code="context_length_exceeded")
    key = max_tokens_key if body.get(max_tokens_key) is not None else "max_tokens"
    default = min(limits.default_max_tokens, limits.max_tokens_limit)
    if limits.context is not None:  # an unset max_tokens shrinks to what the context leaves
        default = max(1, min(default, limits.context - n_prompt))
    max_tokens = _number(body, key, default, lo=1, hi=limits.max_tokens_limit, integer=True)
    if limits.context is not None and n_prompt + max_tokens > limits.context:
        raise ApiError(400, f"prompt ({n_prompt} tokens) + {key} ({max_tokens}) exceeds the model's context of "
                       f"{limits.context} tokens", param=key, code="context_length_exceeded")
    method = body.get("method", method)
    if method not in METHODS:
        raise ApiError(400, f"'method' must be one of {', '.join(METHODS)}", param="method")
    seed = _number(body, "seed", None, lo=-(2**63), hi=2**63 - 1, integer=True)
    return DecodeParams(
        method=method, engine=engine, max_new_tokens=max_tokens, stop=_stop(body),
        temperature=float(_number(body, "temperature", 0.0, lo=0.0, hi=2.0)),
        top_p=float(_number(body, "top_p", 1.0, lo=1e-6, hi=1.0)),
        top_k=_number(body, "top_k", None, lo=1, hi=2**31 - 1, integer=True),
        seed=secrets.randbits(63) if seed is None else seed,
        logprobs=_logprobs(body, chat),
    )


def completion_prompt(body: dict, limits: PromptLimits) -> str | list[int]:
    """`prompt`: a string (checked, not yet tokenized), token ids, or a list holding one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt is None:
        raise ApiError(400, "missing 'prompt'", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        _check_length(len(prompt), limits)
        return check_text(prompt, "prompt")
    if isinstance(prompt, list) and len(prompt) > limits.max_prompt_tokens:  # before looking at each
        raise ApiError(400, f"the prompt has {len(prompt)} tokens; this server accepts at most "
                       f"{limits.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < limits.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {limits.vocab_size})", param="prompt")
        return list(prompt)
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")


def chat_messages(body: dict, limits: PromptLimits) -> list[dict]:
    """`messages` as [{"role", "content": str}]; content parts of type text are joined."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "missing 'messages'", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a 'role' among {', '.join(ROLES)}", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") if isinstance(p, dict) and p.get("type") == "text" else None for p in content]
            content = "".join(parts) if all(isinstance(p, str) for p in parts) else None
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be text", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": check_text(content, f"messages[{i}].content")})
    _check_length(sum(len(m["content"]) for m in out), limits)
    return out


def _check_length(chars: int, limits: PromptLimits) -> None:
    if chars > limits.max_chars:
        raise ApiError(400, f"the prompt is {chars:,} characters long: more than {limits.max_prompt_tokens} tokens, "
                       f"the most this server accepts", param="prompt", code="context_length_exceeded")


def check_prompt_ids(ids: list[int]) -> list[int]:
    if not ids:
        raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
    return ids
