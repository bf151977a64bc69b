"""A checkpoint as one GGUF file that llama.cpp loads (`cllm export --gguf`), written with the
`gguf` package: the architecture's hyperparameters, every weight under llama.cpp's name, and
the tokenizer as llama.cpp reads it, so that llama.cpp splits any text into the very ids the
model's own (Hugging Face) tokenizer gives.

What it knows:

- architectures: Llama (`llama`; llama.cpp rotates (2i, 2i+1) pairs where Hugging Face rotates
  (i, i + d/2), so the rows of the query and key projections are reordered per head) and
  Qwen2 (`qwen2`; the same rotation as Hugging Face, weights as they are);
- weights in f32, f16 or bf16 (1-D tensors, the norms and biases, stay f32 as llama.cpp wants);
- tokenizers: byte-level BPE (`tokenizers`' JSON) whose pre-tokenizer llama.cpp has under a
  name (`PRE_TOKENIZERS`): the GPT-2 split (the shipped models'), Qwen2's and Llama 3's.
  Anything else is refused in one line rather than written to tokenize differently.

What it does not know: rope scaling, sliding-window attention, sentencepiece vocabularies.
Quantization is llama.cpp's own (`cllm.runtime.llamacpp.quantize`, `cllm export --quantize`).

Everything up to the file itself (names, arrays, vocabulary, the refusals) is plain Python and
torch, tested without `gguf`; `gguf` is imported when a file is written or read (`cllm` works
without it, and a missing one is one line saying what to install). The few constants of the
format used below are llama.cpp's (`gguf-py/gguf/constants.py`); the tests that write files
check them against the installed `gguf`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

import torch
from packaging.version import Version

from cllm.core import __version__
from cllm.core.errors import UserError
from cllm.core.outputs import replacing

log = logging.getLogger(__name__)

GGUF_MIN = "0.17"
INSTALL_GGUF = f"the gguf package is not installed: pip install 'gguf>={GGUF_MIN}' (or pip install 'cllm[llamacpp]')"
# what this exporter writes into every file it makes (llama.cpp ignores keys it does not know)
SOURCE_KEY = "cllm.source"
OUT_TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# general.file_type (gguf.LlamaFileType) of each: ALL_F32, MOSTLY_F16, MOSTLY_BF16
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}
# tokenizer.ggml.token_type values (gguf.TokenType)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# the bench's --dtype -> the GGUF weights that decode like it
OUT_TYPE_OF_DTYPE = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "bfloat16": "bf16",
                     "bf16": "bf16"}

# Hugging Face pre-tokenizer -> llama.cpp's name for the same split (`tokenizer.ggml.pre`):
# `tokenizers`' ByteLevel with its own regex is GPT-2's split; the others are a Split on a regex
# followed by a regex-free ByteLevel, named by their regex.
GPT2_BYTE_LEVEL = "gpt-2"
_CONTRACTIONS, _WORDS, _REST = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|", r"[^\r\n\p{L}\p{N}]?\p{L}+|", \
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    _CONTRACTIONS + _WORDS + r"\p{N}|" + _REST: "qwen2",  # Qwen2, Qwen2.5: digits one by one
    _CONTRACTIONS + _WORDS + r"\p{N}{1,3}|" + _REST: "llama-bpe",  # Llama 3: up to three digits
}


def import_gguf():
    """The `gguf` package, or a one-line UserError saying what to install."""
    try:
        import gguf
    except ImportError:
        raise UserError(INSTALL_GGUF) from None
    try:
        version = installed_version("gguf")
    except PackageNotFoundError:  # importable but not installed as a distribution (a source tree)
        return gguf
    if Version(version) < Version(GGUF_MIN):
        raise UserError(f"gguf {version} is too old for cllm export: pip install 'gguf>={GGUF_MIN}'")
    return gguf


# ---------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class Architecture:
    """What llama.cpp needs to know of a model's shape."""

    name: str  # llama.cpp's architecture name (general.architecture)
    permute_qk: bool  # llama.cpp rotates adjacent pairs: reorder the q/k rows (Llama)
    context: int
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    tied: bool  # the output projection is the embedding (no output.weight is written)


ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


def _rope_theta(config) -> float:
    """The rope base; a scaled rope (linear, dynamic, YaRN, Llama 3's) is refused."""
    params = getattr(config, "rope_parameters", None) or {}  # transformers 5
    scaling = getattr(config, "rope_scaling", None) or {}  # transformers 4
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise UserError(f"cllm export does not write rope scaling ({kind!r}): only unscaled rope is supported")
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def architecture(config) -> Architecture:
    """The model's shape in llama.cpp's terms; a UserError for what llama.cpp would run otherwise."""
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        raise UserError(f"cllm export writes Llama and Qwen2 models, not {kind!r}")
    name, permute = ARCHITECTURES[kind]
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UserError(f"cllm export: activation {config.hidden_act!r} is not a {name} one (silu)")
    if getattr(config, "use_sliding_window", False):
        raise UserError("cllm export does not write sliding-window attention")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if kind == "qwen2" and head_dim * heads != config.hidden_size:
        raise UserError("cllm export: llama.cpp's qwen2 needs head_dim x heads == hidden_size")
    return Architecture(name, permute, config.max_position_embeddings, config.hidden_size,
                        config.num_hidden_layers, config.intermediate_size, heads,
                        getattr(config, "num_key_value_heads", None) or heads, head_dim, _rope_theta(config),
                        float(config.rms_norm_eps), bool(getattr(config, "tie_word_embeddings", False)))


# Hugging Face weight name (after `model.layers.{i}.`) -> llama.cpp's (gguf.TENSOR_NAMES: the
# MODEL_TENSOR member named in the comment), `blk.{i}.` before it
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",  # ATTN_NORM
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",  # ATTN_Q/K/V
    "self_attn.o_proj": "attn_output",  # ATTN_OUT
    "post_attention_layernorm": "ffn_norm",  # FFN_NORM
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",  # FFN_GATE/UP/DOWN
}
# TOKEN_EMBD, OUTPUT_NORM, OUTPUT
TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def pair_rotation(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection (or its bias) reordered from Hugging Face's half-split rotary
    pairs (i, i + d/2) to llama.cpp's adjacent pairs (2i, 2i + 1), head by head:
    row h*d + s*d/2 + j -> row h*d + 2j + s."""
    shape = weight.shape
    per_head = weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:])  # (H, 2, d/2, ...)
    return per_head.transpose(1, 2).reshape(shape)  # (H, d/2, 2, ...) flattened


def gguf_tensor_name(hf_name: str) -> str | None:
    """llama.cpp's name of a Hugging Face weight (`blk.3.attn_q.weight`); None for what llama.cpp
    does not read (rotary caches)."""
    stem, _, kind = hf_name.rpartition(".")
    if "rotary_emb" in stem:
        return None
    parts = stem.split(".")
    if stem in TOP_TENSORS:
        return f"{TOP_TENSORS[stem]}.{kind}"
    if parts[:2] == ["model", "layers"] and len(parts) > 3 and ".".join(parts[3:]) in LAYER_TENSORS:
        return f"blk.{int(parts[2])}.{LAYER_TENSORS['.'.join(parts[3:])]}.{kind}"
    raise UserError(f"cllm export: weight {hf_name!r} has no place in llama.cpp's model")


def gguf_tensors(model: torch.nn.Module, arch: Architecture, out_type: str) -> Iterator[tuple[str, Any]]:
    """(llama.cpp name, numpy array) for every weight: matrices in `out_type`, 1-D tensors in f32;
    bf16 goes as its raw bytes (numpy has no bfloat16), which the writer is told the type of."""
    for hf_name, weight in model.state_dict().items():
        name = gguf_tensor_name(hf_name)
        if name is None or (arch.tied and name.startswith("output.")):
            continue
        weight = weight.detach().to("cpu", torch.float32)
        if arch.permute_qk and name.split(".")[-2] in ("attn_q", "attn_k"):
            weight = pair_rotation(weight, arch.heads if ".attn_q." in name else arch.kv_heads)
        if weight.dim() == 1 or out_type == "f32":
            yield name, weight.contiguous().numpy()
        elif out_type == "f16":
            yield name, weight.to(torch.float16).contiguous().numpy()
        else:  # (rows, 2 * cols) uint8: the writer reads the element shape back from BF16's size
            yield name, weight.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()


# ---------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True)
class Vocab:
    """A tokenizer as llama.cpp's BPE reads it (`tokenizer.ggml.*`)."""

    tokens: list[str]  # by id; byte-level strings as in tokenizer.json
    types: list[int]  # gguf.TokenType per id
    merges: list[str]  # "left right", in rank order
    pre: str  # llama.cpp's pre-tokenizer name
    special: dict[str, int | None]  # bos / eos / pad / unk -> id
    add_bos: bool
    add_eos: bool


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for the pre-tokenizer of a tokenizer.json, or a UserError."""
    pre, normalizer = spec.get("pre_tokenizer") or {}, spec.get("normalizer")
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix"):
        raise UserError("cllm export writes byte-level BPE tokenizers only (tokenizer.json model type BPE)")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        name = GPT2_BYTE_LEVEL
    elif pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2:
        split, byte_level = pre["pretokenizers"]
        regex = (split.get("pattern") or {}).get("Regex")
        if (split.get("type") != "Split" or regex not in PRE_TOKENIZERS or byte_level.get("type") != "ByteLevel"
                or byte_level.get("use_regex", True) or byte_level.get("add_prefix_space")):
            raise UserError("cllm export: this tokenizer's pre-tokenizer (a Split on an unknown regex) has no "
                            "llama.cpp equivalent it knows")
        name = PRE_TOKENIZERS[regex]
    else:
        raise UserError(f"cllm export: pre-tokenizer {pre.get('type')!r} has no llama.cpp equivalent it knows "
                        "(byte-level BPE with the GPT-2, Qwen2 or Llama 3 split)")
    if normalizer is not None and not (name == "qwen2" and normalizer.get("type") == "NFC"):
        raise UserError(f"cllm export: llama.cpp applies no {normalizer.get('type')!r} normalizer before BPE")
    if bool(model.get("ignore_merges")) != (name == "llama-bpe"):  # llama.cpp sets it by the name
        raise UserError("cllm export: the tokenizer's ignore_merges differs from what llama.cpp assumes for "
                        f"{name!r}")
    return name


def gguf_vocab(tokenizer, n_vocab: int) -> Vocab:
    """The model's tokenizer in llama.cpp's terms, padded to the embedding's `n_vocab` rows."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError("cllm export needs a fast (tokenizers) tokenizer with a tokenizer.json")
    spec = json.loads(backend.to_str())
    pre = pre_tokenizer_name(spec)
    tokens: dict[int, str] = {i: t for t, i in spec["model"]["vocab"].items()}
    types = dict.fromkeys(tokens, NORMAL)
    for added in spec.get("added_tokens", []):  # their text is matched as it is, not as bytes
        tokens[added["id"]] = added["content"]
        types[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    if max(tokens) >= n_vocab:
        raise UserError(f"cllm export: the tokenizer has id {max(tokens)}, beyond the model's {n_vocab} embeddings")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"].get("merges", [])]
    probe_plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    probe = tokenizer("a")["input_ids"]  # what the tokenizer adds on its own (prompt_ids keeps it)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return Vocab(
        tokens=[tokens.get(i, f"[PAD{i}]") for i in range(n_vocab)],
        types=[types.get(i, UNUSED) for i in range(n_vocab)],
        merges=merges, pre=pre,
        special={"bos": bos, "eos": eos, "pad": tokenizer.pad_token_id, "unk": tokenizer.unk_token_id},
        add_bos=bos is not None and len(probe) > len(probe_plain) and probe[0] == bos,
        add_eos=eos is not None and len(probe) > len(probe_plain) and probe[-1] == eos)


# ---------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class GgufSummary:
    path: Path
    architecture: str
    out_type: str
    tensors: int
    parameters: int
    vocab: int
    pre_tokenizer: str
    bytes: int
    side: str | None = None  # what went into the side folder, in words
    lookup_cache: str | None = None  # what --lookup-cache wrote, in words

    def line(self) -> str:
        text = (f"wrote {self.path} ({self.bytes / 2**20:.1f} MiB): llama.cpp {self.architecture}, "
                f"{self.parameters:,} parameters in {self.tensors} tensors ({self.out_type}), "
                f"BPE vocabulary of {self.vocab} with the {self.pre_tokenizer!r} pre-tokenizer")
        return "\n".join([text, *(x for x in (self.side, self.lookup_cache) if x)])


def _write_metadata(writer, arch: Architecture, vocab: Vocab, out_type: str, name: str,
                    source: dict[str, Any]) -> None:
    writer.add_name(name)
    writer.add_file_type(FILE_TYPES[out_type])
    writer.add_context_length(arch.context)
    writer.add_embedding_length(arch.hidden)
    writer.add_block_count(arch.layers)
    writer.add_feed_forward_length(arch.ffn)
    writer.add_head_count(arch.heads)
    writer.add_head_count_kv(arch.kv_heads)
    writer.add_key_length(arch.head_dim)
    writer.add_value_length(arch.head_dim)
    writer.add_rope_dimension_count(arch.head_dim)
    writer.add_rope_freq_base(arch.rope_theta)
    writer.add_layer_norm_rms_eps(arch.rms_eps)
    writer.add_vocab_size(len(vocab.tokens))
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for role, token_id in vocab.special.items():
        if token_id is not None:
            getattr(writer, f"add_{role}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_string(SOURCE_KEY, json.dumps(source, sort_keys=True))


def write_gguf(model: torch.nn.Module, tokenizer, path: str | os.PathLike, *, out_type: str = "f32",
               name: str = "model", source: dict[str, Any] | None = None) -> GgufSummary:
    """Write `model` (a Llama or Qwen2 causal LM) and its `tokenizer` to `path` as GGUF; the file
    appears whole or not at all. `source`: what it was made from, stored under `cllm.source`."""
    if out_type not in OUT_TYPES:
        raise UserError(f"unknown GGUF type {out_type!r}; choose one of {', '.join(OUT_TYPES)}")
    gguf = import_gguf()
    arch = architecture(model.config)
    n_vocab = model.get_input_embeddings().weight.shape[0]
    vocab = gguf_vocab(tokenizer, n_vocab)
    path = Path(path)
    with replacing(path) as tmp:  # never a half-written file under the real name
        writer = gguf.GGUFWriter(str(tmp), arch.name)
        source = {"exporter": f"cllm {__version__}", **(source or {})}
        _write_metadata(writer, arch, vocab, out_type, name, source)
        tensors = parameters = 0
        for tensor_name, array in gguf_tensors(model, arch, out_type):
            raw = gguf.GGMLQuantizationType.BF16 if array.dtype.name == "uint8" else None
            writer.add_tensor(tensor_name, array, raw_dtype=raw)
            tensors += 1
            parameters += array.size // (2 if raw is not None else 1)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return GgufSummary(path, arch.name, out_type, tensors, parameters, n_vocab, vocab.pre, path.stat().st_size)


def read_source(path: str | os.PathLike) -> dict[str, Any] | None:
    """What a GGUF file cllm wrote was made from (`cllm.source`), or None for any other file."""
    gguf = import_gguf()
    try:
        field_ = gguf.GGUFReader(str(path)).get_field(SOURCE_KEY)
        return json.loads(field_.contents()) if field_ is not None else None
    except Exception:  # noqa: BLE001 - not a GGUF file, or a damaged one: not ours to replace
        return None
