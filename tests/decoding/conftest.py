"""Tiny random models of several architectures, built once per session, and the exactness helper.

A larger `initializer_range` makes logits peaked, so float32 near-ties (which would make two
correct implementations disagree) are rare; on a mismatch the helper prints the top-2 margin.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cllm.runtime import Runtime, as_runtime, open_runtime
from cllm.runtime.lean import graphs

VOCAB = 256
MAX_POSITIONS = 256


def _config(arch: str):
    common = dict(
        vocab_size=VOCAB, initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=0
    )
    if arch == "gpt2":
        return tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=MAX_POSITIONS, **common)
    sizes = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
    )
    if arch == "gpt-neox":
        return tf.GPTNeoXConfig(**sizes, **common)
    kv_heads = dict(num_key_value_heads=2)
    configs = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "phi3": tf.Phi3Config}
    return configs[arch](**sizes, **kv_heads, **common)


ARCHS = ["llama", "qwen2", "gpt2", "gpt-neox", "phi3"]
# A plain name decodes on the model's "auto" runtime: llama and qwen2 on the lean runtime
# (`cllm.runtime.lean`, float32 on its packed weights), the others on transformers'. The same
# tests run on the lean runtime's feature-major MKL layout ("@gemm"), its token-major one
# ("@rows"; which of the three a machine runs fastest is measured at load), its CUDA-graph path
# ("@graphs": every forward of a few tokens through the static buffers and the index writes, the
# graph stood in by `graphs.EagerGraph` on the CPU) and on the transformers runtime
# ("@transformers"), so every runtime and path passes every exactness test
PATHS = ARCHS + ["llama@gemm", "qwen2@rows", "qwen2@graphs", "llama@transformers", "qwen2@transformers"]
# ... and the llama.cpp runtime ("@llamacpp": the model exported to an f32 GGUF file), run by
# `make test-llamacpp` in the environment that has llama-cpp-python
LLAMACPP_PATHS = [pytest.param(f"{a}@llamacpp", marks=pytest.mark.llamacpp) for a in ("llama", "qwen2")]
_MODELS: dict[str, torch.nn.Module] = {}
_RUNTIMES: dict[str, Runtime] = {}
_GGUF_DIR: list = []  # the session's folder for GGUF exports, made on first use


def tiny_module(arch: str) -> torch.nn.Module:
    """A 2-layer random transformers model (float32, eval) of the architecture `arch` names (its
    "@path" ignored), the same object for the whole session."""
    name = arch.partition("@")[0]
    if name not in _MODELS:
        torch.manual_seed(1234)
        _MODELS[name] = tf.AutoModelForCausalLM.from_config(_config(name)).float().eval()
    return _MODELS[name]


def tiny_model(arch: str) -> torch.nn.Module | Runtime:
    """What the decoders are tested on: the model (on its "auto" runtime) for a plain name, the
    runtime "@path" names otherwise (made once per session)."""
    if "@" not in arch:
        return tiny_module(arch)
    if arch not in _RUNTIMES:
        _RUNTIMES[arch] = on_path(arch, tiny_module(arch))
    return _RUNTIMES[arch]


def module_of(model: torch.nn.Module | Runtime) -> torch.nn.Module:
    """The transformers model a runtime runs (a model itself as it is)."""
    return model if isinstance(model, torch.nn.Module) else model.model


def on_path(arch: str, model: torch.nn.Module) -> torch.nn.Module | Runtime:
    """`model` on the runtime `arch`'s "@path" names (itself, on its "auto" one, for none)."""
    path = arch.partition("@")[2]
    if not path:
        return model
    if path == "llamacpp":
        return on_llamacpp(model)
    runtime, options = {"transformers": ("transformers", {}), "gemm": ("lean", {"path": "gemm"}),
                        "rows": ("lean", {"path": "rows"}), "graphs": ("lean", {})}[path]
    return open_runtime(model, runtime, **options)


def on_llamacpp(model: torch.nn.Module) -> Runtime:
    """`model` (float32) exported to a GGUF file with a byte-level vocabulary of its size, on the
    llama.cpp runtime (2 threads)."""
    from cllm.runtime.gguf import write_gguf
    from cllm.runtime.llamacpp import LlamaCppRuntime

    if not _GGUF_DIR:
        _GGUF_DIR.append(tempfile.TemporaryDirectory(prefix="cllm-test-gguf-"))
    path = Path(_GGUF_DIR[0].name) / f"{len(list(Path(_GGUF_DIR[0].name).iterdir()))}.gguf"
    write_gguf(model.float(), byte_tokenizer(model.config.vocab_size), path)
    return LlamaCppRuntime(path, threads=2, context=4096)


def byte_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly `size` ids (3 or more: the first size - 1 byte
    symbols and one merge of the first two): what a GGUF file needs to name a tiny model's ids;
    never used to tokenize here."""
    chars = sorted(pre_tokenizers.ByteLevel.alphabet())[: size - 1]
    vocab = {ch: i for i, ch in enumerate([*chars, chars[0] + chars[1]])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(chars[0], chars[1])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)


@pytest.fixture(params=PATHS + LLAMACPP_PATHS)
def arch(request):
    """An architecture's name and the runtime it is tested on ("llama", "qwen2@rows",
    "llama@llamacpp", ...)."""
    with graphs_standing_in(request.param.endswith("@graphs")):
        yield request.param


@pytest.fixture(params=PATHS)
def torch_arch(request):
    """The same, on the torch runtimes only: for tests of what needs the transformers model or
    its hidden states (Medusa, EAGLE, the oracles, the lean runtime's own tests), which the
    llama.cpp runtime does not give."""
    with graphs_standing_in(request.param.endswith("@graphs")):
        yield request.param


@contextmanager
def graphs_standing_in(on: bool) -> Iterator[None]:
    """Within (when `on`): the lean runner replays every forward of up to `graphs.MAX_TOKENS` fed
    tokens from a graph, captured the first time its shape is fed, `graphs.EagerGraph` standing in
    for CUDA's (this runs on the CPU)."""
    if not on:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graphs, "GRAPH_KIND", graphs.EagerGraph)
        patch.setattr(graphs, "CAPTURE_AT", 1)
        yield


class Spied:
    """A runtime whose sessions note the logits' dtype of every forward they run (`seen`), and
    that answers everything else as the runtime it wraps."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime, self.seen = runtime, []

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def session(self):
        session, seen = self.runtime.session(), self.seen

        def noting(call):
            def noted(*args, **kwargs):
                out = call(*args, **kwargs)
                seen.append((out[1] if isinstance(out, tuple) else out).logits.dtype)
                return out
            return noted

        session.open, session.feed = noting(session.open), noting(session.feed)
        return session


def random_prompt(seed: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (1, length), generator=g)


@torch.inference_mode()
def top2_margin(model: torch.nn.Module | Runtime, context: list[int]) -> float:
    """Gap between the two largest next-token logits after `context` (one forward of the runtime)."""
    session = as_runtime(model).session()
    rows, out = session.open([context])
    session.close(rows)
    top = out.logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def assert_same_tokens(
    model, prompt: list[int], expected: list[int], got: list[int], what: str = ""
) -> None:
    """Token-for-token equality; on a mismatch say where and how close the call was."""
    if expected == got:
        return
    k = next(
        (i for i, (e, g) in enumerate(zip(expected, got, strict=False)) if e != g),
        min(len(expected), len(got)),
    )
    margin = top2_margin(model, prompt + expected[:k])
    raise AssertionError(
        f"{what}: first difference at new token {k} (expected {expected[k : k + 3]}, got {got[k : k + 3]}, "
        f"lengths {len(expected)} vs {len(got)}); top-2 logit margin there {margin:.3g} "
        f"({'a numerical near-tie' if margin < 1e-3 else 'NOT a near-tie: a bug'})"
    )


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, T - p.shape[1] :] = p[0]
        mask[r, T - p.shape[1] :] = 1
    return ids, mask
