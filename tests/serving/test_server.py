"""`cllm serve` as a real process on a loopback port, driven by the official `openai` client and
by raw HTTP: greedy completions (Jacobi and AR, streamed or not) equal `greedy_decode`, 32
concurrent requests are batched and all come back right, bad requests get a 4xx with an
OpenAI-style message and the server keeps serving; an oversized body is a 413 and a slow one a
408 while /health keeps answering. In-process (`create_app`, under TestClient or uvicorn in a
thread): the API key, the Host check, 500s that say nothing, and an abandoned non-streamed
request that stops decoding.
"""

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from fastapi.testclient import TestClient

from cllm.cli import main
from cllm.models import load_draft_table, load_model
from cllm.serving.app import create_app
from cllm.serving.completion import DecodeParams, TextCodec, complete
from cllm.serving.config import ServeConfig, exposure_warning
from tests.commands.test_generate import CHAT_TEMPLATE, PROMPTS, Oracle, save_tiny_model
from tests.serving.test_scheduler import Gate

NEW, BLOCK, NAME = 24, 8, "tiny"
LIMITS = {"max_tokens_limit": 64, "max_prompt_tokens": 48, "max_body_bytes": 65536, "read_timeout": 2}
WAIT = 60  # seconds: a bound against hangs, never a speed requirement
LOCAL = "http://127.0.0.1"  # a Host the server accepts by default (TestClient's own is "testserver")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The served model, with a draft table of its own (`serve --draft-table auto` loads it, so
    every test below checks greedy outputs with the table in use)."""
    directory = save_tiny_model(tmp_path_factory.mktemp("serve") / "model", chat_template=CHAT_TEMPLATE)
    prompts = directory.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n" for i, t in enumerate(PROMPTS)))
    assert main(["drafts", "--model", str(directory), "--prompts", str(prompts), "--max-new-tokens", "32",
                 "--min-count", "1", "--min-share", "0.1"]) == 0
    assert load_draft_table(directory) is not None
    return directory


@pytest.fixture(scope="module")
def oracle(model_dir):
    return Oracle(model_dir)


SERVER_LOGS: dict = {}  # the server fixture's URL -> its log file


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`python -m cllm.cli serve` on a free loopback port; yields its base URL."""
    log = open(tmp_path_factory.mktemp("serve-log") / "server.log", "w+")
    port = free_port()
    cmd = [sys.executable, "-m", "cllm.cli", "serve", "--model", str(model_dir), "--port", str(port), "--compile",
           "--served-model-name", NAME, "--block-size", str(BLOCK), "--threads", "1",
           "--log-level", "warning", "--max-tokens-limit", str(LIMITS["max_tokens_limit"]),
           "--max-prompt-tokens", str(LIMITS["max_prompt_tokens"]),
           "--max-body-bytes", str(LIMITS["max_body_bytes"]), "--read-timeout", str(LIMITS["read_timeout"])]
    proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    SERVER_LOGS[url] = log
    try:
        wait_until_up(url, proc, log, seconds=300)  # it builds its compiled forward first
        yield url
    finally:
        stop_server(proc, log)


def test_the_server_compiles_its_runner_forward_when_asked_and_says_so(server):
    """Every test here then decodes on them: the outputs against the oracle are theirs."""
    log = SERVER_LOGS[server]
    log.seek(0)
    said = log.read()
    assert "cllm serve: forward: lean (llama, float32; compiled forward up to 24 fed tokens" in said
    assert f"cllm serve: --compile: the compiled forward is loaded from {ENV['CLLM_COMPILE_CACHE']}" in said


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path, body, content_type="application/json", **kwargs):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server}{path}", content=content, timeout=60,
                      headers={"Content-Type": content_type}, **kwargs)


def sse_events(server, path, body) -> list:
    """The `data:` payloads of an SSE response, JSON-decoded except the final `[DONE]`."""
    with httpx.stream("POST", f"{server}{path}", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    payloads = [line[len("data: "):] for line in lines]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def finish_reason(oracle, ids: list[int], max_new_tokens: int = NEW) -> str:
    """What a greedy completion must report: "stop" when it ends with EOS, else "length"."""
    tokens = oracle.tokens(ids, max_new_tokens)
    return "stop" if tokens and tokens[-1] in oracle.stop else "length"


def assert_ok_afterwards(server, oracle):
    """The server still answers correctly (after an error)."""
    r = post(server, "/v1/completions", {"model": NAME, "prompt": "import re", "max_tokens": NEW})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle.text("import re")


def test_openai_client_completions_equal_greedy_decode(client, oracle):
    for prompt in PROMPTS:
        response = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW, temperature=0)
        choice = response.choices[0]
        assert choice.text == oracle.text(prompt)
        assert choice.finish_reason == finish_reason(oracle, oracle.ids(prompt))
        tokens = oracle.tokens(oracle.ids(prompt))
        assert response.usage.completion_tokens == len(tokens)
        assert response.usage.prompt_tokens == len(oracle.ids(prompt))
        assert 1 <= response.usage.forward_passes <= len(tokens)  # extra field kept by the client


def test_openai_client_streamed_completion_equals_greedy_decode(client, oracle):
    stream = client.completions.create(model=NAME, prompt="class A:", max_tokens=NEW, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == oracle.text("class A:")
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == finish_reason(oracle, oracle.ids("class A:"))
    assert set(reasons[:-1]) <= {None}
    assert chunks[-1].usage.completion_tokens == len(oracle.tokens(oracle.ids("class A:")))


def test_openai_client_chat_streamed_and_not_equals_greedy_decode_of_the_template(client, oracle):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f(x):"}]
    expected = oracle.text(oracle.chat_ids(messages))
    response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW)
    assert response.choices[0].message.content == expected
    assert response.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=NEW, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == finish_reason(oracle, oracle.chat_ids(messages))
    assert response.choices[0].finish_reason == finish_reason(oracle, oracle.chat_ids(messages))


def test_raw_http_sse_is_openai_chunks_ending_with_done(server, oracle):
    events = sse_events(server, "/v1/completions",
                        {"model": NAME, "prompt": "for k in d:\n", "max_tokens": NEW, "stream": True})
    assert all(e["object"] == "text_completion" and len(e["choices"]) == 1 for e in events)
    assert len({e["id"] for e in events}) == 1
    assert "".join(e["choices"][0]["text"] for e in events) == oracle.text("for k in d:\n")
    assert [e["choices"][0]["finish_reason"] for e in events][:-1] == [None] * (len(events) - 1)
    last = events[-1]["choices"][0]["finish_reason"]
    assert last == finish_reason(oracle, oracle.ids("for k in d:\n"))
    assert events[-1]["cllm"]["method"] == "jacobi" and events[-1]["cllm"]["block_size"] == BLOCK

    chat = sse_events(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": NEW, "stream": True})
    assert all(e["object"] == "chat.completion.chunk" for e in chat)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in chat) == \
        oracle.text(oracle.chat_ids([{"role": "user", "content": "hi"}]))


def test_raw_http_ar_and_jacobi_methods_agree_and_report_forward_passes(server, oracle):
    bodies = {m: post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": NEW, "method": m}).json()
              for m in ("ar", "jacobi")}
    assert bodies["ar"]["choices"][0]["text"] == bodies["jacobi"]["choices"][0]["text"] == oracle.text("def f(x):")
    ar, jacobi = bodies["ar"]["usage"], bodies["jacobi"]["usage"]
    assert ar["forward_passes"] == ar["completion_tokens"]  # AR: one token per forward
    assert jacobi["forward_passes"] <= ar["forward_passes"]
    assert bodies["jacobi"]["cllm"]["forward_passes"] == jacobi["forward_passes"]


def test_32_concurrent_requests_all_return_greedy_outputs(server, client, oracle):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS) % 3) for i in range(32)]
    expected = {p: oracle.text(p, max_new_tokens=16) for p in set(prompts)}

    def one(i: int) -> str:
        p = prompts[i]
        if i % 4 == 0:  # streamed
            stream = client.completions.create(model=NAME, prompt=p, max_tokens=16, stream=True)
            return "".join(c.choices[0].text for c in stream)
        method = "ar" if i % 4 == 1 else "jacobi"
        return post(server, "/v1/completions", {"prompt": p, "max_tokens": 16,
                                                "method": method}).json()["choices"][0]["text"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [expected[p] for p in prompts]
    batching = httpx.get(f"{server}/metrics.json").json()["batching"]
    assert batching["max_batch"] > 1 and batching["mean_batch"] > 1  # they were decoded together


@pytest.mark.parametrize(
    "path, body, status, words",
    [
        ("/v1/completions", '{"prompt": "x", "max_tokens": ', 400, "not valid JSON"),
        ("/v1/completions", "[1, 2]", 400, "JSON object"),
        ("/v1/completions", {"model": NAME, "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"model": NAME, "prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/chat/completions", {"model": NAME}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
        ("/v1/completions", {"prompt": "x", "max_tokens": LIMITS["max_tokens_limit"] + 1}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, 400,
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x = 1\n" * 60}, 400, "at most"),
        ("/v1/completions", {"prompt": [5, 10**6]}, 400, "token ids"),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 17}, 400, "'n' must be between 1 and 16"),
        ("/v1/completions", {"prompt": "x", "n": True}, 400, "'n' must be an integer"),
        ("/v1/completions", {"prompt": "x", "n": 1.0}, 400, "'n' must be an integer"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3}, 400, "'best_of' = 3 is not supported"),
        ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "'logprobs' must be an integer"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "'logprobs' must be between 0 and 20"),
        ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, 400, "not 'top_logprobs'"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": "yes"}, 400,
         "'logprobs' must be a boolean"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "needs 'logprobs': true"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, 400, "'presence_penalty'"),
        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, 400,
         "'stream_options'"),
        ("/v1/nowhere", {"prompt": "x"}, 404, "Not Found"),
        ("/v1/completions", {"model": [NAME], "prompt": "x"}, 400, "'model' must be a string"),
        ("/v1/chat/completions", {"model": {"id": NAME}, "messages": []}, 400, "'model' must be a string"),
        ("/v1/completions", '{"prompt": "def f(x):\\ud800"}', 400, "lone surrogate"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}], "stream": true}', 400,
         "lone surrogate"),
        ("/v1/completions", {"prompt": "x" * 100_000}, 413, "Content Too Large"),
        ("/v1/completions", {"prompt": [5] * 49}, 400, "at most 48"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "'stream'"),
        ("/v1/completions", '{"prompt": ' + "[" * 20_000 + "]" * 20_000 + "}", 400, "nests too deeply"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 1' + "0" * 5_000 + "}", 400, "cannot be used"),
        ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, "NaN is not JSON"),
        ("/v1/completions", '{"prompt": "x",}', 400, "not valid JSON"),
    ],
)
def test_bad_request_gets_a_4xx_with_a_message_and_the_server_keeps_serving(server, oracle, path, body, status, words):
    r = post(server, path, body)
    assert r.status_code == status
    if status == 413 and not r.headers["content-type"].startswith("application/json"):
        assert words in r.text  # Starlette's own answer to a declared length over the limit
    else:
        error = r.json()["error"]
        assert words in error["message"] and error["type"]
    assert_ok_afterwards(server, oracle)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
def test_a_body_not_sent_as_application_json_is_a_415(server, oracle, content_type):
    """A web page can make a browser send text/plain cross-origin without asking first."""
    r = post(server, "/v1/completions", {"prompt": "import re", "max_tokens": 4}, content_type=content_type)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert post(server, "/v1/completions", {"prompt": "import re", "max_tokens": 4},
                content_type="application/json; charset=utf-8").status_code == 200


def test_stream_null_and_empty_chat_content_are_served(server, oracle):
    r = post(server, "/v1/completions", {"prompt": "import re", "max_tokens": NEW, "stream": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle.text("import re")
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    events = sse_events(server, "/v1/chat/completions", {"messages": messages, "max_tokens": NEW, "stream": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        oracle.text(oracle.chat_ids(messages))
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def _raw(server) -> socket.socket:
    host, port = server.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=WAIT)


def _response(sock: socket.socket) -> bytes:
    """One whole HTTP response (head and a Content-Length body), however the packets fall."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _head(length: int | None) -> bytes:
    size = f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{size}\r\n\r\n").encode()


def test_an_oversized_body_is_a_413_before_it_is_read_while_health_answers(server, oracle):
    with _raw(server) as declared, _raw(server) as chunked:
        declared.sendall(_head(100_000_000) + b'{"prompt": "' + b"x" * 4096)  # 100 MB announced, 4 KB sent
        chunk = b"y" * 20_000
        chunked.sendall(_head(None) + b"".join(b"%x\r\n%b\r\n" % (len(chunk), chunk) for _ in range(4)))
        assert httpx.get(f"{server}/health", timeout=WAIT).json()["status"] == "ok"
        assert _response(declared).startswith(b"HTTP/1.1 413")
        assert _response(chunked).startswith(b"HTTP/1.1 413")
    assert_ok_afterwards(server, oracle)


def test_a_body_that_stops_arriving_is_a_408_after_the_read_timeout(server, oracle):
    with _raw(server) as slow:
        slow.sendall(_head(100) + b'{"prompt": ')  # 11 of 100 bytes, then nothing
        assert httpx.get(f"{server}/health", timeout=WAIT).json()["status"] == "ok"
        response = _response(slow)
    assert response.startswith(b"HTTP/1.1 408") and b"did not arrive within 2 s" in response
    assert_ok_afterwards(server, oracle)


def test_openai_client_raises_on_bad_requests_with_the_servers_message(client, server, oracle):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=NAME, prompt="x", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="at most 48"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "y = 2\n" * 60}])
    assert_ok_afterwards(server, oracle)


def test_sampling_follows_the_seed_the_temperature_and_top_p(client, oracle, model_dir):
    """The same seed gives the same text and another seed another; the text is what `complete`
    samples in-process with the same settings (so temperature, top_p and seed reach the
    decoder), and not the greedy text."""
    def sample(seed: int) -> str:
        response = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=NEW,
                                             temperature=0.9, top_p=0.95, seed=seed)
        return response.choices[0].text

    first, again, other = sample(11), sample(11), sample(12)
    assert first == again != other
    engine = ServeConfig(model=str(model_dir))  # the server runs with the default engine settings
    params = DecodeParams(engine=dataclasses.replace(engine.jacobi, block_size=BLOCK), max_new_tokens=NEW,
                          temperature=0.9, top_p=0.95, seed=11)
    expected = complete(oracle.model, TextCodec(oracle.tokenizer), oracle.ids("def f(x):"), params,
                        draft_table=load_draft_table(model_dir))
    assert first == expected.text != oracle.text("def f(x):")


def test_seeds_are_used_whole_sixty_four_bits(client):
    """torch's CPU generator keeps the low 32 bits of a seed: 0, 2^32 and -2^63 drew one stream."""
    def sample(seed: int) -> str:
        return client.completions.create(model=NAME, prompt="def f(x):", max_tokens=NEW, temperature=1.0,
                                         seed=seed).choices[0].text

    texts = [sample(seed) for seed in (0, 2**32, -(2**63), 2**63 - 1)]
    assert len(set(texts)) == len(texts) and sample(2**32) == texts[1]


def test_a_refused_request_is_one_line_in_the_servers_log(model_dir, tmp_path):
    """At the default --log-level (info): a 400 and a 401 are one line each, with no traceback."""
    port, log = free_port(), open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "cllm.cli", "serve", "--model", str(model_dir), "--port", str(port),
                             "--threads", "1", "--api-key", "k"], env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(url, proc, log)
        assert post(url, "/v1/completions", {"prompt": "x"}).status_code == 401
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "x", "n": True}, timeout=WAIT,
                          headers={"Authorization": "Bearer k"}).status_code == 400
    finally:
        stop_server(proc, log)
    said = (tmp_path / "server.log").read_text()
    assert said.count("POST /v1/completions -> 401: invalid or missing API key") == 1, said
    assert said.count("POST /v1/completions -> 400: 'n' must be an integer") == 1, said
    assert "Traceback" not in said


def test_stop_string_cuts_the_completion(client, oracle):
    full = oracle.text("def f(x):")
    stop = next(full[i : i + 2] for i in range(4, len(full))
                if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    response = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=NEW, stop=[stop])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_models_health_and_metrics_by_method(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    post(server, "/v1/completions", {"prompt": "x", "max_tokens": -1})
    for extra in ({"method": "jacobi"}, {"method": "ar"}, {"temperature": 0.5}):
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, **extra}).status_code == 200
    metrics = httpx.get(f"{server}/metrics.json").json()
    assert metrics["requests"] >= 4 and metrics["errors_by_status"]["400"] >= 1
    jacobi = metrics["methods"]["jacobi"]
    assert jacobi["completion_tokens"] > 0 and jacobi["tokens_per_second"] > 0
    assert jacobi["tokens_per_forward"] >= 1.0 and metrics["methods"]["ar"]["tokens_per_forward"] == 1.0
    assert "jacobi_sample" in metrics["methods"]


def test_create_app_serves_in_process_and_fits_max_tokens_to_the_context(model_dir, oracle):
    from fastapi.testclient import TestClient

    settings = ServeConfig(model=str(model_dir), served_model_name=NAME, max_prompt_tokens=120, max_tokens_limit=64)
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings), base_url=LOCAL) as http:
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "import re", "max_tokens": NEW})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle.text("import re")
        assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400
        long_prompt = list(range(1, 101))  # 100 tokens of a 128-position model
        r = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/v1/completions", json={"prompt": long_prompt})  # no max_tokens: what fits
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 28


def test_stream_interval_sends_fewer_chunks_of_the_same_text(model_dir, oracle):
    """--stream-interval 0: a chunk per decoding step; an interval longer than the decode: the
    first text at once, the rest in one chunk before the finish."""
    from fastapi.testclient import TestClient

    body = {"model": NAME, "prompt": "def f(x):", "max_tokens": NEW, "stream": True}
    texts = {}
    for interval in (0, 3600):
        with TestClient(create_app(oracle.model, oracle.tokenizer, _settings(model_dir, stream_interval=interval)),
                        base_url=LOCAL) as http, http.stream("POST", "/v1/completions", json=body) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        chunks = [json.loads(line[len("data: "):])["choices"][0] for line in lines]
        assert chunks[-1]["finish_reason"] == finish_reason(oracle, oracle.ids("def f(x):"))
        texts[interval] = [c["text"] for c in chunks if c["text"]]
        assert "".join(texts[interval]) == oracle.text("def f(x):"), interval
    assert len(texts[0]) > 2 and len(texts[3600]) == 2


# ----------------------------------------------------------------------------------------------
# In-process: create_app under TestClient, or under uvicorn in a thread


def _settings(model_dir, **kwargs) -> ServeConfig:
    return ServeConfig(model=str(model_dir), served_model_name=NAME, **kwargs)


def stop_server(proc: subprocess.Popen, log, seconds: float = 15) -> None:
    """Stop a server subprocess (killed when it has not exited after `seconds`) and close its log."""
    proc.terminate()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def wait_until_up(url: str, proc: subprocess.Popen, log, seconds: float = 90) -> None:
    """Poll a server subprocess's /health until it answers (`seconds` at most); on failure,
    the test fails with the server's log."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log.seek(0)
            pytest.fail(f"server did not start:\n{log.read()}")
        time.sleep(0.2)


@contextmanager
def live(app, **uvicorn_settings):
    """`app` served by uvicorn on a free loopback port, in a thread, told when the server exits
    as `serve_app` tells it; yields (base URL, server, thread)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                           **uvicorn_settings))
    app.state.exiting = lambda: server.should_exit
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}", server, thread
    finally:
        server.should_exit = True
        thread.join(WAIT)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_the_api_key_is_enforced_on_every_v1_route_and_only_there(model_dir, oracle, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("CLLM_API_KEY", "s3cret")
    settings = _settings(model_dir, api_key="s3cret" if how == "flag" else None)
    body = {"prompt": "import re", "max_tokens": 8}
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings), base_url=LOCAL) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            r = http.post("/v1/completions", json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/chat/completions", json={"messages": []}).status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        r = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle.text("import re", max_new_tokens=8)


def test_the_openai_client_sends_its_api_key(model_dir, oracle):
    with live(create_app(oracle.model, oracle.tokenizer, _settings(model_dir, api_key="k-1"))) as (url, _, _):
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="k-1", max_retries=0, timeout=WAIT)
        assert good.completions.create(model=NAME, prompt="class A:", max_tokens=NEW).choices[0].text == \
            oracle.text("class A:")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="k-2", max_retries=0).models.list()


def test_only_binding_beyond_loopback_without_a_key_warns():
    assert exposure_warning("0.0.0.0", 8000, keyed=False) and "API key" in exposure_warning("0.0.0.0", 1, False)
    assert exposure_warning("192.168.1.5", 8000, keyed=False)
    assert exposure_warning("0.0.0.0", 8000, keyed=True) is None
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert exposure_warning(host, 8000, keyed=False) is None


def test_allowed_hosts_refuse_another_host_header(model_dir, oracle):
    settings = _settings(model_dir, allowed_hosts=["127.0.0.1", "localhost"])
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings)) as http:  # Host: testserver
        assert http.get("/health").status_code == 400
        assert http.get("/health", headers={"Host": "localhost:8000"}).status_code == 200
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"Host": "evil.example"})
        assert r.status_code == 400


def test_a_500_says_nothing_of_the_failure_and_the_server_goes_on(model_dir, oracle, monkeypatch, caplog):
    app = create_app(oracle.model, oracle.tokenizer, _settings(model_dir))
    with TestClient(app, raise_server_exceptions=False, base_url=LOCAL) as http:
        def broken(messages):
            raise RuntimeError("secret detail at /home/me/.cache/model")

        monkeypatch.setattr(app.state.service.codec, "chat_ids", broken)
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["error"]["message"] == "internal server error"
        assert "secret" not in r.text and "secret detail" in caplog.text  # logged, not sent
        r = http.post("/v1/completions", json={"prompt": "import re", "max_tokens": NEW})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle.text("import re")


def test_chat_whose_messages_encode_to_nothing_is_a_400(tmp_path):
    plain = save_tiny_model(tmp_path / "plain")  # no chat template: the messages' text concatenated
    oracle = Oracle(plain)
    with TestClient(create_app(oracle.model, oracle.tokenizer, _settings(plain)), base_url=LOCAL) as http:
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}], "stream": True})
        assert r.status_code == 400 and "no tokens" in r.json()["error"]["message"]


def test_an_abandoned_non_streamed_request_stops_decoding(model_dir, oracle):
    model = load_model(model_dir)  # its own copy: the gate holds its runtime
    gate = Gate(model, hold_at=4)  # the prefill and two steps pass, then the decode thread waits
    app = create_app(gate, oracle.tokenizer, _settings(model_dir, method="ar"))
    scheduler = app.state.service.scheduler
    with live(app) as (url, _, _):
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
            httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 100},
                       timeout=httpx.Timeout(WAIT, read=1.0))
        deadline = time.monotonic() + WAIT
        while not any(j.cancelled for g in list(scheduler._groups.values()) for j in list(g.jobs.values())):
            assert time.monotonic() < deadline, "the server never noticed the client leave"
            time.sleep(0.02)
        gate.opened.set()
        while scheduler.stats.cancelled == 0 or scheduler.running:  # the worker counts, then lets the row go
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert gate.count == 4 and scheduler.running == 0  # not one forward more (100 without it)
        assert httpx.get(f"{url}/health", timeout=WAIT).json()["running"] == 0


def test_shutdown_waits_for_running_requests_only_the_grace_period(model_dir, oracle):
    """The decode is held (the gate stays closed throughout): the server still stops, its
    request failed or cut, instead of waiting for the decode to end."""
    model = load_model(model_dir)
    gate = Gate(model, hold_at=3)
    app = create_app(gate, oracle.tokenizer, _settings(model_dir, method="ar"))
    outcome = {}

    def request(url):
        try:
            outcome["status"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 50},
                                           timeout=WAIT).status_code
        except httpx.HTTPError as exc:
            outcome["error"] = type(exc).__name__

    with live(app, timeout_graceful_shutdown=1) as (url, server, thread):
        client = threading.Thread(target=request, args=(url,))
        client.start()
        assert gate.reached.wait(WAIT)
        server.should_exit = True
        thread.join(WAIT)
        assert not thread.is_alive() and not gate.opened.is_set()
        client.join(WAIT)
    gate.opened.set()
    assert outcome.get("status", 0) >= 500 or "error" in outcome, outcome


def test_serve_on_a_taken_port_fails_at_once_in_one_line(model_dir, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["serve", "--model", str(model_dir), "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1


def test_the_listening_socket_is_tcp_so_streamed_chunks_go_out_at_once():
    """asyncio turns Nagle off (TCP_NODELAY) on accepted connections only for IPPROTO_TCP
    sockets; with proto 0, each streamed chunk waited ~40 ms for the client's delayed ACK."""
    from cllm.serving.app import bind

    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


def test_a_foreign_host_is_refused_by_default_on_loopback(model_dir, oracle):
    """A web page that rebinds its name to 127.0.0.1 sends its own name as Host: refused."""
    app = create_app(oracle.model, oracle.tokenizer, _settings(model_dir))
    with TestClient(app, base_url="http://attacker.example") as http:
        assert http.get("/health").status_code == 400
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 400
    for host in ("localhost:8000", "127.0.0.1", "127.0.0.1:9"):
        with TestClient(app, base_url=f"http://{host}") as http:
            assert http.get("/health").status_code == 200, host
    from cllm.serving.config import allowed_hosts

    assert allowed_hosts(_settings(model_dir, host="0.0.0.0")) == ["*"]
    assert allowed_hosts(_settings(model_dir, host="10.1.2.3")) == ["10.1.2.3"]
    assert allowed_hosts(_settings(model_dir, allowed_hosts=["*"])) == ["*"]


def test_head_works_where_get_does_and_there_is_no_docs_page_or_schema_unless_asked(model_dir, oracle):
    with TestClient(create_app(oracle.model, oracle.tokenizer, _settings(model_dir)), base_url=LOCAL) as http:
        assert http.head("/health").status_code == 200 and http.head("/metrics").status_code == 200
        assert http.head("/v1/models").status_code == 200
        assert http.get("/docs").status_code == 404 and http.get("/openapi.json").status_code == 404
    keyed = _settings(model_dir, openapi=True, api_key="k")
    with TestClient(create_app(oracle.model, oracle.tokenizer, keyed), base_url=LOCAL) as http:
        assert http.get("/openapi.json").status_code == 401
        schema = http.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()
        assert "/v1/completions" in schema["paths"] and http.get("/docs").status_code == 404


def test_a_temperature_too_small_to_divide_by_samples_greedys_text(server, oracle):
    """3e-38 overflowed softmax to NaN and failed every request in flight; the engine now shifts
    the logits before dividing, so a tiny temperature is a point mass on the argmax; below
    float32's smallest normal number (1e-46 rounds to 0 in float32) it decodes greedily."""
    bodies = [{"prompt": p, "max_tokens": NEW} for p in PROMPTS] + [
        {"prompt": "def f(x):", "max_tokens": NEW, "temperature": t, "seed": 1} for t in (3e-38, 1e-46, 1e-300, 5e-324)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(server, "/v1/completions", b), bodies))
    assert [a.status_code for a in answers] == [200] * len(bodies)
    for body, answer in zip(bodies, answers):
        assert answer.json()["choices"][0]["text"] == oracle.text(body["prompt"])
    assert httpx.get(f"{server}/health", timeout=WAIT).json()["running"] == 0


def test_slow_heads_are_closed_and_idle_connections_cannot_lock_out_health(model_dir, oracle):
    from cllm.serving.http import guarded_protocol

    app = create_app(oracle.model, oracle.tokenizer, _settings(model_dir))
    protocol = guarded_protocol(header_timeout=1.0, max_connections=8)
    with live(app, http=protocol) as (url, _, _):
        slow = [_raw(url) for _ in range(20)]  # more than the cap, each a head that never ends
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for _ in range(3):
            assert httpx.get(f"{url}/health", timeout=WAIT).status_code == 200
        time.sleep(1.5)
        for sock in slow:  # every slow head was closed: by the cap, or by the head deadline
            sock.settimeout(WAIT)
            try:
                assert sock.recv(1024) == b""
            except ConnectionResetError:  # closed with its unread head: a reset, closed all the same
                pass
            sock.close()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "import re", "max_tokens": NEW}, timeout=WAIT)
        assert r.json()["choices"][0]["text"] == oracle.text("import re")


def test_a_client_that_leaves_mid_body_costs_one_log_line_not_a_traceback(model_dir, oracle, caplog):
    app = create_app(oracle.model, oracle.tokenizer, _settings(model_dir))
    with live(app) as (url, _, _):
        with _raw(url) as gone:
            gone.sendall(_head(1000) + b'{"prompt": "x", ')
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "import re", "max_tokens": NEW}, timeout=WAIT)
        assert r.json()["choices"][0]["text"] == oracle.text("import re")
    assert "Traceback" not in caplog.text and "request failed" not in caplog.text


def test_past_the_shutdown_grace_a_request_gets_503_json_and_a_stream_an_error_event_and_done(model_dir, oracle):
    from cllm.serving.app import SHUTDOWN_MARGIN

    model = load_model(model_dir)
    gate = Gate(model, hold_at=3)  # the decode is held until the test ends
    app = create_app(gate, oracle.tokenizer, _settings(model_dir, method="ar", shutdown_grace=1.0))
    outcome: dict = {}

    def plain(url):
        try:
            outcome["plain"] = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 50},
                                          timeout=WAIT)
        except httpx.HTTPError as exc:
            outcome["plain"] = exc

    def streamed(url):
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "y", "max_tokens": 50,
                                                                      "stream": True}, timeout=WAIT) as response:
                outcome["stream"] = [line for line in response.iter_lines() if line]
        except httpx.HTTPError as exc:
            outcome["stream"] = exc

    with live(app, timeout_graceful_shutdown=1.0 + SHUTDOWN_MARGIN) as (url, server, thread):
        clients = [threading.Thread(target=f, args=(url,)) for f in (plain, streamed)]
        for c in clients:
            c.start()
        assert gate.reached.wait(WAIT)
        scheduler, deadline = app.state.service.scheduler, time.monotonic() + WAIT
        while len(scheduler._live) < 2:  # both submitted: waiting, being admitted or running
            assert time.monotonic() < deadline, "the two requests never reached the scheduler"
            time.sleep(0.05)
        server.should_exit = True
        thread.join(WAIT)
        for c in clients:
            c.join(WAIT)
    gate.opened.set()
    answer = outcome["plain"]
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]
    events = outcome["stream"]
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2]


def test_open_app_loads_the_model_off_the_calling_thread(model_dir, monkeypatch):
    """The model is loaded (and the runner's paths timed) on a passing thread, so that the decode
    thread is the only one holding torch CPU threads (`cllm.core.machine.in_passing_thread`)."""
    import cllm.serving.app as app_module

    loaded_on = []
    real = app_module.load_served

    def recording(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(app_module, "load_served", recording)
    bound = app_module.open_app(ServeConfig(model=str(model_dir), port=0, threads=1))
    try:
        assert len(loaded_on) == 1 and loaded_on[0] is not threading.current_thread()
        assert not loaded_on[0].is_alive()
        assert bound.served.model is not None
    finally:
        bound.sock.close()


@pytest.mark.llamacpp
@pytest.mark.parametrize("streams", [0, 4])
def test_the_llama_cpp_runtime_serves_16_concurrent_requests_each_as_alone(model_dir, oracle, tmp_path, streams):
    """Continuous batching over llama.cpp's sequences (rows joining and leaving: one unified
    context, or a server's streams, a row alone unified): every answer equals the oracle's greedy
    text; the batches held several rows at once, and no more than the streams."""
    from fastapi.testclient import TestClient

    from cllm.models import load_for_decoding

    assert main(["export", "--model", str(model_dir), "--gguf", str(tmp_path / "m.gguf")]) == 0
    fast = load_for_decoding(tmp_path / "m.gguf", threads=2, streams=streams)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS) % 3) for i in range(16)]
    expected = {p: oracle.text(p, max_new_tokens=16) for p in set(prompts)}
    with TestClient(create_app(fast.model, fast.tokenizer, _settings(model_dir), fast.draft_table),
                    base_url=LOCAL) as http:
        def one(i: int) -> str:
            body = {"prompt": prompts[i], "max_tokens": 16, "method": "ar" if i % 4 == 1 else "jacobi"}
            return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
        batching = http.get("/metrics.json").json()["batching"]
    assert results == [expected[p] for p in prompts]
    assert batching["max_batch"] > 1 and (not streams or batching["max_batch"] <= streams)
