"""Config dataclasses -> flags, files, resolved JSON."""

import argparse
import json
from dataclasses import dataclass, field, replace
from typing import Literal

import pytest

from cllm.core.config import (
    UserError,
    add_dataclass_arguments,
    build_config,
    read_config_file,
    write_config,
)
from cllm.decoding.settings import RECOMMENDED_CONFIG, JacobiConfig


@dataclass
class ToyConfig:
    block_size: int = field(default=16, metadata={"help": "tokens per block"})
    lr: float = 1e-3
    name: str = "x"
    method: Literal["ar", "jacobi"] = "jacobi"
    sizes: list[int] = field(default_factory=lambda: [4, 8])
    verbose: bool = False
    limit: int | None = None

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


def parse(argv, file_values=None):
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, ToyConfig)
    return build_config(ToyConfig, file_values, vars(parser.parse_args(argv)))


def test_defaults_come_from_the_dataclass():
    assert parse([]) == ToyConfig()


def test_flags_are_typed_and_dashed():
    cfg = parse(["--block-size", "7", "--lr", "0.5", "--method", "ar", "--sizes", "1,2,3",
                 "--verbose", "--limit", "3"])
    assert cfg == ToyConfig(block_size=7, lr=0.5, method="ar", sizes=[1, 2, 3], verbose=True, limit=3)


def test_command_line_overrides_config_file_which_overrides_defaults():
    cfg = parse(["--lr", "0.1"], {"lr": 0.9, "block-size": 4})
    assert cfg.lr == 0.1 and cfg.block_size == 4


def test_unknown_key_in_config_file_is_a_user_error():
    with pytest.raises(UserError, match="unknown option 'nope'"):
        parse([], {"nope": 1})


def test_validation_runs_on_construction():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        parse(["--block-size", "0"])


def test_bad_choice_exits_with_usage_error():
    with pytest.raises(SystemExit):
        parse(["--method", "beam"])


def test_config_files_json_and_yaml(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"lr": 0.2}))
    (tmp_path / "a.yaml").write_text("lr: 0.3\nsizes: [1, 2]\n")
    assert read_config_file(tmp_path / "a.json") == {"lr": 0.2}
    assert read_config_file(tmp_path / "a.yaml") == {"lr": 0.3, "sizes": [1, 2]}


def test_missing_or_malformed_config_file_is_one_line_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        read_config_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError) as info:
        read_config_file(tmp_path / "bad.json")
    assert "\n" not in str(info.value)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="mapping"):
        read_config_file(tmp_path / "list.json")


def test_resolved_config_round_trips_through_json(tmp_path):
    cfg = ToyConfig(block_size=3, sizes=[5])
    path = write_config(cfg, tmp_path / "out" / "config.json")
    assert ToyConfig(**json.loads(path.read_text())) == cfg


@dataclass
class CommandWithEngine:
    model: str = "m"
    engine: JacobiConfig = field(default_factory=lambda: RECOMMENDED_CONFIG)


def test_a_nested_config_is_flattened_into_the_commands_flags_files_and_json(tmp_path):
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, CommandWithEngine)
    assert "(default: 4)" in parser.format_help()  # the nested field's default, not JacobiConfig()'s 16
    args = vars(parser.parse_args(["--block-size", "8", "--recycle-budget", "0"]))
    cfg = build_config(CommandWithEngine, {"recycle": 2, "model": "x"}, args)
    assert cfg == CommandWithEngine(model="x", engine=replace(RECOMMENDED_CONFIG, block_size=8, recycle=2,
                                                              recycle_budget=None))
    assert build_config(CommandWithEngine, None, {}).engine is RECOMMENDED_CONFIG
    saved = json.loads(write_config(cfg, tmp_path / "c.json").read_text())
    assert saved["block_size"] == 8 and saved["recycle_budget"] is None and "engine" not in saved
    assert build_config(CommandWithEngine, saved, {}) == cfg  # the written file reads back
    with pytest.raises(ValueError, match="--blocks-in-flight"):
        build_config(CommandWithEngine, None, {"blocks_in_flight": 0})
