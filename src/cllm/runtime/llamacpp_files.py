"""What llama.cpp does with a GGUF file besides decoding it: quantize it (`quantize`, llama.cpp's
own quantizer, for `cllm export --quantize` and `cllm bench --forward-shapes`), and tokenize with
its vocabulary, render its chat template and know its end-of-turn tokens (`LlamaCppTokenizer`,
for a GGUF file without the side folder `cllm export` writes)."""

from __future__ import annotations

import ctypes
import os

from transformers import BatchEncoding
from transformers.utils.chat_template_utils import render_jinja_template

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
    `eos_token_id` / `bos_token_id` / `pad_token_id`, `len()`, and the file's chat template
    (`chat_template`, `apply_chat_template`). For a GGUF without the side folder `cllm export`
    writes (which holds the model's own tokenizer).

    `eos_token_ids`: every id llama.cpp ends generation at (`llama_vocab_is_eog`: EOS, and the
    end-of-turn tokens it knows, such as `<|im_end|>` or `<|eot_id|>`)."""

    def __init__(self, runtime: LlamaCppRuntime) -> None:
        self._llama_cpp, self._vocab, self._runtime = runtime._llama_cpp, runtime.vocab, runtime
        lib, vocab = self._llama_cpp, self._vocab
        eos, bos = lib.llama_vocab_eos(vocab), lib.llama_vocab_bos(vocab)
        self.eos_token_id = eos if eos >= 0 else None
        self.bos_token_id = bos if bos >= 0 else None
        self.pad_token_id = self.eos_token_id
        self.name_or_path = str(runtime.path)
        self._add_bos = bool(lib.llama_vocab_get_add_bos(vocab))
        self.eos_token_ids = frozenset(t for t in range(runtime.vocab_size) if lib.llama_vocab_is_eog(vocab, t))
        template = lib.llama_model_chat_template(runtime._model, None)  # tokenizer.chat_template, or None
        self.chat_template: str | None = template.decode("utf-8", errors="replace") if template else None

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The special tokens' text by role, as a Hugging Face tokenizer's (what a chat template
        reads as `bos_token`, `eos_token`, `pad_token`)."""
        ids = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id, "pad_token": self.pad_token_id}
        return {role: self.decode([i]) for role, i in ids.items() if i is not None}

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs):
        """The conversation (a list of messages, or a list of such lists) written by the chat
        template, as a Hugging Face tokenizer's `apply_chat_template` writes it: transformers'
        own renderer (its sandboxed Jinja environment: a template cannot reach Python's
        internals), with the special tokens' text (`special_tokens_map`) and `kwargs` as the
        template's variables. `tokenize`: the ids (`return_dict`: as a `BatchEncoding`)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"{self.name_or_path} has no chat template (no tokenizer.chat_template in its metadata)")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        chats = [[_plain_message(m) for m in chat] for chat in (conversation if batched else [conversation])]
        rendered, _ = render_jinja_template(
            conversations=chats, tools=tools, documents=documents, chat_template=template,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **{**self.special_tokens_map, **kwargs})
        texts = rendered if batched else rendered[0]
        if not tokenize:
            return texts
        if return_dict:
            return self(texts, add_special_tokens=False)  # the template writes any BOS itself
        ids = [self.encode(text, add_special_tokens=False) for text in rendered]
        return ids if batched else ids[0]

    def __deepcopy__(self, memo) -> LlamaCppTokenizer:
        """Itself: it reads the runtime's vocabulary, which is never written, and a copy must
        not copy the runtime (its model would be freed twice)."""
        return self

    def __len__(self) -> int:
        return self._runtime.vocab_size

    def convert_ids_to_tokens(self, ids):
        """Each id's token as the vocabulary holds it (llama.cpp's text of it, byte-level BPE's
        `Ġ` for a space included), as a Hugging Face tokenizer's; one id gives one token."""
        one = isinstance(ids, int)
        texts = [self._llama_cpp.llama_vocab_get_text(self._vocab, i).decode("utf-8", errors="replace")
                 for i in ([ids] if one else ids)]
        return texts[0] if one else texts

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


def _plain_message(message) -> dict:
    """A message as transformers hands it to a template: its keys without a value (None) left
    out (an OpenAI client's `content=None` would otherwise render as the text 'None')."""
    return {key: value for key, value in dict(message).items() if value is not None}
