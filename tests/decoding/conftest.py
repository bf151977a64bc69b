"""Tiny random models of several architectures, built once per session, and the exactness helper.

A larger `initializer_range` makes logits peaked, so float32 near-ties (which would make two
correct implementations disagree) are rare; on a mismatch the helper prints the top-2 margin.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import transformers as tf

from cllm.runtime.lean import cpu_paths, graphs
from cllm.runtime.lean import runner as lean

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
# llama and qwen2 decode through the lean runner (`cllm.runtime.lean.runner`), in float32 on its packed
# weights; "@unpacked" runs the same tests on its feature-major MKL path, "@rows" on its token-major
# one (`cpu_paths`: which of the three a machine runs fastest is measured at load), "@graphs" on
# its CUDA-graph path (every forward of a few tokens through the static buffers and the index
# writes, the graph stood in by `graphs.EagerGraph` on the CPU), "@transformers" on transformers'
# own forward, so every path passes every exactness test
PATHS = ARCHS + ["llama@unpacked", "qwen2@rows", "qwen2@graphs", "llama@transformers", "qwen2@transformers"]
_MODELS: dict[str, torch.nn.Module] = {}


def tiny_model(arch: str) -> torch.nn.Module:
    """A 2-layer random model (float32, eval), the same object for the whole session."""
    if arch not in _MODELS:
        torch.manual_seed(1234)
        _MODELS[arch] = tf.AutoModelForCausalLM.from_config(_config(arch)).float().eval()
    return _MODELS[arch]


@pytest.fixture(params=PATHS)
def arch(request):
    """An architecture's name, with the decoding forward it is tested on switched on."""
    name, _, path = request.param.partition("@")
    with lean.runner_enabled(path != "transformers"), lean.packed_enabled(path != "unpacked"), \
            cpu_paths.forced("rows" if path == "rows" else None), graphs_standing_in(path == "graphs"):
        yield name


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


def random_prompt(seed: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (1, length), generator=g)


@torch.inference_mode()
def top2_margin(model: torch.nn.Module, context: list[int]) -> float:
    """Gap between the two largest next-token logits after `context` (plain full forward)."""
    logits = model(input_ids=torch.tensor([context])).logits[0, -1]
    top = logits.topk(2).values
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
