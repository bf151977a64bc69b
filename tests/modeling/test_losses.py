"""Losses on hand-sized tensors: zeros, agreement with torch, masks, stop-gradient, accumulation."""

import pytest
import torch
import torch.nn.functional as F

from cllm.modeling.losses import (
    ar_loss,
    block_logits,
    consistency_loss,
    distill_loss,
    from_first_difference,
    gc_loss,
    gc_mask,
    lc_loss,
    lc_mask,
    token_distance,
)


def logits(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 2


@pytest.mark.parametrize("distance", ["fkl", "rkl", "jsd"])
def test_distance_is_zero_for_identical_inputs(distance):
    x = logits(2, 3, 11)
    assert torch.allclose(token_distance(x, x.clone(), distance), torch.zeros(2, 3), atol=1e-6)


@pytest.mark.parametrize("distance", ["fkl", "rkl", "jsd"])
def test_distance_is_positive_for_different_inputs(distance):
    assert (token_distance(logits(4, 7), logits(4, 7, seed=1), distance) > 0).all()


def test_forward_kl_agrees_with_torch_kl_div():
    t, s = logits(2, 3, 11), logits(2, 3, 11, seed=1)
    expected = F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True,
                        reduction="none").sum(-1)
    assert torch.allclose(token_distance(t, s, "fkl"), expected, atol=1e-5)


def test_reverse_kl_is_forward_kl_with_roles_swapped():
    t, s = logits(5, 9), logits(5, 9, seed=1)
    assert torch.allclose(token_distance(t, s, "rkl"), token_distance(s, t, "fkl"), atol=1e-5)


def test_jsd_is_symmetric_at_half_and_bounded_by_log2():
    t, s = logits(5, 9) * 10, logits(5, 9, seed=1) * 10
    a, b = token_distance(t, s, "jsd"), token_distance(s, t, "jsd")
    assert torch.allclose(a, b, atol=1e-5)
    assert (a <= torch.log(torch.tensor(2.0)) + 1e-5).all()


def test_unknown_distance_is_rejected():
    with pytest.raises(ValueError, match="unknown distance"):
        token_distance(logits(2, 3), logits(2, 3), "l2")


def test_ar_loss_agrees_with_cross_entropy_and_label_smoothing():
    x = logits(2, 4, 13)
    y = torch.randint(0, 13, (2, 4), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 4, dtype=torch.bool)
    for smoothing in (0.0, 0.1):
        expected = F.cross_entropy(x.view(-1, 13), y.view(-1), label_smoothing=smoothing)
        assert torch.allclose(ar_loss(x, y, mask, label_smoothing=smoothing), expected, atol=1e-5)


def test_masked_positions_are_ignored():
    t, s = logits(2, 4, 7), logits(2, 4, 7, seed=1)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    garbage = s.clone()
    garbage[~mask] = 1e4 * torch.randn_like(garbage[~mask])
    assert torch.allclose(consistency_loss(t, s, mask), consistency_loss(t, garbage, mask))
    y = torch.zeros(2, 4, dtype=torch.long)
    assert torch.allclose(ar_loss(s, y, mask), ar_loss(garbage, y, mask))


def test_no_gradient_flows_into_the_target():
    t = logits(2, 3, 5).requires_grad_()
    s = logits(2, 3, 5, seed=1).requires_grad_()
    consistency_loss(t, s, torch.ones(2, 3, dtype=torch.bool)).backward()
    assert t.grad is None
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_two_accumulation_steps_give_the_gradient_of_one_double_step():
    # Two micro-batches with different numbers of counted positions: normalising by the global
    # count makes the summed micro-gradients equal the full-batch gradient exactly.
    torch.manual_seed(0)
    head = torch.nn.Linear(6, 9)
    h, ht = torch.randn(4, 5, 6), torch.randn(4, 5, 9)
    mask = torch.rand(4, 5) > 0.3
    full = consistency_loss(ht, head(h), mask)
    full.backward()
    expected = head.weight.grad.clone()
    head.zero_grad()
    total = mask.sum()
    for rows in (slice(0, 1), slice(1, 4)):
        consistency_loss(ht[rows], head(h[rows]), mask[rows], normalizer=total).backward()
    assert torch.allclose(head.weight.grad, expected, atol=1e-6)


def test_from_first_difference_masks_the_already_correct_prefix():
    fixed = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    state = torch.tensor([[1, 9, 3, 4], [1, 2, 3, 4], [7, 2, 3, 4]])
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    expected = torch.tensor([[0, 1, 1, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    assert torch.equal(from_first_difference(state, fixed, valid), expected)


def test_mismatched_shapes_are_rejected():
    with pytest.raises(ValueError, match="shapes differ"):
        consistency_loss(logits(2, 3, 5), logits(2, 4, 5), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask shape"):
        consistency_loss(logits(2, 3, 5), logits(2, 3, 5), torch.ones(2, 4, dtype=torch.bool))


# ------------------------------------------------------------------------------------------
# From a forward over prefix + block to the GC / LC terms


def test_block_logits_are_the_predictions_for_each_block_token():
    # logits[b, t] "name" their position t: block token i is predicted at position P - 1 + i
    P, N, V = 5, 3, 16
    logits = torch.eye(V)[: P + N].expand(2, P + N, V)  # (B, T, V)
    positions = block_logits(logits, N).argmax(-1)  # (B, N)
    assert positions.tolist() == [[P - 1, P, P + 1]] * 2
    # the same from the last N + 1 positions only (logits_to_keep)
    assert torch.equal(block_logits(logits[:, -(N + 1) :], N), block_logits(logits, N))
    with pytest.raises(ValueError, match="do not cover"):
        block_logits(logits[:, -N:], N)


def test_gc_is_zero_for_a_state_at_its_fixed_point_and_counts_from_the_first_difference():
    fixed = torch.tensor([[1, 2, 3, 4]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    t, s = logits(1, 4, 7), logits(1, 4, 7, seed=1)
    assert not gc_mask(fixed, fixed, valid).any()
    assert gc_loss(s, t, gc_mask(fixed, fixed, valid)) == 0
    state = torch.tensor([[1, 2, 9, 4]])
    mask = gc_mask(state, fixed, valid)
    assert mask.tolist() == [[False, False, True, True]]
    expected = token_distance(t, s)[0, 2:].mean()
    assert torch.allclose(gc_loss(s, t, mask), expected, atol=1e-6)


def test_lc_targets_the_next_state_and_counts_where_the_two_states_part():
    state = torch.tensor([[1, 7, 7, 7]])
    next_state = torch.tensor([[1, 2, 7, 7]])  # one Jacobi step later
    fixed = torch.tensor([[1, 2, 3, 4]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert lc_mask(state, next_state, valid).tolist() == [[False, True, True, True]]
    assert lc_mask(next_state, next_state, valid).sum() == 0 < gc_mask(next_state, fixed, valid).sum()
    s, t_next = logits(1, 4, 7).requires_grad_(), logits(1, 4, 7, seed=2).requires_grad_()
    mask = lc_mask(state, next_state, valid)
    loss = lc_loss(s, t_next, mask, distance="rkl")
    assert torch.allclose(loss, consistency_loss(t_next, s, mask, distance="rkl"))
    loss.backward()
    assert t_next.grad is None and s.grad is not None  # the next state's logits are a target


def test_argmax_distance_is_cross_entropy_on_the_targets_argmax():
    target, student = logits(3, 5, 9), logits(3, 5, 9, seed=1)
    want = F.cross_entropy(student.reshape(-1, 9), target.argmax(-1).reshape(-1), reduction="none").reshape(3, 5)
    assert torch.allclose(token_distance(target, student, "argmax"), want, atol=1e-5)
    student.requires_grad_(True)
    target.requires_grad_(True)
    token_distance(target, student, "argmax").sum().backward()
    assert target.grad is None and student.grad is not None


def test_gc_window_counts_only_the_positions_right_after_the_first_difference():
    fixed = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
    state = torch.tensor([[1, 2, 9, 9, 9, 9, 9]])
    valid = torch.ones(1, 7, dtype=torch.bool)
    assert gc_mask(state, fixed, valid).tolist() == [[False, False, True, True, True, True, True]]
    assert gc_mask(state, fixed, valid, window=2).tolist() == [[False, False, True, True, True, False, False]]
    assert not gc_mask(fixed, fixed, valid, window=2).any()


def test_distillation_is_the_teachers_kl_with_masks_and_no_gradient_into_the_teacher():
    teacher, student = logits(2, 5, 11), logits(2, 5, 11, seed=1).requires_grad_()
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    per_position = F.kl_div(F.log_softmax(student, -1), F.log_softmax(teacher, -1), log_target=True,
                            reduction="none").sum(-1)
    loss = distill_loss(teacher.requires_grad_(), student, mask, normalizer=4)
    assert torch.allclose(loss, (per_position * mask).sum() / 4, atol=1e-5)
    loss.backward()
    assert teacher.grad is None and student.grad is not None
    assert torch.equal(student.grad[~mask], torch.zeros_like(student.grad[~mask]))
    assert float(distill_loss(teacher, teacher.clone(), mask)) < 1e-6
