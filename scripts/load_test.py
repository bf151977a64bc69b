"""A bounded load on a running `cllm serve` (loopback only): throughput, latency and time to
first token at several concurrency levels, with every output checked against the same
request's output served alone.

    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64 \\
        --methods jacobi,ar --max-tokens 128 --json load.json

For each method: first every distinct prompt is completed once, alone (the single-request
outputs); then, for each concurrency level C, C clients each send requests back to back
(streamed, so that the first token's arrival is seen) until the level's requests are sent:
max(--min-requests, C x --rounds). Each output is compared with its single-request output.
Reports per level: requests/s, completion tokens/s, p50 / p99 latency, p50 / p99 time to first
token, mismatches, errors, and the server's mean batch size over the level (cllm's /metrics.json;
none for other servers). Stops by itself: after the last level, or once --time-limit seconds
have passed (requests not sent are counted). Exits non-zero on any error or mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
STALE_RETRIES = 66  # the pool holds at most 64 + 2 connections (--concurrency <= 64)
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    def __init__(self):\n",
    "def read_lines(path):\n    with open(path) as fh:\n",
    "for key, value in sorted(mapping.items()):\n",
    'def is_prime(n: int) -> bool:\n    """Return True if n is prime."""\n',
    "try:\n    import json\nexcept ImportError:\n",
    "def merge(a, b):\n    result = []\n",
]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def complete(client: httpx.AsyncClient, prompt: str, args, method: str) -> dict:
    """One streamed completion: its text, tokens, latency and time to first token."""
    return await _fresh(lambda: _complete(client, prompt, args, method))


async def _get(client: httpx.AsyncClient, path: str) -> httpx.Response:
    return await _fresh(lambda: client.get(path))


async def _fresh(request):
    """`request()`, sent again when its pooled connection had been closed by the server
    (llama-server closes idle ones), as HTTP clients do (each try drops one such connection from
    the pool); nothing of it had been answered."""
    for _ in range(STALE_RETRIES):
        try:
            return await request()
        except httpx.RemoteProtocolError as exc:
            if "without sending a response" not in str(exc):
                raise
    return await request()


async def _complete(client: httpx.AsyncClient, prompt: str, args, method: str) -> dict:
    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if method != "server":  # `server`: the server's own greedy decoding (any OpenAI server, e.g. vLLM's)
        body["method"] = method
    start = time.perf_counter()
    first, text, usage = None, [], {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return {"error": f"HTTP {response.status_code}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"].get("code") or "stream error"}
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    text.append(choice["text"])
    end = time.perf_counter()
    return {"text": "".join(text), "latency": end - start, "ttft": (first or end) - start,
            "tokens": usage.get("completion_tokens", 0), "forwards": usage.get("forward_passes", 0)}


def _json(response: httpx.Response) -> dict:
    """A JSON object answer, or {} (vLLM's /health is empty; other servers have no /metrics.json)."""
    try:
        found = response.json()
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


async def level(client: httpx.AsyncClient, args, method: str, concurrency: int, reference: dict[str, str],
                deadline: float) -> dict:
    total = max(args.min_requests, concurrency * args.rounds)
    before = _json(await _get(client, "/metrics.json")).get("batching", {})
    queue = list(range(total))
    results: list[dict] = []
    not_sent = 0

    async def client_loop() -> None:
        nonlocal not_sent
        while queue:
            i = queue.pop(0)
            if time.monotonic() > deadline:
                not_sent += 1
                continue
            prompt = PROMPTS[i % len(PROMPTS)]
            try:
                result = await complete(client, prompt, args, method)
            except httpx.HTTPError as exc:
                result = {"error": type(exc).__name__}
            result["prompt"] = prompt
            results.append(result)

    start = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    after = _json(await _get(client, "/metrics.json")).get("batching", {})
    ok = [r for r in results if "error" not in r]
    steps = after.get("steps", 0) - before.get("steps", 0)
    rows = after.get("rows_stepped", 0) - before.get("rows_stepped", 0)
    errors: dict[str, int] = {}
    for r in results:
        if "error" in r:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    return {
        "method": method, "concurrency": concurrency, "requests": total, "completed": len(ok),
        "errors": sum(errors.values()), "errors_by_kind": errors, "not_sent_time_limit": not_sent,
        "mismatches": sum(r["text"] != reference[r["prompt"]] for r in ok),
        "wall_seconds": round(wall, 3), "requests_per_second": len(ok) / wall, "tokens_per_second": tokens / wall,
        "completion_tokens": tokens,
        "tokens_per_forward": tokens / max(1, sum(r["forwards"] for r in ok)) if any(r["forwards"] for r in ok)
        else None,  # a server that does not report its forwards (vLLM's)
        "latency_p50_ms": 1000 * percentile([r["latency"] for r in ok], 50),
        "latency_p99_ms": 1000 * percentile([r["latency"] for r in ok], 99),
        "ttft_p50_ms": 1000 * percentile([r["ttft"] for r in ok], 50),
        "ttft_p99_ms": 1000 * percentile([r["ttft"] for r in ok], 99),
        "server_mean_batch": rows / steps if steps else 0.0,
    }


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=max(args.concurrency) + 2,
                          max_keepalive_connections=max(args.concurrency) + 2)
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout, limits=limits) as client:
        server = _json(await _get(client, "/health"))
        deadline = time.monotonic() + args.time_limit
        levels, references = [], {}
        for method in args.methods:
            reference = {}
            for prompt in PROMPTS:  # alone: the single-request outputs (and a warm-up)
                result = await complete(client, prompt, args, method)
                if "error" in result:
                    raise SystemExit(f"load_test: the single request for {prompt!r} failed: {result['error']}")
                reference[prompt] = result["text"]
            references[method] = reference
            for concurrency in args.concurrency:
                found = await level(client, args, method, concurrency, reference, deadline)
                levels.append(found)
                print(_row(found), file=sys.stderr, flush=True)
    ratios = {}
    for method in args.methods:
        by_c = {r["concurrency"]: r["tokens_per_second"] for r in levels if r["method"] == method}
        if 1 in by_c and by_c[1] > 0:
            ratios[method] = {str(c): round(v / by_c[1], 2) for c, v in by_c.items()}
    return {"url": args.url, "model": server.get("model"), "max_tokens": args.max_tokens,
            "levels": levels, "throughput_vs_one_client": ratios}


def _row(r: dict) -> str:
    return (f"| {r['method']} | {r['concurrency']} | {r['completed']}/{r['requests']} | {r['errors']} | "
            f"{r['mismatches']} | {r['requests_per_second']:.2f} | {r['tokens_per_second']:.0f} | "
            f"{r['latency_p50_ms']:.0f} | {r['latency_p99_ms']:.0f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p99_ms']:.0f} | {r['server_mean_batch']:.1f} |")


HEADER = ("| method | clients | completed | errors | mismatches | req/s | tokens/s | p50 latency ms | "
          "p99 latency ms | p50 TTFT ms | p99 TTFT ms | mean batch |\n|" + "---|" * 12)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    parser.add_argument("--concurrency", default="1,8,32,64", help="client counts, comma-separated (each <= 64)")
    parser.add_argument("--methods", default="jacobi,ar", help="greedy decoders, comma-separated: jacobi, ar, or "
                        "server (no method field: the server's own decoding, for another OpenAI server such as vLLM's)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    parser.add_argument("--min-requests", type=int, default=16, help="requests per level at least")
    parser.add_argument("--time-limit", type=float, default=900, help="stop sending after this many seconds")
    parser.add_argument("--request-timeout", type=float, default=300)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        parser.error(f"--url must point at a loopback address, not {host!r}")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error("--concurrency takes integers, e.g. 1,8,32,64")
    args.methods = [m for m in args.methods.split(",") if m]
    if not all(1 <= c <= 64 for c in args.concurrency) or not set(args.methods) <= {"jacobi", "ar", "server"}:
        parser.error("--concurrency values must be in 1..64 and --methods among jacobi, ar, server")
    if not 1 <= args.rounds <= 20 or not 1 <= args.min_requests <= 500:
        parser.error("--rounds must be in 1..20 and --min-requests in 1..500")
    print(HEADER, file=sys.stderr)
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    bad = sum(r["errors"] + r["mismatches"] for r in result["levels"])
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
