"""`GET /metrics` in Prometheus' text format, on the in-process app and its tiny model: a scrape
parses and carries every series, labelled with the model's name; requests (plain, streamed,
refused, 32 at once) are counted once each, the per-request histograms once per answer, the
generated tokens as the responses' usage says; the queue gauges are read at scrape time; each
app has its own registry. `GET /metrics.json` keeps the JSON view.
"""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cllm.models import load_model
from cllm.serving.app import create_app
from cllm.serving.config import ServeConfig
from tests.commands.test_generate import CHAT_TEMPLATE, PROMPTS, Oracle, save_tiny_model
from tests.serving.test_scheduler import Gate

NAME = "tiny"
LOCAL = "http://127.0.0.1"  # a Host the server accepts by default
WAIT = 60  # seconds: a bound against hangs, never a speed requirement
SERIES = [  # every family a scrape carries once a request is served (names without _total)
    "cllm:requests", "cllm:request_success", "cllm:num_requests_running", "cllm:num_requests_waiting",
    "cllm:batch_size", "cllm:prompt_tokens", "cllm:generation_tokens", "cllm:time_to_first_token_seconds",
    "cllm:time_per_output_token_seconds", "cllm:e2e_request_latency_seconds", "cllm:request_prompt_tokens",
    "cllm:request_generation_tokens", "cllm:forward_passes", "cllm:tokens_per_forward",
    "cllm:accepted_tokens_per_step", "cllm:spec_decode_num_draft_tokens", "cllm:spec_decode_num_accepted_tokens",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("metrics") / "model", chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def oracle(model_dir):
    return Oracle(model_dir)


def settings(model_dir, **kwargs) -> ServeConfig:
    return ServeConfig(model=str(model_dir), served_model_name=NAME, **kwargs)


def scrape(http) -> dict[str, list]:
    """{family name: its samples} of one GET /metrics."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {family.name: family.samples for family in text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels) -> float:
    """The sum of `sample`'s values over the samples whose labels include `labels`."""
    family = max((name for name in families if sample.startswith(name)), key=len)  # its family's name
    return sum(s.value for s in families[family] if s.name == sample and labels.items() <= s.labels.items())


def test_a_scrape_parses_and_carries_every_series_labelled_with_the_model(model_dir, oracle):
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings(model_dir, api_key="k")),
                    base_url=LOCAL) as http:
        r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8},
                      headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        families = scrape(http)  # no key needed, as /metrics.json and /health
        assert http.head("/metrics").status_code == 200 and http.head("/metrics.json").status_code == 200
        assert http.get("/metrics.json").json()["methods"]["jacobi"]["requests"] == 1
    assert sorted(set(SERIES) - set(families)) == []
    assert all(s.labels.get("model_name") == NAME for samples in families.values() for s in samples)
    assert value(families, "cllm:requests_total", endpoint="/v1/completions", status="200") == 1
    assert value(families, "cllm:forward_passes_total", method="jacobi") > 0


def test_requests_tokens_and_latencies_are_counted_once_each(model_dir, oracle):
    """1 plain, 1 streamed chat, 1 refused (400) and 32 concurrent requests (jacobi and ar)."""
    usages = []
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings(model_dir)), base_url=LOCAL) as http:
        def complete(i: int) -> dict:
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 6, "method": "ar" if i % 2 else "jacobi"}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200
            return r.json()["usage"]

        usages.append(complete(0))
        chat = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=chat) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usages.append(json.loads(lines[-1].removeprefix("data: "))["usage"])
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
        with ThreadPoolExecutor(32) as pool:
            usages += list(pool.map(complete, range(32)))
        families = scrape(http)
        batching = http.get("/metrics.json").json()["batching"]
    done = len(usages)  # 34 answered with 200
    assert value(families, "cllm:requests_total") == done + 1
    assert value(families, "cllm:requests_total", endpoint="/v1/completions", status="200") == 33
    assert value(families, "cllm:requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert value(families, "cllm:requests_total", endpoint="/v1/completions", status="400") == 1
    assert value(families, "cllm:request_success_total") == done
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
                      "request_generation_tokens", "tokens_per_forward"):
        assert value(families, f"cllm:{histogram}_count") == done, histogram
    longer = sum(u["completion_tokens"] > 1 for u in usages)
    assert value(families, "cllm:time_per_output_token_seconds_count") == longer
    generated = sum(u["completion_tokens"] for u in usages)
    assert value(families, "cllm:generation_tokens_total") == generated
    assert value(families, "cllm:request_generation_tokens_sum") == generated
    assert value(families, "cllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    # every token made final, one forward and row at a time, is one the answers hold
    assert value(families, "cllm:accepted_tokens_per_step_sum") == generated
    # batched steps: as many as the JSON view's, and some held several rows
    steps = value(families, "cllm:batch_size_count")
    assert steps == batching["steps"] and value(families, "cllm:batch_size_sum") == batching["rows_stepped"]
    assert value(families, "cllm:batch_size_bucket", le="1.0") < steps
    assert value(families, "cllm:forward_passes_total", method="ar") > 0
    # AR feeds no drafts; Jacobi's drafts are counted by source, never more accepted than fed
    assert value(families, "cllm:spec_decode_num_draft_tokens_total", method="ar") == 0
    drafted = {s.labels["source"]: s.value for s in families["cllm:spec_decode_num_draft_tokens"]
               if s.name.endswith("_total")}
    accepted = {s.labels["source"]: s.value for s in families["cllm:spec_decode_num_accepted_tokens"]
                if s.name.endswith("_total")}
    assert sum(drafted.values()) > 0 and all(n <= drafted[source] for source, n in accepted.items())
    assert value(families, "cllm:num_requests_running") == value(families, "cllm:num_requests_waiting") == 0


def test_the_queue_gauges_are_read_at_scrape_time(model_dir, oracle):
    """The decode thread is held in its first step: one request runs, the next waits."""
    model = load_model(model_dir)  # its own copy, kept alive here: the gate holds its runtime
    gate = Gate(model, hold_at=2)  # the prefill passes, the first step waits
    with TestClient(create_app(gate, oracle.tokenizer, settings(model_dir)), base_url=LOCAL) as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 4}
        first = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": body})
        first.start()
        assert gate.reached.wait(WAIT)
        second = threading.Thread(target=http.post, args=("/v1/completions",), kwargs={"json": body})
        second.start()
        scheduler, deadline = http.app.state.service.scheduler, time.monotonic() + WAIT
        while scheduler.waiting == 0 and time.monotonic() < deadline:
            second.join(0.02)
        held = scrape(http)
        gate.opened.set()
        first.join(WAIT)
        second.join(WAIT)
        after = scrape(http)
    assert value(held, "cllm:num_requests_running") == 1 and value(held, "cllm:num_requests_waiting") == 1
    assert value(after, "cllm:num_requests_running") == value(after, "cllm:num_requests_waiting") == 0
    assert value(after, "cllm:requests_total", status="200") == 2


def test_each_app_counts_on_its_own_registry(model_dir, oracle):
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings(model_dir)), base_url=LOCAL) as one, \
         TestClient(create_app(oracle.model, oracle.tokenizer, settings(model_dir)), base_url=LOCAL) as two:
        assert one.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        assert value(scrape(one), "cllm:requests_total") == 1
        assert value(scrape(two), "cllm:requests_total") == 0
