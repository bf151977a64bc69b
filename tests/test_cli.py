"""The `cllm` command line: help everywhere, one-line errors on bad input."""

import subprocess
import sys

import pytest

from cllm.cli import COMMANDS, CONFIGS, command_module, config_class, main

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


@pytest.mark.parametrize(("args", "expected"), [
    (["bench", "--blok-size", "4"],
     "cllm bench: error: unrecognized argument --blok-size (did you mean --block-size?)"),
    (["generate", "--sed=3"], "cllm generate: error: unrecognized argument --sed (did you mean --seed?)"),
    (["bnech"], "cllm: error: unknown command 'bnech' (did you mean bench?)"),
])
def test_a_typo_gets_one_line_naming_the_closest_flag(args, expected, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1


def test_a_bad_value_is_one_line_without_the_usage_block(capsys):
    with pytest.raises(SystemExit) as info:
        main(["bench", "--block-size", "x"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err == "cllm bench: error: argument --block-size: invalid int value: 'x'\n"


def test_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    key = out[out.index("--api-key API_KEY bearer"):].split(" --", 1)[0]
    assert key.count("(default") == 1 and "(default: the CLLM_API_KEY environment variable" in key
    port = out[out.index("--port PORT TCP"):].split(" --", 1)[0]  # a help that does not say it gets it added
    assert port.count("(default") == 1 and "(default: 8000)" in port


# Run in a fresh interpreter: the test process itself has imported torch long before.
_IMPORTS_PROBE = """
import sys
from cllm.cli import main
try:
    main([{command!r}, {flag!r}])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print("heavy:", ",".join(heavy) or "none")
"""


@pytest.mark.parametrize("flag", ["--help", "--no-such-flag"])
@pytest.mark.parametrize("command", COMMANDS)
def test_help_and_a_bad_flag_import_neither_torch_nor_transformers(command, flag):
    """`cllm CMD --help` and a mistyped flag answer at once: argparse runs on the command's config
    dataclass alone, and its run code (torch, transformers) is imported only after parsing."""
    result = subprocess.run([sys.executable, "-c", _IMPORTS_PROBE.format(command=command, flag=flag)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    last = result.stdout.splitlines()[-1]
    assert last == "heavy: none", f"cllm {command} {flag} imported {last.removeprefix('heavy: ')}"


def test_each_command_parses_with_the_config_its_run_takes():
    """The parser is built from `CONFIGS` (light modules); `run` takes `cllm.commands.<name>.Config`:
    one class."""
    assert list(CONFIGS) == list(COMMANDS)
    for name in COMMANDS:
        assert command_module(name).Config is config_class(name), name
