"""`cllm serve`: an OpenAI-compatible HTTP server over one model (FastAPI + uvicorn).

Thin on purpose: requests are checked and turned into token ids and `DecodeParams` by
`cllm.serving.api`, and decoded by `cllm.serving.scheduler.Scheduler`: one decode thread that batches
concurrent requests continuously (they join the running batch between steps and leave when
done), on the same engine and text streaming as `cllm generate`, so CLI and HTTP agree and a
request's output does not depend on what else is being served. The event loop only parses,
tokenizes (in a thread), queues and streams.

Limits: request bodies over `--max-body-bytes` get 413 (Starlette's body-limit middleware,
checked against Content-Length before the body is read, and while reading); a body that takes
longer than `--read-timeout` to arrive gets 408; a prompt is bounded in characters before it is
tokenized and in tokens after; a request that waits and decodes longer than
`--request-timeout` is stopped (504); a full queue answers 503; a client that goes away
(streamed or not) takes its row out of the batch before the next step; on SIGTERM / Ctrl-C,
running requests get `--shutdown-grace` seconds to finish.

Security: loopback by default; `--api-key` (or CLLM_API_KEY) is enforced as a bearer token on
every /v1 route; bodies are accepted only as `Content-Type: application/json` (so a web page
cannot send one as a "simple" cross-origin request); `--allowed-hosts` checks the Host header
(Starlette's TrustedHostMiddleware); a 500 says nothing of the failure (it is logged).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE chunks ending with
`data: [DONE]`, or not), GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from cllm.core.errors import UserError
from cllm.decoding import RECOMMENDED_CONFIG, JacobiConfig
from cllm.decoding.inputs import position_limit
from cllm.serving.api import (
    ApiError,
    PromptLimits,
    chat_messages,
    check_body,
    check_prompt_ids,
    completion_prompt,
    parse_params,
)
from cllm.serving.completion import METHODS, Completion, TextCodec
from cllm.serving.scheduler import Job, Overloaded, Scheduler

log = logging.getLogger(__name__)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
API_KEY_ENV = "CLLM_API_KEY"


@dataclass
class ServeConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "model dir, shipped name or hub id"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback by default; beyond it, set "
        "--api-key)"})
    port: int = field(default=8000, metadata={"help": "TCP port"})
    served_model_name: str | None = field(default=None, metadata={"help": "the model id clients use (default: the "
        "model dir's name)"})
    method: Literal["jacobi", "ar"] = field(default="jacobi", metadata={"help": "greedy decoder when a request does "
        "not name one"})
    engine: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG, metadata={"help": "the Jacobi engine's "
        "settings (flags --block-size, --recycle, ...)"})
    draft_table: str = field(default="auto", metadata={"help": "Jacobi: the model's draft table (cllm drafts): auto "
        "(the one saved beside the checkpoint, if any), none, or a file; speed only, the output is unchanged"})
    default_max_tokens: int = field(default=128, metadata={"help": "max_tokens when a request gives none (capped by "
        "--max-tokens-limit)"})
    max_tokens_limit: int = field(default=1024, metadata={"help": "largest max_tokens a request may ask for"})
    max_prompt_tokens: int = field(default=2048, metadata={"help": "longest prompt accepted, in tokens"})
    max_batch_size: int = field(default=64, metadata={"help": "requests decoded together at most (continuous "
        "batching); more wait in the queue"})
    max_tokens_in_flight: int = field(default=65536, metadata={"help": "prompt + max_tokens summed over the batch at "
        "most (bounds the KV cache); a request alone always runs"})
    forward_width: int = field(default=64, metadata={"help": "Jacobi with recycling, batched: tokens a forward feeds "
        "over the whole batch, roughly; each request's drafts shrink to its share as the batch grows (speed only; 0: "
        "each keeps --recycle-budget)"})
    queue_size: int = field(default=256, metadata={"help": "requests waiting beyond this get 503"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "larger request bodies get 413, checked before the "
        "body is read"})
    read_timeout: float = field(default=30.0, metadata={"help": "seconds a request body may take to arrive (408)"})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds a request may wait and decode in all "
        "(504); 0: no limit"})
    shutdown_grace: float = field(default=10.0, metadata={"help": "seconds running requests get to finish on SIGTERM / "
        "Ctrl-C"})
    max_connections: int = field(default=1024, metadata={"help": "open connections at most (uvicorn's "
        "limit_concurrency: 503 beyond)"})
    api_key: str | None = field(default=None, repr=False, metadata={"help": "bearer token every /v1 request must send "
        f"(default: the {API_KEY_ENV} environment variable, which keeps it out of the process list; unset: no check)"})
    allowed_hosts: list[str] = field(default_factory=list, metadata={"help": "Host header values accepted, e.g. "
        "localhost,127.0.0.1 (default: any)"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: one per core the load average leaves free "
        "at start, at least 1: two threads that wait on each other on a shared CPU made every request ~30x slower)"})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level"})

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name in ("default_max_tokens", "max_tokens_limit", "max_prompt_tokens", "queue_size",
                     "max_batch_size", "max_tokens_in_flight", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("read_timeout", "request_timeout", "shutdown_grace"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.read_timeout == 0:
            raise ValueError("--read-timeout must be > 0")
        if self.threads < 0 or self.forward_width < 0:
            raise ValueError("--threads and --forward-width must be >= 0")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, port: int, keyed: bool) -> str | None:
    """What to say when the server can be reached from other machines without a key."""
    if keyed or is_loopback(host):
        return None
    return (f"listening on {host}, beyond this machine, without an API key: anyone who can reach "
            f"port {port} can use the model (set {API_KEY_ENV} or --api-key)")


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


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _worker_error(reason: str, cfg: ServeConfig) -> ApiError:
    if reason == "timeout":  # a retry would time out again: tell the openai client not to
        return ApiError(504, f"the request did not finish within --request-timeout ({cfg.request_timeout:g} s)",
                        type="server_error", code="timeout", headers={"x-should-retry": "false"})
    if reason == "shutdown":
        return ApiError(503, "the server is shutting down", type="server_error")
    return ApiError(500, "internal error while decoding (logged by the server)", type="server_error")


class Service:
    """What the routes do: check a request, queue it, answer (plain JSON or SSE)."""

    def __init__(self, model, tokenizer, cfg: ServeConfig, draft_table=None) -> None:
        self.cfg, self.codec = cfg, TextCodec(tokenizer)
        self.limits = PromptLimits.for_tokenizer(
            tokenizer, max_prompt_tokens=cfg.max_prompt_tokens, max_tokens_limit=cfg.max_tokens_limit,
            default_max_tokens=cfg.default_max_tokens, context=position_limit(model),
            vocab_size=model.config.vocab_size)
        # the decode thread detokenizes with its own copy: encoding a prompt never waits for it
        self.scheduler = Scheduler(model, TextCodec(_copy(tokenizer)), draft_table=draft_table,
                                   queue_size=cfg.queue_size, max_batch_size=cfg.max_batch_size,
                                   max_tokens_in_flight=cfg.max_tokens_in_flight,
                                   forward_width=cfg.forward_width or None)
        self.metrics = Metrics()
        self.names = {cfg.model_id, cfg.model}

    async def read_body(self, request: Request) -> dict:
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, "the body must be JSON sent with 'Content-Type: application/json'",
                           code="unsupported_media_type")
        try:
            raw = await asyncio.wait_for(request.body(), self.cfg.read_timeout)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.cfg.read_timeout:g} s") from None
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        return check_body(body, self.names, self.cfg.model_id)

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        return check_prompt_ids(await asyncio.to_thread(self.codec.encode, prompt))

    async def respond(self, request: Request, body: dict, prompt_ids: list[int], chat: bool):
        cfg = self.cfg
        params = parse_params(body, self.limits, len(prompt_ids), method=cfg.method, engine=cfg.engine,
                              max_tokens_key="max_completion_tokens" if chat else "max_tokens")
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def on_event(kind: str, value) -> None:  # from the decode thread
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, value))
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
    import copy

    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (behind its lock)
        return tokenizer


def create_app(model, tokenizer, settings: ServeConfig | None = None, draft_table=None) -> FastAPI:
    """The FastAPI app serving `model` (Jacobi with `draft_table`, when given: `cllm drafts`);
    its decode thread starts now and stops with the app. The API key is `settings.api_key`,
    else the CLLM_API_KEY environment variable."""
    cfg = settings or ServeConfig()
    service = Service(model, tokenizer, cfg, draft_table)
    metrics, scheduler = service.metrics, service.scheduler
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV) or None
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        # after uvicorn's grace period: what waits or runs is failed; a step in progress gets
        # a few seconds to end (the thread is a daemon: it never holds the process)
        await asyncio.to_thread(scheduler.stop, 5.0)

    app = FastAPI(title="cllm", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=cfg.max_body_bytes)
    if cfg.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=cfg.allowed_hosts)

    def error_response(err: ApiError) -> JSONResponse:
        metrics.error(err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError):
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException):
        return error_response(ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, err: RequestValidationError):
        return error_response(ApiError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, err: Exception):
        log.exception("request failed")  # the details stay in the server's log
        return error_response(ApiError(500, "internal server error", type="server_error"))

    bearer = HTTPBearer(auto_error=False)

    async def check_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if api_key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.post("/completions")
    async def completions(request: Request):
        metrics.request("/v1/completions")
        body = await service.read_body(request)
        ids = await service.encode(completion_prompt(body, service.limits))
        return await service.respond(request, body, ids, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        metrics.request("/v1/chat/completions")
        body = await service.read_body(request)
        messages = chat_messages(body, service.limits)
        ids = check_prompt_ids(await asyncio.to_thread(service.codec.chat_ids, messages))
        return await service.respond(request, body, ids, chat=True)

    @v1.get("/models")
    async def models():
        metrics.request("/v1/models")
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model",
                                            "created": created, "owned_by": "cllm"}]}

    app.include_router(v1)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": cfg.model_id, "queued": scheduler.waiting, "running": scheduler.running}

    @app.get("/metrics")
    async def get_metrics():
        return {**metrics.snapshot(), "queued": scheduler.waiting, "running": scheduler.running,
                "batching": scheduler.stats.snapshot()}

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port), before anything slow: a taken port fails at once
    (one line), and clients that connect while the model loads wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, as asyncio's own sockets: it sets TCP_NODELAY on accepted connections
    # only then (with proto 0, Nagle held each streamed chunk back ~40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _free_cores() -> int:
    """Torch threads for a shared CPU: the cores the 1-minute load average leaves free, at
    least one (the same rule as `cllm bench` and `cllm demo`)."""
    from cllm.core.machine import load_average_1min, threads_for_load

    cores = os.cpu_count() or 1
    return threads_for_load(load_average_1min(), cores, wanted=cores)


def serve(config: ServeConfig) -> int:
    """Load the model and serve it until interrupted."""
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    from cllm.models import load_draft_table, load_model, load_tokenizer

    sock = bind(config.host, config.port)
    try:
        hf_logging.disable_progress_bar()
        torch.set_num_threads(config.threads or _free_cores())
        tokenizer = load_tokenizer(config.model)
        table = load_draft_table(config.model, config.draft_table)
        model = load_model(config.model, dtype=config.dtype, device=config.device)
        app = create_app(model, tokenizer, config, table)
    except BaseException:
        sock.close()
        raise
    port = sock.getsockname()[1]
    keyed = bool(config.api_key or os.environ.get(API_KEY_ENV))
    warning = exposure_warning(config.host, port, keyed)
    if warning:
        print(f"cllm serve: warning: {warning}", file=sys.stderr, flush=True)
    drafts = f", draft table of {len(table):,} contexts" if table is not None else ""
    print(f"cllm serve: '{config.model_id}' on http://{config.host}:{port}/v1 "
          f"(greedy: {config.method}, n = {config.engine.block_size}{drafts}; batches up to {config.max_batch_size} "
          f"requests; {torch.get_num_threads()} torch thread(s){'; API key required' if keyed else ''})",
          file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=config.log_level, access_log=False, limit_concurrency=config.max_connections,
        timeout_graceful_shutdown=config.shutdown_grace))  # type: ignore[arg-type] - seconds, 0 = none
    server.run(sockets=[sock])
    return 0
