"""The bridge between HTTP requests and the scheduler: `Service` checks a request body, turns
it into token ids and `DecodeParams` (`cllm.serving.api`), queues it on the decode thread
(`cllm.serving.scheduler.Scheduler`) and answers with OpenAI's shapes, as one JSON body or as SSE
chunks ending with `data: [DONE]`; `Metrics` counts what was served. The routes themselves are
`cllm.serving.app`'s.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from collections import defaultdict

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from cllm.core.errors import first_line, json_problem
from cllm.decoding.inputs import position_limit
from cllm.runtime import as_runtime
from cllm.serving.api import ApiError, PromptLimits, check_body, check_prompt_ids, parse_params
from cllm.serving.completion import Completion, TextCodec
from cllm.serving.config import ServeConfig
from cllm.serving.scheduler import Job, Overloaded, Scheduler


class Metrics:
    """Counters since start; per decoder ("jacobi", "ar", "jacobi_sample", "ar_sample")."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests: dict[str, int] = defaultdict(int)  # by endpoint
        self.errors: dict[int, int] = defaultdict(int)  # by status
        self.methods: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def request(self, endpoint: str) -> None:
        with self.lock:
            self.requests[endpoint] += 1

    def error(self, status: int) -> None:
        with self.lock:
            self.errors[status] += 1

    def completed(self, result: Completion) -> None:
        with self.lock:
            m = self.methods[result.method]
            m["requests"] += 1
            m["prompt_tokens"] += result.prompt_tokens
            m["completion_tokens"] += len(result.tokens)
            m["forward_passes"] += result.forward_passes
            m["decode_seconds"] += result.seconds

    def snapshot(self) -> dict:
        with self.lock:
            methods = {}
            for name, m in self.methods.items():
                tokens, forwards, seconds = m["completion_tokens"], m["forward_passes"], m["decode_seconds"]
                methods[name] = {
                    "requests": int(m["requests"]), "prompt_tokens": int(m["prompt_tokens"]),
                    "completion_tokens": int(tokens), "forward_passes": int(forwards),
                    "decode_seconds": round(seconds, 4),
                    "tokens_per_second": tokens / seconds if seconds else 0.0,
                    "tokens_per_forward": tokens / forwards if forwards else 0.0,
                }
            return {
                "uptime_seconds": round(time.time() - self.started, 3),
                "requests": sum(self.requests.values()), "requests_by_endpoint": dict(self.requests),
                "errors": sum(self.errors.values()), "errors_by_status": {str(k): v for k, v in self.errors.items()},
                "methods": methods,
            }


# ----------------------------------------------------------------------------------------------
# Response bodies (OpenAI's shapes, plus `usage.forward_passes` and a `cllm` block)


def _usage(result: Completion) -> dict:
    n = len(result.tokens)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
            "total_tokens": result.prompt_tokens + n, "forward_passes": result.forward_passes}


def _cllm(result: Completion, job: Job) -> dict:
    return {"method": result.method,
            "block_size": job.params.engine.block_size if result.method.startswith("jacobi") else 1,
            "forward_passes": result.forward_passes, "tokens_per_forward": result.tokens_per_forward,
            "decode_seconds": round(result.seconds, 6),
            "queue_seconds": round(max(0.0, job.started_at - job.queued_at), 6)}


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
        # the decode thread detokenizes with its own copy: encoding a prompt never waits for it
        self.scheduler = Scheduler(model, TextCodec(_copy(tokenizer)), draft_table=draft_table,
                                   queue_size=cfg.queue_size, max_batch_size=cfg.max_batch_size,
                                   max_tokens_in_flight=cfg.max_tokens_in_flight,
                                   forward_width=cfg.forward_width or None, stream_interval=cfg.stream_interval)
        self.metrics = Metrics()
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
        cfg = self.cfg
        params = parse_params(body, self.limits, len(prompt_ids), method=cfg.method, engine=cfg.jacobi,
                              max_tokens_key="max_completion_tokens" if chat else "max_tokens")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        mailbox = self._mailbox

        def on_event(kind: str, value) -> None:  # from the decode thread
            try:
                mailbox.post(events, (kind, value))
            except RuntimeError:  # the event loop is gone (shutdown)
                job.cancelled = True

        stream = bool(body.get("stream"))
        deadline = time.monotonic() + cfg.request_timeout if cfg.request_timeout else None
        job = Job(prompt_ids, params, on_event, stream_text=stream, deadline=deadline)
        try:
            self.scheduler.submit(job)
        except Overloaded:
            raise ApiError(503, "the server is busy (request queue full); retry later",
                           type="server_error", code="overloaded") from None
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": cfg.model_id}
        if stream:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(self.stream(job, events, head, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        # a client that leaves stops the decode (Starlette does not cancel a plain handler)
        watcher = asyncio.create_task(_on_disconnect(request, lambda: events.put_nowait(("gone", None))))
        try:
            while (event := await events.get())[0] == "text":
                pass
        finally:
            watcher.cancel()
            self.scheduler.cancel(job)  # a no-op when it is done
        kind, result = event
        if kind == "gone":
            return Response(status_code=499)  # nobody reads it; the access log shows it
        if kind == "error":
            raise _worker_error(result, cfg)
        self.metrics.completed(result)
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text})
        return {**head, "choices": [choice], "usage": _usage(result), "cllm": _cllm(result, job)}

    async def stream(self, job: Job, events: asyncio.Queue, head: dict, chat: bool, include_usage: bool):
        """SSE: OpenAI's chunks (a role chunk first for chat), the finish chunk, `[DONE]`."""
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**head, "choices": [choice]}

        try:
            if chat:
                yield _sse(chunk(None, role=True))
            while True:
                kind, value = await events.get()
                if kind == "text":
                    yield _sse(chunk(value))
                    continue
                if kind == "done":
                    self.metrics.completed(value)
                    yield _sse({**chunk(None, value.finish_reason), "cllm": _cllm(value, job)})
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(value)})
                else:  # the status line has gone out already: the error travels as an event
                    err = _worker_error(value, self.cfg)
                    self.metrics.error(err.status)
                    yield _sse(err.body())
                break
            yield _sse("[DONE]")
        finally:
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
