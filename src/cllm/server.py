"""`cllm serve`: an OpenAI-compatible HTTP server over one model (FastAPI + uvicorn).

Thin on purpose: requests are checked and turned into token ids and `DecodeParams` here, and
decoded by `cllm.generate.complete`, the same code as `cllm generate`, so CLI and HTTP agree.

Concurrency: one decode worker thread takes jobs from a bounded FIFO queue and decodes them one
at a time, each with its own fresh KV cache (nothing is shared between requests, and greedy
output does not depend on what else is being served). The event loop only parses, tokenizes,
queues and streams; the worker hands text back to it with `call_soon_threadsafe`. A full queue
answers 503; a client that goes away cancels its job at the next decoding step.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE chunks ending with
`data: [DONE]`, or not), GET /v1/models, GET /health, GET /metrics.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sys
import threading
import time
import uuid
from collections import defaultdict
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from cllm.decoding import RECOMMENDED
from cllm.decoding.inputs import position_limit
from cllm.generate import METHODS, Completion, DecodeParams, TextCodec, complete

log = logging.getLogger(__name__)
ROLES = ("system", "developer", "user", "assistant")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass
class ServeConfig:
    model: str = field(default="stdlib-coder", metadata={"help": "model dir, shipped name or hub id"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind (loopback by default)"})
    port: int = field(default=8000, metadata={"help": "TCP port"})
    served_model_name: str | None = field(default=None, metadata={"help": "the model id clients use (default: the model dir's name)"})
    method: Literal["jacobi", "ar"] = field(default="jacobi", metadata={"help": "greedy decoder when a request does not name one"})
    block_size: int = field(default=RECOMMENDED["block_size"], metadata={"help": "Jacobi block size n (4 with recycling suits a CPU; a GPU affords 16-32)"})
    recycle: int = field(default=RECOMMENDED["recycle"], metadata={"help": "Jacobi: n-gram pool drafts verified beside the block per forward (exact; 0: the paper's plain Jacobi)"})
    recycle_budget: int = field(default=RECOMMENDED["recycle_budget"], metadata={"help": "Jacobi with recycling: tokens fed per forward at most (0: no limit; a GPU affords more)"})
    blocks_in_flight: int = field(default=RECOMMENDED["blocks_in_flight"], metadata={"help": "Jacobi, greedy: blocks drafted at once (exact)"})
    draft_table: str = field(default="auto", metadata={"help": "Jacobi: the model's draft table (cllm drafts): auto (the one saved beside the checkpoint, if any), none, or a file; speed only, the output is unchanged"})
    default_max_tokens: int = field(default=128, metadata={"help": "max_tokens when a request gives none (capped by --max-tokens-limit)"})
    max_tokens_limit: int = field(default=1024, metadata={"help": "largest max_tokens a request may ask for"})
    max_prompt_tokens: int = field(default=2048, metadata={"help": "longest prompt accepted, in tokens"})
    queue_size: int = field(default=256, metadata={"help": "requests waiting beyond this get 503"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    device: str = field(default="cpu", metadata={"help": "torch device"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level"})

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.recycle < 0 or self.recycle_budget < 0 or self.blocks_in_flight < 1:
            raise ValueError("--recycle and --recycle-budget must be >= 0, --blocks-in-flight >= 1")
        for name in ("block_size", "default_max_tokens", "max_tokens_limit", "max_prompt_tokens", "queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    @property
    def model_id(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name or self.model


class ApiError(Exception):
    """A request the server refuses, with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------------------------
# Checking a request (pure: body -> token ids + DecodeParams, or ApiError)


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


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stop)


def _unsupported(body: dict) -> None:
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        raise ApiError(400, "only n = 1 (one choice per request) is supported", param="n")
    if body.get("echo") or body.get("logprobs") or body.get("suffix"):
        raise ApiError(400, "echo, logprobs and suffix are not supported", param="logprobs")


def parse_params(body: dict, cfg: ServeConfig, prompt_ids: list[int], position_limit: int | None,
                 max_tokens_key: str = "max_tokens") -> DecodeParams:
    _unsupported(body)
    if len(prompt_ids) > cfg.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this server accepts at most "
                       f"{cfg.max_prompt_tokens}", param="prompt", code="context_length_exceeded")
    key = max_tokens_key if body.get(max_tokens_key) is not None else "max_tokens"
    default = min(cfg.default_max_tokens, cfg.max_tokens_limit)
    if position_limit is not None:  # an unset max_tokens shrinks to what the context leaves
        default = max(1, min(default, position_limit - len(prompt_ids)))
    max_tokens = _number(body, key, default, lo=1, hi=cfg.max_tokens_limit, integer=True)
    if position_limit is not None and len(prompt_ids) + max_tokens > position_limit:
        raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                       f"the model's context of {position_limit} tokens", param=key,
                       code="context_length_exceeded")
    method = body.get("method", cfg.method)
    if method not in METHODS:
        raise ApiError(400, f"'method' must be one of {', '.join(METHODS)}", param="method")
    seed = _number(body, "seed", None, lo=-(2**63), hi=2**63 - 1, integer=True)
    return DecodeParams(
        method=method, block_size=cfg.block_size, max_new_tokens=max_tokens, stop=_stop(body),
        recycle=cfg.recycle, recycle_budget=cfg.recycle_budget, blocks_in_flight=cfg.blocks_in_flight,
        temperature=float(_number(body, "temperature", 0.0, lo=0.0, hi=2.0)),
        top_p=float(_number(body, "top_p", 1.0, lo=1e-6, hi=1.0)),
        top_k=_number(body, "top_k", None, lo=1, hi=2**31 - 1, integer=True), seed=seed,
    )


def completion_prompt(body: dict, codec: TextCodec, vocab_size: int) -> list[int]:
    """`prompt`: a string, token ids, or a list holding one of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = codec.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        ids = list(prompt)
    elif prompt is None:
        raise ApiError(400, "missing 'prompt'", param="prompt")
    else:
        raise ApiError(400, "'prompt' must be a string or a list of token ids (one prompt per request)", param="prompt")
    if not ids:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return ids


def chat_messages(body: dict) -> list[dict]:
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
        out.append({"role": role, "content": content})
    return out


# ----------------------------------------------------------------------------------------------
# The decode worker


@dataclass
class Job:
    prompt_ids: list[int]
    params: DecodeParams
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # ("text"|"done"|"error", value)
    cancelled: bool = False
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float = 0.0

    def push(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone (shutdown)
            self.cancelled = True


class DecodeWorker:
    """One thread, one job at a time, in arrival order."""

    def __init__(self, model, codec: TextCodec, queue_size: int, draft_table=None) -> None:
        self.model, self.codec, self.draft_table = model, codec, draft_table
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self.thread = threading.Thread(target=self._run, name="cllm-decode", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(503, "the server is busy (request queue full); retry later",
                           type="server_error", code="overloaded") from None

    def stop(self, timeout: float = 5.0) -> None:
        while True:  # fail what is still waiting, then let the thread finish its current job
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.push("error", ApiError(503, "the server is shutting down", type="server_error"))
        self.jobs.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancelled:
                continue
            job.started_at = time.perf_counter()
            try:
                result = complete(self.model, self.codec, job.prompt_ids, job.params,
                                  on_text=(lambda text, job=job: job.push("text", text)) if job.stream else None,
                                  cancelled=lambda job=job: job.cancelled, draft_table=self.draft_table)
            except Exception as exc:  # noqa: BLE001 - reported to the client, the worker lives on
                log.exception("decode failed")
                job.push("error", ApiError(500, f"decoding failed: {exc}", type="server_error"))
            else:
                job.push("done", result)


class Metrics:
    """Counters since start; per decoder ("jacobi", "ar", "ar_sample")."""

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

    def snapshot(self, queued: int) -> dict:
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
                "queued": queued, "methods": methods,
            }


# ----------------------------------------------------------------------------------------------
# Response bodies (OpenAI's shapes, plus `usage.forward_passes` and a `cllm` block)


def _usage(result: Completion) -> dict:
    n = len(result.tokens)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n,
            "total_tokens": result.prompt_tokens + n, "forward_passes": result.forward_passes}


def _cllm(result: Completion, job: Job) -> dict:
    return {"method": result.method, "block_size": job.params.block_size if result.method == "jacobi" else 1,
            "forward_passes": result.forward_passes, "tokens_per_forward": result.tokens_per_forward,
            "decode_seconds": round(result.seconds, 6),
            "queue_seconds": round(job.started_at - job.queued_at, 6)}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Service:
    """What the routes do: check a request, queue it, answer (plain JSON or SSE)."""

    def __init__(self, model, tokenizer, cfg: ServeConfig, draft_table=None) -> None:
        self.cfg, self.codec = cfg, TextCodec(tokenizer)
        self.context, self.vocab = position_limit(model), model.config.vocab_size
        self.worker, self.metrics = DecodeWorker(model, self.codec, cfg.queue_size, draft_table), Metrics()
        self.names = {cfg.model_id, cfg.model}

    def check_body(self, raw: bytes) -> dict:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        model_name = body.get("model")
        if model_name is not None and model_name not in self.names:
            raise ApiError(404, f"the model '{model_name}' does not exist; this server serves "
                           f"'{self.cfg.model_id}'", param="model", code="model_not_found")
        if not isinstance(body.get("stream", False), bool):
            raise ApiError(400, "'stream' must be true or false", param="stream")
        return body

    async def respond(self, body: dict, prompt_ids: list[int], chat: bool):
        key = "max_completion_tokens" if chat else "max_tokens"
        params = parse_params(body, self.cfg, prompt_ids, self.context, max_tokens_key=key)
        job = Job(prompt_ids, params, bool(body.get("stream")), asyncio.get_running_loop())
        self.worker.submit(job)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.cfg.model_id}
        if job.stream:
            options = body.get("stream_options")
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            return StreamingResponse(self.stream(job, head, chat, usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            while (event := await job.events.get())[0] == "text":
                pass
        finally:
            job.cancelled = True  # a no-op when done; stops the decode if the client left
        kind, result = event
        if kind == "error":
            raise result
        self.metrics.completed(result)
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        choice.update({"message": {"role": "assistant", "content": result.text}} if chat else {"text": result.text})
        return {**head, "choices": [choice], "usage": _usage(result), "cllm": _cllm(result, job)}

    async def stream(self, job: Job, head: dict, chat: bool, include_usage: bool):
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
                kind, value = await job.events.get()
                if kind == "text":
                    yield _sse(chunk(value))
                    continue
                if kind == "done":
                    self.metrics.completed(value)
                    yield _sse({**chunk(None, value.finish_reason), "cllm": _cllm(value, job)})
                    if include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(value)})
                else:  # the status line has gone out already: the error travels as an event
                    self.metrics.error(value.status)
                    yield _sse(value.body())
                break
            yield _sse("[DONE]")
        finally:
            job.cancelled = True


def create_app(model, tokenizer, settings: ServeConfig | None = None, draft_table=None) -> FastAPI:
    """The FastAPI app serving `model` (Jacobi with `draft_table`, when given: `cllm drafts`);
    its decode worker starts now and stops with the app."""
    cfg = settings or ServeConfig()
    service = Service(model, tokenizer, cfg, draft_table)
    metrics, worker = service.metrics, service.worker
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(worker.stop)

    app = FastAPI(title="cllm", lifespan=lifespan)
    app.state.service = service

    def error_response(err: ApiError) -> JSONResponse:
        metrics.error(err.status)
        return JSONResponse(err.body(), status_code=err.status)

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
        log.exception("request failed")
        return error_response(ApiError(500, f"internal error: {err}", type="server_error"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        metrics.request("/v1/completions")
        body = service.check_body(await request.body())
        return await service.respond(body, completion_prompt(body, service.codec, service.vocab), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        metrics.request("/v1/chat/completions")
        body = service.check_body(await request.body())
        ids = await asyncio.to_thread(service.codec.chat_ids, chat_messages(body))
        return await service.respond(body, ids, chat=True)

    @app.get("/v1/models")
    async def models():
        metrics.request("/v1/models")
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model",
                                            "created": created, "owned_by": "cllm"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": cfg.model_id, "queued": worker.jobs.qsize()}

    @app.get("/metrics")
    async def get_metrics():
        return metrics.snapshot(worker.jobs.qsize())

    return app


def serve(config: ServeConfig) -> int:
    """Load the model and serve it until interrupted."""
    import torch
    import uvicorn
    from transformers.utils import logging as hf_logging

    from cllm.models import load_draft_table, load_model, load_tokenizer

    hf_logging.disable_progress_bar()
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = load_tokenizer(config.model)
    table = load_draft_table(config.model, config.draft_table)
    model = load_model(config.model, dtype=config.dtype, device=config.device)
    app = create_app(model, tokenizer, config, table)
    drafts = f", draft table of {len(table):,} contexts" if table is not None else ""
    print(f"cllm serve: '{config.model_id}' on http://{config.host}:{config.port}/v1 "
          f"(greedy: {config.method}, n = {config.block_size}{drafts})", file=sys.stderr, flush=True)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False)
    return 0
