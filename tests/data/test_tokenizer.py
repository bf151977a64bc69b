"""The byte-level BPE tokenizer: exact round trips, one special token, offline reload."""

import pytest
from transformers import AutoTokenizer

from cllm.data.corpus import load_corpus
from cllm.data.tokenizer import EOT, save_tokenizer, tokenizer_sha256, train_tokenizer

SAMPLES = [
    "def f(x):\n    return x + 1\n",
    "class A:\n\tdef g(self):\n\t\tpass  # tabs\n",
    "s = 'héllo wörld — 世界 🙂'\n",
    "   leading and trailing spaces   \n\n\n",
    "x=1;y=2\r\nz = {'a': [1, 2, 3]}\r\n",
    "",
    "\x00\x7f weird bytes \u200b",
]


@pytest.fixture(scope="module")
def tokenizer():
    texts = [d.text for d in load_corpus("train", max_files=5).documents]
    return train_tokenizer(texts, vocab_size=400)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_endoftext_is_one_token_id_0_and_eos_bos_pad(tokenizer):
    assert tokenizer.convert_tokens_to_ids(EOT) == 0
    assert tokenizer.eos_token == tokenizer.bos_token == tokenizer.pad_token == EOT
    ids = tokenizer(f"a{EOT}b", add_special_tokens=False)["input_ids"]
    assert ids.count(0) == 1 and len(ids) == 3


def test_no_special_tokens_are_added_implicitly(tokenizer):
    assert 0 not in tokenizer("def f(): pass")["input_ids"]


def test_vocab_size_is_respected(tokenizer):
    assert len(tokenizer) <= 400


def test_saved_tokenizer_loads_offline_with_autotokenizer(tokenizer, tmp_path):
    save_tokenizer(tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in SAMPLES:
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.eos_token_id == 0 and loaded.pad_token_id == 0
    assert tokenizer_sha256(loaded) == tokenizer_sha256(tokenizer)


def test_training_is_deterministic(tokenizer):
    texts = [d.text for d in load_corpus("train", max_files=5).documents]
    assert tokenizer_sha256(train_tokenizer(texts, vocab_size=400)) == tokenizer_sha256(tokenizer)
