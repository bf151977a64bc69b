"""A bounded load on a running `cllm serve` (loopback only): requests/s, tokens/s, errors, latency.

    python scripts/load_test.py --url http://127.0.0.1:8000 --requests 200 --concurrency 8 \\
        --max-tokens 64 --method jacobi

Sends `--requests` greedy completions (prompts cycled from a fixed list of code openings) from
`--concurrency` threads, and stops by itself: after the last request or after `--time-limit`
seconds, whichever comes first. Only loopback addresses are accepted. Reads the server's own
counters (/metrics) before and after, so that decode-side tokens/s and tokens per forward are
reported next to what the client saw.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
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


def run(args: argparse.Namespace) -> dict:
    client = httpx.Client(base_url=args.url, timeout=args.request_timeout)
    before = client.get("/metrics").json()
    deadline = time.monotonic() + args.time_limit
    lock = threading.Lock()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    tokens = forwards = skipped = 0

    def one(i: int) -> None:
        nonlocal tokens, forwards, skipped
        if time.monotonic() > deadline:
            with lock:
                skipped += 1
            return
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.max_tokens, "method": args.method}
        start = time.perf_counter()
        try:
            response = client.post("/v1/completions", json=body)
            ok = response.status_code == 200
            usage = response.json().get("usage", {}) if ok else {}
            kind = None if ok else f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            ok, usage, kind = False, {}, type(exc).__name__
        elapsed = time.perf_counter() - start
        with lock:
            if ok:
                latencies.append(elapsed)
                tokens += usage.get("completion_tokens", 0)
                forwards += usage.get("forward_passes", 0)
            else:
                errors[kind] = errors.get(kind, 0) + 1

    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(one, range(args.requests)))
    wall = time.perf_counter() - start
    after = client.get("/metrics").json()
    server = _server_delta(before, after, args.method)
    done = len(latencies)
    return {
        "url": args.url, "method": args.method, "requests": args.requests, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "completed": done, "errors": sum(errors.values()),
        "errors_by_kind": errors, "not_sent_time_limit": skipped, "wall_seconds": round(wall, 3),
        "requests_per_second": done / wall, "tokens_per_second": tokens / wall,
        "completion_tokens": tokens, "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "latency_p50_ms": 1000 * percentile(latencies, 50), "latency_p99_ms": 1000 * percentile(latencies, 99),
        "latency_mean_ms": 1000 * statistics.fmean(latencies) if latencies else float("nan"),
        "server_decode_tokens_per_second": server,
    }


def _server_delta(before: dict, after: dict, method: str) -> float:
    """Decode-side tokens/s over this run, from the server's counters."""
    b, a = before.get("methods", {}).get(method, {}), after.get("methods", {}).get(method, {})
    seconds = a.get("decode_seconds", 0) - b.get("decode_seconds", 0)
    return (a.get("completion_tokens", 0) - b.get("completion_tokens", 0)) / seconds if seconds > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    parser.add_argument("--requests", type=int, default=200, help="how many requests (at most 2000)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight (at most 64)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--method", choices=["jacobi", "ar"], default="jacobi")
    parser.add_argument("--time-limit", type=float, default=300, help="stop sending after this many seconds")
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    host = urlparse(args.url).hostname
    if host not in LOOPBACK:
        parser.error(f"--url must point at a loopback address, not {host!r}")
    if not 1 <= args.requests <= 2000 or not 1 <= args.concurrency <= 64:
        parser.error("--requests must be in 1..2000 and --concurrency in 1..64")
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
