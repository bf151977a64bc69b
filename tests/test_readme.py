"""README.md's "Use it on your own model" walkthrough, run as written, in order, end to end.

The test reads the section's bash block and runs every `cllm ...` line of it (continuation lines
joined, comments stripped) with no flag added or changed, in a fresh temporary working directory
that holds what a new user brings, under the names the README uses:

- `path/to/model`: a tiny random Qwen2 with a tokenizer of the user's own (byte-level BPE trained
  here with the `tokenizers` library on a few hundred lines of Python, its special token appended
  after the merges as Qwen's are, saved as tokenizer.json + a hand-written tokenizer_config.json;
  cllm's own tokenizer helpers are not used),
- `my_prompts.jsonl`: 30 prompts of the user's; `my_heldout.jsonl`: 8 others, held out,
- `my_corpus.txt`: a small text file of the user's domain,
- `path/to/small-model`: another tiny Qwen2 (only when a command names it).

Each command runs in-process through `cllm.cli.main` and must return 0; `cllm serve` blocks, so it
runs as a subprocess with the README's flags, its `--port` the one thing changed (to a free one):
the test waits for /health, sends one completion and stops it. The `pip install` lines are skipped
(the installed package is the one under test; tests/test_install.py covers installing). Any other
line that is not a `cllm` command fails the test, so the block cannot grow a step this test skips.
"""

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import tokenize
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Qwen2Config, Qwen2ForCausalLM

from cllm.cli import main
from tests.serving.test_server import free_port, stop_server, wait_until_up

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Use it on your own model"
WAIT = 300  # seconds: a bound against a server that never comes up, not a speed requirement

# What the user brings: 30 prompts for training, 8 held out (none shared), in the README's format.
PROMPTS = [
    "def quicksort(xs):", "def binary_search(items, target):", "class Stack:", "def fibonacci(n):",
    "def read_lines(path):", "import json\n\ndef load_config(path):", "def is_prime(n):",
    "class Node:\n    def __init__(self, value):", "def flatten(nested):", "def merge(a, b):",
    "def count_words(text):", "for i in range(10):", "def reverse_string(s):", "class Counter:",
    "def gcd(a, b):", "def parse_args(argv):", "with open('data.txt') as f:", "def mean(values):",
    "def chunks(xs, n):", "try:\n    import numpy as np\nexcept ImportError:", "def unique(items):",
    "def transpose(matrix):", "class Queue:", "def factorial(n):", "def to_snake_case(name):",
    "def dedent_lines(lines):", "while queue:", "def max_depth(tree):", "def zip_dicts(a, b):",
    "if __name__ == '__main__':",
]
HELDOUT = [
    "def insertion_sort(xs):", "class LinkedList:", "def median(values):", "def is_palindrome(s):",
    "def word_lengths(words):", "def power_set(items):", "import os\n\ndef list_files(root):",
    "def clamp(x, lo, hi):",
]


def python_lines(count: int = 400) -> list[str]:
    """A few hundred lines of real Python (from the standard library): the user's code domain."""
    lines: list[str] = []
    for module in (textwrap, shlex, tokenize, inspect):
        lines += inspect.getsource(module).splitlines(keepends=True)
        if len(lines) >= count:
            break
    return lines[:count]


def save_user_tokenizer(directory: Path) -> tuple[int, int]:
    """Byte-level BPE of the user's, trained on their code; returns (vocabulary size, EOS id)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(python_lines(), trainer=trainer)
    tokenizer.add_special_tokens(["<|endoftext|>"])  # after the merges, as in Qwen's vocabulary
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 32768, "clean_up_tokenization_spaces": False,
    }, indent=2) + "\n")
    return tokenizer.get_vocab_size(), tokenizer.token_to_id("<|endoftext|>")


def save_qwen2(directory: Path, *, layers: int, seed: int) -> Path:
    """A tiny random Qwen2 (tied embeddings, like the small Qwen2s) with the user's tokenizer."""
    vocab_size, eos = save_user_tokenizer(directory)
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, initializer_range=0.1, tie_word_embeddings=True,
                         eos_token_id=eos, bos_token_id=None, pad_token_id=None)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def write_jsonl(path: Path, prompts: list[str], prefix: str) -> None:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "prompt": p}) + "\n"
                            for i, p in enumerate(prompts)))


def readme_commands() -> list[list[str]]:
    """The section's bash block as commands: continuation lines joined, comments stripped, the
    `pip install` lines dropped (anything else that is not `cllm ...` is an error)."""
    text = README.read_text()
    section = text[text.index(SECTION):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        argv: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:  # `a && b` is two commands
            if word != "&&":
                argv.append(word)
                continue
            if argv and argv[:2] != ["pip", "install"]:
                assert argv[0] == "cllm", f"README line this test does not run: {line!r}"
                commands.append(argv)
            argv = []
    return commands


def serve_once(argv: list[str], log_path: Path) -> int:
    """`cllm serve` as written but on a free port: up, one completion, stopped; returns 0."""
    port = free_port()
    argv = [str(port) if previous == "--port" else a for previous, a in zip([None, *argv], argv)]
    assert "--port" in argv, "the README's serve line names its port"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    url = f"http://127.0.0.1:{port}"
    log = open(log_path, "w+")
    proc = subprocess.Popen([sys.executable, "-m", "cllm.cli", *argv[1:]], env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        wait_until_up(url, proc, log, seconds=WAIT)
        name = httpx.get(f"{url}/v1/models", timeout=WAIT).json()["data"][0]["id"]
        reply = httpx.post(f"{url}/v1/completions", timeout=WAIT,
                           json={"model": name, "prompt": HELDOUT[0], "max_tokens": 16})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
        return 0
    finally:
        stop_server(proc, log)


# Where the README's comments say a command leaves what it makes (each `--out` is checked too):
# the place as the README names it -> a folder that must then hold something.
PROMISED = {"runs/my-distill/model/": "runs/my-distill/model/drafts", "runs/my-cllm/drafts/": "runs/my-cllm/drafts",
            "path/to/model/medusa/": "path/to/model/medusa", "path/to/model/eagle/": "path/to/model/eagle"}


@pytest.mark.slow
def test_the_readme_walkthrough_runs_as_written_on_a_users_own_model(tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert [argv[1] for argv in commands][-1] == "serve" and len(commands) >= 10
    block = README.read_text().split(SECTION)[1]
    assert all(path in block for path in PROMISED), "the README no longer names these places"
    # what the user brings, at the paths the README names
    assert len(PROMPTS) == 30 and len(HELDOUT) == 8 and not set(PROMPTS) & set(HELDOUT)
    save_qwen2(tmp_path / "path/to/model", layers=2, seed=0)
    if any("path/to/small-model" in argv for argv in commands):
        save_qwen2(tmp_path / "path/to/small-model", layers=1, seed=1)
    write_jsonl(tmp_path / "my_prompts.jsonl", PROMPTS, "p")
    write_jsonl(tmp_path / "my_heldout.jsonl", HELDOUT, "h")
    (tmp_path / "my_corpus.txt").write_text("".join(python_lines(300)))
    monkeypatch.chdir(tmp_path)

    threads = torch.get_num_threads()  # commands set their own; the next test gets conftest's back
    try:
        for argv in commands:
            start = time.perf_counter()
            code = serve_once(argv, tmp_path / "serve.log") if argv[1] == "serve" else main(argv[1:])
            out = capsys.readouterr()
            with capsys.disabled():  # each command's time, for whoever reads a slow run's log
                print(f"\n[{time.perf_counter() - start:6.1f} s] {shlex.join(argv)}")
            said = f"{out.out[-3000:]}\n{out.err[-3000:]}"
            assert code == 0, f"`{shlex.join(argv)}` returned {code}:\n{said}"
            if argv[1] == "generate":  # "prints the tokens per forward it made"
                assert "tokens/forward" in out.out + out.err, said
            if "--out" in argv:
                assert (tmp_path / argv[argv.index("--out") + 1]).is_dir(), said
    finally:
        torch.set_num_threads(threads)
    holds = [tmp_path / path for path in PROMISED.values()]
    missing = [str(path.relative_to(tmp_path)) for path in holds if not path.is_dir() or not any(path.iterdir())]
    assert not missing, f"not where the README says: {missing}"
