"""`cllm distill` end to end on the synthetic language of tests/training/test_train.py: one command
collects, trains and evaluates; a rerun skips every finished stage."""

import dataclasses
import json
from pathlib import Path

import pytest

from cllm.cli import main as cli_main
from cllm.core.config import build_config, config_to_dict
from cllm.core.errors import UserError
from cllm.decoding.draft_table import DraftTable
from cllm.models import DRAFT_TABLE, fingerprint
from cllm.training.cards import evaluation_table
from cllm.training.distill import distill, plan_evaluation, repetition_warning
from cllm.training.distill_config import DISTILL_RECIPE, DistillConfig
from tests.training.test_train import BLOCK, NEW, make_tokenizer, pretrain_target, write_prompts


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    target = pretrain_target(root / "target", make_tokenizer())
    return root, target, write_prompts(root / "train.jsonl", 48, seed=1), write_prompts(root / "val.jsonl", 12, seed=2)


def config(setup, **overrides) -> DistillConfig:
    root, target, train_prompts, val_prompts = setup
    values = dict(model=str(target), prompts=str(train_prompts), out=str(root / "out"), max_prompts=None,
                  block_size=BLOCK, max_new_tokens=NEW, collect_batch_size=16, max_steps=100, lr=1e-3,
                  train_eval_count=4, eval_interval=100, eval_prompts=str(val_prompts), eval_count=12,
                  eval_block_sizes=[BLOCK, 2 * BLOCK], eval_max_new_tokens=2 * NEW, ar_text="none", rollout_tokens=NEW)
    values.update(overrides)
    return build_config(DistillConfig, values, {})  # flat options, as on the command line


@pytest.fixture(scope="module")
def distilled(setup):
    return distill(config(setup))


def test_one_command_gives_a_faster_exact_cllm_and_an_evaluation(setup, distilled):
    out = setup[0] / "out"
    ev = distilled.evaluation
    assert json.loads((out / "evaluation.json").read_text()) == ev
    assert ev["prompts_evaluated"] == 12
    for n in (str(BLOCK), str(2 * BLOCK)):
        assert ev["tokens_per_forward"]["cllm"][n] > ev["tokens_per_forward"]["target"][n] + 0.5
        assert ev["cllm_jacobi_equals_greedy"][n] == 1.0
    assert ev["ar_loss"]["cllm"] is not None and ev["ar_loss"]["target"] is not None
    for key in ("degenerate", "looping"):
        assert set(ev[key]) == {"target", "cllm"} and all(0 <= v <= 1 for v in ev[key].values())
    assert (out / "trajectories" / "meta.json").is_file()
    assert (out / "model" / "model.safetensors").is_file()
    assert "## Distillation evaluation" in (out / "model" / "MODEL_CARD.md").read_text()
    assert json.loads((out / "distill_config.json").read_text())["block_size"] == BLOCK
    # the CLLM's draft table, built from its own greedy completions of the training prompts
    table = DraftTable.load(out / "model" / DRAFT_TABLE)
    assert len(table) > 0 and table.meta["model_fingerprint"] == fingerprint(out / "model")


def test_the_table_shows_repetition_and_warns_when_the_cllm_loops_far_more():
    ev = {"tokens_per_forward": {"target": {"16": 1.05}, "cllm": {"16": 2.2}},
          "cllm_jacobi_equals_greedy": {"16": 1.0}, "ar_loss": {"target": 2.77, "cllm": 2.84},
          "greedy_agreement": 0.0, "token_agreement": 0.09,
          "degenerate": {"target": 0.0, "cllm": 0.8}, "looping": {"target": 0.26, "cllm": 0.85}}
    table = evaluation_table(ev)
    assert "| greedy completions ending in a loop | 26% | 85% |" in table
    assert "| greedy completions one token 10+ times in a row | 0% | 80% |" in table
    assert "85%" in repetition_warning(ev) and "\n" not in repetition_warning(ev)
    assert repetition_warning({**ev, "looping": {"target": 0.26, "cllm": 0.4}}) is None
    old = {k: v for k, v in ev.items() if k not in ("degenerate", "looping")}  # an older evaluation.json
    assert "loop" not in evaluation_table(old) and repetition_warning(old) is None


def test_rerun_skips_every_finished_stage(setup, distilled):
    out = setup[0] / "out"
    before = {p: p.stat().st_mtime_ns for p in [out / "evaluation.json", out / "model" / "train_log.jsonl",
                                                out / "model" / DRAFT_TABLE,
                                                *sorted((out / "trajectories").glob("shard-*"))]}
    again = distill(config(setup))
    assert again.skipped == ["train", "evaluate", "drafts"]
    assert again.evaluation == distilled.evaluation
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_bad_distill_input_is_a_one_line_error(setup, tmp_path, capsys):
    with pytest.raises(UserError, match="eval-block-sizes"):
        config(setup, eval_block_sizes=[0])
    with pytest.raises(UserError, match="round-block-sizes"):
        config(setup, round_block_sizes=[BLOCK, 0])
    with pytest.raises(UserError, match="micro-batch-size"):
        config(setup, micro_batch_size=5)  # training options are checked up front
    assert cli_main(["distill", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cllm distill: error:") and "\n" not in err and "not found" in err


def test_a_second_round_recollects_with_the_first_cllm_and_trains_it_further(setup, distilled):
    out = setup[0] / "out"
    result = distill(config(setup, rounds=2))
    assert result.skipped[0] == "train round 1"
    meta = json.loads((out / "trajectories-round2" / "meta.json").read_text())
    assert meta["model_fingerprint"] == fingerprint(out / "model")  # on-policy: the round-1 CLLM
    assert meta["drop_loops"] is True  # the CLLM's own loops are not taught back to it
    assert json.loads((out / "trajectories" / "meta.json").read_text())["drop_loops"] is False
    assert (out / "model-round2" / "model.safetensors").is_file()
    assert result.evaluation["cllm_fingerprint"] == fingerprint(out / "model-round2")
    assert all(v == 1.0 for v in result.evaluation["cllm_jacobi_equals_greedy"].values())


def test_round_block_sizes_collect_each_round_at_its_size_and_train_on_its_size_alone(setup):
    """Jacobi Forcing's schedule (n, then 2n from round 1's CLLM): a round's data are the rounds
    so far collected at its own block size (a batch never mixes block sizes)."""
    cfg = config(setup, rounds=3, round_block_sizes=[BLOCK, 2 * BLOCK])
    assert [cfg.collect_config(r).block_size for r in (1, 2, 3)] == [BLOCK, 2 * BLOCK, 2 * BLOCK]
    out = Path(cfg.out)
    assert cfg.train_config(1).data == str(out / "trajectories")
    assert cfg.train_config(2).data == str(out / "trajectories-round2")
    assert cfg.train_config(3).data == f"{out / 'trajectories-round2'},{out / 'trajectories-round3'}"
    plain = config(setup, rounds=2)  # without it every round collects at --block-size and keeps all data
    assert plain.collect_config(2).block_size == BLOCK
    assert plain.train_config(2).data == f"{out / 'trajectories'},{out / 'trajectories-round2'}"


def cli_args(cfg: DistillConfig) -> list[str]:
    args = ["distill"]
    for name, value in config_to_dict(cfg).items():
        if isinstance(value, list):
            value = ",".join(map(str, value))
        if name == "ar_text" and value is None:
            value = "none"  # the recipe's default is stdlib-train
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def test_the_command_prints_the_evaluation_with_its_held_out_set_and_measures(setup, distilled, capsys):
    capsys.readouterr()
    assert cli_main(cli_args(config(setup))) == 0
    out = capsys.readouterr().out
    evaluation = json.loads((setup[0] / "out" / "evaluation.json").read_text())
    assert f"distilled {setup[1]} -> {setup[0] / 'out' / 'model'} (skipped: train" in out
    assert evaluation_table(evaluation) in out
    assert f"held-out sets: {setup[3]} (12 prompts, not Python, no parse rate)" in out
    from cllm.evaluation.gates import gates_verdict

    verdict = gates_verdict(evaluation["gates"])  # which gates failed, one advice line each
    assert verdict[0].startswith("gates: ") and "\n".join(verdict) in out


def test_distill_trains_one_epoch_of_the_collected_records_by_default():
    """The recipe of distill_ablations.md's r7 with the training length of the data, not 450 steps."""
    cfg = DistillConfig()
    assert cfg.recipe == DISTILL_RECIPE and cfg.recipe.epochs is None and cfg.recipe.max_steps is None
    assert cfg.train_config().recipe.total_steps(steps_per_epoch=37) == 37
    assert (cfg.recipe.distance, cfg.recipe.kd_weight, cfg.recipe.ar_weight) == ("argmax", 10.0, 0.0)


def test_without_eval_prompts_the_last_prompts_of_a_users_set_are_held_out(setup, tmp_path):
    cfg = config(setup, eval_prompts=None, eval_count=12, out=str(tmp_path / "out"))
    plan = plan_evaluation(cfg)
    texts = [json.loads(line) for line in setup[2].read_text().splitlines()]
    assert plan.limit == 36 and [p.id for p in plan.held_out] == [t["id"] for t in texts[36:]]
    assert plan.prompts == str(tmp_path / "out" / "heldout_prompts.jsonl") and "no --eval-prompts" in plan.line
    assert cfg.collect_config(1, limit=plan.limit).max_prompts == 36
    assert cfg.drafts_config(tmp_path, limit=plan.limit).max_prompts == 36
    assert cfg.train_config(1, eval_prompts=plan.prompts).recipe.eval_prompts == plan.prompts
    with pytest.raises(UserError, match="leaves none to train on"):
        plan_evaluation(config(setup, eval_prompts=None, eval_count=48))
    # the stdlib domain: a named prompt set evaluates on stdlib-val, nothing held out
    stdlib = plan_evaluation(config(setup, eval_prompts=None, prompts="stdlib-train"))
    assert (stdlib.prompts, stdlib.held_out, stdlib.limit) == ("stdlib-val", [], None)


@pytest.mark.parametrize("case, message", [
    ("ar text", "--ar-text"),
    ("eval prompts", "prompt file not found"),
    ("prompts", "prompt file not found"),
    ("model out", "did not write"),
])
def test_every_input_is_checked_before_collection(setup, tmp_path, case, message):
    overrides = {"ar text": dict(ar_text=str(tmp_path / "missing.txt")),
                 "eval prompts": dict(eval_prompts=str(tmp_path / "missing.jsonl")),
                 "prompts": dict(prompts=str(tmp_path / "missing.jsonl")),
                 "model out": {}}[case]
    out = tmp_path / "out"
    if case == "model out":
        (out / "model").mkdir(parents=True)
        (out / "model" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=message):
        distill(config(setup, out=str(out), **overrides))
    assert not (out / "trajectories").exists()


def test_each_stages_time_left_says_it_is_that_stages_and_estimates_the_later_ones():
    """distill's own lines name the stages after the one whose time left the bar or train gives,
    and at collection's speed, roughly how long evaluation and the draft table decode."""
    from cllm.training.distill import later_stages

    cfg = DistillConfig(eval_count=10, eval_block_sizes=[16, 32], drafts_prompts=100, drafts_max_new_tokens=64)
    assert later_stages(cfg, 1, "collect") == "then: train, evaluate, the draft table"
    decoded = 2 * 10 * cfg.recipe.eval_max_new_tokens * 3 + 100 * 64
    line = later_stages(cfg, 1, "train", tokens_per_second=decoded / 30)
    assert line == f"then: evaluate, the draft table (evaluation and draft table: roughly 30 s more at " \
                   f"collection's {decoded / 30:.0f} tokens/s)"
    assert later_stages(dataclasses.replace(cfg, rounds=3, drafts_prompts=0), 1, "train") == \
        "then: 2 more collect + train rounds, evaluate"


def test_inside_distill_the_trainings_time_left_says_it_is_trainings_and_what_comes_after(tmp_path, monkeypatch,
                                                                                          caplog):
    """The loop's "about N s to go" covers training alone: run by distill it says so and ends
    with distill's later stages and their rough estimate; run by `cllm train`, it reads as before."""
    import logging
    from types import SimpleNamespace

    import cllm.training.distill as distilling
    from cllm.training.distill import EvalPlan
    from cllm.training.skeleton import Plan, Trainer

    seen = {}

    def fake_train(train_config, *, then=""):
        seen["then"] = then
        return SimpleNamespace(lines=lambda: [])

    summary = SimpleNamespace(lines=lambda: [], new_tokens=3000, tokens_per_second=100.0)
    monkeypatch.setattr(distilling, "collect", lambda collect_config: summary)
    monkeypatch.setattr(distilling, "train", fake_train)
    cfg = DistillConfig(out=str(tmp_path / "out"), eval_count=10, eval_block_sizes=[16, 32], drafts_prompts=100,
                        drafts_max_new_tokens=64)
    distilling._round(cfg, EvalPlan("stdlib-val", [], None, ""), 1, [], write_config_file=False)
    assert seen["then"] == distilling.later_stages(cfg, 1, "train", tokens_per_second=100.0)
    assert seen["then"].startswith("then: evaluate, the draft table (evaluation and draft table: roughly")

    class Quiet(Trainer):  # a trainer that evaluates nothing, after its first step
        step, evaluates = 1, False

    def plan(then: str) -> Plan:
        return Plan(log=tmp_path / "log", checkpoint=tmp_path / "ckpt", total=11, eval_every=100, checkpoint_every=100,
                    desc="train", then=then)

    with caplog.at_level(logging.INFO, logger="cllm.training.skeleton"):
        for then in (seen["then"], ""):
            run = Quiet()
            run.plan = plan(then)
            run._say_time_left(11, 1.2)
    inside, alone = [r.getMessage() for r in caplog.records if r.name == "cllm.training.skeleton"]
    assert inside == f"step 1 took 1.2 s: train: about 12 s to go (10 steps); {seen['then']}"
    assert alone == "step 1 took 1.2 s: about 12 s to go (10 steps)"


def test_a_first_run_failing_before_its_first_shard_leaves_no_folder_but_the_users_stays(
        setup, tmp_path, monkeypatch, capsys):
    """The folder is claimed (marker, held-out prompts) before collection: a failure after that
    removes the folder the run made, never one that was there before."""
    import cllm.training.distill as distilling

    def fails(collect_config):
        raise UserError("collection failed")

    monkeypatch.setattr(distilling, "collect", fails)
    out = tmp_path / "new"
    assert cli_main(cli_args(config(setup, out=str(out), eval_prompts=None))) == 2
    assert "collection failed" in capsys.readouterr().err and not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert cli_main(cli_args(config(setup, out=str(mine), eval_prompts=None))) == 2
    assert mine.is_dir()


def test_the_final_evaluation_loads_both_models_on_the_runs_device(setup, tmp_path, monkeypatch):
    """On a GPU run both models are evaluated there, not on the CPU: they load on the main
    process's device (accelerate's), the one training used."""
    from types import SimpleNamespace

    import torch

    from cllm.training import distill as module

    class Loaded(Exception):
        pass

    devices = []
    monkeypatch.setattr(module, "PartialState", lambda: SimpleNamespace(device=torch.device("meta")))  # not a CPU
    monkeypatch.setattr(module, "load_tokenizer", lambda path: None)

    def load_model(name, **kwargs):
        devices.append(kwargs.get("device"))
        if len(devices) == 2:
            raise Loaded
        return None

    monkeypatch.setattr(module, "load_model", load_model)
    with pytest.raises(Loaded):
        module.evaluate_distilled(str(setup[1]), tmp_path, config(setup), "val")
    assert devices == [torch.device("meta"), torch.device("meta")]
