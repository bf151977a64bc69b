"""A byte-level BPE tokenizer for the embedded corpus, trained with `tokenizers`.

Byte-level means every string round-trips exactly (unicode, tabs, runs of spaces) and there is
no unknown token. One special token, `<|endoftext|>`, separates documents and serves as EOS,
BOS and pad. The tokenizer does not add it by itself: the caller decides where documents end.
It is saved as a `PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained(dir)` loads it
offline.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cllm.data.corpus import Corpus

EOT = "<|endoftext|>"


def train_tokenizer(
    texts: Iterable[str], *, vocab_size: int = 8192, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on `texts`; `<|endoftext|>` gets id 0."""
    if vocab_size < 256 + 1:
        raise ValueError(f"vocab_size must cover the 256 bytes plus {EOT}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # GPT-2's split regex keeps indentation runs together, which suits code.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return wrap(tok)


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def tokenizer_sha256(tokenizer: PreTrainedTokenizerFast) -> str:
    """sha256 of the serialized tokenizer (vocab, merges, normalisation, special tokens)."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(directory)
    # transformers 5 writes its own class name; the generic one loads on 4.x and 5.x alike.
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    return directory


def token_stream(corpus: Corpus, tokenizer) -> torch.Tensor:
    """All documents of a split as one (N,) int64 stream, each followed by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids(EOT)
    encoded = tokenizer([doc.text for doc in corpus.documents], add_special_tokens=False)
    ids: list[int] = []
    for doc_ids in encoded["input_ids"]:
        ids.extend(doc_ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)
