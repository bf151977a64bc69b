"""`cllm serve`: an OpenAI-compatible HTTP server over one model (FastAPI + uvicorn).

Thin on purpose: requests are checked and turned into token ids and `DecodeParams` by
`cllm.serving.api`, and decoded by `cllm.serving.scheduler.Scheduler`: one decode thread that batches
concurrent requests continuously (they join the running batch between steps and leave when
done), on the same engine and text streaming as `cllm generate`, so CLI and HTTP agree and a
request's output does not depend on what else is being served. The event loop only parses,
tokenizes (in a thread), queues and streams (`cllm.serving.service.Service`). This module holds
the routes, and how the app is bound to a socket and run.

Limits: a request head must arrive within `--header-timeout` and at most `--max-connections`
connections stay open, the longest idle one closed for a newcomer (`cllm.serving.http`); request
bodies over `--max-body-bytes` get 413 (Starlette's body-limit middleware, checked against
Content-Length before the body is read, and while reading); a body that takes longer than
`--read-timeout` to arrive gets 408; a body that is not JSON, nests too deeply or holds an
over-long number gets 400; a prompt is bounded in characters before it is tokenized and in
tokens after; a request that waits and decodes longer than `--request-timeout` is stopped (504);
a full queue answers 503; a client that goes away (streamed or not) takes its row out of the
batch before the next step; a request that fails to decode fails alone (500), its batch mates
go on; on SIGTERM / Ctrl-C, running requests get `--shutdown-grace` seconds to finish, then get
503 (a stream: an error event and `[DONE]`).

Security: loopback by default; `--api-key` (or CLLM_API_KEY) is enforced as a bearer token on
every /v1 route; bodies are accepted only as `Content-Type: application/json` (so a web page
cannot send one as a "simple" cross-origin request); the Host header must be one of
`--allowed-hosts` (by default the loopback names on loopback: DNS rebinding is refused); no
/docs page and no schema unless `--openapi`; a 500 says nothing of a bug (it is logged); each
refused request is one log line.

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE chunks ending with
`data: [DONE]`, or not), GET /v1/models, GET /health, GET /metrics (Prometheus' text format:
`cllm.serving.metrics`) and GET /metrics.json (a JSON summary, with the batching's counters);
HEAD works wherever GET does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from cllm.core.errors import UserError
from cllm.core.machine import in_passing_thread
from cllm.serving.api import ApiError, chat_messages, completion_prompt
from cllm.serving.config import ServeConfig, allowed_hosts, api_key
from cllm.serving.http import guarded_protocol, room_for_connections
from cllm.serving.loading import ServedModel, free_cores, load_served
from cllm.serving.metrics import CONTENT_TYPE_LATEST
from cllm.serving.service import Service

log = logging.getLogger(__name__)

SHUTDOWN_MARGIN = 5.0  # seconds uvicorn waits past --shutdown-grace for the 503s to go out


def create_app(model, tokenizer, settings: ServeConfig | None = None, draft_table=None) -> FastAPI:
    """The FastAPI app serving `model` (a transformers model, on its "auto" runtime, or a runtime;
    Jacobi with `draft_table`, when given: `cllm drafts`);
    its decode thread starts now and stops with the app. The API key is `settings.api_key`,
    else the CLLM_API_KEY environment variable."""
    cfg = settings or ServeConfig()
    service = Service(model, tokenizer, cfg, draft_table)

    @asynccontextmanager
    async def lifespan(app):
        watcher = asyncio.create_task(_fail_after_grace(app, service))
        yield
        watcher.cancel()
        # what still waits or runs is failed; a step in progress gets a few seconds to end (the
        # thread is a daemon: it never holds the process)
        await asyncio.to_thread(service.scheduler.stop, 5.0)

    app = FastAPI(title="cllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=cfg.max_body_bytes)
    if (hosts := allowed_hosts(cfg)) != ["*"]:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    _add_error_handlers(app, service)
    key_check = _key_check(api_key(cfg))
    app.include_router(_v1_routes(service, key_check))
    _add_status_routes(app, service)
    if cfg.openapi:
        app.get("/openapi.json", dependencies=[Depends(key_check)], include_in_schema=False)(app.openapi)
    return app


async def _fail_after_grace(app: FastAPI, service: Service) -> None:
    """Once the server is told to exit (`app.state.exiting`, set by `serve_app`), running
    requests get `--shutdown-grace` seconds; then what is left fails with 503 (a stream: an
    error event and [DONE]) before uvicorn would cut the connections."""
    exiting = getattr(app.state, "exiting", None)
    if exiting is None:
        return
    while not exiting():
        await asyncio.sleep(0.1)
    await asyncio.sleep(service.cfg.shutdown_grace)
    left = service.scheduler.waiting + service.scheduler.running
    if left:
        log.warning("--shutdown-grace (%g s) is over: %d request(s) get 503", service.cfg.shutdown_grace, left)
    await asyncio.to_thread(service.scheduler.stop, 5.0)


def _add_error_handlers(app: FastAPI, service: Service) -> None:
    """Every failure answers with OpenAI's error shape, and is counted by path and status."""

    def error_response(request: Request, err: ApiError) -> JSONResponse:
        service.metrics.answered(request.url.path, err.status)
        if err.status < 500:  # a refused request is one line in the log, whatever it sent
            log.info("%s %s -> %d: %s", request.method, request.url.path, err.status, err.message[:200])
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, err: ApiError):
        return error_response(request, err)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, err: HTTPException):
        return error_response(request, ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, err: RequestValidationError):
        return error_response(request, ApiError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, err: Exception):
        log.exception("request failed")  # the details stay in the server's log
        return error_response(request, ApiError(500, "internal server error", type="server_error"))


def _key_check(key: str | None):
    """The dependency that checks the bearer token `key` (none when `key` is None)."""
    bearer = HTTPBearer(auto_error=False)

    async def check_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:  # noqa: B008
        if key is None:
            return
        given = credentials.credentials if credentials is not None else ""
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "invalid or missing API key: send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check_key


def _v1_routes(service: Service, check_key) -> APIRouter:
    """The OpenAI routes, behind the bearer-token dependency `check_key`."""
    cfg, metrics = service.cfg, service.metrics
    created = int(time.time())
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
        ids = await service.encode_chat(messages)
        return await service.respond(request, body, ids, chat=True)

    @v1.head("/models", include_in_schema=False)
    @v1.get("/models")
    async def models():
        metrics.request("/v1/models")
        metrics.answered("/v1/models", 200)
        return {"object": "list", "data": [{"id": cfg.model_id, "object": "model",
                                            "created": created, "owned_by": "cllm"}]}

    return v1


def _add_status_routes(app: FastAPI, service: Service) -> None:
    """/health, /metrics and /metrics.json: open to anyone who reaches the port (no key)."""
    cfg, metrics, scheduler = service.cfg, service.metrics, service.scheduler

    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health():
        return {"status": "ok", "model": cfg.model_id, "queued": scheduler.waiting, "running": scheduler.running}

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/metrics.json", methods=["GET", "HEAD"], include_in_schema=False)
    async def json_metrics():
        return {**metrics.snapshot(), "queued": scheduler.waiting, "running": scheduler.running,
                "batching": scheduler.stats.snapshot()}


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


@dataclass
class BoundApp:
    """An app ready to serve: its listening socket, and the model it decodes with."""

    app: FastAPI
    sock: socket.socket
    served: ServedModel

    @property
    def port(self) -> int:
        """The port bound (the one asked for, or the one the system chose for port 0)."""
        return self.sock.getsockname()[1]

    @property
    def max_batch_size(self) -> int:
        """Requests decoded together at most: --max-batch-size, or the rows the runtime holds
        when fewer (llama.cpp's streams)."""
        return self.app.state.service.scheduler.max_batch_size


def open_app(config: ServeConfig) -> BoundApp:
    """Bind the port first (a taken port fails before anything slow), then load the model
    (`--threads 0`: the cores the load average leaves free) and build its app."""
    sock = bind(config.host, config.port)

    def load() -> tuple[ServedModel, FastAPI]:
        served = load_served(config.model, dtype=config.dtype, device=config.device,
                             threads=config.threads or free_cores(), draft_table=config.draft_table,
                             compile=config.compile, runtime=config.runtime, max_rows=config.max_batch_size)
        return served, create_app(served.model, served.codec.tokenizer, config, served.draft_table)

    try:  # off the main thread: the decode thread is then the only one with torch CPU threads
        served, app = in_passing_thread(load)
    except BaseException:
        sock.close()
        raise
    return BoundApp(app, sock, served)


def serve_app(bound: BoundApp, config: ServeConfig) -> None:
    """Serve until SIGTERM / Ctrl-C (uvicorn), running requests given `--shutdown-grace` seconds."""
    protocol = guarded_protocol(header_timeout=config.header_timeout,
                                max_connections=room_for_connections(config.max_connections))
    server = uvicorn.Server(uvicorn.Config(
        bound.app, log_level=config.log_level, access_log=False, http=protocol,
        timeout_graceful_shutdown=config.shutdown_grace + SHUTDOWN_MARGIN))  # type: ignore[arg-type]
    bound.app.state.exiting = lambda: server.should_exit  # read by `_fail_after_grace`
    server.run(sockets=[bound.sock])
