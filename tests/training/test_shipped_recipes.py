"""A shipped checkpoint's recipe, rerun on today's training loop, logs the losses its shipped log
holds: the loop, the optimizer, the schedule and the data order are what made it. The draft
model's is the one quick enough for the suite (its tokenizer is the target's, its corpus this
Python's standard library)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

import cllm.training.skeleton as skeleton
from cllm.core.config import build_config, read_config_file
from cllm.models import SHIPPED
from cllm.training.config import PretrainConfig
from cllm.training.pretrain import pretrain

STEPS = 3


@pytest.mark.slow
def test_the_shipped_drafts_recipe_logs_its_first_losses_again(tmp_path, monkeypatch):
    folder = SHIPPED["stdlib-coder-draft"]
    values = read_config_file(folder / "pretrain_config.json")
    values |= {"out": str(tmp_path / "draft"), "tokenizer": str(SHIPPED["stdlib-coder"])}
    config = build_config(PretrainConfig, values, {})

    @contextmanager
    def stop_after_the_first_steps():  # as Ctrl-C during step STEPS: the step ends, a checkpoint is kept
        flag = {"set": False}
        real = skeleton.Trainer.advance

        def advance(self):
            flag["set"] = self.step + 1 == STEPS
            return real(self)

        with monkeypatch.context() as m:
            m.setattr(skeleton.Trainer, "advance", advance)
            yield flag

    monkeypatch.setattr(skeleton, "sigint_flag", stop_after_the_first_steps)
    with pytest.raises(KeyboardInterrupt):
        pretrain(config)
    shipped = [json.loads(line) for line in (folder / "pretrain_log.jsonl").read_text().splitlines()[:STEPS]]
    rerun = [json.loads(line) for line in (tmp_path / "draft" / "pretrain_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rerun] == [r["step"] for r in shipped] == list(range(1, STEPS + 1))
    for mine, theirs in zip(rerun, shipped, strict=True):
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=1e-4)  # float noise across CPUs, not a change
