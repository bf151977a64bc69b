"""What a response carries beyond its text: `logprobs` (completions' `logprobs: k`, chat's
`logprobs` + `top_logprobs`), streamed too; `n` choices, each a row of its own; `usage` with the
forward passes and tokens per forward, and the final usage chunk of a stream.

Greedy log-probabilities are checked against the log-softmax of the logits greedy decoding
computes at each token (`autoregressive` with a recording choice), on the served model itself.
"""

import json

import pytest
import torch
from fastapi.testclient import TestClient

from cllm.decoding.argmax import argmax
from cllm.decoding.autoregressive import autoregressive
from cllm.serving.app import create_app
from cllm.serving.config import ServeConfig
from tests.commands.test_generate import CHAT_TEMPLATE, Oracle, save_tiny_model

NEW, NAME, LOCAL, TOL = 20, "tiny", "http://127.0.0.1", 2e-4


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = save_tiny_model(tmp_path_factory.mktemp("choices") / "model", chat_template=CHAT_TEMPLATE)
    oracle = Oracle(directory)
    settings = ServeConfig(model=str(directory), served_model_name=NAME)
    with TestClient(create_app(oracle.model, oracle.tokenizer, settings), base_url=LOCAL) as http:
        yield http, oracle


@torch.inference_mode()
def greedy_log_softmax(oracle: Oracle, ids: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding's tokens and, per token, the log-softmax it was chosen from."""
    seen = []

    def choose(logits):
        seen.append(logits[0].float().log_softmax(-1))
        return argmax(logits).tolist()

    out = autoregressive(oracle.model, torch.tensor([ids]), None, max_new_tokens=NEW,
                         eos_token_id=oracle.tokenizer.eos_token_id, choose=choose)
    return out.new_tokens[0], seen


def stream(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("prompt", ["def f(x):", "import os\n"])
def test_completion_logprobs_equal_greedy_decodings_log_softmax(served, prompt):
    http, oracle = served
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": NEW, "logprobs": 3})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    tokens, log_softmax = greedy_log_softmax(oracle, oracle.ids(prompt))
    shown = [t for t in tokens if t != oracle.tokenizer.eos_token_id]  # EOS has no text: no entry
    got = choice["logprobs"]
    assert got["tokens"] == [oracle.tokenizer.decode([t]) for t in shown]
    assert "".join(got["tokens"]) == choice["text"]
    for i, t in enumerate(shown):
        assert got["token_logprobs"][i] == pytest.approx(log_softmax[i][t].item(), abs=TOL)
        values, ids = log_softmax[i].topk(3)
        top = got["top_logprobs"][i]  # keyed by text: tokens that decode alike share a key
        assert set(top) == {oracle.tokenizer.decode([j]) for j in ids.tolist()}
        assert all(any(abs(v - w) <= TOL for w in values.tolist()) for v in top.values())
        assert list(top)[0] == got["tokens"][i]  # greedy: the chosen token leads
    assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(len(shown))]


def test_chat_logprobs_streamed_equal_the_whole_answers(served):
    http, oracle = served
    body = {"messages": [{"role": "user", "content": "def g(y):"}], "max_completion_tokens": NEW,
            "logprobs": True, "top_logprobs": 2}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert "".join(e["token"] for e in content) == whole["message"]["content"]
    tokens, log_softmax = greedy_log_softmax(oracle, oracle.chat_ids(body["messages"]))
    for e, t, dist in zip(content, tokens, log_softmax, strict=False):
        assert e["logprob"] == pytest.approx(dist[t].item(), abs=TOL)
        assert [a["logprob"] for a in e["top_logprobs"]] == pytest.approx(dist.topk(2).values.tolist(), abs=TOL)
    assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
    chunks = stream(http, "/v1/chat/completions", body)
    streamed = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=TOL)
    for c in chunks:  # each text chunk carries the tokens it completes
        for ch in c["choices"]:
            if ch["delta"].get("content") and ch["logprobs"]:
                assert "".join(e["token"] for e in ch["logprobs"]["content"]) == ch["delta"]["content"]
    plain = http.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_a_stop_string_cuts_the_logprobs_with_the_text(served):
    http, oracle = served
    full = http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": NEW, "logprobs": 0}).json()
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = http.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": NEW, "logprobs": 0,
                                             "stop": stop}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)]
    tokens = cut["logprobs"]["tokens"]
    assert "".join(tokens).startswith(cut["text"]) and len("".join(tokens[:-1])) < max(len(cut["text"]), 1)
    assert cut["logprobs"]["token_logprobs"] == pytest.approx(
        full["choices"][0]["logprobs"]["token_logprobs"][: len(tokens)], abs=TOL)
    assert all(top == {} for top in cut["logprobs"]["top_logprobs"])


def test_n_choices_greedy_are_equal_and_sampled_reproduce_with_a_seed(served):
    http, oracle = served
    greedy = http.post("/v1/completions", json={"prompt": "class A:", "max_tokens": NEW, "n": 3}).json()
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2]
    assert {c["text"] for c in greedy["choices"]} == {oracle.text("class A:", NEW)}
    body = {"prompt": "class A:", "max_tokens": NEW, "n": 4, "temperature": 1.0, "seed": 7}
    first, again = (http.post("/v1/completions", json=body).json() for _ in range(2))
    texts = [c["text"] for c in first["choices"]]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1  # each choice draws with its own generator
    alone = http.post("/v1/completions", json={**body, "n": 1}).json()["choices"][0]["text"]
    assert alone == texts[0]  # choice 0 is the request's own seed
    usage = first["usage"]
    single = http.post("/v1/completions", json={**body, "n": 1}).json()["usage"]
    assert usage["prompt_tokens"] == single["prompt_tokens"] == len(oracle.ids("class A:"))  # counted once
    assert usage["completion_tokens"] > single["completion_tokens"]  # every choice's tokens
    streamed = stream(http, "/v1/completions", body)
    by_choice = {i: "".join(c["choices"][0]["text"] for c in streamed if c["choices"] and c["choices"][0]["index"] == i)
                 for i in range(4)}
    assert [by_choice[i] for i in range(4)] == texts


def test_usage_carries_forward_passes_and_tokens_per_forward_and_a_stream_ends_with_it(served):
    http, _ = served
    body = {"prompt": "def f(x):", "max_tokens": NEW}
    usage = http.post("/v1/completions", json=body).json()["usage"]
    assert usage["forward_passes"] >= 1
    assert usage["tokens_per_forward"] == pytest.approx(usage["completion_tokens"] / usage["forward_passes"], abs=1e-4)
    chunks = stream(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    last = chunks[-1]["usage"]  # forward passes may differ: the server's lookup cache learns from each answer
    assert chunks[-1]["choices"] == [] and last["completion_tokens"] == usage["completion_tokens"]
    assert last["tokens_per_forward"] == pytest.approx(last["completion_tokens"] / last["forward_passes"], abs=1e-4)
    assert all("usage" not in c for c in stream(http, "/v1/completions", body))
