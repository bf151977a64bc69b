"""`cllm medusa --joint` (Medusa-2) on a tiny random Llama saved in tmp_path: the model trains with
its heads and moves, the loss falls; a warm-up as long as the run leaves the model bit for bit the
original; the new checkpoint loads, its heads pass the fingerprint check against it and are
refused on the original; Medusa decoding of it is its own greedy decoding; an interrupted run
resumes to the same model and heads; bad options are one-line errors. Plus the loss alone."""

import json

import pytest
import torch

from cllm.cli import main
from cllm.core.errors import UserError
from cllm.decoding import greedy_decode
from cllm.decoding.rivals.medusa import medusa_decode
from cllm.modeling.heads import CONFIG_FILE, HEADS_DIR, WEIGHTS_FILE
from cllm.models import fingerprint, load_heads, load_model
from cllm.training.medusa.loss import backbone_terms, joint_loss, medusa_loss
from tests.commands.test_generate import save_tiny_model
from tests.training.test_drafts import run

TINY = ["--heads", "2", "--max-new-tokens", "16", "--holdout", "2", "--steps", "6", "--batch-size", "3",
        "--eval-every", "3", "--eval-count", "2", "--quality-count", "3", "--eval-max-new-tokens", "12",
        "--top-k", "3", "--tree-nodes", "5", "--warmup-heads", "2", "--backbone-lr", "3e-3"]


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("medusa2-base"))


@pytest.fixture(scope="module")
def joint(base, tmp_path_factory, prompt_file):
    """The tiny model trained jointly with its heads by the CLI, into a folder of its own."""
    out = tmp_path_factory.mktemp("medusa2") / "model"
    code = main(["medusa", "--joint", "--model", str(base), "--prompts", str(prompt_file), "--eval-prompts",
                 str(prompt_file), "--out", str(out), *TINY])
    assert code == 0
    return out


# ------------------------------------------------------------------------ the loss alone


def test_the_backbone_term_is_zero_for_the_original_and_counts_only_masked_positions():
    g = torch.Generator().manual_seed(0)
    original = torch.randn(2, 5, 11, generator=g)
    model = torch.randn(2, 5, 11, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert float(backbone_terms(original, original, mask)) == pytest.approx(0.0, abs=1e-6)
    changed = model.clone()
    changed[0, 3:] = 100 * torch.randn(2, 11, generator=g)  # masked positions: no effect
    assert torch.allclose(backbone_terms(model, original, mask), backbone_terms(changed, original, mask))
    reference = torch.nn.functional.kl_div(model.log_softmax(-1), original.log_softmax(-1), log_target=True,
                                           reduction="none").sum(-1)
    assert torch.allclose(backbone_terms(model, original, mask), reference[mask].sum(), atol=1e-5)


def test_the_joint_loss_is_the_kl_plus_lambda_times_the_medusa_loss():
    g = torch.Generator().manual_seed(1)
    original, model = torch.randn(2, 6, 9, generator=g), torch.randn(2, 6, 9, generator=g)
    heads = torch.randn(3, 2, 6, 9, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    loss = joint_loss(model, heads, original, mask, heads_weight=0.25, weights=[1, 0.8, 0.64])
    medusa = medusa_loss(heads, original, mask, weights=[1, 0.8, 0.64])
    assert torch.allclose(loss.heads, medusa) and torch.allclose(loss.total, loss.backbone + 0.25 * medusa)
    assert torch.allclose(loss.backbone, backbone_terms(model, original, mask) / 12)
    warm = joint_loss(None, heads, original, mask, heads_weight=0.25, weights=[1, 0.8, 0.64])
    assert torch.allclose(warm.total, medusa) and float(warm.backbone) == 0.0


def test_joint_steps_lower_the_training_loss_and_move_the_model(base):
    """JointTrainer alone: joint steps from the first one lower the loss on the texts trained on;
    the teacher (a copy of the original LM head) does not move while the model's own does."""
    from cllm.modeling.heads import MedusaHeads
    from cllm.training.medusa import greedy_texts, hidden_states
    from cllm.training.medusa.joint import JointTrainer, frozen_copy

    model = load_model(base)
    texts = greedy_texts(model, [[5, 6, 7], [40, 41], [100], [7, 8, 9, 10], [60, 61, 62], [9]], max_new_tokens=12,
                         batch_size=3, eos_token_id=None, pad_id=0)
    states = hidden_states(model, texts)
    teacher = frozen_copy(model.get_output_embeddings())
    original_head = teacher.weight.clone()
    model.requires_grad_(True)
    trainer = JointTrainer(model, MedusaHeads.for_model(model, num_heads=2), texts, states, teacher, steps=20,
                           held=list(zip(texts, states, strict=True)), batch_size=3, lr=1e-2, backbone_lr=1e-3,
                           heads_weight=1.0)
    before = trainer.holdout()
    for _ in range(20):
        trainer.advance()
    after = trainer.holdout()
    assert after["loss"] < before["loss"] and before["backbone_kl"] == pytest.approx(0.0, abs=1e-6)
    assert torch.equal(teacher.weight, original_head)
    assert not torch.equal(model.get_output_embeddings().weight, original_head)


# ------------------------------------------------------------------------ the command


def test_help_lists_the_joint_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["medusa", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for flag in ("--joint", "--warmup-heads", "--backbone-lr", "--heads-weight", "--quality-count"):
        assert flag in out


def test_joint_training_moves_the_model_and_lowers_the_loss(base, joint):
    assert not same_weights(load_model(base), load_model(joint))
    record = json.loads((joint / HEADS_DIR / CONFIG_FILE).read_text())["training"]
    before, after = record["holdout_before"], record["holdout_after"]
    assert after["heads_loss"] < before["heads_loss"] and after["backbone_kl"] > before["backbone_kl"] == 0
    log = [json.loads(line) for line in (joint / "medusa_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(7))
    assert [r["joint"] for r in log[1:]] == [False, False, True, True, True, True]
    assert all(r["backbone_kl"] == 0 for r in log[1:3]) and log[-1]["backbone_kl"] > 0


def test_the_folder_is_a_checkpoint_with_its_heads_record_card_and_evaluation(base, joint):
    names = {p.name for p in joint.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "MODEL_CARD.md",
            "evaluation.json", "medusa_train_config.json", "medusa_log.jsonl", "medusa"} <= names
    assert not {"checkpoint.pt", "texts.jsonl"} & names
    assert {p.name for p in (joint / HEADS_DIR).iterdir()} == {CONFIG_FILE, WEIGHTS_FILE}
    record = json.loads((joint / HEADS_DIR / CONFIG_FILE).read_text())
    assert record["model_fingerprint"] == fingerprint(joint) and record["base_fingerprint"] == fingerprint(base)
    evaluation = json.loads((joint / "evaluation.json").read_text())
    assert evaluation["exact"] == evaluation["prompts"] == 2
    quality = evaluation["quality"]
    assert quality["prompts"] == 3 and 0 <= quality["model"]["same_as_target"] <= 1
    card = (joint / "MODEL_CARD.md").read_text()
    assert "Medusa-2" in card and "cllm medusa --joint" in card and "tokens per forward" in card


def test_the_heads_load_on_the_new_model_and_are_refused_on_the_original(base, joint):
    assert load_heads(joint, load_model(joint)) is not None
    with pytest.raises(UserError, match="trained on another model"):
        load_heads(joint / HEADS_DIR, load_model(base), model_path=base)
    with pytest.raises(UserError, match="trained on another model"):
        load_heads(joint / HEADS_DIR, load_model(base))  # the parameters' fingerprint


def test_medusa_decoding_of_the_new_model_is_its_greedy_decoding(joint):
    model = load_model(joint)
    heads = load_heads(joint, model)
    for ids in ([5, 6, 7], [40, 41], [100], [7, 8, 9, 10, 11, 12]):
        prompt = torch.tensor([ids])
        expected = greedy_decode(model, prompt, max_new_tokens=30).new_tokens
        assert medusa_decode(model, heads, prompt, max_new_tokens=30).new_tokens == expected


def test_generate_medusa_auto_uses_the_new_checkpoints_heads(joint, capsys):
    from tests.commands.test_generate import Oracle

    oracle = Oracle(joint)
    code, out, err = run(capsys, "generate", "--model", joint, "--prompt", "def g(y):", "--max-new-tokens", 24,
                         "--medusa", "auto")
    assert code == 0 and out == oracle.text("def g(y):") + "\n"
    assert err.strip().splitlines()[-1].startswith("[medusa]")


def test_a_warmup_as_long_as_the_run_leaves_the_model_the_original(base, prompt_file, tmp_path, capsys):
    out = tmp_path / "warm"
    code, _, err = run(capsys, "medusa", "--joint", "--model", base, "--prompts", prompt_file, *TINY,
                       "--warmup-heads", 6, "--eval-count", 0, "--quality-count", 0, "--out", out)
    assert code == 0, err
    assert same_weights(load_model(base), load_model(out))
    assert load_heads(out, load_model(out)) is not None


def test_an_interrupted_run_resumes_to_the_same_model_and_heads(base, joint, prompt_file, tmp_path, monkeypatch,
                                                                 capsys):
    """Ctrl-C after the first joint step saves a checkpoint (model, heads, both optimizers); the
    rerun ends with the model and heads of the uninterrupted run (`joint`), bit for bit."""
    from contextlib import contextmanager

    import cllm.training.skeleton
    from cllm.training.medusa.joint import JointTrainer

    out = tmp_path / "resumed"
    args = ["medusa", "--joint", "--model", base, "--prompts", prompt_file, *TINY, "--eval-count", "0",
            "--quality-count", "0", "--out", out]
    original_step = JointTrainer.train_step

    @contextmanager
    def pressed():
        flag = {"set": False}
        with monkeypatch.context() as m:  # Ctrl-C during the first joint step (step 3)

            def step(self):
                record = original_step(self)
                flag["set"] = self.step + 1 == 3
                return record

            m.setattr(JointTrainer, "train_step", step)
            yield flag

    with monkeypatch.context() as m:
        m.setattr(cllm.training.skeleton, "sigint_flag", pressed)
        code, out_text, _ = run(capsys, *args)
    assert code == 130 and "resume" in out_text and (out / "checkpoint.pt").exists()
    assert not (out / "model.safetensors").exists()
    code, out_text, err = run(capsys, *args)
    assert code == 0 and "resuming" in out_text and not (out / "checkpoint.pt").exists(), err
    assert same_weights(load_model(out), load_model(joint))
    a, b = load_heads(out, load_model(out)), load_heads(joint, load_model(joint))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    log = [json.loads(line) for line in (out / "medusa_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(7))


def test_a_finished_checkpoint_is_not_replaced_without_force(base, joint, prompt_file, capsys):
    weights = (joint / "model.safetensors").read_bytes()
    code, _, err = run(capsys, "medusa", "--joint", "--model", base, "--prompts", prompt_file, "--out", joint, *TINY)
    assert code == 2 and "--force" in err and err.count("\n") == 1
    assert (joint / "model.safetensors").read_bytes() == weights


@pytest.mark.parametrize(("args", "message"), [
    (["--joint"], "--joint changes the model: give --out"),
    (["--joint", "--out", "x", "--backbone-lr=-1e-4"], "--backbone-lr must be > 0"),
    (["--joint", "--out", "x", "--heads-weight=-1"], "--heads-weight must be >= 0"),
    (["--joint", "--out", "x", "--warmup-heads=-1"], "--warmup-heads must be an int >= 0"),
])
def test_bad_joint_options_are_one_line_errors(base, capsys, args, message):
    code, _, err = run(capsys, "medusa", "--model", base, *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("cllm medusa: error:") and message in err, err


def test_an_out_folder_of_other_files_or_the_model_itself_is_refused(base, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    for out, why in ((tmp_path, "did not write"), (base, "is the --model folder")):
        code, _, err = run(capsys, "medusa", "--joint", "--model", base, "--out", out)
        assert code == 2 and err.count("\n") == 1 and why in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_init_heads_starts_from_the_models_medusa1_heads_and_refuses_another_models(base, prompt_file, tmp_path,
                                                                                     capsys):
    """--init-heads: the run starts where Medusa-1's heads ended (the same held-out heads' loss at
    step 0, the model being the original then); heads of another model are refused at once."""
    first = tmp_path / "medusa1"
    common = ["--prompts", prompt_file, *TINY, "--eval-count", 0, "--quality-count", 0]
    assert run(capsys, "medusa", "--model", base, *common, "--out", first)[0] == 0
    out = tmp_path / "joint"
    code, _, err = run(capsys, "medusa", "--joint", "--model", base, *common, "--init-heads", first,
                       "--warmup-heads", 0, "--out", out)
    assert code == 0, err
    medusa1 = json.loads((first / CONFIG_FILE).read_text())["training"]["holdout_after"]
    start = json.loads((out / "medusa_log.jsonl").read_text().splitlines()[0])["holdout"]
    assert start["heads_loss"] == pytest.approx(medusa1["loss"], rel=1e-4)
    other = save_tiny_model(tmp_path / "other", seed=3)
    code, _, err = run(capsys, "medusa", "--joint", "--model", other, *common, "--init-heads", first,
                       "--out", tmp_path / "o")
    assert code == 2 and "trained on another model" in err.strip().splitlines()[-1]


def test_a_forced_rerun_stopped_early_resumes_without_force(base, joint, prompt_file, tmp_path, monkeypatch, capsys):
    """--force over a finished checkpoint starts over; stopped by Ctrl-C, it is an unfinished run
    again, which the same command without --force resumes (the old weights are gone)."""
    import shutil
    from contextlib import contextmanager

    import cllm.training.skeleton

    out = tmp_path / "again"
    shutil.copytree(joint, out)
    args = ["medusa", "--joint", "--model", base, "--prompts", prompt_file, *TINY, "--eval-count", "0",
            "--quality-count", "0", "--out", out]

    @contextmanager
    def pressed():
        yield {"set": True}

    with monkeypatch.context() as m:
        m.setattr(cllm.training.skeleton, "sigint_flag", pressed)
        assert run(capsys, *args, "--force")[0] == 130
    assert not (out / "model.safetensors").exists() and (out / "checkpoint.pt").exists()
    code, out_text, err = run(capsys, *args)
    assert code == 0 and "resuming" in out_text, err
    assert same_weights(load_model(out), load_model(joint))


def test_a_first_run_failing_before_its_first_checkpoint_leaves_no_folder_but_the_users_stays(
        base, prompt_file, tmp_path, monkeypatch, capsys):
    """The folder is claimed (marker, config) once the inputs are checked: a failure after that
    (here while the texts are decoded) removes the folder the run made, never one that was there."""
    import importlib

    def fails(*args, **kwargs):
        raise UserError("decoding failed")

    monkeypatch.setattr(importlib.import_module("cllm.training.drafter"), "training_texts", fails)
    for out in (tmp_path / "new", tmp_path / "mine"):
        if out.name == "mine":
            out.mkdir()
        code, _, err = run(capsys, "medusa", "--joint", "--model", base, "--prompts", prompt_file, "--out", out, *TINY)
        assert code == 2 and "decoding failed" in err
        assert out.is_dir() == (out.name == "mine")
