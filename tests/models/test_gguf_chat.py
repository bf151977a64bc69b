"""A third-party GGUF works as it comes: without a side folder, its own chat template (the
metadata's `tokenizer.chat_template`) writes the conversation exactly as transformers writes it
with the same template, and generation stops at llama.cpp's end-of-generation tokens, not only
at EOS (`cllm generate`, `cllm serve`'s completions and chat completions). A template that
reaches for Python's internals, a side folder's bad chat_template.jinja, or a side folder's
tokenizer larger than the file's vocabulary is refused at load in one line. Tiny GGUF files are
written here (`write_gguf`, with the metadata a converter adds); llama.cpp runs them, so these
are marked `llamacpp` (`make test-llamacpp`).
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from fastapi.testclient import TestClient

import cllm.runtime.gguf as gguf_writer
from cllm.cli import main
from cllm.core.errors import UserError
from cllm.data.tokenizer import train_tokenizer
from cllm.decoding import greedy_decode
from cllm.models import load_for_decoding
from cllm.models.gguf import side_folder
from cllm.serving.app import create_app
from cllm.serving.completion import DecodeParams, TextCodec, complete
from cllm.serving.config import ServeConfig
from tests.runtime.test_gguf import VOCAB, tiny_llama
from tests.tiny import CODE_TEXTS

pytestmark = pytest.mark.llamacpp

CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ eos_token }}")
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
CONVERSATIONS = [
    [{"role": "user", "content": "def add(a, b):"}],
    [{"role": "system", "content": "You write code."}, {"role": "user", "content": "for i in range(10):"},
     {"role": "assistant", "content": "    print(i)"}, {"role": "user", "content": "import os"}],
]
INTERNALS = ("<class", "subclasses", "<built-in")


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE with ChatML's turn tokens (special: llama.cpp takes <|im_end|> as an end of
    turn by its text); EOS is <|endoftext|>."""
    tok = train_tokenizer(CODE_TEXTS * 3, vocab_size=300, min_frequency=1)
    tok.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    return tok


def write_tiny_gguf(path, tokenizer, *, template: str | None = None, end_of_turn: int | None = None):
    """A tiny random Llama as GGUF, with the chat template and end-of-turn id a converter
    (llama.cpp's convert_hf_to_gguf) writes into the metadata."""
    write_metadata = gguf_writer._write_metadata

    def with_chat(writer, *args, **kwargs):
        write_metadata(writer, *args, **kwargs)
        if template is not None:
            writer.add_chat_template(template)
        if end_of_turn is not None:
            writer.add_eot_token_id(end_of_turn)

    with mock.patch.object(gguf_writer, "_write_metadata", with_chat):
        gguf_writer.write_gguf(tiny_llama(), tokenizer, path)
    return path


def test_a_ggufs_own_chat_template_writes_the_conversation_as_transformers_does(tokenizer, tmp_path):
    fast = load_for_decoding(write_tiny_gguf(tmp_path / "chat.gguf", tokenizer, template=CHATML), threads=1)
    assert fast.tokenizer.chat_template == CHATML and TextCodec(fast.tokenizer).has_chat_template
    tokenizer.chat_template = CHATML
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            want = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert fast.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == want
            assert fast.tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False) == \
                tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, return_dict=False)
    assert fast.tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(CONVERSATIONS, tokenize=False, add_generation_prompt=True)


def test_a_ggufs_template_that_reaches_for_python_internals_is_refused_at_load_in_one_line(tokenizer, tmp_path,
                                                                                          capsys):
    path = write_tiny_gguf(tmp_path / "evil.gguf", tokenizer, template=ESCAPE)
    with pytest.raises(UserError, match=r"tokenizer\.chat_template") as caught:
        load_for_decoding(path, threads=1)
    assert "sandbox" in str(caught.value) and not any(x in str(caught.value) for x in INTERNALS)
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--threads", "1"]) == 2
    out, err = capsys.readouterr()
    assert len(err.strip().splitlines()) == 1 and str(path) in err and "Traceback" not in err
    assert not any(x in out + err for x in INTERNALS)


def test_a_side_folders_bad_chat_template_is_refused_at_load_in_one_line(tokenizer, tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "m.gguf", tokenizer, template=CHATML)
    side = side_folder(path)
    tokenizer.save_pretrained(side)
    (side / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}")  # never closed
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(side / "chat_template.jinja") in err
    assert "not valid Jinja" in err and "Traceback" not in err


def test_a_side_folders_tokenizer_larger_than_the_ggufs_vocabulary_is_refused(tokenizer, tmp_path, capsys):
    path = write_tiny_gguf(tmp_path / "m.gguf", tokenizer)
    larger = train_tokenizer(CODE_TEXTS * 3, vocab_size=300, min_frequency=1)
    larger.add_tokens([f"<extra_{i}>" for i in range(VOCAB)])
    assert len(larger) > VOCAB
    larger.save_pretrained(side_folder(path))
    with pytest.raises(UserError, match=f"{len(larger)} tokens, more than the {VOCAB}"):
        load_for_decoding(path, threads=1)
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt", "def f(x):", "--threads", "1"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def ends_early(tokenizer, tmp_path_factory):
    """(GGUF, chat messages, the reply's tokens): a GGUF whose end-of-turn id (metadata) is a token
    greedy decoding writes a few tokens into the reply to `messages`, not EOS."""
    messages = CONVERSATIONS[0]
    tokenizer.chat_template = CHATML.replace("{{ eos_token }}", "")
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    greedy = greedy_decode(tiny_llama(), torch.tensor([prompt]), max_new_tokens=16).new_tokens[0]
    k = next(k for k in range(1, len(greedy)) if greedy[k] not in greedy[:k] and greedy[k] != tokenizer.eos_token_id)
    path = write_tiny_gguf(tmp_path_factory.mktemp("eot") / "eot.gguf", tokenizer, template=tokenizer.chat_template,
                           end_of_turn=greedy[k])
    return path, messages, greedy[: k + 1]


def test_generation_on_a_gguf_stops_at_its_end_of_turn_token_not_only_at_eos(ends_early, tokenizer):
    path, messages, want = ends_early
    fast = load_for_decoding(path, threads=1)
    assert want[-1] in fast.tokenizer.eos_token_ids and want[-1] != fast.tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in fast.tokenizer.eos_token_ids
    codec = TextCodec(fast.tokenizer)
    for method in ("jacobi", "ar"):
        result = complete(fast.model, codec, codec.chat_ids(messages), DecodeParams(method=method, max_new_tokens=16))
        assert result.tokens == want and result.finish_reason == "stop", method


def test_the_server_on_a_gguf_alone_answers_chats_with_its_template_and_stops_at_its_end_of_turn(ends_early):
    """`cllm serve --model file.gguf` without a side folder: the app starts, a chat completion
    is written by the file's template, and every kind of completion stops at the end of turn."""
    path, messages, want = ends_early
    fast = load_for_decoding(path, threads=1)
    settings = ServeConfig(model=str(path), served_model_name="tiny", max_prompt_tokens=64, max_tokens_limit=16)
    text = fast.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with TestClient(create_app(fast.model, fast.tokenizer, settings), base_url="http://127.0.0.1") as http:
        for route, body in (("/v1/chat/completions", {"messages": messages}), ("/v1/completions", {"prompt": text})):
            r = http.post(route, json={**body, "max_tokens": 16})
            assert r.status_code == 200, r.text
            answer = r.json()
            assert answer["choices"][0]["finish_reason"] == "stop", route
            assert answer["usage"]["completion_tokens"] == len(want), route
            with http.stream("POST", route, json={**body, "max_tokens": 16, "stream": True}) as response:
                lines = [line for line in response.iter_lines() if line.startswith("data: {")]
            assert '"finish_reason": "stop"' in lines[-1], route
