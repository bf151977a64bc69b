"""The bridge between HTTP requests and the scheduler: `Service` checks a request body, turns
it into token ids and `DecodeParams` (`cllm.serving.api`), queues it on the decode thread
(`cllm.serving.scheduler.Scheduler`) and answers with OpenAI's shapes, as one JSON body or as SSE
chunks ending with `data: [DONE]`, and tells `cllm.serving.metrics.Metrics` what was served. The
routes themselves are `cllm.serving.app`'s.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import threading
import time
import uuid
from dataclasses import replace

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from cllm.core.errors import first_line, json_problem
from cllm.decoding.inputs import position_limit
from cllm.runtime import as_runtime
from cllm.serving.api import (
    ApiError,
    PromptLimits,
    check_body,
    check_prompt_ids,
    choice_seed,
    choices,
    parse_params,
)
from cllm.serving.completion import Completion, TextCodec
from cllm.serving.config import ServeConfig
from cllm.serving.logprobs import Entry, chat_logprobs, completions_logprobs
from cllm.serving.metrics import Metrics, completion_endpoint
from cllm.serving.scheduler import Job, Overloaded, Scheduler

# ----------------------------------------------------------------------------------------------
# Response bodies (OpenAI's shapes, plus `usage.forward_passes` and a `cllm` block)


def _usage(results: list[Completion]) -> dict:
    """OpenAI's usage (the prompt counted once, every choice's tokens), plus the forward passes
    the choices took and the tokens per forward they made (an extension)."""
    tokens, forwards = sum(len(r.tokens) for r in results), sum(r.forward_passes for r in results)
    prompt = results[0].prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens,
            "forward_passes": forwards, "tokens_per_forward": round(tokens / forwards, 4) if forwards else 0.0}


def _cllm(result: Completion, job: Job) -> dict:
    return {"method": result.method,
            "block_size": job.params.engine.block_size if result.method.startswith("jacobi") else 1,
            "forward_passes": result.forward_passes, "tokens_per_forward": result.tokens_per_forward,
            "decode_seconds": round(result.seconds, 6),
            "queue_seconds": round(max(0.0, job.started_at - job.queued_at), 6)}


def _logprobs(entries: list[Entry] | None, chat: bool, top: int) -> dict | None:
    if entries is None:
        return None
    return chat_logprobs(entries, top) if chat else completions_logprobs(entries)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON (write numbers as numbers)")


def parse_json(raw: bytes) -> object:
    """A request body as JSON; anything else (not UTF-8, NaN, nested too deeply, a number too
    long to convert) is a 400 that says what, never a 500."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {json_problem(exc)}") from None
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text") from None
    except RecursionError:
        raise ApiError(400, "the body's JSON nests too deeply") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise ApiError(400, f"the body's JSON cannot be used: {first_line(exc)}") from None


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _worker_error(reason: str, cfg: ServeConfig) -> ApiError:
    if reason == "timeout":  # a retry would time out again: tell the openai client not to
        return ApiError(504, f"the request did not finish within --request-timeout ({cfg.request_timeout:g} s)",
                        type="server_error", code="timeout", headers={"x-should-retry": "false"})
    if reason == "shutdown":
        return ApiError(503, "the server is shutting down", type="server_error")
    why = reason.removeprefix("failed: ") if reason.startswith("failed: ") else "logged by the server"
    return ApiError(500, f"decoding this request failed ({why})", type="server_error", code="decode_failed")


class _Mailbox:
    """Events from the decode thread to the requests' queues on the event loop. A step delivers
    an event to every running request; they reach the loop in one wake-up (one
    `call_soon_threadsafe`), not one each. One request's events keep their order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, tuple]] = []

    def post(self, queue: asyncio.Queue, event: tuple) -> None:
        """Put `event` on `queue` from another thread; RuntimeError when the loop is closed."""
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a drain is scheduled and has not run yet: it takes this one too
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._pending.clear()
            raise

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class Service:
    """What the routes do: check a request, queue it, answer (plain JSON or SSE)."""

    def __init__(self, model, tokenizer, cfg: ServeConfig, draft_table=None) -> None:
        model = as_runtime(model)  # a runtime (`cllm.runtime`), or a model on its "auto" one
        self.cfg, self.codec = cfg, TextCodec(tokenizer)
        self.limits = PromptLimits.for_tokenizer(
            tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, max_tokens_limit=cfg.max_tokens_limit,
            default_max_tokens=cfg.default_max_tokens, context=position_limit(model),
            vocab_size=model.vocab_size)
        self.metrics = Metrics(cfg.model_id)
        # the decode thread detokenizes with its own copy: encoding a prompt never waits for it
        self.scheduler = Scheduler(model, TextCodec(_copy(tokenizer)), draft_table=draft_table,
                                   queue_size=cfg.queue_size, max_batch_size=cfg.max_batch_size,
                                   max_tokens_in_flight=cfg.max_tokens_in_flight,
                                   forward_width=cfg.forward_width or None, stream_interval=cfg.stream_interval,
                                   on_step=self.metrics.step)
        self.metrics.watch(self.scheduler)
        self.names = {cfg.model_id, cfg.model}
        # one prompt tokenized at a time: a flood of long prompts takes one core, not every core
        self.tokenizing = asyncio.Semaphore(1)
        self._mailbox: _Mailbox | None = None  # the decode thread's events to the event loop

    async def read_body(self, request: Request) -> dict:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, "the body must be JSON sent with 'Content-Type: application/json'",
                           code="unsupported_media_type")
        try:
            raw = await asyncio.wait_for(request.body(), self.cfg.read_timeout)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.cfg.read_timeout:g} s") from None
        except ClientDisconnect:  # nobody reads the answer; the log gets one line
            raise ApiError(499, "the client closed the connection before its body arrived") from None
        return check_body(parse_json(raw), self.names, self.cfg.model_id)

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        async with self.tokenizing:
            return check_prompt_ids(await asyncio.to_thread(self.codec.encode, prompt))

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        async with self.tokenizing:
            return check_prompt_ids(await asyncio.to_thread(self.codec.chat_ids, messages))

    async def respond(self, request: Request, body: dict, prompt_ids: list[int], chat: bool):
        """Queue the request's choices (`n`, each a row of its own) and answer: one JSON body
        once every choice is done, or an SSE stream of their chunks as they come."""
        cfg = self.cfg
        params = parse_params(body, self.limits, len(prompt_ids), method=cfg.method, engine=cfg.jacobi,
                              max_tokens_key="max_completion_tokens" if chat else "max_tokens", chat=chat)
        n = choices(body)
        loop, events = asyncio.get_running_loop(), asyncio.Queue()  # (choice, kind, value)
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        mailbox = self._mailbox
        stream = bool(body.get("stream"))
        deadline = time.monotonic() + cfg.request_timeout if cfg.request_timeout else None

        def on_event(index: int, kind: str, value) -> None:  # from the decode thread
            try:
                mailbox.post(events, (index, kind, value))
            except RuntimeError:  # the event loop is gone (shutdown)
                jobs[index].cancelled = True

        jobs = [Job(prompt_ids, replace(params, seed=choice_seed(params.seed, i)),
                    functools.partial(on_event, i), stream_text=stream, deadline=deadline) for i in range(n)]
        try:
            for job in jobs:
                self.scheduler.submit(job)
        except Overloaded:
            for job in jobs:  # the choices queued already leave the queue unanswered
                self.scheduler.cancel(job)
            raise ApiError(503, "the server is busy (request queue full); retry later",
                           type="server_error", code="overloaded") from None
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": cfg.model_id}
        if stream:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(self.stream(jobs, events, head, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # a client that leaves stops the decode (Starlette does not cancel a plain handler)
        watcher = asyncio.create_task(_on_disconnect(request, lambda: events.put_nowait((0, "gone", None))))
        results: dict[int, Completion] = {}
        try:
            while len(results) < n:
                index, kind, value = await events.get()
                if kind == "gone":
                    self.metrics.answered(completion_endpoint(chat), 499)
                    return Response(status_code=499)  # nobody reads it; the access log shows it
                if kind == "error":
                    raise _worker_error(value, cfg)
                if kind == "done":
                    results[index] = value
        finally:
            watcher.cancel()
            for job in jobs:
                self.scheduler.cancel(job)  # a no-op when it is done
        self.metrics.completed([results[i] for i in range(n)], jobs)
        self.metrics.answered(completion_endpoint(chat), 200)
        answers = []
        for i in range(n):
            result = results[i]
            choice = {"index": i, "finish_reason": result.finish_reason,
                      "logprobs": _logprobs(result.logprobs, chat, params.logprobs or 0)}
            choice.update({"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text})
            answers.append(choice)
        return {**head, "choices": answers, "usage": _usage([results[i] for i in range(n)]),
                "cllm": _cllm(results[0], jobs[0])}

    async def stream(self, jobs: list[Job], events: asyncio.Queue, head: dict, chat: bool, include_usage: bool):
        """SSE: OpenAI's chunks, each choice's by its index (a role chunk first for chat; text
        chunks with the log-probabilities of the tokens they complete, when asked), each choice's
        finish chunk, then the usage chunk (`stream_options.include_usage`) and `[DONE]`."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        top = jobs[0].params.logprobs or 0

        def chunk(index: int, text: str | None, finish: str | None = None, role: bool = False,
                  entries: list[Entry] | None = None) -> dict:
            logprobs = _logprobs(entries, chat, top) if jobs[index].params.logprobs is not None else None
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
            return {**head, "choices": [choice]}

        status = 499  # the client left before the end
        first_text_at: dict[int, float] = {}
        pending: dict[int, list[Entry]] = {}  # a choice's entries, for its next text chunk
        sent = [0] * len(jobs)  # entries sent per choice
        results: dict[int, Completion] = {}
        try:
            if chat:
                for index in range(len(jobs)):
                    yield _sse(chunk(index, None, role=True))
            while len(results) < len(jobs):
                index, kind, value = await events.get()
                if kind == "logprobs":
                    pending[index] = pending.get(index, []) + value
                    continue
                if kind == "text":
                    first_text_at.setdefault(index, time.monotonic())
                    entries = pending.pop(index, [])
                    sent[index] += len(entries)
                    yield _sse(chunk(index, value, entries=entries))
                    continue
                if kind == "done":
                    results[index] = value
                    rest = (value.logprobs or [])[sent[index] :]  # the tokens of its last chunk, or a stop's cut
                    yield _sse({**chunk(index, None, value.finish_reason, entries=rest),
                                "cllm": _cllm(value, jobs[index])})
                    continue
                # the status line has gone out already: the error travels as an event
                err = _worker_error(value, self.cfg)
                status = err.status
                yield _sse(err.body())
                break
            else:
                status = 200
                self.metrics.completed([results[i] for i in range(len(jobs))], jobs,
                                       min(first_text_at.values(), default=None))
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage([results[i] for i in range(len(jobs))])})
            yield _sse("[DONE]")
        finally:
            self.metrics.answered(completion_endpoint(chat), status)
            for job in jobs:
                self.scheduler.cancel(job)  # a client that left (Starlette cancels the stream)


async def _on_disconnect(request: Request, callback) -> None:
    """Call `callback` when the client disconnects (the body has been read: the next ASGI
    message is the disconnect, or arrives when the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    callback()


def _copy(tokenizer):
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (behind its lock)
        return tokenizer
