"""`cllm serve` as a real process on a loopback port, driven by the official `openai` client and
by raw HTTP: greedy completions (Jacobi and AR, streamed or not) equal `greedy_decode`, 32
concurrent requests all come back right, bad requests get a 4xx with an OpenAI-style message
and the server keeps serving.
"""

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from cllm.cli import main
from cllm.generate import DecodeParams, TextCodec, complete
from cllm.models import load_draft_table
from cllm.server import ServeConfig, create_app
from tests.test_generate import CHAT_TEMPLATE, PROMPTS, Oracle, save_tiny_model

NEW, BLOCK, NAME = 24, 8, "tiny"
LIMITS = {"max_tokens_limit": 64, "max_prompt_tokens": 48}
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


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`python -m cllm.cli serve` on a free loopback port; yields its base URL."""
    log = open(tmp_path_factory.mktemp("serve-log") / "server.log", "w+")
    port = free_port()
    cmd = [sys.executable, "-m", "cllm.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--served-model-name", NAME, "--block-size", str(BLOCK), "--threads", "1",
           "--log-level", "warning", "--max-tokens-limit", str(LIMITS["max_tokens_limit"]),
           "--max-prompt-tokens", str(LIMITS["max_prompt_tokens"])]
    proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not start:\n{log.read()}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path, body, **kwargs):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server}{path}", content=content, timeout=60,
                      headers={"Content-Type": "application/json"}, **kwargs)


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
    return "stop" if tokens and tokens[-1] == oracle.tokenizer.eos_token_id else "length"


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
        return post(server, "/v1/completions", {"prompt": p, "max_tokens": 16, "method": method}).json()["choices"][0]["text"]

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert results == [expected[p] for p in prompts]


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
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x = 1\n" * 60}, 400, "at most"),
        ("/v1/completions", {"prompt": [5, 10**6]}, 400, "token ids"),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 3}, 400, "n = 1"),
        ("/v1/nowhere", {"prompt": "x"}, 404, "Not Found"),
    ],
)
def test_bad_request_gets_a_4xx_with_a_message_and_the_server_keeps_serving(server, oracle, path, body, status, words):
    r = post(server, path, body)
    assert r.status_code == status
    error = r.json()["error"]
    assert words in error["message"] and error["type"]
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
    params = DecodeParams(block_size=BLOCK, max_new_tokens=NEW, temperature=0.9, top_p=0.95,
                          seed=11, recycle=engine.recycle, recycle_budget=engine.recycle_budget)
    expected = complete(oracle.model, TextCodec(oracle.tokenizer), oracle.ids("def f(x):"), params,
                        draft_table=load_draft_table(model_dir))
    assert first == expected.text != oracle.text("def f(x):")


def test_stop_string_cuts_the_completion(client, oracle):
    full = oracle.text("def f(x):")
    stop = next(full[i : i + 2] for i in range(4, len(full)) if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    response = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=NEW, stop=[stop])
    assert response.choices[0].text == full[: full.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_models_health_and_metrics_by_method(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server}/health").json()["status"] == "ok"
    post(server, "/v1/completions", {"prompt": "x", "max_tokens": -1})
    for extra in ({"method": "jacobi"}, {"method": "ar"}, {"temperature": 0.5}):
        assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 8, **extra}).status_code == 200
    metrics = httpx.get(f"{server}/metrics").json()
    assert metrics["requests"] >= 4 and metrics["errors_by_status"]["400"] >= 1
    jacobi = metrics["methods"]["jacobi"]
    assert jacobi["completion_tokens"] > 0 and jacobi["tokens_per_second"] > 0
    assert jacobi["tokens_per_forward"] >= 1.0 and metrics["methods"]["ar"]["tokens_per_forward"] == 1.0
    assert "jacobi_sample" in metrics["methods"]


def test_create_app_serves_in_process_and_fits_max_tokens_to_the_context(model_dir, oracle):
    from fastapi.testclient import TestClient

    settings = ServeConfig(model=str(model_dir), served_model_name=NAME, max_prompt_tokens=120, max_tokens_limit=64)
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings)) as http:
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "import re", "max_tokens": NEW})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == oracle.text("import re")
        assert http.post("/v1/completions", json={"prompt": ""}).status_code == 400
        long_prompt = list(range(1, 101))  # 100 tokens of a 128-position model
        r = http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 64})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = http.post("/v1/completions", json={"prompt": long_prompt})  # no max_tokens: what fits
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 28
