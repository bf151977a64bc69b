"""The cache adapter alone: crop, holes, row selection and compaction on a real DynamicCache."""

import pytest
import torch
from transformers import DynamicCache

from cllm.runtime import hf_cache as cache


def _filled(valid: list[list[int]]) -> cache.RowCache:
    """A 1-layer cache whose key at (row, t) is 100 * row + t, with the given validity."""
    B, S = len(valid), len(valid[0])
    keys = (100 * torch.arange(B)[:, None] + torch.arange(S)[None, :]).float()[:, None, :, None]
    kv = DynamicCache()
    kv.update(keys, keys.clone(), 0)
    mask = torch.tensor(valid, dtype=torch.bool)
    return cache.RowCache(kv=kv, lengths=mask.sum(1).tolist(), valid=mask)


def _keys(rc: cache.RowCache) -> list[list[int]]:
    return rc.kv.layers[0].keys[:, 0, :, 0].long().tolist()


def test_commit_crops_entries_no_row_keeps_and_marks_holes():
    rc = _filled([[1, 1], [1, 1]])
    rc.valid = None
    rc.kv.update(torch.zeros(2, 1, 3, 1), torch.zeros(2, 1, 3, 1), 0)  # a forward fed 3 per row
    cache.commit(rc, keep=[1, 2], fed=3)
    assert rc.physical_length == 4  # the third entry went for both rows
    assert rc.lengths == [3, 4]
    assert rc.valid.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_commit_at_batch_one_only_crops():
    rc = _filled([[1, 1, 1]])
    rc.valid = None
    rc.kv.update(torch.zeros(1, 1, 4, 1), torch.zeros(1, 1, 4, 1), 0)
    cache.commit(rc, keep=[2], fed=4)
    assert rc.physical_length == 5 and rc.valid is None and rc.lengths == [5]


def test_commit_kept_at_batch_one_moves_off_branch_entries_up_without_holes():
    rc = _filled([[1, 1]])
    rc.valid = None
    fed = torch.tensor([10.0, 11, 12, 13, 14])[None, None, :, None]  # a trie of 5 nodes after 2 entries
    rc.kv.update(fed, fed.clone(), 0)
    cache.commit_kept(rc, [[0, 3, 4]], fed=5)  # the accepted path left the first branch at node 3
    assert rc.valid is None and rc.lengths == [5] and rc.physical_length == 5
    assert _keys(rc) == [[0, 1, 10, 13, 14]]
    assert rc.kv.layers[0].values[0, 0, :, 0].long().tolist() == [0, 1, 10, 13, 14]


def test_commit_kept_in_a_batch_marks_holes():
    rc = _filled([[1, 1], [1, 1]])
    rc.valid = None
    rc.kv.update(torch.zeros(2, 1, 4, 1), torch.zeros(2, 1, 4, 1), 0)
    cache.commit_kept(rc, [[0, 2], [0, 1]], fed=4)
    assert rc.lengths == [4, 4] and rc.physical_length == 5
    assert rc.valid.int().tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 1, 0]]


def test_rollback_forgets_each_rows_last_entries_as_a_commit_would():
    rc = _filled([[1, 1], [1, 1]])
    rc.valid = None
    fed = torch.tensor([[10.0, 11, 12], [20, 21, 22]])[:, None, :, None]  # three 1-token forwards, kept
    rc.kv.update(fed, fed.clone(), 0)
    rc.lengths = [5, 5]
    cache.rollback(rc, [2, 1])  # row 0 keeps 10, row 1 keeps 20, 21
    assert rc.lengths == [3, 4] and rc.physical_length == 4  # the last entry went for both rows
    assert rc.valid.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    cache.rollback(rc, [0, 0])
    assert rc.lengths == [3, 4]


def test_rollback_at_batch_one_only_crops_and_refuses_to_forget_holes():
    rc = _filled([[1, 1, 1, 1]])
    rc.valid = None
    cache.rollback(rc, [3])
    assert rc.valid is None and rc.lengths == [1] and rc.physical_length == 1
    holes = _filled([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="valid"):
        cache.rollback(holes, [1, 1])


def test_compact_gathers_valid_entries_in_order_left_padded():
    rc = _filled([[0, 1, 0, 1, 1], [1, 1, 1, 0, 1]])
    cache.compact(rc)
    assert rc.valid.int().tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]  # row 0: slot 0 is padding
    keys = _keys(rc)
    assert keys[0][1:] == [1, 3, 4] and keys[1] == [100, 101, 102, 104]
    assert rc.kv.get_seq_length() == 4


def test_compact_to_equal_lengths_becomes_dense():
    rc = _filled([[0, 1, 1, 0], [1, 0, 1, 0]])
    cache.compact(rc)
    assert rc.valid is None and _keys(rc) == [[1, 2], [100, 102]]


def test_select_rows_drops_finished_rows():
    rc = _filled([[1, 1, 1], [0, 1, 1], [0, 0, 1]])
    cache.select_rows(rc, [0, 2])
    assert rc.lengths == [3, 1]
    assert _keys(rc)[1][-1] == 202


def test_keep_rows_fills_the_gaps_with_rows_from_the_end_and_says_the_new_order():
    rc = _filled([[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 0, 1]])
    order = cache.keep_rows(rc, [0, 2, 3, 4])  # row 1 left: the last row takes its place
    assert order == [0, 4, 2, 3]
    assert rc.lengths == [3, 2, 3, 1]
    assert [k[-1] for k in _keys(rc)] == [2, 402, 202, 302]
    assert rc.valid.int().tolist() == [[1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 0, 1]]
    assert cache.keep_rows(rc, [0, 1]) == [0, 1]  # only the last rows left: nothing moves


def test_joining_rows_keep_their_slots_and_the_shorter_part_is_padded_hidden():
    rc = _filled([[1, 1], [1, 0]])
    longer = _filled([[1, 1, 1, 1]])
    cache.append_rows(rc, longer)  # the running rows are padded after their entries
    assert _keys(rc) == [[0, 1, 0, 0], [100, 101, 0, 0], [0, 1, 2, 3]]
    assert rc.valid.int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    shorter = _filled([[1]])
    cache.append_rows(rc, shorter)  # a newcomer with fewer entries is padded before them
    assert _keys(rc)[3] == [0, 0, 0, 0] and rc.valid.int().tolist()[3] == [0, 0, 0, 1]
    assert rc.lengths == [2, 1, 4, 1]


def test_attention_mask_hides_holes_and_tail_padding():
    rc = _filled([[1, 0, 1], [1, 1, 1]])
    mask = cache.attention_mask_for(rc, fed=[1, 2], width=2)
    assert mask.int().tolist() == [[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]]
    rc.valid = None
    assert cache.attention_mask_for(rc, fed=[2, 2], width=2) is None


# ------------------------------------------------------------------ the last hidden state


def test_the_last_hidden_state_is_what_the_lm_head_reads(arch):
    """hidden_states[-1] of transformers is the final norm's output, on every architecture the
    tests build: the LM head applied to it gives the logits, in the prefill, a tree forward and
    a plain forward; and asking for it changes no logit."""
    from tests.decoding.conftest import random_prompt, tiny_model

    model = tiny_model(arch)
    lm_head = model.get_output_embeddings()
    prompt = random_prompt(5, 9)
    with torch.inference_mode():
        plain = cache.forward_hidden(model, prompt)
        assert torch.allclose(lm_head(plain.hidden), plain.logits, atol=1e-5)
        assert torch.allclose(plain.logits, model(input_ids=prompt).logits, atol=1e-5)
        rc, first = cache.prefill_hidden(model, prompt, torch.ones_like(prompt))
        assert first.hidden.shape == (1, 1, model.config.hidden_size)
        assert torch.allclose(lm_head(first.hidden), first.logits, atol=1e-5)
        assert torch.allclose(first.logits[0, -1], plain.logits[0, -1], atol=1e-4)
        tokens, offsets = torch.tensor([[3, 4, 5]]), torch.tensor([[0, 1, 1]])
        tree = torch.tensor([[[1, 0, 0], [1, 1, 0], [1, 0, 1]]])  # 4 and 5 both follow 3
        out = cache.feed_tree_hidden(model, rc, tokens, offsets, tree)
        assert torch.allclose(lm_head(out.hidden), out.logits, atol=1e-5)
        cache.commit_kept(rc, [[]], fed=3)
        assert torch.allclose(cache.feed_tree(model, rc, tokens, offsets, tree), out.logits, atol=1e-5)
