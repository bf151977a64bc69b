"""--layout packed (Jacobi Forcing's sequence packing): one forward per prompt over its clean
text and its state blocks computes what one row per ``prefix + block`` computes, and the
trainer's loss on it equals the records layout's."""

from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.data.trajectories import TrajectoryRecord
from cllm.modeling.forwards import BlockGroup, enable_checkpointing, forward_blocks, forward_packed, rows_from_lists
from cllm.training.batches import Counts, make_micro_batch, pack, prompt_chains
from cllm.training.config import Recipe, TrainConfig
from cllm.training.objective import micro_batch_loss

V, N = 40, 5


def tiny(seed: int = 0, attention: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation=attention, initializer_range=0.3)  # sharp attention: positions matter
    return LlamaForCausalLM(cfg).float()


def chain(prompt_id: str, prompt: list[int], blocks: list[list[int]], g, states: int = 3) -> list[TrajectoryRecord]:
    """One prompt's records: block j's prefix is the prompt and the fixed points before it."""
    out, prefix = [], list(prompt)
    for j, fixed in enumerate(blocks):
        noisy = [torch.randint(1, V, (len(fixed),), generator=g).tolist() for _ in range(states - 1)]
        out.append(TrajectoryRecord(prompt_id=prompt_id, prompt_index=0, block_index=j, prompt_len=len(prompt),
                                    prefix_ids=list(prefix), states=noisy + [list(fixed)], fixed_point=list(fixed)))
        prefix += fixed
    return out


def records(seed: int = 0) -> list[TrajectoryRecord]:
    g = torch.Generator().manual_seed(seed)

    def rand(n):
        return torch.randint(1, V, (n,), generator=g).tolist()

    a = chain("a", rand(4), [rand(N), rand(N), rand(3)], g)  # the last block cut short (EOS)
    b = chain("b", rand(7), [rand(N), rand(N)], g)
    return [a[1], b[0], a[0], a[2], b[1]]  # shuffled, as a step draws them


def test_chains_group_one_prompts_blocks_in_order_and_split_diverging_rounds():
    recs = records()
    chains = prompt_chains(recs)
    assert [[(r.prompt_id, r.block_index) for r in c] for c in chains] == [[("a", 0), ("a", 1), ("a", 2)],
                                                                            [("b", 0), ("b", 1)]]
    # the same prompt collected again with another continuation is another chain
    g = torch.Generator().manual_seed(9)
    again = chain("a", list(recs[2].prefix_ids[:4]), [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], g)
    assert [len(c) for c in prompt_chains(recs + again)] == [3, 2, 2]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_equals_one_row_per_block_in_values_and_gradients(attention, checkpointing):
    recs = records()
    g = torch.Generator().manual_seed(3)
    owner = torch.tensor([0, 0, 1, 2, 3, 3, 4])  # two state rows for some records, one for others
    states = torch.stack([torch.randint(1, V, (N,), generator=g) for _ in owner])
    widths = torch.tensor([len(recs[o].fixed_point) for o in owner.tolist()])
    state_mask = (torch.arange(N)[None, :] < widths[:, None]).long()
    model = tiny(attention=attention)
    if checkpointing:
        enable_checkpointing(model)
    model.train()

    fixed_rows = rows_from_lists([r.prefix_ids for r in recs], [r.fixed_point for r in recs], pad_id=0)
    state_rows = rows_from_lists([recs[o].prefix_ids for o in owner.tolist()],
                                 [s[:w] for s, w in zip(states.tolist(), widths.tolist(), strict=True)], pad_id=0)
    fixed_valid, state_valid = fixed_rows.block_mask.bool(), state_mask.bool()

    def loss(fixed, state):
        return fixed.square().mean(-1)[fixed_valid].sum() + state.sin().mean(-1)[state_valid].sum()

    model.zero_grad()
    want_fixed, want_state = forward_blocks(model, fixed_rows), forward_blocks(model, state_rows)
    loss(want_fixed, want_state).backward()
    want_grads = [p.grad.clone() for p in model.parameters()]

    model.zero_grad()
    got_fixed, (got_state, stopped) = forward_packed(
        model, pack(recs, pad_id=0), N,
        [BlockGroup(states, state_mask, owner), BlockGroup(states, state_mask, owner, grad=False)])
    loss(got_fixed, got_state).backward()
    assert torch.allclose(got_fixed[fixed_valid], want_fixed[fixed_valid], atol=1e-5)
    assert torch.allclose(got_state[state_valid], want_state[state_valid], atol=1e-5)
    assert not stopped.requires_grad and torch.allclose(stopped[state_valid], want_state[state_valid], atol=1e-5)
    for p, w in zip(model.parameters(), want_grads, strict=True):
        assert torch.allclose(p.grad, w, atol=1e-5)


def test_a_state_block_sees_only_the_fixed_points_before_its_own():
    """Changing block 1's fixed point changes the logits of block 1's and 2's states (they read
    it), never those of block 0's; a mask that let block 0 see later text fails here."""
    recs = [r for r in records() if r.prompt_id == "a"]
    recs.sort(key=lambda r: r.block_index)
    states = torch.tensor([recs[j].states[0] + [0] * (N - len(recs[j].states[0])) for j in range(3)])
    mask = (states != 0).long()
    model = tiny(5).eval()
    group = [BlockGroup(states, mask, torch.arange(3))]
    _, (before,) = forward_packed(model, pack(recs, 0), N, group)
    changed = list(recs)
    changed[1] = replace(recs[1], fixed_point=[(t % (V - 1)) + 1 for t in recs[1].fixed_point])
    changed[2] = replace(recs[2], prefix_ids=recs[2].prefix_ids[:-N] + changed[1].fixed_point)
    _, (after,) = forward_packed(model, pack(changed, 0), N, group)
    assert torch.equal(before[0], after[0])
    assert not torch.allclose(before[2], after[2])


@pytest.mark.parametrize("teacher", ["model", "target"])
def test_packed_layout_gives_the_records_layouts_loss(teacher):
    """The whole objective (GC, AR on fixed points, KD) on one micro-batch, both layouts."""
    import copy

    from cllm.training.objective import FrozenTeacher

    recs = records(4)
    model = tiny(6).train()
    frozen = FrozenTeacher(copy=copy.deepcopy(model).eval())
    draws = torch.rand(len(recs), 3, generator=torch.Generator().manual_seed(0))
    values = []
    for layout in ("records", "packed"):
        cfg = TrainConfig(recipe=Recipe(consistency="gc+lc", distance="fkl", ar_target="fixed_points", ar_weight=1.0,
                                        kd_weight=2.0, consistency_teacher=teacher, states_per_record=2, layout=layout,
                                        label_smoothing=0.0))
        mb = make_micro_batch(recs, draws, pad_id=0, block_size=N, config=cfg)
        assert (mb.packing is not None) == (layout == "packed")
        counts = Counts()
        counts.add(mb, cfg)
        parts = micro_batch_loss(model, mb, counts, cfg, 0, teacher=frozen)
        values.append(torch.stack([parts.gc, parts.lc, parts.ar, parts.kd]))
    assert values[0].abs().min() > 0
    assert torch.allclose(values[0], values[1], atol=1e-5)
