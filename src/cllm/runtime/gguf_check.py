"""A GGUF file's header checked against what llama.cpp asserts on, before llama.cpp reads it.

llama.cpp refuses most malformed files with an error it logs (a truncation, a bad magic, a
tensor of the wrong shape), but a few header values trip a `GGML_ASSERT` in its loader instead
(`llama_model_base::load_hparams`, llama-cpp-python 0.3.36), which aborts the whole process
(SIGABRT): a block count outside 1..`MAX_LAYERS`, more next-token-prediction layers than
blocks, expert counts that do not fit together, an unknown rope scaling type. Those are
refused here in one line, with the hyper-parameters llama.cpp would take in silence and our
runtime cannot use (a context length of 0) and the inconsistencies that are cheap to name
plainly (the block count against the `blk.N.*` tensors, head counts against the embedding
length, the vocabulary against `token_embd`'s shape).

The header is read with the `gguf` package's reader, which memory-maps the file: its tensor
data is never read, so the check costs the same on a 100 MB file as on a 100 kB one. A file
the reader cannot parse is left to llama.cpp, which refuses it in one line of its own.
"""

from __future__ import annotations

import os
import re

import numpy as np

MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS (src/llama-hparams.h)
MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
ROPE_SCALING = ("none", "linear", "yarn", "longrope")  # LLAMA_ROPE_SCALING_TYPES
_BLOCK = re.compile(r"blk\.(\d+)\.")


def check_gguf(path: str | os.PathLike) -> None:
    """A one-line ValueError naming the first header value of the GGUF at `path` that would
    abort llama.cpp or that contradicts the file's tensors; None when there is none."""
    try:
        import gguf

        reader = gguf.GGUFReader(os.fspath(path))
    except Exception:  # noqa: BLE001 - not readable as GGUF here: llama.cpp says why in one line
        return
    problem = _problem(reader)
    if problem is not None:
        raise ValueError(f"{os.fspath(path)} is not a model llama.cpp can load: {problem}")


def _scalar(reader, key: str):
    """A field's value: a number (the largest element of a numeric array), a string, or None."""
    import gguf

    field = reader.fields.get(key)
    if field is None or not field.data or not field.types:
        return None
    kind = field.types[-1]  # an array's element type comes last
    try:
        if kind == gguf.GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        return max(np.asarray(field.parts[i]).ravel()[0].item() for i in field.data)
    except (ValueError, IndexError, TypeError):
        return None


def _problem(reader) -> str | None:
    arch = _scalar(reader, "general.architecture")
    if not isinstance(arch, str):
        return None  # llama.cpp refuses a file without one
    def key(name: str):
        return _scalar(reader, f"{arch}.{name}")

    blocks = key("block_count")
    if blocks is not None and not 1 <= blocks <= MAX_LAYERS:
        return f"{arch}.block_count is {blocks}, not 1..{MAX_LAYERS}"
    if (problem := _experts(key, arch, blocks)) is not None:
        return problem
    scaling = key("rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING:
        return f"{arch}.rope.scaling.type is {scaling!r}, not one of {', '.join(ROPE_SCALING)}"
    context = key("context_length")
    if context is not None and context < 1:
        return f"{arch}.context_length is {context}, not at least 1"
    names = [t.name for t in reader.tensors]
    present = {int(m.group(1)) for name in names if (m := _BLOCK.match(name))}
    if blocks is not None and present and present != set(range(blocks)):
        return f"{arch}.block_count is {blocks}, but the file's blocks are blk.{min(present)}..blk.{max(present)}"
    width, heads, kv_heads = key("embedding_length"), key("attention.head_count"), key("attention.head_count_kv")
    if width is not None and width < 1:
        return f"{arch}.embedding_length is {width}, not at least 1"
    if heads is not None and key("attention.key_length") is None and (heads < 1 or (width or 0) % heads):
        return f"{arch}.attention.head_count {heads} does not divide {arch}.embedding_length {width}"
    if heads is not None and kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        return f"{arch}.attention.head_count_kv {kv_heads} does not divide {arch}.attention.head_count {heads}"
    return _vocabulary(reader, arch, width)


def _experts(key, arch: str, blocks: int | None) -> str | None:
    """llama.cpp's asserts on the mixture-of-experts counts and the next-token layers."""
    nextn = key("nextn_predict_layers") or 0
    if blocks is not None and nextn > blocks:
        return f"{arch}.nextn_predict_layers is {nextn}, more than {arch}.block_count {blocks}"
    experts, used = key("expert_count") or 0, key("expert_used_count") or 0
    groups, groups_used = key("expert_group_count") or 0, key("expert_group_used_count") or 0
    if experts > MAX_EXPERTS:
        return f"{arch}.expert_count is {experts}, more than {MAX_EXPERTS}"
    if used > experts:
        return f"{arch}.expert_used_count is {used}, more than {arch}.expert_count {experts}"
    if experts and not used:
        return f"{arch}.expert_count is {experts} but {arch}.expert_used_count is 0"
    if groups and groups >= max(experts, 1):
        return f"{arch}.expert_group_count is {groups}, not fewer than {arch}.expert_count {experts}"
    if groups > 1 and (experts % groups or not 0 < groups_used < groups):
        return (f"{arch}.expert_group_count {groups} does not divide {arch}.expert_count {experts}, or "
                f"{arch}.expert_group_used_count {groups_used} is not 1..{groups - 1}")
    return None


def _vocabulary(reader, arch: str, width: int | None) -> str | None:
    """The vocabulary's size (its token list) against `token_embd`'s rows."""
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if tokens is None or embed is None or len(embed.shape) < 2:
        return None
    n_vocab, rows = len(tokens.data), int(embed.shape[1])  # GGUF shapes list the fastest dimension first
    if n_vocab != rows:
        return f"its vocabulary has {n_vocab} tokens, token_embd.weight {rows} rows"
    if width is not None and int(embed.shape[0]) != width:
        return f"{arch}.embedding_length is {width}, token_embd.weight's rows are {int(embed.shape[0])} wide"
    return None
