"""Request checking (`cllm.serving.api`, pure): the inputs a hostile or careless client sends are 400s with
OpenAI's error shape, raised before anything is tokenized or decoded."""

import pytest

from cllm.decoding import RECOMMENDED_CONFIG
from cllm.serving.api import (
    ApiError,
    PromptLimits,
    chat_messages,
    check_body,
    completion_prompt,
    parse_params,
)

LIMITS = PromptLimits(max_prompt_tokens=48, max_tokens_limit=64, default_max_tokens=128, context=128,
                      vocab_size=320, max_chars=48 * 4 * 8)
ENGINE = dict(method="jacobi", engine=RECOMMENDED_CONFIG)


def refused(call, *args, status=400, words="", **kwargs):
    with pytest.raises(ApiError) as info:
        call(*args, **kwargs)
    err = info.value
    assert err.status == status and words in err.message, err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("model", [["tiny"], {"id": "tiny"}, 3, True])
def test_a_model_that_is_not_a_string_is_a_400(model):
    refused(check_body, {"model": model, "prompt": "x"}, {"tiny"}, "tiny", words="'model' must be a string")


def test_an_unknown_model_is_a_404_and_stream_null_means_not_streamed():
    refused(check_body, {"model": "gpt-9"}, {"tiny"}, "tiny", status=404, words="does not exist")
    assert check_body({"model": "tiny", "stream": None, "prompt": "x"}, {"tiny"}, "tiny")["stream"] is None
    refused(check_body, {"stream": "yes"}, {"tiny"}, "tiny", words="'stream'")


def test_a_lone_surrogate_in_a_prompt_chat_content_or_stop_string_is_a_400():
    refused(completion_prompt, {"prompt": "def f(x):\ud800"}, LIMITS, words="lone surrogate at character 9")
    refused(completion_prompt, {"prompt": ["\udfff"]}, LIMITS, words="lone surrogate")
    messages = [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]
    err = refused(chat_messages, {"messages": messages}, LIMITS, words="lone surrogate")
    assert err.param == "messages[1].content"
    refused(parse_params, {"stop": ["\ud800"]}, LIMITS, 3, **ENGINE, words="lone surrogate")


def test_empty_prompts_are_400s_and_empty_chat_content_is_text():
    refused(completion_prompt, {"prompt": ""}, LIMITS, words="empty")
    refused(completion_prompt, {"prompt": []}, LIMITS, words="empty")
    assert chat_messages({"messages": [{"role": "user", "content": ""}]}, LIMITS) == [{"role": "user", "content": ""}]


def test_an_over_long_text_is_refused_by_its_length_without_tokenizing():
    refused(completion_prompt, {"prompt": "x" * (LIMITS.max_chars + 1)}, LIMITS, words="characters long")
    refused(chat_messages, {"messages": [{"role": "user", "content": "y" * LIMITS.max_chars},
                                         {"role": "user", "content": "z"}]}, LIMITS, words="characters long")
    assert completion_prompt({"prompt": "x" * LIMITS.max_chars}, LIMITS) == "x" * LIMITS.max_chars


def test_the_character_bound_holds_for_every_prompt_the_token_limit_allows():
    class Tokenizer:  # pieces of 1 to 5 characters
        def __len__(self):
            return 5

        def convert_ids_to_tokens(self, ids):
            return ["a" * (i + 1) for i in ids]

    limits = PromptLimits.for_tokenizer(Tokenizer(), max_prompt_tokens=10, max_tokens_limit=8,
                                        default_max_tokens=8, context=None, vocab_size=5)
    assert limits.max_chars >= 10 * 5


def test_a_prompt_alone_too_long_for_the_context_blames_the_prompt_not_max_tokens():
    limits = PromptLimits(max_prompt_tokens=500, max_tokens_limit=64, default_max_tokens=16, context=128,
                          vocab_size=320, max_chars=10**6)
    err = refused(parse_params, {"max_tokens": 4}, limits, 130, **ENGINE, words="no room for a completion")
    assert err.param == "prompt" and err.code == "context_length_exceeded"
    err = refused(parse_params, {"max_tokens": 64}, limits, 100, **ENGINE, words="max_tokens (64)")
    assert err.param == "max_tokens"


def test_a_request_without_a_seed_gets_a_fresh_one_and_a_seed_is_kept():
    seeds = {parse_params({"temperature": 1.0}, LIMITS, 3, **ENGINE).seed for _ in range(4)}
    assert len(seeds) == 4
    assert parse_params({"temperature": 1.0, "seed": 7}, LIMITS, 3, **ENGINE).seed == 7
