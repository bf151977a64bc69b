"""Distillation from the frozen target inside `cllm train`: the KD term (soft labels on the AR
rows and on the model's own rollouts), the target as consistency teacher, LoRA's adapter-disabled
teacher; exact accumulation and resume with all of them. The synthetic world of test_train."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from cllm.core.errors import UserError
from cllm.data.trajectories import TrajectoryReader
from cllm.training.batches import Counts, make_micro_batch, make_rollouts, rollout_prompts
from cllm.training.objective import FrozenTeacher, micro_batch_loss
from cllm.training.train import train
from tests.training.test_train import BLOCK, build_world, config, foreign_model, step_losses, tiny_llama


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("train-distill"))


@pytest.fixture(scope="module")
def records(world):
    return TrajectoryReader(world.data).records()[:12]


def batch_loss(model, records, cfg, teacher, *, micro=12, rollouts=0):
    """The global batch's loss parts, accumulated over micro-batches of `micro` records, with
    `rollouts` greedy rollouts of the model dealt out to them."""
    draws = torch.rand(len(records), 64, generator=torch.Generator().manual_seed(0))
    mbs = [make_micro_batch(records[i : i + micro], draws[i : i + micro], pad_id=0, block_size=BLOCK, config=cfg)
           for i in range(0, len(records), micro)]
    prompts = rollout_prompts(records)[:rollouts]
    shares = [list(range(len(prompts)))[i :: len(mbs)] for i in range(len(mbs))]
    counts = Counts()
    for mb, share in zip(mbs, shares, strict=True):
        counts.add(mb, cfg, rollouts=len(share))
    parts = []
    for mb, share in zip(mbs, shares, strict=True):
        if share:
            mb.rollout = make_rollouts(model, [prompts[i] for i in share], cfg, share, eos_token_id=0, pad_id=0)
        parts.append(micro_batch_loss(model, mb, counts, cfg, pad_id=0, teacher=teacher))
    return parts


def test_a_teacher_equal_to_the_model_gives_zero_kd_and_the_models_own_consistency_targets(world, records):
    model = tiny_llama(3)
    same = FrozenTeacher(copy=copy.deepcopy(model).eval())
    kd = config(world, world.root / "unused", kd_weight=1.0, ar_weight=0.0, ar_target="both", rollout_prompts=4,
                rollout_tokens=6)
    (kd_parts,) = batch_loss(model, records, kd, same, rollouts=4)
    assert float(kd_parts.kd) < 1e-6 and float(kd_parts.ar) == 0.0
    # the target as consistency teacher: the same GC as the model's own (stop-gradient) logits
    own = config(world, world.root / "unused", ar_weight=0.0)
    frozen = config(world, world.root / "unused", ar_weight=0.0, consistency_teacher="target")
    (a,), (b,) = batch_loss(model, records, own, None), batch_loss(model, records, frozen, same)
    assert float(a.gc) > 0 and torch.allclose(a.gc, b.gc, rtol=1e-5)


def test_another_teacher_changes_the_targets(world, records):
    model = tiny_llama(3)
    other = FrozenTeacher(copy=tiny_llama(5).eval())
    cfg = config(world, world.root / "unused", kd_weight=1.0, ar_target="both", consistency_teacher="target")
    (parts,) = batch_loss(model, records, cfg, other)
    (own,) = batch_loss(model, records, config(world, world.root / "unused", ar_target="both"), None)
    assert float(parts.kd) > 0.01
    assert not torch.allclose(parts.gc, own.gc)


def test_accumulated_micro_batches_give_the_full_gradient_with_kd_rollouts_and_the_target_teacher(world, records):
    cfg = config(world, world.root / "unused", consistency="gc+lc", kd_weight=2.0, ar_target="both",
                 consistency_teacher="target", rollout_prompts=6, rollout_tokens=5)
    model, teacher = tiny_llama(3), FrozenTeacher(copy=tiny_llama(5).eval())

    def gradient(micro: int) -> torch.Tensor:
        model.zero_grad()
        for parts in batch_loss(model, records, cfg, teacher, micro=micro, rollouts=6):
            parts.total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    full = gradient(12)
    assert torch.allclose(gradient(4), full, atol=1e-6, rtol=1e-4)
    assert torch.allclose(gradient(3), full, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    dict(kd_weight=1.0, ar_weight=1.0, rollout_prompts=4, rollout_tokens=6, rollout_temperature=0.8,
         consistency_teacher="target"),
    dict(lora=True, kd_weight=1.0, ar_weight=0.0, ar_target="both", rollout_prompts=3, rollout_tokens=4),
    dict(lora=True, kd_weight=1.0, rollout_prompts=3, rollout_tokens=5, rollout_policy="teacher",
         rollout_temperature=0.5),
], ids=["full-sampled-rollouts", "lora-adapter-off-teacher", "lora-teacher-rollouts"])
def test_a_stopped_run_with_distillation_resumes_to_the_same_losses(world, tmp_path, overrides):
    common = dict(max_steps=8, eval_count=0, checkpoint_interval=3, **overrides)
    train(config(world, tmp_path / "straight", **common))
    train(config(world, tmp_path / "resumed", stop_at_step=4, **common))
    train(config(world, tmp_path / "resumed", **common))
    assert step_losses(tmp_path / "resumed") == step_losses(tmp_path / "straight")
    kd = [r for r in map(eval_json, (tmp_path / "straight" / "train_log.jsonl").read_text().splitlines()) if "kd" in r]
    assert kd and kd[-1]["kd"] > 0  # the model moved away from its teacher, and the term saw it


def eval_json(line: str) -> dict:
    import json

    return json.loads(line)


def test_kd_on_the_models_own_rollouts_pulls_it_back_to_the_target(world, tmp_path):
    """The consistency term alone moves the model's greedy text away from the target's; the same
    run with the distillation term (soft labels on the fixed points and on its rollouts) keeps
    more of the target's greedy text."""
    from cllm.evaluation.heldout import decode_prompts, heldout_prompts

    common = dict(max_steps=60, eval_count=0, lr=3e-3, ar_weight=0.0)
    train(config(world, tmp_path / "free", **common))
    train(config(world, tmp_path / "kd", kd_weight=3.0, ar_target="fixed_points", rollout_prompts=8,
                 rollout_tokens=16, **common))
    prompts = heldout_prompts(str(world.val_prompts), world.tokenizer, count=16, max_new_tokens=16, context=64)

    def greedy(path):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        return decode_prompts(model, prompts, method="greedy", max_new_tokens=16, eos_token_id=0).new_tokens

    target = greedy(world.target)

    def agreement(path) -> float:
        pairs = [(x, y) for a, b in zip(greedy(path), target, strict=True) for x, y in zip(a, b, strict=False)]
        return sum(x == y for x, y in pairs) / len(pairs)

    assert agreement(tmp_path / "kd") > agreement(tmp_path / "free")


def test_bad_distillation_options_are_one_line_errors(world, tmp_path):
    with pytest.raises(UserError, match="needs --kd-weight"):
        config(world, tmp_path / "out", rollout_prompts=4)
    with pytest.raises(UserError, match="kd-distance must be one of"):
        config(world, tmp_path / "out", kd_weight=1.0, kd_distance="xkl")
    with pytest.raises(UserError, match="another tokenizer"):
        train(config(world, tmp_path / "out", kd_weight=1.0, teacher=str(foreign_model(world, "tokenizer"))))


def test_loop_positions_mark_the_tokens_that_continue_a_loop():
    from cllm.data.trajectories import TrajectoryRecord
    from cllm.training.batches import loop_positions

    prompt = [9, 8, 7]
    before = [1, 2, 3] * 7  # 21 generated tokens: the loop is 24 long after three more
    record = TrajectoryRecord("p", 0, 1, len(prompt), prompt + before, [[5, 5, 5, 5]], [1, 2, 3, 4])
    assert loop_positions([record], 4).tolist() == [[False, False, True, False]]


def test_cut_loops_drops_loop_positions_from_the_consistency_masks(world, records):
    import dataclasses

    # the same records after 30 generated tokens of one repeated word: every block token continues it
    looped = [dataclasses.replace(r, prefix_ids=list(r.prefix_ids[: r.prompt_len]) + [r.fixed_point[0]] * 30)
              for r in records]
    draws = torch.rand(len(records), 64, generator=torch.Generator().manual_seed(0))

    def masks(recs, cut):
        mb = make_micro_batch(recs, draws, pad_id=0, block_size=BLOCK,
                              config=config(world, world.root / "unused", cut_loops=cut))
        return mb.gc_mask, mb.lc_mask

    (gc, lc), (gc_cut, lc_cut) = masks(looped, False), masks(looped, True)
    assert gc.any() and lc.any()
    loops = loop_positions_of(looped)
    assert torch.equal(gc_cut, gc & ~loops) and torch.equal(lc_cut, lc & ~loops)
    assert gc_cut.sum() < gc.sum()
    assert torch.equal(masks(records, True)[0], masks(records, False)[0])  # no loop: nothing cut


def loop_positions_of(records):
    from cllm.training.batches import loop_positions

    return loop_positions(records, BLOCK)  # one state per record (the default): rows align


def test_several_trajectory_directories_train_together(world, tmp_path):
    from cllm.training.collect import CollectConfig, collect
    from tests.training.test_train import NEW, write_prompts

    more = tmp_path / "more"
    collect(CollectConfig(model=str(world.target), prompts=str(write_prompts(tmp_path / "p.jsonl", 16, seed=5)),
                          out=str(more), block_size=BLOCK, max_new_tokens=NEW, batch_size=16))
    summary = train(config(world, tmp_path / "out", data=f"{world.data},{more}", max_steps=2, eval_count=0))
    assert summary.records == len(TrajectoryReader(world.data).records()) + len(TrajectoryReader(more).records())
    other = tmp_path / "other-n"
    collect(CollectConfig(model=str(world.target), prompts=str(write_prompts(tmp_path / "q.jsonl", 16, seed=6)),
                          out=str(other), block_size=BLOCK // 2, max_new_tokens=NEW, batch_size=16))
    with pytest.raises(UserError, match="one block size at a time"):
        train(config(world, tmp_path / "out2", data=f"{world.data},{other}", max_steps=2, eval_count=0))


def test_the_progressive_schedule_picks_the_state_nearest_the_blocks_noise_level():
    from cllm.training.batches import pick_states, progressive_keys

    fixed = torch.tensor([[1, 2, 3, 4]] * 3)
    # states with noise 1, 3/4, 1/2, 1/4, then the fixed point
    traj = torch.tensor([[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 9, 9], [1, 2, 3, 9], [1, 2, 3, 4]])
    states = traj[None].expand(3, -1, -1)
    valid = torch.ones(3, 4, dtype=torch.bool)
    blocks = torch.tensor([0, 15, 8])  # noise levels 0, 1 and 8/15
    keys = progressive_keys(states, fixed, valid, blocks, torch.rand(3, 5, generator=torch.Generator().manual_seed(0)))
    picks, exists = pick_states(keys, torch.tensor([5, 5, 5]), 1)
    assert picks[:, 0].tolist() == [3, 0, 2] and exists.all()
    two, _ = pick_states(keys, torch.tensor([5, 5, 5]), 2)
    assert two[0].tolist() == [3, 2] and two[1].tolist() == [0, 1]


def test_gated_selection_exports_the_fastest_evaluation_that_passes_the_gates(world, tmp_path, monkeypatch):
    import json

    import cllm.training.consistency as consistency_module
    from cllm.training.run import BEST

    common = dict(max_steps=40, eval_interval=10, eval_count=8, select="gated")
    # the synthetic target repeats one word 16 times: every evaluation fails the degenerate gate
    none = train(config(world, tmp_path / "none", **common))
    assert none.selected_step is None and not (tmp_path / "none" / BEST).exists()
    # with gates that every evaluation passes, the fastest one is exported
    monkeypatch.setattr(consistency_module, "passes_text_gates", lambda *args: True)
    run = train(config(world, tmp_path / "any", **common))
    evals = [json.loads(line) for line in (tmp_path / "any" / "train_log.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_tokens_per_forward_not_looping"] for r in evals if r["step"] and "eval_ar_loss" in r}
    assert run.selected_step == max(evals, key=evals.get)
    assert run.eval_after["tokens_per_forward_not_looping"] == evals[run.selected_step]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "any").state_dict()
    best = torch.load(tmp_path / "any" / BEST, weights_only=False)["trainable"]
    assert all(torch.equal(exported[k], v) for k, v in best.items())


def test_teacher_rollouts_are_the_teachers_own_text(world):
    from cllm.decoding import greedy_decode

    cfg = config(world, world.root / "unused", kd_weight=1.0, rollout_prompts=2, rollout_tokens=6,
                 rollout_policy="teacher")
    teacher_model = tiny_llama(5).eval()
    prompt = rollout_prompts(TrajectoryReader(world.data).records())[0]
    rows = FrozenTeacher(copy=teacher_model)(lambda m: make_rollouts(m, [prompt], cfg, [0], eos_token_id=0, pad_id=0))
    want = greedy_decode(teacher_model, torch.tensor([prompt]), max_new_tokens=6, eos_token_id=0).new_tokens[0]
    assert rows.block_ids[0, : len(want)].tolist() == want


def test_ar_target_auto_falls_back_to_the_fixed_points_without_references(world, tmp_path):
    import json

    from cllm.training.collect import CollectConfig, collect
    from tests.training.test_train import NEW, write_prompts

    prompts = write_prompts(tmp_path / "bare.jsonl", 16, seed=3, references=False)
    collect(CollectConfig(model=str(world.target), prompts=str(prompts), out=str(tmp_path / "bare"),
                          block_size=BLOCK, max_new_tokens=NEW, batch_size=16))
    summary = train(config(world, tmp_path / "out", data=str(tmp_path / "bare"), max_steps=2, eval_count=0))
    assert summary.finished
    assert json.loads((tmp_path / "out" / "train_config.json").read_text())["ar_target"] == "fixed_points"
    # with references, auto means the labels
    train(config(world, tmp_path / "out2", max_steps=2, eval_count=0))
    assert json.loads((tmp_path / "out2" / "train_config.json").read_text())["ar_target"] == "labels"


def test_copy_positions_are_targets_a_wrong_state_token_before_them_already_shows():
    from cllm.training.batches import copy_positions

    fixed = torch.tensor([[1, 2, 3, 4, 5]])
    shifted = torch.tensor([[1, 3, 4, 5, 9]])  # the fixed point shifted left by one after a wrong token
    assert copy_positions(shifted, fixed).tolist() == [[False, False, True, True, True]]
    # a correct token before a target is no shortcut, even when the fixed point repeats it
    assert not copy_positions(torch.tensor([[7, 7, 0, 0]]), torch.tensor([[7, 7, 7, 7]]))[0, :2].any()
    assert copy_positions(torch.tensor([[1, 9, 9, 9, 9]]), fixed, reach=2).sum() == 0
    two_back = torch.tensor([[1, 4, 8, 8, 8]])  # y*_3 = 4 sits wrong two positions back
    assert copy_positions(two_back, fixed).tolist() == [[False, False, False, True, False]]
