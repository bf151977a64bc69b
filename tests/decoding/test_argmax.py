"""The greedy choice (`cllm.decoding.argmax`): torch's indices, faster on CPU logits."""

import torch

from cllm.decoding.argmax import argmax


def test_the_blocked_argmax_gives_torchs_indices_on_feature_major_logits_ties_included():
    generator = torch.Generator().manual_seed(5)
    by_vocab = torch.randn(1024, 3 * 40, generator=generator)  # (V, B * L), as the lean runtime makes them
    by_vocab[700, 0] = by_vocab[900, 0] = by_vocab[10, 0] = 9.0  # a tie across blocks: the first wins
    by_vocab[300, 1] = by_vocab[301, 1] = 9.0  # a tie within a block
    by_vocab[:, 2] = 0.0  # a tie everywhere
    logits = by_vocab.t().view(3, 40, 1024)
    got = argmax(logits)
    assert torch.equal(got, logits.argmax(-1))
    assert got[0, :3].tolist() == [10, 300, 0]
    assert torch.equal(argmax(logits.contiguous()), logits.argmax(-1))  # other layouts: numpy's, the same


def test_nan_counts_as_the_largest_as_in_torch():
    logits = torch.tensor([[0.0, float("nan"), 3.0], [1.0, 2.0, 2.0]])
    assert argmax(logits).tolist() == logits.argmax(-1).tolist() == [1, 1]
