"""What `cllm serve` counts: Prometheus series (`GET /metrics`) and a JSON view (`GET /metrics.json`).

The series carry vLLM's names with the `cllm:` prefix, and its `model_name` label on every one,
so a dashboard made for vLLM reads them. Series vLLM does not have say what Jacobi decoding
does, by `method` (the decoder: "jacobi", "ar", "jacobi_sample", "ar_sample") and, for drafts,
by `source` (where a draft came from: `cllm.decoding.jacobi.rule.SOURCES`). Each server owns
its registry: apps built in one process never share a series.

Nothing here knows HTTP or the decode loop: the routes and `Service` call in as requests arrive
and end, the scheduler after each batched forward (`step`, from the decode thread); the queue
gauges are read off the scheduler at scrape time.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cllm.decoding.stats import DecodeStats
from cllm.serving.completion import Completion
from cllm.serving.scheduler import Job

__all__ = ["CONTENT_TYPE_LATEST", "ENDPOINTS", "Metrics", "completion_endpoint"]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")  # any other path: "other"


def completion_endpoint(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


# vLLM's buckets, with finer ones at the low end (a small model on a CPU answers in milliseconds)
LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
           20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
             2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
       120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PER_FORWARD = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8, 10, 12, 16)
ACCEPTED = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 64)


class Metrics:
    """Every series of one server, on its own `CollectorRegistry`, and the JSON counters since
    start (per decoder). Safe to call from any thread."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()

        def series(kind, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs):
            return kind(name, doc, ["model_name", *labels], registry=self.registry, **kwargs)

        # per request, as vLLM's
        self._requests = series(Counter, "cllm:requests", "Requests answered, by endpoint and HTTP status (a "
                                "stream that fails once under way: its error's status; 499: the client left).",
                                ("endpoint", "status"))
        self._success = series(Counter, "cllm:request_success", "Requests decoded to their end (n "
                               "choices: one request), by finish reason.",
                               ("finished_reason",))
        self._prompt_tokens = series(Counter, "cllm:prompt_tokens", "Prompt tokens of the requests decoded.")
        self._generation_tokens = series(Counter, "cllm:generation_tokens", "Tokens generated for the requests "
                                         "decoded (their usage.completion_tokens).")
        self._ttft = series(Histogram, "cllm:time_to_first_token_seconds", "From queueing to the first token "
                            "(streamed: to its first text sent).", buckets=LATENCY)
        self._tpot = series(Histogram, "cllm:time_per_output_token_seconds", "After the first token, seconds "
                            "per further token of the request's longest choice (2 tokens or more).", buckets=PER_TOKEN)
        self._e2e = series(Histogram, "cllm:e2e_request_latency_seconds", "From queueing to the answer.",
                           buckets=E2E)
        self._request_prompt = series(Histogram, "cllm:request_prompt_tokens", "Prompt tokens per request.",
                                      buckets=TOKENS)
        self._request_generation = series(Histogram, "cllm:request_generation_tokens", "Generated tokens per "
                                          "request.", buckets=TOKENS)
        self._running = series(Gauge, "cllm:num_requests_running", "Requests decoding now.")
        self._waiting = series(Gauge, "cllm:num_requests_waiting", "Requests queued, not decoding yet.")
        # per decoder: what Jacobi decoding does
        self._forwards = series(Counter, "cllm:forward_passes", "Batched model forwards, prefills included.",
                                ("method",))
        self._batch = series(Histogram, "cllm:batch_size", "Rows in one batched forward after the prefills.",
                             ("method",), buckets=ROWS)
        self._per_forward = series(Histogram, "cllm:tokens_per_forward", "Per request: generated tokens / the "
                                   "forwards it took part in (its prefill included).", ("method",),
                                   buckets=PER_FORWARD)
        self._accepted = series(Histogram, "cllm:accepted_tokens_per_step", "Tokens one forward made final for "
                                "one row (prefills included: sum / count is tokens per forward).", ("method",),
                                buckets=ACCEPTED)
        self._drafts = series(Counter, "cllm:spec_decode_num_draft_tokens", "Draft tokens fed to a forward to be "
                              "verified, by source.", ("method", "source"))
        self._drafts_accepted = series(Counter, "cllm:spec_decode_num_accepted_tokens", "Draft tokens made final, "
                                       "by source.", ("method", "source"))

        self.lock = threading.Lock()  # the JSON counters'
        self.started = time.time()
        self.requests: dict[str, int] = defaultdict(int)  # by endpoint
        self.errors: dict[int, int] = defaultdict(int)  # by status
        self.methods: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def watch(self, scheduler) -> None:
        """Read the running and waiting gauges off `scheduler` (its `running`, `waiting`) at each scrape."""
        self._running.labels(self.model_name).set_function(lambda: scheduler.running)
        self._waiting.labels(self.model_name).set_function(lambda: scheduler.waiting)

    # -- the routes' and the service's side

    def request(self, endpoint: str) -> None:
        """A request reached `endpoint`'s route (JSON only: Prometheus counts it as answered)."""
        with self.lock:
            self.requests[endpoint] += 1

    def answered(self, endpoint: str, status: int) -> None:
        """A request's answer went out with HTTP `status` (once per request)."""
        endpoint = endpoint if endpoint in ENDPOINTS else "other"  # a path a client made up is no label
        self._requests.labels(self.model_name, endpoint, str(status)).inc()
        if status >= 400:
            with self.lock:
                self.errors[status] += 1

    def completed(self, results: Sequence[Completion], jobs: Sequence[Job], first_text_at: float | None = None) -> None:
        """One request decoded to its end, answered now: its choices' `results` and their `jobs`
        (`n` of each, one per choice). It counts once: its prompt once, its generated tokens
        summed over the choices (its usage's `completion_tokens`); its finish reason "length"
        when any choice ran out of tokens. `first_text_at`: when its first text went out
        (`time.monotonic()`, streamed), else the first choice's first token counts (the prefill's)."""
        now, name = time.monotonic(), self.model_name
        queued = min(job.queued_at for job in jobs)
        first = first_text_at if first_text_at is not None else min(job.started_at for job in jobs)
        longest = max(len(r.tokens) for r in results)  # the choices decode side by side
        tokens, forwards = sum(len(r.tokens) for r in results), sum(r.forward_passes for r in results)
        prompt, method = results[0].prompt_tokens, results[0].method
        reason = "length" if any(r.finish_reason == "length" for r in results) else results[0].finish_reason
        self._ttft.labels(name).observe(max(0.0, first - queued))
        self._e2e.labels(name).observe(now - queued)
        if longest > 1:
            self._tpot.labels(name).observe(max(0.0, now - first) / (longest - 1))
        self._success.labels(name, reason).inc()
        self._prompt_tokens.labels(name).inc(prompt)
        self._generation_tokens.labels(name).inc(tokens)
        self._request_prompt.labels(name).observe(prompt)
        self._request_generation.labels(name).observe(tokens)
        self._per_forward.labels(name, method).observe(tokens / forwards if forwards else 0.0)
        with self.lock:
            m = self.methods[method]
            m["requests"] += 1
            m["prompt_tokens"] += prompt
            m["completion_tokens"] += tokens
            m["forward_passes"] += forwards
            m["decode_seconds"] += sum(r.seconds for r in results)

    # -- the decode thread's side

    def step(self, method: str, rows: int, stats: DecodeStats) -> None:
        """One group's batched forward over `rows` rows (0: none ran, its newcomers' prefills
        alone), with its decoder's counters since the last `step`."""
        name = self.model_name
        self._forwards.labels(name, method).inc(stats.forward_passes)
        if rows:
            self._batch.labels(name, method).observe(rows)
        accepted = self._accepted.labels(name, method)
        for tokens in stats.accepted:
            accepted.observe(tokens)
        for source, n in stats.drafted.items():
            self._drafts.labels(name, method, source).inc(n)
        for source, n in stats.drafts_accepted.items():
            self._drafts_accepted.labels(name, method, source).inc(n)

    # -- the two views

    def exposition(self) -> bytes:
        """Every series in Prometheus' text format (`CONTENT_TYPE_LATEST`)."""
        return generate_latest(self.registry)

    def snapshot(self) -> dict:
        """The JSON counters: requests by endpoint, errors by status, and per decoder requests,
        tokens, forward passes, decode seconds, tokens/s and tokens per forward."""
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
