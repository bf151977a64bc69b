"""Medusa heads (`cllm.modeling.heads`) and their training (`cllm.training.medusa`) on tiny in-process models:
the loss on hand-sized tensors (zero when each head matches the model k positions on, torch's
KL per head, masks, weights and hard labels), a fresh head is the LM head, training lowers the
loss and raises the heads' agreement with the model's greedy tokens k + 1 ahead, heads survive
a save and load (`cllm.models.load_heads`; same decoding), and a load for another model or with
damaged files is a one-line UserError."""

import json

import pytest
import torch
import torch.nn.functional as F

from cllm.core.errors import UserError
from cllm.decoding import greedy_decode
from cllm.decoding.rivals.medusa import medusa_decode
from cllm.modeling.heads import CONFIG_FILE, HEADS_DIR, WEIGHTS_FILE, MedusaHeads
from cllm.models import load_heads, load_model
from cllm.training.medusa import (
    HeadsTrainer,
    Text,
    base_model_meta,
    greedy_texts,
    hidden_states,
    measure_accuracies,
    medusa_loss,
    medusa_terms,
    save_heads,
    texts_from_trajectories,
    train_heads,
)
from tests.commands.test_generate import save_tiny_model
from tests.decoding.conftest import ARCHS, VOCAB, random_prompt, tiny_model
from tests.modeling.test_losses import logits

# ------------------------------------------------------------------------------ the loss


def shifted(model_logits, K):
    """Head logits equal to the model's own k positions on (and anything where nothing counts)."""
    B, T, V = model_logits.shape
    heads = torch.zeros(K, B, T, V)
    for k in range(1, K + 1):
        heads[k - 1, :, : T - k] = model_logits[:, k:]
    return heads


def test_medusa_loss_is_zero_when_each_head_matches_the_model_k_positions_on():
    model = logits(2, 6, 11)
    mask = torch.ones(2, 6, dtype=torch.bool)
    assert float(medusa_loss(shifted(model, 3), model, mask)) == pytest.approx(0.0, abs=1e-6)
    # the same heads compared without the shift are wrong
    assert float(medusa_loss(model[None].repeat(3, 1, 1, 1), model, mask)) > 0.1


def test_medusa_terms_agree_with_torch_kl_div_per_head():
    model, heads = logits(2, 5, 7), logits(3, 2, 5, 7, seed=1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    terms = medusa_terms(heads, model, mask)
    for k in range(1, 4):
        expected = F.kl_div(F.log_softmax(heads[k - 1, :, : 5 - k], -1), F.log_softmax(model[:, k:], -1),
                            log_target=True, reduction="sum")
        assert float(terms[k - 1]) == pytest.approx(float(expected), rel=1e-5)


def test_medusa_loss_counts_a_position_only_when_it_and_its_target_count():
    model, heads = logits(1, 6, 7), logits(2, 1, 6, 7, seed=1)
    mask = torch.tensor([[False, True, True, True, True, False]])
    changed_model, changed_heads = model.clone(), heads.clone()
    changed_model[0, 0], changed_model[0, 5] = 50.0, -50.0  # masked positions: never a target
    changed_heads[:, 0, 0] = 9.0  # position 0 is masked: never a source
    changed_heads[1, 0, 3:] = 9.0  # head 2 at 3 or later would target 5 or later: masked
    assert torch.allclose(medusa_terms(changed_heads, changed_model, mask), medusa_terms(heads, model, mask))
    assert float(medusa_loss(heads, model, mask)) == pytest.approx(float(medusa_terms(heads, model, mask).sum()) / 4)


def test_medusa_loss_weights_heads_and_hard_labels_are_the_greedy_tokens():
    model, heads = logits(2, 5, 7), logits(2, 2, 5, 7, seed=1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    terms = medusa_terms(heads, model, mask)
    weighted = medusa_loss(heads, model, mask, weights=[1.0, 0.8], normalizer=1)
    assert float(weighted) == pytest.approx(float(terms[0] + 0.8 * terms[1]), rel=1e-6)
    hard = medusa_terms(heads, model, mask, distance="argmax")
    greedy = model.argmax(-1)
    expected = F.cross_entropy(heads[1, :, :3].flatten(0, 1), greedy[:, 2:].flatten(), reduction="sum")
    assert float(hard[1]) == pytest.approx(float(expected), rel=1e-5)


# ------------------------------------------------------------------------------ training


@pytest.fixture(scope="module")
def texts():
    """Eight prompts of the tiny Llama with its greedy continuations."""
    model = tiny_model("llama")
    prompts = [random_prompt(s, 5)[0].tolist() for s in range(8)]
    return greedy_texts(model, prompts, max_new_tokens=24, batch_size=4, eos_token_id=None, pad_id=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_fresh_head_is_the_lm_head(arch):
    model = tiny_model(arch)
    hidden = torch.randn(2, 3, model.config.hidden_size)
    for own in (False, True):
        heads = MedusaHeads.for_model(model, num_heads=3, own_projection=own)
        logits = heads(hidden)
        assert logits.shape == (3, 2, 3, VOCAB)
        for k in range(3):
            assert torch.allclose(logits[k], model.get_output_embeddings()(hidden), atol=1e-6)


def test_parameters_added_count_the_heads_own_weights_only():
    model = tiny_model("llama")
    H = model.config.hidden_size
    assert MedusaHeads.for_model(model, num_heads=4).parameters_added() == 4 * (H * H + H)
    assert MedusaHeads.for_model(model, num_heads=2,
                                 own_projection=True).parameters_added() == 2 * (H * H + H + VOCAB * H)
    assert not any(p is model.get_output_embeddings().weight for p in MedusaHeads.for_model(model).parameters())


def test_hidden_states_cover_the_greedy_part_of_each_text(texts):
    model = tiny_model("llama")
    states = hidden_states(model, texts, batch_size=3)
    lm_head = model.get_output_embeddings()
    for text, s in zip(texts, states, strict=True):
        assert s.shape == (len(text.completion) + 1, model.config.hidden_size)
        # the state at the prompt's last token predicts the first greedy token, and so on
        assert lm_head(s[:-1]).argmax(-1).tolist() == text.completion
    eos = texts[0].completion[-1]  # a text ending in EOS: nothing after it is learnt
    assert hidden_states(model, texts[:1], eos_token_id=eos)[0].shape[0] == len(texts[0].completion)


def test_training_lowers_the_loss_and_raises_agreement(texts):
    model = tiny_model("llama").requires_grad_(False)
    states = hidden_states(model, texts)
    for own in (False, True):
        torch.manual_seed(0)
        heads = MedusaHeads.for_model(model, num_heads=3, own_projection=own)
        trainer = HeadsTrainer(heads, states, states, steps=40, batch_size=8, lr=1e-2)
        before = trainer.holdout()
        for _ in range(40):
            trainer.advance()
        after = trainer.holdout()
        assert after["loss"] < 0.7 * before["loss"], (own, before, after)
        assert sum(after["agreement"]) > sum(before["agreement"]) + 0.2, (own, before, after)
    assert all(not p.requires_grad for p in model.parameters())


def test_a_resumed_trainer_takes_the_same_steps(texts):
    model = tiny_model("gpt2").requires_grad_(False)
    states = hidden_states(model, texts)

    def trainer():
        torch.manual_seed(0)
        return HeadsTrainer(MedusaHeads.for_model(model, num_heads=2), states, steps=6, batch_size=3, lr=1e-2, seed=5)

    straight = trainer()
    logs = [straight.advance() for _ in range(6)]
    first = trainer()
    for _ in range(3):
        first.advance()
    saved = first.checkpoint()
    second = trainer()
    second.restore(saved)
    assert [second.advance() for _ in range(3)] == logs[3:]
    for a, b in zip(straight.heads.parameters(), second.heads.parameters(), strict=True):
        assert torch.equal(a, b)


def test_trained_heads_decode_exactly_and_faster(texts):
    model = tiny_model("llama")
    heads = train_heads(model, texts, num_heads=3, steps=60, lr=1e-2)
    assert len(heads.accuracies) == 3 and all(0 <= a <= 1 for row in heads.accuracies for a in row)
    forwards = tokens = 0
    for text in texts:
        prompt = torch.tensor([text.prompt])
        out = medusa_decode(model, heads, prompt, max_new_tokens=24)
        assert out.new_tokens[0] == greedy_decode(model, prompt, max_new_tokens=24).new_tokens[0] == text.completion
        forwards, tokens = forwards + out.forward_passes, tokens + len(text.completion)
    assert tokens / forwards > 1.2  # the training texts themselves: the heads fit them


def test_accuracies_of_fresh_heads_rank_the_token_one_ahead_first():
    """A fresh head k guesses the next token, not the one k + 1 ahead: on a text that repeats
    one token, both are the same and every head is right at rank 0."""
    model = tiny_model("llama")
    state = hidden_states(model, [Text([5], [7] * 6)])  # the model need not write it: states only
    heads = MedusaHeads.for_model(model, num_heads=2)
    acc = measure_accuracies(heads, state, top_k=3)
    greedy = model.get_output_embeddings()(state[0]).argmax(-1)
    expected = [float((greedy[:-k] == greedy[k:]).float().mean()) for k in (1, 2)]
    assert [row[0] for row in acc] == pytest.approx(expected)


def test_texts_from_trajectories_join_each_prompts_blocks():
    class R:
        def __init__(self, pid, index, block, prefix, fixed):
            self.prompt_id, self.prompt_index, self.block_index = pid, index, block
            self.prompt_len, self.prefix_ids, self.fixed_point = 2, prefix, fixed

    records = [R("b", 1, 0, [9, 9], [5]), R("a", 0, 1, [1, 2, 3, 4], [5, 6]), R("a", 0, 0, [1, 2], [3, 4])]
    assert texts_from_trajectories(records) == [Text([1, 2], [3, 4, 5, 6]), Text([9, 9], [5])]


# ------------------------------------------------------------------------------ save and load


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama saved as a checkpoint, with trained heads in its medusa/ folder."""
    directory = save_tiny_model(tmp_path_factory.mktemp("medusa-ckpt"))
    model = load_model(directory)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    texts = greedy_texts(model, prompts, max_new_tokens=16, batch_size=2, eos_token_id=None, pad_id=0)
    heads = train_heads(model, texts, num_heads=2, steps=10, lr=1e-2)
    heads.meta = base_model_meta(model, directory)
    save_heads(heads, directory / HEADS_DIR)
    return directory, heads, texts


def test_save_and_load_give_the_same_heads_and_output(checkpoint):
    directory, heads, texts = checkpoint
    model = load_model(directory)
    loaded = load_heads(directory, model)  # the checkpoint: its medusa/ folder
    assert loaded is not None and loaded.accuracies == heads.accuracies  # JSON keeps Python floats exactly
    again = load_heads(directory / HEADS_DIR, model)  # the heads folder itself
    hidden = torch.randn(4, model.config.hidden_size)
    assert torch.equal(loaded(hidden), heads(hidden)) and torch.equal(again(hidden), heads(hidden))
    prompt = torch.tensor([texts[0].prompt])
    a = medusa_decode(model, heads, prompt, max_new_tokens=16)
    b = medusa_decode(model, loaded, prompt, max_new_tokens=16)
    assert a.new_tokens == b.new_tokens and a.forward_passes == b.forward_passes
    record = json.loads((directory / HEADS_DIR / CONFIG_FILE).read_text())
    assert record["num_heads"] == 2 and record["model_fingerprint"] and record["parameters_added"] > 0


def test_a_checkpoint_without_heads_gives_none(tmp_path):
    directory = save_tiny_model(tmp_path / "bare")
    assert load_heads(directory, load_model(directory)) is None
    with pytest.raises(UserError, match="not found"):
        load_heads(tmp_path / "nothing", load_model(directory))


def test_heads_of_another_model_are_a_one_line_error(checkpoint, tmp_path):
    directory, heads, _ = checkpoint
    other_dir = save_tiny_model(tmp_path / "other", seed=1)
    other = load_model(other_dir)
    for source, kwargs in ((directory / HEADS_DIR, {"model_path": other_dir}), (directory / HEADS_DIR, {})):
        with pytest.raises(UserError, match="trained on another model") as info:
            load_heads(source, other, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="vocabulary x hidden size"):
        load_heads(directory / HEADS_DIR, tiny_model("llama"))


def test_damaged_heads_are_a_one_line_error(checkpoint, tmp_path):
    directory, heads, _ = checkpoint
    model = load_model(directory)
    folder = tmp_path / "damaged"
    heads.meta = {}
    save_heads(heads, folder)
    (folder / WEIGHTS_FILE).write_bytes(b"not safetensors")
    with pytest.raises(UserError, match="cannot load"):
        load_heads(folder, model)
    (folder / CONFIG_FILE).write_text("{")
    with pytest.raises(UserError, match="cannot read"):
        load_heads(folder, model)


def test_a_checkpoint_of_the_loop_before_the_skeleton_still_resumes(texts, tmp_path):
    """Checkpoints written before the skeleton held the trainer's state under "trainer" (heads,
    optimizer, scheduler, generator, step): read back, they restore what today's would."""
    from cllm.core.runs import save_checkpoint
    from cllm.training.drafter import _checkpoint

    model = tiny_model("gpt2").requires_grad_(False)
    states = hidden_states(model, texts)
    trainer = HeadsTrainer(MedusaHeads.for_model(model, num_heads=2), states, states, steps=6, batch_size=3, seed=5)
    trainer.evaluate()  # step 0: the untrained heads' held-out measures, kept in the checkpoint
    trainer.advance()
    today = trainer.checkpoint()
    state = {k: today[k] for k in ("optimizer", "scheduler", "generator")}
    save_checkpoint(tmp_path / "old.pt", {"trainer": {"heads": today["drafter"], **state, "step": today["step"]},
                                          "before": today["before"], "elapsed_s": today["elapsed_s"]})
    read = _checkpoint(tmp_path / "old.pt")
    assert set(read) == set(today) and read["step"] == 1 and read["before"] == today["before"] is not None
    resumed = HeadsTrainer(MedusaHeads.for_model(model, num_heads=2), states, states, steps=6, batch_size=3, seed=9)
    resumed.restore(read)
    assert resumed.advance() == trainer.advance()


def test_the_saved_record_reuses_the_last_steps_held_out_measures(texts, tmp_path, monkeypatch):
    """A finished run's record takes the held-out loss its last step measured (same weights):
    no second pass over the held-out texts; a run resumed at its end measures it once."""
    from cllm.training.skeleton import Plan

    model = tiny_model("gpt2").requires_grad_(False)
    states = hidden_states(model, texts)
    passes = []
    monkeypatch.setattr(HeadsTrainer, "holdout", lambda self, measure=HeadsTrainer.holdout: passes.append(self.step)
                        or measure(self))
    plan = Plan(log=tmp_path / "log.jsonl", checkpoint=tmp_path / "ckpt.pt", total=5, eval_every=2,
                checkpoint_every=5, desc="test")
    trainer = HeadsTrainer(MedusaHeads.for_model(model, num_heads=2), states, states, steps=5, batch_size=3, plan=plan)
    trainer.begin(None)
    assert trainer.fit() and passes == [0, 2, 4, 5]
    last = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[-1])
    assert trainer.final_holdout() == last["holdout"] and passes == [0, 2, 4, 5]
    resumed = HeadsTrainer(MedusaHeads.for_model(model, num_heads=2), states, states, steps=5, batch_size=3, plan=plan)
    resumed.restore(trainer.checkpoint())
    assert resumed.final_holdout() == last["holdout"] and passes == [0, 2, 4, 5, 5]
