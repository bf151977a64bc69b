"""Shared option groups: each option declared once across the commands, `retune`, grouped `--help`."""

import argparse
import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field

import pytest

from cllm.bench.config import BenchConfig, DemoConfig
from cllm.cli import CONFIGS, build_parser, config_class
from cllm.core.config import Section, add_dataclass_arguments, build_config, config_to_dict, declared_fields, retune
from cllm.decoding.settings import RECOMMENDED_CONFIG, JacobiConfig
from cllm.profiling.config import ProfileConfig, TuneConfig
from cllm.serving.config import ExportConfig, ServeConfig
from cllm.serving.options import ChatConfig, GenerateConfig
from cllm.training.config import CollectConfig, DraftsConfig, PretrainConfig, Recipe, TrainConfig
from cllm.training.distill_config import DISTILL_RECIPE, DistillConfig
from cllm.training.eagle.config import EagleConfig
from cllm.training.medusa.config import MedusaConfig

# names declared in more than one class, each a different option under one name
EXCEPTIONS = {
    "heads": "pretrain's attention heads, medusa's Medusa heads",
    "out": "a run folder that must be given (train, pretrain, collect, distill; bench and demo name theirs), or an "
           "optional destination whose default lies in the model's folder (drafts: a table file; medusa, eagle: the "
           "drafter's folder; tune: the defaults file), or profile's, where 'none' prints only",
    "batch_size": "examples per optimizer step (train, distill, pretrain, medusa, eagle), or prompts per decoding "
                  "forward (collect, drafts: what medusa and eagle call --decode-batch-size)",
    "max_steps": "train's is optional and excludes --epochs; medusa's and eagle's is always set, old name --steps",
    "eval_prompts": "without it train evaluates on stdlib-val or nothing; medusa and eagle's 'auto' is humaneval or "
                    "the held-out texts' prompts",
    "eval_count": "distill's counts its final evaluation, which always runs (>= 1); elsewhere 0 turns it off",
    "data": "train's trajectories, required (comma-separated folders allowed); medusa's and eagle's an optional "
            "alternative to decoding --prompts",
    "dtype": "the dtype a model is loaded in (float16 too), train's autocast precision of the forwards (float32 or "
             "bfloat16, weights stay float32), or profile's, unset by default (bfloat16 on CUDA, float32 on a CPU)",
    "device": "any torch device, or auto / cpu / cuda resolved at run time (pretrain, profile, tune)",
    "threads": "0 leaves the count to torch or llama.cpp (drafts, medusa, eagle, generate, chat, export), to serve "
               "(a thread per free core) or to demo (2, or 1 when busy); bench and pretrain always set one (>= 1); "
               "profile and tune take a count or nothing (their library's choice)",
    "block_size": "the trajectories' n (collect, distill), the engine's (its frozen JacobiConfig, which generate, "
                  "chat, serve and bench embed), or demo's short bench's, which takes no other engine flag",
    "guess": "the trajectories' first guess (collect, distill), or the engine's (JacobiConfig)",
    "engine": "the Jacobi engine's settings (generate, chat, bench), or serve's server: cllm or vllm (serve's Jacobi "
              "settings are its `jacobi`)",
    "runtime": "the decoders' runtime (generate, chat, serve, bench), or a command's narrower choice: collect (no "
               "llamacpp: it runs torch forwards), profile (the torch runtimes it times), tune (auto or llamacpp)",
    "prompt": "generate's text to continue ('-' reads stdin), or demo's text to decode live",
    "temperature": "generate's and chat's (0: greedy), or bench's *_sampling methods' (> 0)",
    "top_k": "sampling's k most likely tokens (generate, chat), or the candidate tree's ranks (medusa, eagle)",
    "warmup": "bench's untimed prompts per method, or medusa's and eagle's warm-up steps",
}


def option_classes() -> set[type]:
    """Every dataclass a command's config is built from: the configs, their groups, what they embed."""
    seen: set[type] = set()
    todo = [config_class(command) for command in CONFIGS]
    while todo:
        klass = todo.pop()
        if klass in seen or not dataclasses.is_dataclass(klass):
            continue
        seen.add(klass)
        hints = typing.get_type_hints(klass)
        todo += [*klass.__mro__[1:], *(hints[f.name] for f in dataclasses.fields(klass))]
    return seen


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
    assert {GenerateConfig, ServeConfig, BenchConfig, JacobiConfig, TuneConfig} <= option_classes()


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


def test_the_decode_commands_own_defaults():
    assert (GenerateConfig().model, ServeConfig().model, ExportConfig(gguf="m.gguf").model, TuneConfig().model) == (
        "stdlib-coder", "stdlib-coder", "stdlib-coder-cllm", "stdlib-coder-cllm")
    repeats = (BenchConfig().repeats, DemoConfig().repeats, ProfileConfig().repeats, TuneConfig().repeats)
    assert repeats == (3, 2, 20, 10)
    assert (ProfileConfig().prefix, TuneConfig().prefix, ProfileConfig().k[:2]) == (512, 256, [1, 2])
    assert (BenchConfig().prompts, DemoConfig().prompts, DemoConfig().max_prompts, CollectConfig().prompts) == (
        "humaneval", "humaneval", 8, "stdlib-train")
    assert (BenchConfig().sweep_block_sizes, DemoConfig().sweep_block_sizes) == ([4, 8, 16, 32, 64], [4, 8, 16, 32])
    assert (BenchConfig().out, DemoConfig().out, BenchConfig().medusa, ChatConfig().medusa) == (
        "reports/bench", "reports/demo", "auto", "none")
    assert GenerateConfig().engine == BenchConfig().engine == ServeConfig().jacobi == RECOMMENDED_CONFIG
    assert (GenerateConfig().seed, BenchConfig(cllm="none").cllm, DemoConfig(cllm="none").cllm) == (0, None, None)


@pytest.mark.parametrize(("config", "values", "message"), [
    (ServeConfig, {"dtype": "float8"}, "unknown dtype"),
    (GenerateConfig, {"seed": -1}, "--seed must be an int >= 0"),
    (ChatConfig, {"max_new_tokens": 0}, "--max-new-tokens must be an int >= 1"),
    (ServeConfig, {"method": "beam"}, "--method must be one of"),
    (BenchConfig, {"runtime": "onnx"}, "--runtime must be one of"),
    (BenchConfig, {"repeats": 0}, "--repeats must be an int >= 1"),
    (BenchConfig, {"max_prompts": 0}, "--max-prompts must be an int >= 1"),
    (DemoConfig, {"sweep_block_sizes": [4, 4]}, "has a size twice"),
    (DemoConfig, {"val_prompts": -1}, "--val-prompts must be an int >= 0"),
    (ProfileConfig, {"forward_batches": [0]}, "--forward-batches must be ints >= 1"),
    (TuneConfig, {"threads": 0}, "--threads must be an int >= 1"),
    (TuneConfig, {"device": "tpu"}, "--device must be auto, cpu or cuda"),
    (ExportConfig, {"gguf": "m.gguf", "threads": -1}, "--threads must be an int >= 0"),
    (ExportConfig, {"threads": 1}, "--gguf OUT.gguf is required"),  # the config's own check still runs
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


@pytest.mark.parametrize("command", list(CONFIGS))
def test_each_config_builds_from_flags_and_from_its_written_file(command, tmp_path):
    cls, parser = config_class(command), command_parser(command)
    # the required options: export's --gguf; import's file (its one positional) and --out
    needed, argv = {"export": ({"gguf": "m.gguf"}, ["--gguf", "m.gguf"]),
                    "import": ({"file": "m.gguf", "out": "ckpt"}, ["m.gguf", "--out", "ckpt"])}.get(command, ({}, []))
    default = build_config(cls, None, vars(parser.parse_args(argv)))
    assert default == cls(**needed)
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
