"""The `cllm` command line: one subcommand per pipeline step, generated from config dataclasses.

`COMMANDS` maps each subcommand to its summary; its module `cllm.commands.<name>` holds `Config`
(the dataclass its flags come from) and `run(config) -> int`, which can be called from Python
just the same. `CONFIGS` says where each `Config` is defined, in a module that imports neither
torch nor transformers: the parser is built from it, and the command module (which imports the
heavy run code) only after parsing, so that `--help` and a mistyped flag answer at once.
A `UserError`/`ValueError`/`FileNotFoundError` raised by a command is a user mistake: it is
printed as one line and the exit status is 2 (set ``CLLM_DEBUG=1`` to see the traceback).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
from types import ModuleType

from cllm.core import __version__
from cllm.core.config import add_dataclass_arguments, build_config, read_config_file
from cllm.core.errors import UserError, first_line
from cllm.core.versions import check_versions

# subcommand -> summary; `cllm.commands.<name>` (or `MODULES`' name) holds its `Config` and `run(config) -> int`
COMMANDS: dict[str, str] = {
    "pretrain": "train the embedded target model from scratch on the stdlib corpus",
    "collect": "Jacobi-decode a prompt set with the target and record trajectories",
    "train": "consistency (GC/LC) + AR fine-tuning on collected trajectories",
    "distill": "collect + train + a short evaluation in one command",
    "drafts": "build a model's draft table from its own greedy completions (faster Jacobi, same output)",
    "medusa": "train Medusa heads for a model (frozen; --joint: with it) on its greedy text; decoding stays exact",
    "eagle": "train an EAGLE draft head for a model (frozen) on its own greedy text; decoding with it stays exact",
    "generate": "decode a prompt (AR or Jacobi), streaming",
    "chat": "multi-turn chat in the terminal",
    "serve": "OpenAI-compatible HTTP server",
    "bench": "measure AR vs Jacobi vs CLLM vs peers: speed and quality",
    "profile": "time a decoding step of k fed tokens on random-weight models up to 13B; predicted tokens/s",
    "tune": "measure a model's step cost here and write its decode defaults beside it",
    "export": "write a model as a GGUF file for llama.cpp (and its draft table as llama.cpp's lookup cache)",
    "import": "write a GGUF file (any quantization) as a checkpoint folder the torch side trains and decodes",
    "demo": "the whole story on the embedded default models",
}

# subcommand -> "module:class" of its config dataclass (`cllm.commands.<name>.Config` is that class)
CONFIGS: dict[str, str] = {
    "pretrain": "cllm.training.config:PretrainConfig",
    "collect": "cllm.training.config:CollectConfig",
    "train": "cllm.training.config:TrainConfig",
    "distill": "cllm.training.distill_config:DistillConfig",
    "drafts": "cllm.training.config:DraftsConfig",
    "medusa": "cllm.training.medusa.config:MedusaConfig",
    "eagle": "cllm.training.eagle.config:EagleConfig",
    "generate": "cllm.serving.options:GenerateConfig",
    "chat": "cllm.serving.options:ChatConfig",
    "serve": "cllm.serving.config:ServeConfig",
    "bench": "cllm.bench.config:BenchConfig",
    "profile": "cllm.profiling.config:ProfileConfig",
    "tune": "cllm.profiling.config:TuneConfig",
    "export": "cllm.serving.config:ExportConfig",
    "import": "cllm.models.import_config:ImportConfig",
    "demo": "cllm.bench.config:DemoConfig",
}


def config_class(name: str) -> type:
    """The config dataclass of subcommand `name`, imported without its run code."""
    module, _, cls = CONFIGS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


# subcommand -> its module's name in `cllm.commands`, where that is not the subcommand's own
# (`import` is a Python keyword)
MODULES: dict[str, str] = {"import": "import_gguf"}


def command_module(name: str) -> ModuleType:
    """`cllm.commands.<name>`, imported when that command runs (so `cllm --help` stays fast)."""
    return importlib.import_module(f"cllm.commands.{MODULES.get(name, name)}")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block: `--help` shows it) and, on Python 3.14+,
    its own suggestions for mistyped choices."""

    def __init__(self, *args, **kwargs) -> None:
        if sys.version_info >= (3, 14):
            kwargs.setdefault("suggest_on_error", True)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message.splitlines()[0]}\n")


def _closest(word: str, options: list[str]) -> str:
    """' (did you mean X?)' for the option nearest to `word`, or ''."""
    found = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f" (did you mean {found[0]}?)" if found else ""


def _unknown_flags(parser: argparse.ArgumentParser, command: str, extras: list[str]) -> str:
    """The one-line error for arguments `command` does not take, with the closest flag."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    word = next((e for e in extras if e.startswith("-")), extras[0]).split("=", 1)[0]
    hint = _closest(word, flags) if word.startswith("-") else ""
    return f"cllm {command}: error: unrecognized argument {word}{hint} (cllm {command} --help lists them)"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser for `command` (from its config dataclass alone: `CONFIGS`); the other
    subcommands get only their summary, so `cllm --help` imports nothing heavy."""
    parser = _Parser(
        prog="cllm",
        description="Consistency LLMs: collect Jacobi trajectories, train, measure and serve "
        "a causal LM that decodes several tokens per forward pass, exactly.",
    )
    parser.add_argument("--version", action="version", version=f"cllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        p.add_argument("--config", metavar="FILE", help="JSON or YAML file of options (flags override it)")
        if name != command:
            continue
        add_dataclass_arguments(p, config_class(name))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command is not None and command not in COMMANDS:
        print(f"cllm: error: unknown command {command!r}{_closest(command, list(COMMANDS))}; "
              f"commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if command is not None:
        try:  # before any command module imports transformers
            check_versions()
        except UserError as exc:
            print(f"cllm: error: {exc}", file=sys.stderr)
            return 2
    parser = build_parser(command)
    args, extras = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if extras:
        print(_unknown_flags(parser, args.command, extras), file=sys.stderr)
        return 2
    prog = f"cllm {args.command}"
    module = command_module(args.command)
    try:
        file_values = read_config_file(args.config) if args.config else None
        config = build_config(module.Config, file_values, vars(args))
        result = module.run(config)
    except KeyboardInterrupt as exc:  # a run that resumes says so in its message
        print(f"\n{prog}: {first_line(exc) if str(exc).strip() else 'interrupted'}", file=sys.stderr)
        return 130
    except (UserError, ValueError, FileNotFoundError) as exc:
        if os.environ.get("CLLM_DEBUG"):
            raise
        message = first_line(exc)
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    return int(result) if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
