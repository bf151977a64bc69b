"""A memory soak of `cllm serve` (loopback only): the server's resident memory over a long mixed
load, and greedy texts served under that load checked against the same requests served alone.

    python scripts/soak.py --model stdlib-coder --threads 2 --minutes 10 --clients 32 \\
        --sample 30 --replay 100 --json soak.json

It starts `cllm serve` on --host (loopback) and --port (0: a free one). --clients clients send
requests back to back for --minutes: greedy and sampled (temperature, top_p, top_k, seed), jacobi
and ar, /v1/completions (a text or token-id prompt) and /v1/chat/completions, streamed or not,
max_tokens 1-256, stop strings, prompts from a few tokens to near the context (windows of the
standard library's source); some close a stream after a few chunks or give up a plain request
early. The server's VmRSS is read every --sample seconds and once the load has drained. Then
--replay greedy requests drawn among those completed are sent again, one at a time: each text
must equal the one served under load. Prints the RSS table and the totals; exits non-zero on any
HTTP error, client exception (an intended disconnect is none) or greedy mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from cllm.core.machine import machine_info
from cllm.models import load_tokenizer, model_config, resolve_model_path

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
STOPS = ["\n\n", "return", "def ", ":\n", "#", "\nclass", ")"]
MAX_TOKENS = [1, 8, 16, 32, 64, 96, 128, 200, 256]
GIVE_UP = 0.3  # seconds an impatient plain request waits before it hangs up
START_TIMEOUT = 300  # seconds the server may take to load its model
DRAIN = 3  # seconds between the last answer and the drained RSS reading


class Requests:
    """Random mixed requests for one model: (path, body, drop), where drop is None (read the
    whole answer), a chunk count (close the stream after it) or seconds (give up a plain one)."""

    def __init__(self, model: str):
        path = resolve_model_path(model)
        self.tokenizer = load_tokenizer(path)
        self.context = model_config(path).max_position_embeddings
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        self.texts = [t for t in (p.read_text("utf-8", "replace") for p in sorted(stdlib.glob("*.py"))[:200])
                      if len(t) > 4000]

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]  # as the server encodes a text prompt

    def __call__(self, rng: random.Random) -> tuple[str, dict, float | None]:
        c = self.context
        tier = rng.random()  # 15% near the context, 35% middling, half short
        n = rng.randint(int(0.75 * c), int(0.94 * c)) if tier < 0.15 else \
            rng.randint(int(0.12 * c), int(0.6 * c)) if tier < 0.5 else rng.randint(4, int(0.12 * c))
        text = rng.choice(self.texts)
        start = rng.randrange(len(text) - 3000)
        ids = self.ids(text[start:start + 20 * n])[:n]
        body = {"max_tokens": min(c - len(ids), rng.choice(MAX_TOKENS)), "method": rng.choice(["jacobi", "ar"]),
                "stream": rng.random() < 0.5, "temperature": 0}
        if rng.random() < 0.5:
            body["temperature"] = round(rng.uniform(0.2, 1.3), 2)
            body["seed"] = rng.randrange(2**63)
            if rng.random() < 0.5:
                body["top_p"] = rng.choice([0.5, 0.9, 0.95, 0.99])
            if rng.random() < 0.4:
                body["top_k"] = rng.choice([5, 20, 40, 100])
        if rng.random() < 0.3:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 3))
        if body["stream"] and rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        prompt = self.tokenizer.decode(ids, skip_special_tokens=True)
        if rng.random() < 0.3 and len(ids) < 0.6 * c:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": prompt if prompt.strip() else "def f(x):\n"}]
            # the message's text may encode longer than its window (and a template adds tokens)
            body["max_completion_tokens"] = max(1, min(body.pop("max_tokens"), c - 2 * len(ids) - 8))
        else:
            path = "/v1/completions"
            as_text = rng.random() < 0.5 and prompt and len(self.ids(prompt)) + body["max_tokens"] <= c
            body["prompt"] = prompt if as_text else ids
        drop = None
        if body["stream"] and rng.random() < 0.1:
            drop = rng.randint(1, 5)
        elif not body["stream"] and rng.random() < 0.05:
            drop = GIVE_UP
        return path, body, drop


async def send(client: httpx.AsyncClient, path: str, body: dict, drop: float | None) -> dict:
    """One request: {"text": ...}, {"dropped": True} or {"error": ...}."""
    if body["stream"]:
        chunks, text = 0, []
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": f"in the stream: {str(event['error'])[:200]}"}
                for choice in event.get("choices", []):
                    piece = choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")
                    if piece:
                        text.append(piece)
                        chunks += 1
                if drop is not None and chunks >= drop:
                    return {"dropped": True}  # leaving the block closes the connection mid-stream
        return {"text": "".join(text)}
    try:
        response = await client.post(path, json=body, timeout=drop or httpx.USE_CLIENT_DEFAULT)
    except httpx.TimeoutException:
        if drop is None:
            raise
        return {"dropped": True}
    if response.status_code != 200:
        return {"error": f"HTTP {response.status_code}: {response.text[:200]}"}
    choice = response.json()["choices"][0]
    return {"text": choice["text"] if "text" in choice else choice["message"]["content"]}


@dataclass
class Tally:
    """What the clients saw, with the first few failures whole."""

    requests: int = 0
    completed: int = 0
    disconnects: int = 0
    errors: int = 0  # HTTP errors, and error events in a stream
    exceptions: int = 0  # on the client's side: broken connections, timeouts, bad JSON
    failures: list[dict] = field(default_factory=list)


def brief(body: dict) -> dict:
    """A request without its prompt: enough to tell what kind it was."""
    return {k: v for k, v in body.items() if k not in ("prompt", "messages")}


async def client_loop(i: int, args, make: Requests, deadline: float, tally: Tally, greedy: list) -> None:
    rng = random.Random(f"{args.seed}/{i}")
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout) as client:
        while time.monotonic() < deadline:
            path, body, drop = make(rng)
            try:
                result = await send(client, path, body, drop)
            except Exception as exc:  # counted, and the run fails
                result = {"exception": repr(exc)[:200]}
            tally.requests += 1
            if "text" in result:
                tally.completed += 1
                if body["temperature"] == 0 and len(greedy) < 5000:
                    greedy.append((path, body, result["text"]))
            elif "dropped" in result:
                tally.disconnects += 1
            else:
                tally.errors += "error" in result
                tally.exceptions += "exception" in result
                tally.failures += [{**result, **brief(body)}] if len(tally.failures) < 20 else []


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return round(kib / 1024, 1)


async def sampler(pid: int, start: float, deadline: float, every: float, tally: Tally, rows: list) -> None:
    while True:
        now = time.monotonic()
        rows.append({"t": round(now - start), "rss_mib": rss_mib(pid), "requests": tally.requests})
        print(f"soak: {rows[-1]} {tally.errors} errors, {tally.exceptions} exceptions", file=sys.stderr, flush=True)
        if now >= deadline:
            return
        await asyncio.sleep(min(every, deadline - now))


async def replay(args, greedy: list) -> tuple[int, list[dict]]:
    """Greedy requests served under load, again one at a time: their texts must not change."""
    chosen = random.Random(args.seed).sample(greedy, min(args.replay, len(greedy)))
    mismatches = []
    async with httpx.AsyncClient(base_url=args.url, timeout=args.request_timeout) as client:
        for path, body, text in chosen:
            alone = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
            result = await send(client, path, alone, None)
            if result.get("text") != text:
                mismatches.append({**brief(alone), "under_load": text[:200], "alone": str(result)[:200]})
    return len(chosen), mismatches


async def soak(args, server: subprocess.Popen, make: Requests) -> dict:
    tally, greedy, rows = Tally(), [], []
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    await asyncio.gather(sampler(server.pid, start, deadline, args.sample, tally, rows),
                         *(client_loop(i, args, make, deadline, tally, greedy) for i in range(args.clients)))
    await asyncio.sleep(DRAIN)
    drained = {"t": round(time.monotonic() - start), "rss_mib": rss_mib(server.pid), "requests": tally.requests}
    async with httpx.AsyncClient(base_url=args.url) as client:
        metrics = (await client.get("/metrics.json")).json()
    replayed, mismatches = await replay(args, greedy)
    totals = {k: v for k, v in asdict(tally).items() if k != "failures"}
    return {"rss": rows, "drained": drained, "totals": {**totals, "greedy_recorded": len(greedy),
            "greedy_replayed": replayed, "mismatches": len(mismatches)}, "failures": tally.failures,
            "mismatch_samples": mismatches[:10], "server_metrics": metrics}


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until_up(url: str, server: subprocess.Popen, log) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while server.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet, or still loading the model
        time.sleep(0.5)
    log.seek(0)
    raise SystemExit(f"soak: the server did not come up (exit code {server.poll()}):\n{log.read()[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="stdlib-coder", help="model dir or shipped name, for `cllm serve`")
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--host", default="127.0.0.1", help="the server's address (loopback only)")
    parser.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    parser.add_argument("--minutes", type=float, default=10, help="how long the clients send requests")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (<= 64)")
    parser.add_argument("--sample", type=float, default=30, help="seconds between RSS readings")
    parser.add_argument("--replay", type=int, default=100, help="greedy requests replayed alone at the end")
    parser.add_argument("--seed", type=int, default=0, help="seeds the clients' requests and the replay's draw")
    parser.add_argument("--request-timeout", type=float, default=300, help="seconds a request may take")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.host not in LOOPBACK:
        parser.error(f"--host must be a loopback address, not {args.host!r}")
    if not 1 <= args.clients <= 64 or not 0 < args.minutes <= 240 or not 0 < args.sample <= 3600:
        parser.error("--clients must be in 1..64, --minutes in (0, 240] and --sample in (0, 3600]")
    if not 0 <= args.replay <= 1000 or not 0 <= args.port < 65536 or args.request_timeout <= 0:
        parser.error("--replay must be in 0..1000, --port in 0..65535 and --request-timeout positive")
    machine = machine_info()  # its load average, before the server starts
    machine.pop("threads")  # this process's, not the server's (--threads)
    make = Requests(args.model)
    port = args.port or free_port(args.host)
    args.url = f"http://{'[::1]' if args.host == '::1' else args.host}:{port}"
    command = [sys.executable, "-m", "cllm.cli", "serve", "--model", args.model, "--host", args.host,
               "--port", str(port), "--threads", str(args.threads), "--log-level", "warning"]
    log = tempfile.TemporaryFile("w+")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(args.url, server, log)
        result = asyncio.run(soak(args, server, make))
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    result = {"command": ["python", *sys.argv], "server": command[1:], "model": args.model,
              "clients": args.clients, "minutes": args.minutes, "machine": machine, **result}
    print("| t (s) | RSS (MiB) | requests |\n|---|---|---|")
    for row in [*result["rss"], {**result["drained"], "t": f"{result['drained']['t']} (drained)"}]:
        print(f"| {row['t']} | {row['rss_mib']} | {row['requests']} |")
    print(json.dumps(result["totals"]))
    for sample in result["failures"][:5] + result["mismatch_samples"][:5]:
        print(json.dumps(sample), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    totals = result["totals"]
    return 0 if totals["errors"] + totals["exceptions"] + totals["mismatches"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
