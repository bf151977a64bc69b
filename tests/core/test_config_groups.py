"""Shared option groups: each training option declared once, `retune`, grouped `--help`."""

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field

import pytest

from cllm.cli import CONFIGS, build_parser, config_class
from cllm.core.config import Section, add_dataclass_arguments, build_config, config_to_dict, declared_fields, retune
from cllm.training.config import CollectConfig, DraftsConfig, PretrainConfig, Recipe, TrainConfig
from cllm.training.distill_config import DISTILL_RECIPE, DistillConfig
from cllm.training.eagle.config import EagleConfig
from cllm.training.medusa.config import MedusaConfig

TRAINING_CONFIGS = [Recipe, TrainConfig, PretrainConfig, CollectConfig, DraftsConfig, DistillConfig, MedusaConfig,
                    EagleConfig]
TRAINING_COMMANDS = ["train", "distill", "pretrain", "collect", "drafts", "medusa", "eagle"]

# names declared in more than one class, each a different option under one name
EXCEPTIONS = {
    "heads": "pretrain's attention heads, medusa's Medusa heads",
    "out": "a run folder that must be given (train, pretrain, collect, distill), or an optional destination that "
           "defaults into the model's folder (drafts: a table file; medusa, eagle: the drafter's folder)",
    "batch_size": "examples per optimizer step (train, distill, pretrain, medusa, eagle), or prompts per decoding "
                  "forward (collect, drafts: what medusa and eagle call --decode-batch-size)",
    "max_steps": "train's is optional and excludes --epochs; medusa's and eagle's is always set, old name --steps",
    "eval_prompts": "without it train evaluates on stdlib-val or nothing; medusa and eagle's 'auto' is humaneval or "
                    "the held-out texts' prompts",
    "eval_count": "distill's counts its final evaluation, which always runs (>= 1); elsewhere 0 turns it off",
    "data": "train's trajectories, required (comma-separated folders allowed); medusa's and eagle's an optional "
            "alternative to decoding --prompts",
    "dtype": "train's autocast precision of the forwards (float32 or bfloat16, weights stay float32), or the dtype "
             "a model is loaded in (float16 too)",
    "device": "pretrain picks among auto, cpu, cuda; drafts, medusa and eagle take any torch device",
    "threads": "pretrain always sets a count (>= 1, default 2); elsewhere 0 leaves torch's default",
}


def option_classes() -> set[type]:
    """Every dataclass the training configs are built from: the configs and their groups."""
    return {klass for config in TRAINING_CONFIGS for klass in config.__mro__ if dataclasses.is_dataclass(klass)}


def own_declarations(klass: type) -> set[str]:
    """What `klass` annotates itself, less class variables and what `retune` injected."""
    fields = {f.name for f in dataclasses.fields(klass)}
    annotations = set(vars(klass).get("__annotations__", {})) & fields
    return annotations - set(vars(klass).get("__retuned__", ()))


def test_no_option_is_declared_twice_but_the_listed_exceptions():
    declarers: dict[str, list[str]] = {}
    for klass in option_classes():
        for name in own_declarations(klass):
            declarers.setdefault(name, []).append(klass.__name__)
    twice = {name: sorted(where) for name, where in declarers.items() if len(where) > 1}
    assert set(twice) == set(EXCEPTIONS), twice  # no new duplicate, no stale exception


def test_the_drafters_declare_only_what_they_add():
    shared = set().union(*(own_declarations(k) for k in MedusaConfig.__mro__[1:] if dataclasses.is_dataclass(k)))
    assert own_declarations(MedusaConfig) & shared == set()
    assert own_declarations(EagleConfig) & shared == set()
    assert MedusaConfig.__mro__[1] is EagleConfig.__mro__[1]  # one drafter base
    assert {"max_steps", "top_k", "tree_nodes"} <= set(vars(MedusaConfig)["__retuned__"])


def test_flat_access_and_the_commands_own_defaults():
    train, medusa, eagle, pretrain = TrainConfig(), MedusaConfig(), EagleConfig(), PretrainConfig()
    assert (train.recipe.lr, pretrain.lr, medusa.lr, eagle.lr) == (2e-4, 2e-3, 3e-3, 3e-3)
    assert (train.recipe.batch_size, pretrain.batch_size, medusa.batch_size, eagle.batch_size) == (16, 8, 8, 6)
    assert (medusa.max_steps, eagle.max_steps, medusa.eval_count, eagle.eval_count) == (300, 400, 8, 16)
    assert (CollectConfig().batch_size, DraftsConfig().batch_size, DraftsConfig().model) == (8, 16, "stdlib-coder-cllm")
    assert DistillConfig().recipe == DISTILL_RECIPE and DistillConfig().recipe is not DistillConfig().recipe
    assert (DistillConfig().drop_loops, CollectConfig().drop_loops) == (True, False)


@pytest.mark.parametrize(("config", "values", "message"), [
    (Recipe, {"lr": 0}, "--lr must be > 0"),
    (PretrainConfig, {"lr": -1}, "--lr must be > 0"),
    (MedusaConfig, {"lr": 0}, "--lr must be > 0"),
    (EagleConfig, {"batch_size": 0}, "--batch-size must be an int >= 1"),
    (CollectConfig, {"seed": -1}, "--seed must be an int >= 0"),
    (Recipe, {"seed": -1}, "--seed must be an int >= 0"),
    (DraftsConfig, {"threads": -1}, "--threads must be an int >= 0"),
    (EagleConfig, {"dtype": "float8"}, "unknown dtype"),
    (TrainConfig, {"out": ""}, "out must name a directory"),
    (DistillConfig, {"max_new_tokens": 0}, "--max-new-tokens must be an int >= 1"),
    (MedusaConfig, {"max_prompts": 4, "holdout": 4}, "--holdout 4 leaves no prompt"),
    (MedusaConfig, {"heads": 0}, "--heads must be an int >= 1"),  # the config's own check still runs
])
def test_each_groups_check_runs_in_every_config_that_takes_it(config, values, message):
    with pytest.raises(ValueError, match=message):
        config(**values)


# retune


SMALL = Section("small", 5)


@dataclass
class Group:
    SECTION = SMALL
    steps: int = field(default=10, metadata={"help": "how many steps", "aliases": ["n"]})
    sizes: list[int] = field(default_factory=lambda: [1], metadata={"help": "sizes"})
    name: str | None = None


@dataclass
@retune(steps=20, sizes=[2, 3])
class Tuned(Group):
    own: int = 1


def test_retune_changes_the_default_and_keeps_the_rest():
    base, tuned = {f.name: f for f in dataclasses.fields(Group)}, {f.name: f for f in dataclasses.fields(Tuned)}
    assert (Tuned().steps, Tuned().sizes, Group().steps) == (20, [2, 3], 10)
    assert Tuned().sizes is not Tuned().sizes  # a list default is copied per instance
    for name in ("steps", "sizes"):
        assert tuned[name].metadata == base[name].metadata and tuned[name].type in (base[name].type, list[int])
    assert [f.name for f in dataclasses.fields(Tuned)] == ["steps", "sizes", "name", "own"]  # order kept
    assert declared_fields(Tuned) == {"own"} and declared_fields(Group) == {"steps", "sizes", "name"}
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, Tuned)
    text = parser.format_help()
    assert "how many steps (default: 20) (--n: its old name" in text and "\nsmall:\n" in text
    assert build_config(Tuned, {"n": 7}, vars(parser.parse_args(["--sizes", "4,5"]))) == Tuned(steps=7, sizes=[4, 5])


def test_retune_refuses_a_name_the_class_does_not_inherit():
    with pytest.raises(TypeError, match="does not inherit an option 'stepz'"):
        retune(stepz=3)(type("Typo", (Group,), {}))
    with pytest.raises(TypeError, match="declares 'own' itself"):
        retune(own=3)(type("Own", (Tuned,), {"__annotations__": {"own": "int"}, "own": 2}))


# --help


def command_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(command)
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


def test_train_help_is_grouped_and_lists_every_flag_once():
    parser = command_parser("train")
    text = parser.format_help()
    titles = ["model and data:", "run:", "training:", "evaluation:", "recipe details (studies):", "LoRA:", "machine:"]
    assert [text.index("\n" + t + "\n") for t in titles] == sorted(text.index("\n" + t + "\n") for t in titles)
    flags = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    assert len(flags) == len(set(flags))
    fields = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "recipe"] + [
        f.name for f in dataclasses.fields(Recipe)]
    assert sorted(a.dest for a in parser._actions if a.dest not in ("help", "config")) == sorted(fields)
    for action in parser._actions:  # each flag in one group, each printed once
        assert sum(action in g._group_actions for g in parser._action_groups) == 1
        assert len(re.findall(rf"^  {re.escape(action.option_strings[0])}[ ,\n]", text, re.M)) == 1


@pytest.mark.parametrize("command", list(CONFIGS))
def test_every_commands_help_prints(command):
    parser = command_parser(command)
    text = parser.format_help()
    assert "--config FILE" in text
    if not any(vars(k).get("SECTION") for k in config_class(command).__mro__):
        assert [g.title for g in parser._action_groups if g._group_actions][-1] == "options"  # one default group


# config files and command lines


@pytest.mark.parametrize("command", TRAINING_COMMANDS)
def test_each_training_config_builds_from_flags_and_from_its_written_file(command, tmp_path):
    cls, parser = config_class(command), command_parser(command)
    default = build_config(cls, None, vars(parser.parse_args([])))
    assert default == cls()
    written = json.loads(json.dumps(config_to_dict(default)))  # what write_config records
    assert build_config(cls, written, {}) == default and config_to_dict(build_config(cls, written, {})) == written
    seed = build_config(cls, None, vars(parser.parse_args(["--seed", "3"]))) if "seed" in written else None
    if seed is not None:
        assert config_to_dict(seed)["seed"] == 3


@pytest.mark.parametrize("command", ["medusa", "eagle"])
def test_old_names_still_work(command):
    cls, parser = config_class(command), command_parser(command)
    assert build_config(cls, None, vars(parser.parse_args(["--steps", "7"]))).max_steps == 7
    assert build_config(cls, {"steps": 5}, {}).max_steps == 5
