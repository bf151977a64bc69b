"""Imports flow one way: commands (the modules behind `cli.COMMANDS`) sit on a library, and
neither a command nor a library module imports a command module.

Every module under src/cllm is parsed with `ast` (nothing is imported), so the check also sees
imports made inside functions and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
from pathlib import Path

from cllm.cli import COMMANDS

SRC = Path(__file__).resolve().parents[1] / "src"
COMMAND_MODULES = frozenset(module for module, *_ in COMMANDS.values())

# (importer, imported command module): edges that are allowed, each with its reason.
ALLOWED = {
    # Pipelines: these commands *are* other commands run in order, on those commands' own
    # configs and entry points; a library copy of them would be the very duplication this
    # test exists to stop. `distill` = collect, train, drafts and a short evaluation per round.
    ("cllm.training.distill", "cllm.training.collect"),
    ("cllm.training.distill", "cllm.training.train"),
    ("cllm.training.distill", "cllm.training.drafts"),
    # `demo` = a small `bench` run (its config, models, measurement and report) told as a story.
    ("cllm.commands.demo", "cllm.bench.run"),
    # Not untangled yet (issue 18 item 3): type hints only, under TYPE_CHECKING. The training
    # step reads its options from TrainConfig; moving that dataclass (and ArTarget, Consistency)
    # into a library module is the next step.
    ("cllm.training.batches", "cllm.training.train"),
    ("cllm.training.objective", "cllm.training.train"),
}


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(SRC).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _imported(tree: ast.AST) -> set[str]:
    """Every module an import statement names, `from a import b` counted as `a` and `a.b`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in sorted((SRC / "cllm").rglob("*.py")):
        importer = _module_name(path)
        for imported in _imported(ast.parse(path.read_text(encoding="utf-8"))) & COMMAND_MODULES:
            if imported != importer:
                edges.add((importer, imported))
    return edges


def test_command_modules_are_known():
    assert "cllm.bench.run" in COMMAND_MODULES and "cllm.commands.generate" in COMMAND_MODULES
    for module in COMMAND_MODULES:
        assert (SRC / Path(*module.split("."))).with_suffix(".py").is_file(), module


def test_no_module_imports_a_command_module_outside_the_allow_list():
    unexpected = sorted(_edges() - ALLOWED)
    assert not unexpected, "imports of command modules (move the shared piece to a library module):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in unexpected)


def test_allow_list_has_no_stale_entries():
    stale = sorted(ALLOWED - _edges())
    assert not stale, "allowed edges that no longer exist (remove them from ALLOWED):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in stale)
