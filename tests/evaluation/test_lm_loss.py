"""The one held-out LM loss against transformers' own forward: every continuation token scored once,
padding and batching change nothing, text windows score what the training loss scores."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.evaluation.lm_loss import lm_loss, stream_windows, text_loss
from cllm.modeling.forwards import window_loss


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


def reference(model, prompts, continuations) -> float:
    """Each pair alone through the model's own forward; CE of the continuation's tokens, pooled."""
    total, count = 0.0, 0
    for p, c in zip(prompts, continuations, strict=True):
        ids = torch.tensor([list(p) + list(c)])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1 : -1]  # the positions that predict c
        total += float(F.cross_entropy(logits.float(), torch.tensor(c), reduction="sum"))
        count += len(c)
    return total / count


def test_lm_loss_equals_each_pair_scored_alone_whatever_the_batch(model):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (3, 9, 1, 6, 12)]
    continuations = [torch.randint(1, 61, (n,), generator=g).tolist() for n in (5, 2, 8, 0, 4)]
    expected = reference(model, [p for p, c in zip(prompts, continuations) if c], [c for c in continuations if c])
    for batch_size in (1, 2, 8):  # left-padded prefixes, right-padded continuations
        assert lm_loss(model, prompts, continuations, batch_size=batch_size) == pytest.approx(expected, rel=1e-5)


def test_lm_loss_has_no_value_without_tokens_and_leaves_the_mode_alone(model):
    assert lm_loss(model, [[1, 2]], [[]]) is None
    model.train()
    lm_loss(model, [[1, 2]], [[3]])
    assert model.training
    model.eval()


def test_text_windows_score_what_the_training_loss_scores(model):
    stream = torch.randint(1, 61, (200,), generator=torch.Generator().manual_seed(2))
    windows = stream_windows(stream, 31)  # (6, 32), consecutive
    assert windows.shape == (6, 32) and torch.equal(windows[1, 0], windows[0, -1])
    with torch.no_grad():
        expected = float(window_loss(model, windows))
    assert text_loss(model, windows, batch_size=4) == pytest.approx(expected, rel=1e-5)
