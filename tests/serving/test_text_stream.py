"""`TextStream` decodes a window of the last tokens per feed: its text must be, chunk for chunk,
what decoding every token at once gives, for the decoders causal LMs ship with (byte-level BPE,
SentencePiece's metaspace, Llama 2's byte fallback with a stripped first space), special tokens,
half UTF-8 characters and stop strings included, at a cost per feed that does not grow with the
text."""

import random

import pytest
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from cllm.data.tokenizer import train_tokenizer
from cllm.serving.completion import TextCodec, TextStream
from tests.tiny import CODE_TEXTS

UNICODE = ["s = 'héllo wörld €'\n", "# 数据 → résumé 😀\n", "x = 'ñ' * 3  # ü\n"]


def byte_level():
    return train_tokenizer(CODE_TEXTS * 4 + UNICODE * 4, vocab_size=400, min_frequency=1)


def _pieces_tokenizer(decoder) -> PreTrainedTokenizerFast:
    """A SentencePiece-style vocabulary (byte fallback tokens, pieces with '▁' for a space)
    with the given decoder; decoding only, so no merges are needed."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁def", "▁x", "x", "▁=", "é", "(", "):", "ab", "▁€", "数", "▁▁", "return", "▁ret"]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoder
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def llama2_style():
    return _pieces_tokenizer(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                                decoders.Strip(" ", 1, 0)]))


def metaspace():
    return _pieces_tokenizer(decoders.Metaspace(replacement="▁", prepend_scheme="first"))


TOKENIZERS = {"byte_level": byte_level, "llama2_style": llama2_style, "metaspace": metaspace}


def random_ids(tokenizer, rng: random.Random, length: int) -> list[int]:
    """Byte-level BPE: any ids (its text is UTF-8 decoded with replacement, which resynchronises).
    SentencePiece-style: what a model emits, pieces, special tokens and the byte tokens of
    whole characters missing from the vocabulary, with half a character at most at the end
    (byte fallback renders a group of bytes that is not UTF-8 as one U+FFFD per byte, so its
    text is only settled once the group is whole)."""
    vocab = len(tokenizer)
    if "<0x00>" not in tokenizer.get_vocab():
        return [rng.randrange(vocab) for _ in range(length)]
    ids: list[int] = []
    while len(ids) < length:
        pick = rng.random()
        if pick < 0.15:
            ids += [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in rng.choice("é€数😀\n\t").encode()]
        elif pick < 0.2:
            ids.append(rng.choice([1, 2]))  # <s>, </s>: skipped
        else:
            ids.append(rng.randrange(259, vocab))
    if rng.random() < 0.3:  # cut in the middle of a character (after a piece: bytes would join it)
        ids.append(rng.randrange(259, vocab))
        ids += [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()[: rng.randint(1, 2)]]
    return ids


def _stream(tokenizer, ids, chunks, stop=(), *, whole=False):
    released = []
    stream = TextStream(TextCodec(tokenizer), stop=stop, on_text=released.append)
    stream._windowed = not whole  # whole: decode every token at each feed (the reference)
    i = 0
    for size in chunks:
        stream.feed(ids[i : i + size])
        i += size
    stream.feed(ids[i:])
    stream.finish()
    return stream, released


def _cases(name: str, seed: int, count: int, shortest: int):
    """`count` random token sequences for the tokenizer `name`, with the generator that drew them."""
    tokenizer, rng = TOKENIZERS[name](), random.Random(seed)
    for _ in range(count):
        yield tokenizer, rng, random_ids(tokenizer, rng, rng.randint(shortest, 60))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_windowed_text_is_the_whole_decode_chunk_for_chunk(name):
    for tokenizer, rng, ids in _cases(name, seed=0, count=150, shortest=1):
        chunks = [rng.randint(0, 5) for _ in range(len(ids))]
        stream, released = _stream(tokenizer, ids, chunks)
        assert released == _stream(tokenizer, ids, chunks, whole=True)[1], (name, ids, chunks)
        assert "".join(released) == stream.text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_the_windowed_text_stops_where_the_whole_decode_has_the_stop_string(name):
    for tokenizer, rng, ids in _cases(name, seed=1, count=100, shortest=5):
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        if len(whole) < 6:
            continue
        at = rng.randrange(1, len(whole) - 3)
        stop = whole[at : at + rng.randint(1, 3)]
        chunks = [rng.randint(1, 4) for _ in ids]
        stream, released = _stream(tokenizer, ids, chunks, stop=[stop])
        assert released == _stream(tokenizer, ids, chunks, stop=[stop], whole=True)[1], (name, ids, chunks)
        assert stream.stopped and "".join(released) == stream.text == whole[: whole.find(stop)], (name, ids)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_feed_decodes_only_the_last_tokens_however_long_the_text(name):
    tokenizer = TOKENIZERS[name]()
    codec = TextCodec(tokenizer)
    decoded = []
    codec_decode = codec.decode
    codec.decode = lambda ids: decoded.append(len(ids)) or codec_decode(ids)
    ids = random_ids(tokenizer, random.Random(2), 2000)
    stream = TextStream(codec)
    for token in ids:
        stream.feed([token])
    stream.finish()
    assert stream.text == tokenizer.decode(ids, skip_special_tokens=True)
    decoded.pop()  # finish: the whole text, once
    assert sum(decoded) < 10 * len(ids)  # decoding the whole text at every feed: ~len(ids)^2 / 2
    assert sorted(decoded)[int(0.99 * len(decoded))] <= 16


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole():
    tokenizer = byte_level()
    tokenizer.clean_up_tokenization_spaces = True
    ids = tokenizer("x = f(a , b) .\n")["input_ids"]
    released = []
    stream = TextStream(TextCodec(tokenizer), on_text=released.append)
    for token in ids:
        stream.feed([token])
    stream.finish()
    assert not stream._windowed
    assert "".join(released) == stream.text == tokenizer.decode(ids, skip_special_tokens=True)
