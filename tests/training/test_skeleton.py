"""The training skeleton (`cllm.training.skeleton`) with a toy trainer: when it evaluates, logs
and checkpoints, what Ctrl-C and --stop-at-step leave, and that a resumed run equals the
uninterrupted one. Each real trainer's own resume test is beside it (test_train, test_pretrain,
test_medusa, test_medusa2, test_eagle)."""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest
import torch

import cllm.training.skeleton as skeleton
from cllm.core.runs import load_checkpoint
from cllm.training.skeleton import Plan, Trainer, descend, draw, time_left


class Toy(Trainer):
    """A linear regression on seeded batches: its checkpoint is the weights, AdamW and the batch
    generator, so a resume must draw and update exactly as the uninterrupted run."""

    def __init__(self, plan: Plan, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.plan = plan
        self.weights = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.AdamW(self.weights.parameters(), lr=0.05)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        self.generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
        self.targets = self.inputs @ torch.tensor([1.0, -2.0, 0.5, 3.0])
        self.evaluations: list[int] = []

    def _loss(self, rows) -> torch.Tensor:
        return ((self.weights(self.inputs[rows]).squeeze(-1) - self.targets[rows]) ** 2).mean()

    def train_step(self) -> dict:
        loss = self._loss(draw(len(self.inputs), 8, self.generator))
        descend(loss, self.optimizer, self.scheduler, clip=1.0, params=self.weights.parameters())
        return {"loss": loss.item()}

    def evaluate(self) -> dict:
        self.evaluations.append(self.step)
        with torch.no_grad():
            return {"held_out": self._loss(list(range(len(self.inputs)))).item()}

    def state_dict(self) -> dict:
        return {"weights": self.weights.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.weights.load_state_dict(state["weights"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])


def plan_in(folder, **changes) -> Plan:
    return Plan(**{"log": folder / "log.jsonl", "checkpoint": folder / "last.pt", "total": 10, "eval_every": 4,
                   "checkpoint_every": 3, "desc": "toy", **changes})


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def run_through(trainer: Trainer, saved: dict | None = None) -> bool:
    trainer.begin(saved)
    return trainer.fit()


def test_a_run_evaluates_logs_and_checkpoints_on_its_intervals(tmp_path, monkeypatch):
    saves = []
    monkeypatch.setattr(Toy, "save", lambda self: saves.append(self.step))
    toy = Toy(plan_in(tmp_path))
    assert run_through(toy)
    assert toy.evaluations == [0, 4, 8, 10]  # step 0 (the untrained model), every 4 steps, the end
    assert saves == [3, 6, 9, 10]
    log = records(tmp_path)
    assert [r["step"] for r in log] == list(range(11))
    assert [r["step"] for r in log if "held_out" in r] == [0, 4, 8, 10]
    assert all("loss" in r and r["elapsed_s"] >= 0 for r in log[1:])
    assert log[-1]["held_out"] < log[0]["held_out"]


def test_stopped_by_ctrl_c_or_stop_at_step_the_resumed_run_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    straight = Toy(plan_in(tmp_path / "straight"))
    (tmp_path / "straight").mkdir()
    assert run_through(straight)

    # Ctrl-C during step 5: the step finishes, a checkpoint is written, fit says it stopped
    @contextmanager
    def pressed():
        flag = {"set": False}
        real = Toy.train_step

        def step(self):
            flag["set"] = self.step + 1 == 5
            return real(self)

        with monkeypatch.context() as m:
            m.setattr(Toy, "train_step", step)
            yield flag

    (tmp_path / "resumed").mkdir()
    with monkeypatch.context() as m:
        m.setattr(skeleton, "sigint_flag", pressed)
        assert not run_through(Toy(plan_in(tmp_path / "resumed")))
    saved = load_checkpoint(tmp_path / "resumed" / "last.pt")
    assert saved["step"] == 5 and [r["step"] for r in records(tmp_path / "resumed")][-1] == 5
    # --stop-at-step 8 of the resumed run, then the rest
    assert run_through(Toy(plan_in(tmp_path / "resumed", stop_at=8)), saved)
    saved = load_checkpoint(tmp_path / "resumed" / "last.pt")
    assert saved["step"] == 8
    resumed = Toy(plan_in(tmp_path / "resumed"), seed=7)  # other initial weights: the checkpoint's win
    assert run_through(resumed, saved)
    assert torch.equal(resumed.weights.weight, straight.weights.weight)
    drop = ("elapsed_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in records(tmp_path / "resumed")] == \
        [{k: v for k, v in r.items() if k not in drop} for r in records(tmp_path / "straight")]


def test_a_resume_rewinds_the_log_to_the_checkpoint(tmp_path):
    first = Toy(plan_in(tmp_path, stop_at=6))
    assert run_through(first)
    saved = load_checkpoint(tmp_path / "last.pt")
    with (tmp_path / "log.jsonl").open("a") as fh:  # steps logged after the checkpoint, then a crash
        fh.write(json.dumps({"step": 7, "loss": 0.0}) + "\n")
    assert run_through(Toy(plan_in(tmp_path)), saved)
    assert [r["step"] for r in records(tmp_path)] == list(range(11))


def test_the_first_step_says_how_long_the_rest_takes(tmp_path, caplog):
    import logging

    toy = Toy(plan_in(tmp_path, then="then: export"))
    with caplog.at_level(logging.INFO, logger="cllm.training.skeleton"):
        run_through(toy)
    lines = [r.getMessage() for r in caplog.records if r.name == "cllm.training.skeleton"]
    assert len(lines) == 1 and lines[0].startswith("step 1 took ")
    assert "toy: about " in lines[0] and "(9 steps, 3 evaluations); then: export" in lines[0]


@pytest.mark.parametrize(("seconds", "said"), [(1.0, "about 10 s to go"), (30.0, "about 5 min to go"),
                                               (600.0, "about 1.7 h to go")])
def test_time_left_reads_in_the_unit_that_fits(seconds, said):
    assert time_left(seconds, 10, 0, None) == said
