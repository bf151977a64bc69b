"""End to end in vLLM (marker `vllm`: `make test-vllm` runs them in .venv-vllm; `make test`
deselects them): the shipped model decoded by vLLM drafting with our proposer, with and without
the Jacobi tail, equals our `greedy_decode` token for token, one request at a time and batched;
`cllm serve --engine vllm` serves the same tokens over HTTP, to concurrent clients."""

import gc
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from cllm.decoding.autoregressive import greedy_decode
from cllm.models import SHIPPED, load_model, load_tokenizer
from cllm.serving.vllm import engine_environment, speculative_config
from tests.serving.test_server import ENV, free_port, stop_server, wait_until_up

pytestmark = pytest.mark.vllm

MODEL = SHIPPED["stdlib-coder"]
NEW = 64
K = 8
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "import os\n\n\ndef list_files(path):\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
           "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument(",
           "for i in range(10):\n    for j in range(10):\n",
           "def read_config(path):\n    with open(path) as f:\n"]


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer(MODEL)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def expected(prompts):
    """Our greedy decoding of each prompt (transformers' forward), EOS not stopping it."""
    model = load_model(MODEL)
    return [greedy_decode(model, torch.tensor([ids]), max_new_tokens=NEW).new_tokens[0] for ids in prompts]


@pytest.fixture(scope="module", params=[False, True], ids=["cllm", "cllm-jacobi"])
def llm(request):
    """vLLM's offline engine on the shipped model, drafting with our proposer (the Jacobi tail
    on or off), in the environment `cllm serve --engine vllm` gives it (preloads aside: they act
    only when a process starts)."""
    from vllm import LLM

    env, _ = engine_environment(1)
    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("VLLM_")})
    engine = LLM(model=str(MODEL), dtype="float32", max_model_len=512, max_num_seqs=len(PROMPTS), seed=0,
                 speculative_config=speculative_config(MODEL, jacobi_tail=request.param, num_speculative_tokens=K))
    try:
        yield engine
    finally:
        del engine
        gc.collect()
        os.environ.clear()
        os.environ.update(saved)


def generate(engine, batch):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outputs = engine.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_one_request_at_a_time_equals_greedy_decode(llm, prompts, expected):
    assert [generate(llm, [ids])[0] for ids in prompts] == expected


def test_a_batch_equals_greedy_decode(llm, prompts, expected):
    assert generate(llm, prompts) == expected
    assert generate(llm, prompts[::-1]) == expected[::-1]  # rows in another order: drafts keyed by content


def test_serve_engine_vllm_answers_concurrent_clients_with_greedys_tokens(prompts, expected, tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    cmd = [sys.executable, "-m", "cllm.cli", "serve", "--engine", "vllm", "--model", str(MODEL), "--port", str(port),
           "--served-model-name", "coder", "--threads", "1", "--log-level", "warning", "--api-key", "k3y",
           "--max-batch-size", "4"]
    proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": "Bearer k3y"}
    try:
        wait_until_up(url, proc, log, seconds=600)
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the key is asked for

        def complete(ids):
            body = {"model": "coder", "prompt": ids, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                    "return_token_ids": True}
            response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(complete, prompts)) == expected
    finally:
        stop_server(proc, log, seconds=60)
