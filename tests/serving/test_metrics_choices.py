"""`GET /metrics` counts a request of n choices once: one success, one latency, its prompt
tokens once, and its generated tokens summed over the choices (as its usage says), plain and
streamed alike."""

import json

from fastapi.testclient import TestClient

from cllm.serving.app import create_app
from tests.serving.test_metrics import LOCAL, model_dir, oracle, scrape, settings, value  # noqa: F401 - fixtures

PER_REQUEST = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_prompt_tokens",
               "request_generation_tokens", "tokens_per_forward")


def counts(families: dict) -> dict[str, float]:
    got = {name: value(families, f"cllm:{name}_count") for name in PER_REQUEST}
    got["success"] = value(families, "cllm:request_success_total")
    got["prompt"] = value(families, "cllm:prompt_tokens_total")
    got["generated"] = value(families, "cllm:generation_tokens_total")
    got["generated_sum"] = value(families, "cllm:request_generation_tokens_sum")
    return got


def test_a_request_of_three_choices_counts_once_with_its_usage_tokens(model_dir, oracle):  # noqa: F811
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings(model_dir)), base_url=LOCAL) as http:
        before = counts(scrape(http))
        r = http.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 6, "n": 3,
                                                "temperature": 1.0, "seed": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        usage = r.json()["usage"]
        after = counts(scrape(http))
        snapshot = http.get("/metrics.json").json()["methods"]
    assert after["success"] - before["success"] == 1
    for name in PER_REQUEST:
        assert after[name] - before[name] == 1, name
    assert after["prompt"] - before["prompt"] == usage["prompt_tokens"]
    assert after["generated"] - before["generated"] == usage["completion_tokens"]
    assert after["generated_sum"] - before["generated_sum"] == usage["completion_tokens"]
    (method,) = snapshot.values()
    assert method["requests"] == 1 and method["prompt_tokens"] == usage["prompt_tokens"]
    assert method["completion_tokens"] == usage["completion_tokens"]


def test_a_streamed_request_of_three_choices_counts_once_with_its_usage_tokens(model_dir, oracle):  # noqa: F811
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings(model_dir)), base_url=LOCAL) as http:
        before = counts(scrape(http))
        body = {"prompt": "def add(a, b):", "max_tokens": 6, "n": 3, "temperature": 1.0, "seed": 2,
                "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        usage = json.loads(lines[-1].removeprefix("data: "))["usage"]
        after = counts(scrape(http))
    assert after["success"] - before["success"] == 1
    for name in PER_REQUEST:
        assert after[name] - before[name] == 1, name
    assert after["prompt"] - before["prompt"] == usage["prompt_tokens"]
    assert after["generated"] - before["generated"] == usage["completion_tokens"]
