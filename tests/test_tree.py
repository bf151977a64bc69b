"""The package tree is the architecture: packages stack in one order, nothing imports upwards or
sideways, no module imports itself back, and every module and function stays small enough to
read.

Every module under src/cllm is parsed with `ast` (nothing is imported), so imports made inside
functions and under `TYPE_CHECKING` count like the others.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
TESTS = Path(__file__).resolve().parent

# Lower layers never import higher ones; the packages of one rank do not import each other.
RANKS = {
    "core": 0,  # errors, config <-> flags, seeds, machine, progress, run folders
    "data": 1,  # corpus, tokenizer, prompt sets, trajectory records
    "runtime": 2,  # the forwards the engine runs on, each behind one protocol
    "decoding": 3,  # the engine: token ids in, token ids out
    "modeling": 4,  # losses, training forwards, heads
    "models": 5,  # loading checkpoints, tokenizers, draft tables, heads
    "evaluation": 6, "profiling": 6, "serving": 6,
    "training": 7,  # collect, train, distill, pretrain, heads
    "bench": 8,
    "commands": 9,  # one thin module per CLI command
    "cli": 10,
    "": 11,  # `cllm` itself: the public API, loaded lazily
}
# Pairs that the ranks allow but the design does not.
FORBIDDEN = {("decoding", "data"): "the engine knows nothing of tokenizers or prompt files"}
# What the engine (`decoding/`) may take from `cllm.runtime`, and the names past it.
RUNTIME_PROTOCOL = {"Forward", "Runtime", "Session", "as_runtime", "position_limit"}
RUNTIME_INSIDES = ("transformers", "cllm.runtime.")  # a runtime's own modules, and transformers
CACHE_CLASSES = {"DynamicCache", "Cache", "LeanKV", "CacheStorage", "Batch"}
# Third-party packages that may be imported inside a function: heavy, and needed by one option.
LAZY_OK = {"matplotlib", "peft", "vllm", "llama_cpp", "gguf", "deepspeed", "arctic_inference"}
MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_TOP_MODULES = 600, 80, 10
# tests of the command line and of repository files rather than of one package: they sit at the top of tests/
TOP_LEVEL_TESTS = {"tree", "cli", "benchmarks", "install", "scripts", "method_doc", "readme"}


@cache
def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted((SRC / "cllm").rglob("*.py"))}


@cache
def tree(name: str) -> ast.Module:
    return ast.parse(modules()[name].read_text(encoding="utf-8"))


def package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imported(name: str) -> list[tuple[str, ast.stmt]]:
    """(cllm module, statement) for every import of a cllm module in `name`, anywhere in it;
    `from a import b` names the module a.b when there is one, else a."""
    found = []
    for node in ast.walk(tree(name)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names if alias.name.split(".")[0] == "cllm"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cllm":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub if sub in modules() else node.module, node))
    return found


def edges() -> set[tuple[str, str]]:
    return {(name, dep) for name in modules() for dep, _ in imported(name) if dep != name}


def test_the_layers_are_known_packages():
    assert {package(m) for m in modules()} <= RANKS.keys()


def test_no_module_imports_a_higher_or_sideways_layer():
    bad = []
    for a, b in sorted(edges()):
        pa, pb = package(a), package(b)
        if pa != pb and (RANKS[pb] >= RANKS[pa] or (pa, pb) in FORBIDDEN):
            bad.append(f"  {a} -> {b}" + (f" ({FORBIDDEN[pa, pb]})" if (pa, pb) in FORBIDDEN else ""))
    assert not bad, "imports against the layer order (core < data < runtime < decoding < modeling < models < " \
                    "evaluation / profiling / serving < training < bench < commands < cli):\n" + "\n".join(bad)


def test_no_import_cycle_among_modules():
    graph: dict[str, set[str]] = {}
    for a, b in edges():
        graph.setdefault(a, set()).add(b)
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_imports_inside_functions_are_only_heavy_optional_packages():
    bad = []
    for name in modules():
        for fn in ast.walk(tree(name)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    tops = [alias.name.split(".")[0] for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    tops = [(node.module or ".").split(".")[0] if not node.level else "."]
                else:
                    continue
                bad += [f"  {name}.{fn.name}: {top}" for top in tops if top not in LAZY_OK]
    assert not bad, "imports inside functions (move them to the module's head):\n" + "\n".join(sorted(set(bad)))


def test_nothing_imports_a_command_module():
    bad = sorted(f"  {a} -> {b}" for a, b in edges() if package(b) == "commands" and package(a) != "cli")
    assert not bad, "imports of command modules (the library must not depend on its commands):\n" + "\n".join(bad)


def test_the_decoders_speak_only_the_runtime_protocol():
    """`decoding/` reaches a forward only through `cllm.runtime`'s protocol and factory: it imports
    neither transformers nor a runtime's own modules, and names no cache class."""
    bad = []
    for name in (m for m in modules() if package(m) == "decoding"):
        for node in ast.walk(tree(name)):
            if isinstance(node, ast.Import):
                bad += [f"  {name}: import {a.name}" for a in node.names if a.name.startswith(RUNTIME_INSIDES)]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(RUNTIME_INSIDES):
                bad.append(f"  {name}: from {node.module} import ...")
            elif isinstance(node, ast.ImportFrom) and node.module == "cllm.runtime":
                bad += [f"  {name}: from cllm.runtime import {a.name}" for a in node.names
                        if a.name not in RUNTIME_PROTOCOL]
            elif isinstance(node, (ast.Name, ast.Attribute)):
                named = node.id if isinstance(node, ast.Name) else node.attr
                if named in CACHE_CLASSES:
                    bad.append(f"  {name}:{node.lineno}: {named}")
    assert not bad, "the engine past the runtime protocol:\n" + "\n".join(sorted(set(bad)))


def test_one_llama_layer():
    """The lean runtime's decoder layer is written once (`runtime/lean/ops.py`): every forward
    (eager, per-width paths, CUDA graphs, compiled) runs it."""
    defining = sorted(name for name in modules() for node in ast.walk(tree(name))
                      if isinstance(node, ast.FunctionDef) and node.name == "decoder_layers")
    assert defining == ["cllm.runtime.lean.ops"]
    layered = {name for name in modules() for n in ast.walk(tree(name))
               if isinstance(n, ast.Name) and n.id == "decoder_layers"
               or isinstance(n, ast.Attribute) and n.attr in ("decoder_layers", "layer_stack")}
    assert layered == {"cllm.runtime.lean.runner", "cllm.runtime.lean.compiled",
                       "cllm.runtime.lean.graphs"}  # runner (eager, per width), compiled, CUDA graphs


def test_modules_and_functions_are_small():
    long_modules = [f"  {name}: {n} lines" for name, path in modules().items()
                    if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES]
    long_functions = [f"  {name}.{fn.name}: {fn.end_lineno - fn.lineno + 1} lines"
                      for name in modules() for fn in ast.walk(tree(name))
                      if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long_modules)
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long_functions)


def test_few_modules_sit_directly_in_the_package():
    top = [p.name for p in (SRC / "cllm").glob("*.py") if p.name not in ("__init__.py", "cli.py")]
    assert len(top) <= MAX_TOP_MODULES, top


def test_tests_mirror_the_tree():
    """Every package has its test folder and every test folder its package; every module at the
    top of the package its test module at the top of tests/."""
    packages = {p.name for p in (SRC / "cllm").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders <= packages, f"test folders without a package: {sorted(folders - packages)}"
    assert packages <= folders, f"packages without a test folder: {sorted(packages - folders)}"
    top = {p.stem for p in (SRC / "cllm").glob("*.py")} - {"__init__"}
    assert top <= TOP_LEVEL_TESTS, f"modules without a test module: {sorted(top - TOP_LEVEL_TESTS)}"
    assert all((TESTS / f"test_{name}.py").is_file() for name in TOP_LEVEL_TESTS)
    loose = sorted(p.name for p in TESTS.glob("test_*.py") if p.stem.removeprefix("test_") not in TOP_LEVEL_TESTS)
    assert not loose, f"tests outside the folder of their package: {loose}"
