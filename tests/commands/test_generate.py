"""`cllm generate` / `cllm chat` on a tiny random Llama saved in tmp_path: the streamed text is
greedy decoding's text, AR and Jacobi agree, stop strings cut (and halt decoding), chat formats
turns with the template or concatenates them without one, bad input is a one-line error.
"""

import dataclasses
import io
import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.cli import main
from cllm.data.tokenizer import save_tokenizer, train_tokenizer
from cllm.decoding import JacobiConfig, greedy_decode
from cllm.models import load_model, load_tokenizer
from cllm.models.chat import end_of_turn_ids
from cllm.runtime import open_runtime
from cllm.serving.completion import DecodeParams, TextCodec, TextStream, complete
from tests.tiny import CODE_TEXTS

TEXTS = [
    *CODE_TEXTS,
    "s = 'héllo wörld €'\n",
]
PROMPTS = ["def f(x):", "class A:", "import re", "for k in d:\n"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NEW = 24


def save_tiny_model(directory, *, chat_template=None, seed=0):
    """A tiny random Llama (vocab 320 covers the tokenizer) + its BPE tokenizer, in one dir."""
    tokenizer = train_tokenizer(TEXTS * 3, vocab_size=320, min_frequency=1)
    if chat_template:
        tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.1, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    save_tokenizer(tokenizer, directory)
    return directory


class Oracle:
    """Greedy decoding of text, computed here independently of cllm.commands.generate."""

    def __init__(self, directory):
        self.model = open_runtime(load_model(directory), "transformers")  # the model's own forward
        self.tokenizer = load_tokenizer(directory)
        self.stop = end_of_turn_ids(self.tokenizer)  # its eos and generation_config.json's, where a reply ends

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def chat_ids(self, messages) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokens(self, ids: list[int], max_new_tokens: int = NEW) -> list[int]:
        out = greedy_decode(self.model, torch.tensor([ids]), max_new_tokens=max_new_tokens, eos_token_id=self.stop)
        return out.new_tokens[0]

    def text(self, prompt: str | list[int], max_new_tokens: int = NEW) -> str:
        ids = self.ids(prompt) if isinstance(prompt, str) else prompt
        return self.tokenizer.decode(self.tokens(ids, max_new_tokens), skip_special_tokens=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def templated(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("templated"), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def oracle(plain):
    return Oracle(plain)


def run(capsys, *args):
    code = main([*map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_jacobi_text_equal_to_greedy_decoding(plain, oracle, capsys):
    for prompt in PROMPTS:
        code, out, err = run(capsys, "generate", "--model", plain, "--prompt", prompt,
                             "--max-new-tokens", NEW, "--block-size", 6)
        assert code == 0
        assert out == oracle.text(prompt) + "\n"
        assert "tokens/forward" in err and "tokens/s" in err


@pytest.mark.parametrize("runtime, said", [("auto", "forward: lean (llama, float32; "),
                                           ("lean", "forward: lean (llama, float32; "),
                                           ("transformers", "forward: transformers' forward (asked for)")])
def test_generate_says_which_runtime_decodes_and_each_gives_greedy_text(plain, oracle, capsys, runtime, said):
    code, out, err = run(capsys, "generate", "--model", plain, "--prompt", PROMPTS[1], "--max-new-tokens", NEW,
                         "--runtime", runtime, "-v")
    assert code == 0 and out == oracle.text(PROMPTS[1]) + "\n"
    assert said in err and ("auto: a llama model" in err) == (runtime == "auto")


def test_generate_compiled_says_so_and_is_still_greedy_and_a_model_it_cannot_compile_gets_a_note(
        plain, oracle, capsys):
    code, out, err = run(capsys, "generate", "--model", plain, "--prompt", PROMPTS[0], "--max-new-tokens", NEW,
                         "--compile", "-v")
    assert code == 0 and out == oracle.text(PROMPTS[0]) + "\n"
    assert "forward: lean (llama, float32; compiled forward" in err
    assert f"--compile: the compiled forward is loaded from {os.environ['CLLM_COMPILE_CACHE']}, or built" in err
    code, out, err = run(capsys, "generate", "--model", plain, "--prompt", PROMPTS[0], "--max-new-tokens", 8,
                         "--compile", "--dtype", "bfloat16")
    assert code == 0 and "note: --compile: the compiled forward runs float32 on a CPU only" in err


def test_generate_with_recycling_and_blocks_in_flight_is_still_greedy(plain, oracle, capsys):
    for prompt in PROMPTS:
        code, out, _ = run(capsys, "generate", "--model", plain, "--prompt", prompt, "--max-new-tokens", NEW,
                           "--block-size", 6, "--recycle", 2, "--blocks-in-flight", 2)
        assert code == 0 and out == oracle.text(prompt) + "\n"


@pytest.mark.parametrize("budget", [0, 3])
def test_generate_with_a_recycling_budget_is_still_greedy(plain, oracle, capsys, budget):
    code, out, _ = run(capsys, "generate", "--model", plain, "--prompt", PROMPTS[0], "--max-new-tokens", NEW,
                       "--recycle", 6, "--recycle-budget", budget)
    assert code == 0 and out == oracle.text(PROMPTS[0]) + "\n"


def test_generate_rejects_a_negative_recycling_budget(plain, capsys):
    code, _, err = run(capsys, "generate", "--model", plain, "--prompt", "x", "--recycle-budget", -1)
    assert code != 0 and "--recycle-budget" in err and "Traceback" not in err


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_generate_ar_and_jacobi_agree(plain, capsys, block_size):
    args = ["generate", "--model", plain, "--prompt", "class A:", "--max-new-tokens", NEW]
    _, ar, ar_err = run(capsys, *args, "--method", "ar")
    _, jacobi, _ = run(capsys, *args, "--method", "jacobi", "--block-size", block_size)
    assert ar == jacobi
    assert f"{NEW} forward passes" in ar_err or "finish: stop" in ar_err  # AR: one per token


def test_generate_reads_the_prompt_from_stdin_dash_pipe_and_file(plain, oracle, capsys, monkeypatch, tmp_path):
    expected = oracle.text("import re") + "\n"
    for args in (["--prompt", "-"], []):
        monkeypatch.setattr(sys, "stdin", io.StringIO("import re"))
        assert run(capsys, "generate", "--model", plain, "--max-new-tokens", NEW, *args)[1] == expected
    (tmp_path / "p.txt").write_text("import re")
    out = run(capsys, "generate", "--model", plain, "--max-new-tokens", NEW, "--prompt-file", tmp_path / "p.txt")[1]
    assert out == expected


def test_stop_string_cuts_the_output_and_halts_decoding(plain, oracle, capsys):
    full = oracle.text("def f(x):", max_new_tokens=64)
    # a printable two-character stop string that first occurs a few tokens in
    start = next(i for i in range(8, len(full)) if full[i : i + 2].isascii() and full[i : i + 2].isprintable())
    stop = full[start : start + 2]
    cut = full[: full.index(stop)]
    assert 0 < len(cut) < len(full) - 2
    code, out, err = run(capsys, "generate", "--model", plain, "--prompt", "def f(x):",
                         "--max-new-tokens", 64, "--stop", stop.replace("\n", "\\n"), "--block-size", 4)
    assert code == 0 and out == cut + "\n" and "finish: stop" in err

    result = complete(oracle.model, TextCodec(oracle.tokenizer), oracle.ids("def f(x):"),
                      DecodeParams(engine=JacobiConfig(block_size=4), max_new_tokens=64, stop=(stop,)))
    assert result.text == cut and result.finish_reason == "stop"
    assert len(result.tokens) < 64  # halted at the step that made the stop string final


def test_show_trajectory_prints_every_iteration_then_the_text(plain, oracle, capsys):
    code, out, _ = run(capsys, "generate", "--model", plain, "--prompt", "def f(x):",
                       "--max-new-tokens", NEW, "--block-size", 8, "--show-trajectory")
    assert code == 0
    assert "block 0" in out and "block 2" in out and "it  0 │" in out and "it  1 │" in out
    assert out.endswith(oracle.text("def f(x):") + "\n")


def test_text_stream_chunks_add_up_and_never_hold_half_a_character_or_stop_string(oracle):
    codec = TextCodec(oracle.tokenizer)
    text = "s = 'héllo wörld €'\nimport os\n"
    chunks = []
    stream = TextStream(codec, stop=["import"], on_text=chunks.append)
    for token in codec.encode(text):
        stream.feed([token])
    stream.finish()
    assert "".join(chunks) == stream.text == "s = 'héllo wörld €'\n" and stream.stopped
    assert not any("\ufffd" in c or c.endswith("imp") for c in chunks)


def test_sampling_with_a_seed_is_reproducible_and_another_seed_samples_otherwise(oracle):
    codec, ids = TextCodec(oracle.tokenizer), oracle.ids("def f(x):")
    params = DecodeParams(max_new_tokens=NEW, temperature=1.0, top_p=0.9, seed=7)
    first, second = (complete(oracle.model, codec, ids, params) for _ in range(2))
    assert first.tokens == second.tokens and first.method == "jacobi_sample"
    other = complete(oracle.model, codec, ids, dataclasses.replace(params, seed=8))
    assert other.tokens != first.tokens and first.text != oracle.text("def f(x):")
    assert first.forward_passes <= len(first.tokens)
    ar = complete(oracle.model, codec, ids, dataclasses.replace(params, method="ar"))
    assert ar.method == "ar_sample" and ar.forward_passes == len(ar.tokens)


def test_a_cancelled_decode_stops_at_the_next_step(oracle):
    codec, ids = TextCodec(oracle.tokenizer), oracle.ids("def f(x):")
    for params in (DecodeParams(max_new_tokens=64), DecodeParams(max_new_tokens=64, temperature=1.0)):
        result = complete(oracle.model, codec, ids, params, cancelled=lambda: True)
        assert len(result.tokens) <= 1 and result.forward_passes <= 2


def test_chat_without_template_continues_the_concatenated_history(plain, oracle, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\nclass A:\n/exit\nnever read\n"))
    code, out, err = run(capsys, "chat", "--model", plain, "--max-new-tokens", NEW, "--block-size", 5)
    first = oracle.text("def f(x):")
    second = oracle.text("def f(x):" + first + "class A:")
    assert code == 0 and out == first + "\n" + second + "\n"
    assert "no chat template" in err and err.count("tokens/forward") == 2


def test_chat_with_template_formats_every_turn_and_quits_on_eof(templated, capsys, monkeypatch):
    oracle = Oracle(templated)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n\nimport os\n"))  # blank lines are skipped
    code, out, _ = run(capsys, "chat", "--model", templated, "--max-new-tokens", NEW, "--method", "ar")
    messages = [{"role": "user", "content": "hello"}]
    first = oracle.text(oracle.chat_ids(messages))
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "import os"}]
    second = oracle.text(oracle.chat_ids(messages))
    assert code == 0 and out == first + "\n" + second + "\n"


@pytest.mark.parametrize(
    "args",
    [
        ["--prompt", "x", "--block-size", "0"],
        ["--prompt", "x", "--prompt-file", "p.txt"],
        ["--prompt-file", "missing.txt"],
        ["--prompt", ""],
        ["--prompt", "x", "--method", "ar", "--show-trajectory"],
        ["--prompt", "x", "--temperature", "-1"],
        ["--prompt", "x", "--max-new-tokens", "500"],  # beyond the model's 128 positions
    ],
)
def test_bad_generate_input_is_a_one_line_error(plain, capsys, args):
    code, _, err = run(capsys, "generate", "--model", plain, *args)
    assert code == 2
    assert err.startswith("cllm generate: error:") and err.count("\n") == 1


def test_unknown_model_directory_is_a_one_line_error(tmp_path, capsys):
    code, _, err = run(capsys, "generate", "--model", tmp_path / "nope", "--prompt", "x")
    assert code == 2 and err.startswith("cllm generate: error: model directory not found")


def test_trim_history_drops_the_oldest_turns_and_keeps_the_system_message():
    from cllm.core.errors import UserError
    from cllm.serving.history import trim_history

    def msg(role, n):
        return {"role": role, "content": "x" * n}

    length = lambda ms: sum(len(m["content"]) for m in ms)  # noqa: E731 - one token per character
    history = [msg("system", 5), msg("user", 10), msg("assistant", 20), msg("user", 10), msg("assistant", 20),
               msg("user", 10)]
    assert trim_history(history, length, 100) == (history, 0)
    kept, dropped = trim_history(history, length, 50)  # 75 -> drop the first exchange -> 45
    assert dropped == 2 and kept == [history[0], *history[3:]]
    kept, dropped = trim_history(history, length, 15)
    assert dropped == 4 and kept == [history[0], history[5]]
    with pytest.raises(UserError, match="leaves no room"):
        trim_history(history, length, 14)


def test_chat_trims_its_history_to_the_context_and_says_so(plain, capsys, monkeypatch):
    """128 positions, 40 new tokens: by the third turn the history no longer fits; every turn
    still gets its reply (it used to fail on every message from then on)."""
    turns = ["def f(x):", "class A:", "import re", "for k in d:", "while True:"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in turns)))
    code, out, err = run(capsys, "chat", "--model", plain, "--max-new-tokens", 40)
    assert code == 0 and "error" not in err
    assert err.count("tokens/forward") == len(turns)  # a reply per turn
    assert "history trimmed" in err and "oldest message(s) dropped" in err


def test_chat_commands_are_not_sent_and_reset_starts_over(plain, oracle, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n/help\n/reset\n/nope\ndef f(x):\n/exit\n"))
    code, out, err = run(capsys, "chat", "--model", plain, "--max-new-tokens", NEW)
    first = oracle.text("def f(x):")
    assert code == 0 and out == first + "\n" + first + "\n"  # after /reset, as if it were the first turn
    assert err.count("tokens/forward") == 2 and "/reset forget the conversation" in err
    assert "conversation cleared" in err and "unknown command /nope" in err


def test_ctrl_c_stops_the_reply_and_the_chat_goes_on_with_what_was_shown(plain, oracle, capsys, monkeypatch):
    import cllm.commands.chat as generate_module

    real, prompts = generate_module.complete, []

    def complete(model, codec, prompt_ids, params, *, on_text=None, **kwargs):
        prompts.append(list(prompt_ids))
        if len(prompts) == 1:  # the first reply: a few words shown, then Ctrl-C
            on_text(" partial")
            raise KeyboardInterrupt
        return real(model, codec, prompt_ids, params, on_text=on_text, **kwargs)

    monkeypatch.setattr(generate_module, "complete", complete)
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\nclass A:\n"))
    code, out, err = run(capsys, "chat", "--model", plain, "--max-new-tokens", NEW)
    second = oracle.text("def f(x): partialclass A:")
    assert code == 0 and out == " partial\n" + second + "\n" and "reply stopped" in err
    assert prompts[1] == oracle.ids("def f(x): partialclass A:")


@pytest.mark.llamacpp
def test_generate_on_llama_cpp_exports_once_and_gives_greedy_text(plain, oracle, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, err = run(capsys, "generate", "--model", plain, "--prompt", PROMPTS[1], "--max-new-tokens", NEW,
                         "--runtime", "llamacpp", "--threads", 2, "-v")
    assert code == 0 and out == oracle.text(PROMPTS[1]) + "\n"
    assert "forward: llama.cpp" in err and "exported now to" in err and str(tmp_path / "cache") in err
    assert main(["export", "--model", str(plain), "--gguf", str(tmp_path / "m.gguf")]) == 0
    capsys.readouterr()
    for prompt in PROMPTS:
        code, out, err = run(capsys, "generate", "--model", tmp_path / "m.gguf", "--prompt", prompt,
                             "--max-new-tokens", NEW, "--block-size", 6, "--recycle", 2)
        assert code == 0 and out == oracle.text(prompt) + "\n"
    code, _, err = run(capsys, "generate", "--model", tmp_path / "m.gguf", "--prompt", PROMPTS[0], "--medusa", "auto",
                       "--runtime", "lean")
    assert code == 2 and "decodes on the llamacpp runtime only" in err and len(err.strip().splitlines()) == 1
