"""The `cllm` command line: help everywhere, one-line errors on bad input."""

import subprocess
import sys

import pytest

from cllm.cli import COMMANDS, main

CONTRACT_COMMANDS = ["pretrain", "collect", "train", "generate", "chat", "serve", "bench", "demo"]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "cllm.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_top_level_help_lists_every_contract_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in CONTRACT_COMMANDS:
        assert name in result.stdout
    assert set(CONTRACT_COMMANDS) <= set(COMMANDS)


@pytest.mark.parametrize("name", CONTRACT_COMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as info:
        main([name, "--help"])
    assert info.value.code == 0
    assert "--config" in capsys.readouterr().out


def test_missing_config_file_is_a_one_line_error(tmp_path, capsys):
    code = main(["demo", "--config", str(tmp_path / "missing.yaml")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("cllm demo: error:") and "\n" not in err
