"""cllm pretrain on a tiny model and corpus: it learns, it resumes exactly, it exports a
checkpoint that transformers loads offline. Plus the shipped model, once it is committed."""

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import cllm.training.pretrain as pretrain_module
from cllm.core.errors import UserError
from cllm.training.pretrain import (
    PretrainConfig,
    evaluate_target,
    pretrain,
    write_model_card,
)
from cllm.training.schedule import lr_factor

SHIPPED = Path(__file__).resolve().parents[2] / "models" / "stdlib-coder"


def tiny(out: Path, **overrides) -> PretrainConfig:
    fields = dict(out=str(out), max_files=4, vocab_size=320, width=32, layers=2, heads=2, context=32,
                  steps=12, batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=4,
                  eval_batches=2, checkpoint_interval=4, threads=1)
    fields.update(overrides)
    return PretrainConfig(**fields)


def log_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "pretrain_log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    pretrain(tiny(out))
    return out


def test_pretraining_lowers_train_and_validation_loss(reference_run):
    log = log_of(reference_run)
    assert [r["step"] for r in log] == list(range(1, 13))
    vals = [r["val_loss"] for r in log if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5


def test_export_loads_offline_with_auto_classes(reference_run):
    model = AutoModelForCausalLM.from_pretrained(reference_run)
    tokenizer = AutoTokenizer.from_pretrained(reference_run)
    assert model.config.tie_word_embeddings and model.config.eos_token_id == tokenizer.eos_token_id == 0
    summary = json.loads((reference_run / "pretrain_summary.json").read_text())
    assert len(summary["corpus"]["train"]["sha256"]) == 64 and summary["steps"] == 12
    assert json.loads((reference_run / "pretrain_config.json").read_text())["width"] == 32


def _interrupt_at(monkeypatch, step: int, how: str):
    """Patch train_step so that call number `step` sends Ctrl-C (finishing that step) or
    crashes before it (as if the machine died)."""
    real, calls = pretrain_module.Pretrainer.train_step, {"n": 0}

    def patched(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == step:
            if how == "crash":
                raise RuntimeError("simulated crash")
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(pretrain_module.Pretrainer, "train_step", patched)


@pytest.mark.parametrize("how, stop, resumed_from", [("ctrl-c", 6, 6), ("crash", 7, 4)])
def test_resume_reproduces_the_uninterrupted_run_exactly(reference_run, tmp_path, monkeypatch, how, stop, resumed_from):
    with monkeypatch.context() as m:
        _interrupt_at(m, stop, how)
        with pytest.raises(KeyboardInterrupt if how == "ctrl-c" else RuntimeError):
            pretrain(tiny(tmp_path))
    saved = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=False)
    assert saved["step"] == resumed_from
    pretrain(tiny(tmp_path))  # the same command again
    expected, got = log_of(reference_run), log_of(tmp_path)
    assert [r["step"] for r in got] == list(range(1, 13))
    for key in ("loss", "val_loss", "lr"):
        assert [r.get(key) for r in got] == [r.get(key) for r in expected]
    a = AutoModelForCausalLM.from_pretrained(reference_run).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_with_a_different_model_is_refused(reference_run, tmp_path):
    import shutil

    shutil.copytree(reference_run, tmp_path, dirs_exist_ok=True)
    with pytest.raises(UserError, match="width"):
        pretrain(tiny(tmp_path, width=64))


@pytest.mark.parametrize("bad", [dict(width=30, heads=4), dict(steps=0), dict(min_lr=1.0, lr=0.1),
                                 dict(warmup_steps=12)])
def test_invalid_config_raises_one_line_value_error(tmp_path, bad):
    with pytest.raises(ValueError) as info:
        tiny(tmp_path, **bad)
    assert "\n" not in str(info.value)


def test_lr_warms_up_then_decays_to_min_lr():
    lrs = [lr_factor(s, 100, 10, floor=0.1) for s in range(100)]
    assert lrs[:10] == sorted(lrs[:10]) and lrs[9] == 1.0
    assert lrs[10:] == sorted(lrs[10:], reverse=True) and lrs[-1] == pytest.approx(0.1, abs=1e-3)


def test_evaluate_target_and_model_card_on_the_tiny_model(reference_run):
    evaluation = evaluate_target(reference_run, n_prompts=3, max_new_tokens=8, n_samples=2)
    assert evaluation.val_loss > 0 and evaluation.n_prompts == 3 and len(evaluation.samples) == 2
    assert (0 <= evaluation.parse_rate <= 1 and 0 <= evaluation.degenerate_rate <= 1
            and 0 <= evaluation.looping_rate <= 1)
    card = write_model_card(reference_run, evaluation, name="tiny").read_text()
    assert "# tiny" in card and "validation loss" in card and evaluation.corpus_sha256[:16] in card


def test_shipped_model_loads_offline_and_decodes_real_code():
    from cllm.decoding import greedy_decode, jacobi_decode

    model = AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    ids = tokenizer("def add(a, b):\n", return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] > ids.shape[1]
    assert tokenizer.decode(out[0]).startswith("def add(a, b):\n")
    assert (SHIPPED / "model.safetensors").stat().st_size < 25e6
    # a real code model, not noise: a function body starts with an indented line
    prompt = tokenizer('def add(a, b):\n    """Return the sum of a and b."""', return_tensors="pt").input_ids
    greedy = greedy_decode(model, prompt, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    assert tokenizer.decode(greedy.new_tokens[0]).startswith("\n    ")
    jacobi = jacobi_decode(model, prompt, block_size=16, max_new_tokens=24, eos_token_id=tokenizer.eos_token_id)
    assert jacobi.new_tokens == greedy.new_tokens


def test_cli_reports_a_bad_config_in_one_line_and_exits_2(capsys):
    from cllm.cli import main

    assert main(["pretrain", "--width", "30", "--heads", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm pretrain: error:") and "\n" not in err


def test_a_draft_model_reuses_the_targets_tokenizer(reference_run, tmp_path):
    draft = tmp_path / "draft"
    pretrain(tiny(draft, tokenizer=str(reference_run), width=16, layers=1, heads=1, steps=2, warmup_steps=1))
    assert (draft / "tokenizer.json").read_bytes() == (reference_run / "tokenizer.json").read_bytes()
    assert AutoModelForCausalLM.from_pretrained(draft).config.num_hidden_layers == 1
    with pytest.raises(UserError, match="320 tokens, not --vocab-size 400"):
        pretrain(tiny(tmp_path / "other", tokenizer=str(reference_run), vocab_size=400))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_device_this_machine_lacks_is_refused_in_one_line_before_anything_is_written(capsys, tmp_path):
    from cllm.cli import main

    out = tmp_path / "run"
    assert main(["pretrain", "--device", "cuda", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--device cuda: torch sees no CUDA device here" in err and "\n" not in err
    assert not out.exists()

