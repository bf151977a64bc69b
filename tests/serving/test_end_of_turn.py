"""A reply ends at the model's end of turn, not only at its tokenizer's EOS: a chat model whose
generation_config.json lists `<|im_end|>` beside its EOS stops there, in `complete` (generate,
chat) and in the server's scheduler, with finish_reason "stop" and no log-probability entry for
the end-of-turn token. A scripted model says the end of turn mid-reply, so the stop is exact.
"""

from __future__ import annotations

import json

import pytest

from cllm.data.tokenizer import train_tokenizer
from cllm.decoding import JacobiConfig
from cllm.models import load_tokenizer
from cllm.serving.completion import DecodeParams, TextCodec, complete
from cllm.serving.scheduler import Job, Scheduler
from tests.decoding.scripted import Script, ScriptedLM, scripted_rule
from tests.serving.test_scheduler import Collector
from tests.tiny import CODE_TEXTS

VOCAB = 320
END_OF_TURN = "<|im_end|>"


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """A tokenizer whose EOS is <|endoftext|> (id 0), saved with a generation_config.json that
    also ends generation at <|im_end|> (as a chat model's folder does)."""
    folder = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer = train_tokenizer(CODE_TEXTS * 3, vocab_size=300, min_frequency=1)
    tokenizer.add_tokens([END_OF_TURN], special_tokens=True)
    tokenizer.save_pretrained(folder)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, end]}))
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def scripted(chat_tokenizer):
    """(model, prompt ids, the reply up to and with the end of turn): the model goes on past it."""
    prompt = tuple(chat_tokenizer("def add(a, b):")["input_ids"])
    reply = tuple(chat_tokenizer("    return a + b")["input_ids"])
    end = chat_tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert end != chat_tokenizer.eos_token_id and end not in reply
    after = tuple(chat_tokenizer("\nclass Point:")["input_ids"])
    model = ScriptedLM(scripted_rule(Script(prompt, reply + (end,) + after)), vocab_size=VOCAB)
    return model, list(prompt), list(reply) + [end]


def test_the_codec_ends_a_reply_at_the_eos_and_the_end_of_turn_of_generation_config(chat_tokenizer):
    codec = TextCodec(chat_tokenizer)
    end = chat_tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert codec.eos_token_id == chat_tokenizer.eos_token_id  # the API keeps its one EOS
    assert codec.eos_ids == {chat_tokenizer.eos_token_id, end}


@pytest.mark.parametrize("method", ["jacobi", "ar"])
def test_a_reply_stops_after_an_end_of_turn_token_that_is_not_the_eos(scripted, chat_tokenizer, method):
    model, prompt, want = scripted
    params = DecodeParams(method=method, max_new_tokens=40, engine=JacobiConfig(block_size=4))
    result = complete(model, TextCodec(chat_tokenizer), prompt, params)
    assert result.tokens == want and result.finish_reason == "stop"
    assert result.text == chat_tokenizer.decode(want, skip_special_tokens=True)


def test_the_server_scheduler_stops_a_job_at_the_end_of_turn_and_gives_it_no_logprob_entry(scripted,
                                                                                          chat_tokenizer):
    model, prompt, want = scripted
    scheduler = Scheduler(model, TextCodec(chat_tokenizer))
    try:
        events = Collector()
        params = DecodeParams(max_new_tokens=40, engine=JacobiConfig(block_size=4), logprobs=1)
        scheduler.submit(Job(prompt, params, events))
        result = events.wait().result
    finally:
        scheduler.stop()
    assert events.error is None, events.error
    assert result is not None and result.tokens == want and result.finish_reason == "stop"
    assert result.text == chat_tokenizer.decode(want, skip_special_tokens=True)
    assert len(result.logprobs) == len(want) - 1  # the end of turn has no text, hence no entry
