"""Training forwards: the shared-prefix forward computes what separate rows compute."""

import itertools
import math
from collections import Counter

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from cllm.modeling.forwards import (
    BlockGroup,
    enable_checkpointing,
    forward_blocks,
    forward_shared_prefix,
    rows_from_lists,
)
from cllm.training.batches import pick_states
from tests.chisquare import chi_square


def tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("checkpointing", [None, "transformers", "torch-wrapper"])
def test_shared_prefix_forward_equals_separate_rows_in_values_and_gradients(checkpointing):
    g = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (5, 9, 3)]
    # blocks: two per prefix for rows 0 and 2, one for row 1, some shorter (right-padded)
    owner = [0, 0, 1, 2, 2]
    blocks = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (6, 6, 4, 6, 2)]
    model = tiny()
    # checkpointed layers cannot keep the cache (transformers drops it; torch's wrapper, FSDP's
    # activation checkpointing, would replay its writes): every block gets its own prefix row
    if checkpointing == "transformers":
        enable_checkpointing(model)
    elif checkpointing == "torch-wrapper":
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
    separate = rows_from_lists([prefixes[o] for o in owner], blocks, pad_id=0)
    model.zero_grad()
    expected = forward_blocks(model, separate)
    valid = separate.block_mask.bool()
    (expected.square().mean(-1)[valid]).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]

    shared = rows_from_lists(prefixes, [[1]] * 3, pad_id=0)
    model.zero_grad()
    (got,) = forward_shared_prefix(model, shared.prefix_ids, shared.prefix_mask,
                                   [BlockGroup(separate.block_ids, separate.block_mask, torch.tensor(owner))])
    (got.square().mean(-1)[valid]).sum().backward()
    assert torch.allclose(got[valid], expected[valid], atol=1e-5)
    for p, w in zip(model.parameters(), want, strict=True):
        assert torch.allclose(p.grad, w, atol=1e-5)


def test_stop_gradient_group_keeps_no_graph_and_matches():
    g = torch.Generator().manual_seed(2)
    prefixes = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (4, 7)]
    blocks = [torch.randint(1, 40, (5,), generator=g).tolist() for _ in range(2)]
    model = tiny(3)
    expected = forward_blocks(model, rows_from_lists(prefixes, blocks, pad_id=0))
    rows = rows_from_lists(prefixes, blocks, pad_id=0)
    (got,) = forward_shared_prefix(model, rows.prefix_ids, rows.prefix_mask,
                                   [BlockGroup(rows.block_ids, rows.block_mask, torch.arange(2), grad=False)])
    assert not got.requires_grad
    assert torch.allclose(got, expected, atol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_pick_states_draws_distinct_non_fixed_states_uniformly(k):
    """Records of 1, 2, 4 and 9 states (0, 1, 3, 8 non-fixed), M = 50,000 of each in one call.
    The set of picks of a record with m non-fixed states must be uniform over the C(m, k)
    subsets: Pearson's chi-square (tests/chisquare.py) rejects at p < 1e-6. At k = 1, moving
    0.015 of probability onto one state is rejected with probability 0.9999 (simulated; 0.8 for
    0.01), where the former check (2000 draws, each share within 0.05) passed a shift of 0.05."""
    M = 50_000
    num_states = torch.tensor([1, 2, 4, 9]).repeat(M)  # (4M,)
    g = torch.Generator().manual_seed(0)
    picks, exists = pick_states(torch.rand(4 * M, 9, generator=g), num_states, k)
    assert picks.shape == exists.shape == (4 * M, k)
    subsets = {3: Counter(), 8: Counter()}
    for n, row, real in zip(num_states.tolist(), picks.tolist(), exists.tolist()):
        chosen = [j for j, e in zip(row, real) if e]
        assert len(chosen) == min(k, n - 1) == len(set(chosen)) and all(j < n - 1 for j in chosen)
        if n - 1 in subsets:
            subsets[n - 1][tuple(sorted(chosen))] += 1
    for m, counts in subsets.items():
        if k >= m:  # one subset, all of them: checked above
            continue
        law = {c: 1 / math.comb(m, k) for c in itertools.combinations(range(m), k)}
        result = chi_square(counts, law)
        assert not result.rejects(), f"{m} non-fixed states, k = {k}: {result}"
