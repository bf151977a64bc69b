"""`cllm tune` on a tiny random checkpoint: it writes decode_defaults.json with settings inside
the rule's ranges, refuses to overwrite it, and `load_for_decoding`'s settings take it up on the
device type it was measured on only."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cllm.cli import main
from cllm.core import outputs
from cllm.core.errors import UserError
from cllm.decoding import RECOMMENDED
from cllm.models import DECODE_DEFAULTS, tuned_defaults
from cllm.profiling import tune as tune_module
from cllm.profiling.tune import TuneConfig, tune

KS = [1, 2, 4, 8, 16]


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def quick(checkpoint, **kw) -> TuneConfig:
    return TuneConfig(model=str(checkpoint), device="cpu", k=KS, repeats=2, prefix=200, **kw)


def test_tune_writes_defaults_within_the_rules_ranges(checkpoint):
    record = tune(quick(checkpoint))
    written = json.loads((checkpoint / DECODE_DEFAULTS).read_text())
    assert written == record
    n, budget = written["settings"]["block_size"], written["settings"]["recycle_budget"]
    assert n in KS and n <= record["rule"]["max_block"]
    assert n <= budget <= KS[-1]
    assert written["measured"]["k"] == KS and written["measured"]["ratio"][0] == 1.0
    assert written["device"] == "cpu" and written["machine"]["prefix"] == 64 - KS[-1]  # fitted to the positions


def test_tune_refuses_to_overwrite_without_force(checkpoint, capsys):
    tune(quick(checkpoint))
    with pytest.raises(UserError, match="--force"):
        tune(quick(checkpoint))
    capsys.readouterr()
    code = main(["tune", "--model", str(checkpoint), "--device", "cpu", "--repeats", "1", "--k", "1,2"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "exists: choose another path, or --force to replace it" in err and "\n" not in err
    assert tune(quick(checkpoint, force=True))["measured"]["k"] == KS


def test_load_for_decoding_settings_take_tuned_defaults_on_the_same_device_type_only(checkpoint):
    assert tuned_defaults(checkpoint, "cpu") == {}
    tune(quick(checkpoint))
    chosen = json.loads((checkpoint / DECODE_DEFAULTS).read_text())["settings"]
    assert tuned_defaults(checkpoint, "cpu") == chosen
    assert set(chosen) <= set(RECOMMENDED)
    assert tuned_defaults(checkpoint, "cuda") == {}


def test_a_damaged_defaults_file_is_a_one_line_error(checkpoint):
    (checkpoint / DECODE_DEFAULTS).write_text("{not json")
    with pytest.raises(UserError, match="rerun cllm tune --force"):
        tuned_defaults(checkpoint, "cpu")


@pytest.mark.parametrize("args, expected", [
    (["--k", "0"], "--k must be ints >= 1"),
    (["--block-max-cost", "3", "--budget-max-cost", "2"], "--block-max-cost <= --budget-max-cost"),
])
def test_bad_tune_options_are_one_line_errors(args, expected, checkpoint, capsys):
    code = main(["tune", "--model", str(checkpoint), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err


def test_tune_never_writes_over_a_file_of_the_model_and_refuses_an_unwritable_out_before_timing(
        checkpoint, tmp_path, monkeypatch):
    config = (checkpoint / "config.json").read_bytes()
    with pytest.raises(UserError, match="--model"):
        tune(quick(checkpoint, out=str(checkpoint / "config.json"), force=True))
    assert (checkpoint / "config.json").read_bytes() == config
    monkeypatch.setattr(tune_module, "time_steps", lambda *a, **k: pytest.fail("timed before checking --out"))
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: False)  # a read-only place (root writes anywhere)
    with pytest.raises(UserError, match="is not writable"):
        tune(quick(checkpoint, out=str(tmp_path / "ro" / "defaults.json")))
