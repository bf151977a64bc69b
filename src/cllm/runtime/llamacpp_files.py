"""What llama.cpp does with a GGUF file besides decoding it: quantize it (`quantize`, llama.cpp's
own quantizer, for `cllm export --quantize` and `cllm bench --forward-shapes`), and tokenize with
its vocabulary (`LlamaCppTokenizer`, for a GGUF file without the side folder `cllm export`
writes)."""

from __future__ import annotations

import ctypes
import os

from transformers import BatchEncoding

from cllm.runtime.choices import QUANT_TYPES
from cllm.runtime.llamacpp import LlamaCppRuntime, checked_api


def quantize(source: str | os.PathLike, out: str | os.PathLike, kind: str, *, threads: int = 0) -> None:
    """Write `source` (a GGUF file) quantized to `kind` (`QUANT_TYPES`) at `out`, with llama.cpp's
    own quantizer; a ValueError when it fails."""
    if kind not in QUANT_TYPES:
        raise ValueError(f"unknown quantization {kind!r}; choose one of {', '.join(QUANT_TYPES)}")
    llama_cpp = checked_api()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = QUANT_TYPES[kind], threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise ValueError(f"llama.cpp could not quantize {source} to {kind}")


class LlamaCppTokenizer:
    """A GGUF file's own tokenizer (llama.cpp's), as far as cllm's commands use a Hugging Face
    one: callable (`input_ids`, `attention_mask`, `return_tensors`), `encode`, `decode`,
    `eos_token_id` / `bos_token_id` / `pad_token_id`, `len()`. For a GGUF without the side
    folder `cllm export` writes (which holds the model's own tokenizer)."""

    chat_template = None

    def __init__(self, runtime: LlamaCppRuntime) -> None:
        self._llama_cpp, self._vocab, self._runtime = runtime._llama_cpp, runtime.vocab, runtime
        eos, bos = self._llama_cpp.llama_vocab_eos(self._vocab), self._llama_cpp.llama_vocab_bos(self._vocab)
        self.eos_token_id = eos if eos >= 0 else None
        self.bos_token_id = bos if bos >= 0 else None
        self.pad_token_id = self.eos_token_id
        self.name_or_path = str(runtime.path)
        self._add_bos = bool(self._llama_cpp.llama_vocab_get_add_bos(self._vocab))

    def __len__(self) -> int:
        return self._runtime.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        while True:
            tokens = (ctypes.c_int32 * size)()
            n = self._llama_cpp.llama_tokenize(self._vocab, data, len(data), tokens, size,
                                               add_special_tokens and self._add_bos, True)
            if n >= 0:
                return list(tokens[:n])
            size = -n

    def __call__(self, text: str | list[str], return_tensors: str | None = None, add_special_tokens: bool = True,
                 **_: object):
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t, add_special_tokens) for t in texts]
        if return_tensors is not None and len({len(i) for i in ids}) > 1:
            raise ValueError("prompts of different lengths: tokenize them one at a time")
        data = {"input_ids": ids if not isinstance(text, str) else ids[0]}
        data["attention_mask"] = [[1] * len(i) for i in ids] if not isinstance(text, str) else [1] * len(ids[0])
        if return_tensors is not None and isinstance(text, str):
            data = {k: [v] for k, v in data.items()}
        return BatchEncoding(data, tensor_type=return_tensors)

    def decode(self, ids, skip_special_tokens: bool = False, **_: object) -> str:
        """Each token's piece, as llama.cpp's tools print them (`llama_detokenize` would also
        apply llama.cpp's clean-up of spaces for some vocabularies, which the text never had)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if ids and isinstance(ids[0], list):
            raise ValueError("decode takes one sequence of ids")
        lib, vocab, out = self._llama_cpp, self._vocab, bytearray()
        size = 64
        buf = ctypes.create_string_buffer(size)
        for token in ids:
            if skip_special_tokens and lib.llama_vocab_is_control(vocab, token):
                continue
            n = lib.llama_token_to_piece(vocab, token, buf, size, 0, not skip_special_tokens)
            if n < 0:  # a longer piece: a buffer that holds it
                size = -n
                buf = ctypes.create_string_buffer(size)
                n = lib.llama_token_to_piece(vocab, token, buf, size, 0, not skip_special_tokens)
            out += buf.raw[:n]
        return out.decode("utf-8", errors="replace")
