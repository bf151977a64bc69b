"""A batched runtime's bookkeeping alone (`cllm.runtime.rows.Batch`): crop, holes, rewinding,
rows leaving and joining, compaction and masks, on a real DynamicCache (`hf.CacheStorage`); and
the last hidden state every runtime gives back."""

import pytest
import torch
from transformers import DynamicCache

from cllm.runtime import as_runtime, hf
from cllm.runtime.rows import Batch, tree_layout
from tests.decoding.conftest import module_of, random_prompt, tiny_model


def _filled(valid: list[list[int]], dense: bool = False) -> Batch:
    """A 1-layer batch whose key at (row, t) is 100 * row + t, with the given slot validity."""
    B, S = len(valid), len(valid[0])
    keys = (100 * torch.arange(B)[:, None] + torch.arange(S)[None, :]).float()[:, None, :, None]
    cache = DynamicCache()
    cache.update(keys, keys.clone(), 0)
    mask = torch.tensor(valid, dtype=torch.bool)
    return Batch(hf.CacheStorage(cache), list(range(B)), mask.sum(1).tolist(), None if dense else mask)


def _keys(batch: Batch) -> list[list[int]]:
    return batch.storage.cache.layers[0].keys[:, 0, :, 0].long().tolist()


def _fed(batch: Batch, values: torch.Tensor) -> None:
    """A forward wrote `values` (B, 1, L, 1) after every row's slots."""
    batch.storage.cache.update(values, values.clone(), 0)


def test_keeping_a_prefix_crops_entries_no_row_keeps_and_marks_holes():
    batch = _filled([[1, 1], [1, 1]], dense=True)
    _fed(batch, torch.zeros(2, 1, 3, 1))  # a forward fed 3 per row
    batch.keep([range(1), range(2)], fed=3)
    assert batch.storage.slots() == 4  # the third entry went for both rows
    assert batch.lengths == [3, 4]
    assert batch.valid.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]


def test_one_row_keeping_a_prefix_only_crops():
    batch = _filled([[1, 1, 1]], dense=True)
    _fed(batch, torch.zeros(1, 1, 4, 1))
    batch.keep([range(2)], fed=4)
    assert batch.storage.slots() == 5 and batch.valid is None and batch.lengths == [5]


def test_one_row_keeping_a_branch_moves_its_entries_up_without_holes():
    batch = _filled([[1, 1]], dense=True)
    _fed(batch, torch.tensor([10.0, 11, 12, 13, 14])[None, None, :, None])  # a tree of 5 nodes after 2 entries
    batch.keep([[0, 3, 4]], fed=5)  # the accepted path left the first branch at node 3
    assert batch.valid is None and batch.lengths == [5] and batch.storage.slots() == 5
    assert _keys(batch) == [[0, 1, 10, 13, 14]]
    assert batch.storage.cache.layers[0].values[0, 0, :, 0].long().tolist() == [0, 1, 10, 13, 14]


def test_rows_keeping_branches_mark_holes():
    batch = _filled([[1, 1], [1, 1]], dense=True)
    _fed(batch, torch.zeros(2, 1, 4, 1))
    batch.keep([[0, 2], [0, 1]], fed=4)
    assert batch.lengths == [4, 4] and batch.storage.slots() == 5
    assert batch.valid.int().tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 1, 0]]


def test_rewinding_forgets_each_rows_last_entries_as_keeping_fewer_would():
    batch = _filled([[1, 1], [1, 1]], dense=True)
    _fed(batch, torch.tensor([[10.0, 11, 12], [20, 21, 22]])[:, None, :, None])  # three 1-token forwards, kept
    batch.lengths = [5, 5]
    batch.rewind([2, 1])  # row 0 keeps 10, row 1 keeps 20, 21
    assert batch.lengths == [3, 4] and batch.storage.slots() == 4  # the last entry went for both rows
    assert batch.valid.int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    batch.rewind([0, 0])
    assert batch.lengths == [3, 4]


def test_one_row_rewinding_only_crops_and_holes_are_never_forgotten():
    batch = _filled([[1, 1, 1, 1]], dense=True)
    batch.rewind([3])
    assert batch.valid is None and batch.lengths == [1] and batch.storage.slots() == 1
    holes = _filled([[1, 1, 0], [1, 1, 1]])
    with pytest.raises(ValueError, match="last slots"):
        holes.rewind([1, 1])


def test_compact_gathers_valid_entries_in_order_left_padded():
    batch = _filled([[0, 1, 0, 1, 1], [1, 1, 1, 0, 1]])
    batch.compact()
    assert batch.valid.int().tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]  # row 0: slot 0 is padding
    keys = _keys(batch)
    assert keys[0][1:] == [1, 3, 4] and keys[1] == [100, 101, 102, 104]
    assert batch.storage.slots() == 4


def test_compact_to_equal_lengths_becomes_dense():
    batch = _filled([[0, 1, 1, 0], [1, 0, 1, 0]])
    batch.compact()
    assert batch.valid is None and _keys(batch) == [[1, 2], [100, 102]]


def test_closed_rows_leave_and_rows_from_the_end_fill_their_places():
    batch = _filled([[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 0, 1]])
    batch.close([1])  # row 1 left: the last row takes its place
    assert batch.ids == [0, 4, 2, 3]
    assert batch.lengths == [3, 2, 3, 1]
    assert [k[-1] for k in _keys(batch)] == [2, 402, 202, 302]
    assert batch.valid.int().tolist() == [[1, 1, 1], [1, 0, 1], [1, 1, 1], [0, 0, 1]]
    batch.close([2, 3])  # only the last rows left: nothing moves
    assert batch.ids == [0, 4] and [k[-1] for k in _keys(batch)] == [2, 402]


def test_joining_rows_keep_their_slots_and_the_shorter_part_is_padded_hidden():
    batch = _filled([[1, 1], [1, 0]])
    longer = _filled([[1, 1, 1, 1]], dense=True)
    longer.ids = [2]
    batch.join(longer)  # the open rows are padded after their entries
    assert _keys(batch) == [[0, 1, 0, 0], [100, 101, 0, 0], [0, 1, 2, 3]]
    assert batch.valid.int().tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]
    shorter = _filled([[1]], dense=True)
    shorter.ids = [3]
    batch.join(shorter)  # a newcomer with fewer entries is padded before them
    assert _keys(batch)[3] == [0, 0, 0, 0] and batch.valid.int().tolist()[3] == [0, 0, 0, 1]
    assert batch.lengths == [2, 1, 4, 1] and batch.ids == [0, 1, 2, 3]


def test_a_chains_mask_hides_holes_and_tail_padding():
    batch = _filled([[1, 0, 1], [1, 1, 1]])
    positions, mask = batch.chain([1, 2], 2, torch.device("cpu"))
    assert mask.int().tolist() == [[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert positions.tolist() == [[2, 2], [3, 4]]  # a pad repeats its row's last position
    batch.valid = None
    assert batch.chain([2, 2], 2, torch.device("cpu"))[1] is None


def test_a_trees_layout_is_its_depths_and_ancestors_and_pads_see_themselves():
    depths, masks = tree_layout([[-1, 0, 1, 0], [-1]], 4)
    T, F = True, False
    assert depths == [[0, 1, 2, 1], [0, 0, 0, 0]]
    assert masks[0] == [[T, F, F, F], [T, T, F, F], [T, T, T, F], [T, F, F, T]]
    assert masks[1] == [[T, F, F, F], [F, T, F, F], [F, F, T, F], [F, F, F, T]]


def test_feeding_other_rows_than_the_open_ones_is_refused():
    session = as_runtime(tiny_model("llama")).session()
    rows, _ = session.open([[5, 6, 7], [8, 9]])
    with pytest.raises(ValueError, match="every open row"):
        session.feed(rows[:1], [[3]])
    with pytest.raises(ValueError, match="parent"):
        session.feed(rows, [[3, 4], [5]], parents=[[-1, 1], [-1]])
    session.close(rows)
    assert session.rows() == []


# ------------------------------------------------------------------ the last hidden state


def test_the_last_hidden_state_is_what_the_lm_head_reads(arch):
    """hidden_states[-1] of transformers is the final norm's output, on every architecture the
    tests build: the LM head applied to it gives the logits, in the prefill, a tree forward and
    a plain forward, on every runtime; and asking for it changes no logit."""
    runtime = as_runtime(tiny_model(arch))
    model = module_of(tiny_model(arch))
    lm_head = model.get_output_embeddings()
    prompt = random_prompt(5, 9)
    with torch.inference_mode():
        plain = hf.forward_hidden(model, prompt)
        assert torch.allclose(lm_head(plain.hidden), plain.logits, atol=1e-5)
        assert torch.allclose(plain.logits, model(input_ids=prompt).logits, atol=1e-5)
        session = runtime.session()
        rows, first = session.open([prompt[0].tolist()], hidden=True)
        assert first.hidden.shape == (1, 1, model.config.hidden_size)
        assert torch.allclose(lm_head(first.hidden), first.logits, atol=1e-5)
        assert torch.allclose(first.logits[0, -1], plain.logits[0, -1], atol=1e-4)
        tokens, parents = [[3, 4, 5]], [[-1, 0, 0]]  # 4 and 5 both follow 3
        out = session.feed(rows, tokens, parents=parents, hidden=True)
        assert torch.allclose(lm_head(out.hidden), out.logits, atol=1e-5)
        session.keep(rows, [[]])
        assert torch.allclose(session.feed(rows, tokens, parents=parents).logits, out.logits, atol=1e-5)
        session.close(rows)
