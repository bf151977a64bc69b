"""The engine's layering: no import cycle among `cllm.decoding`'s modules, and nothing in it
imports the rest of the package (commands, models, tokenizers)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_imports() -> dict[str, set[str]]:
    """Per module of cllm.decoding: the cllm modules its top level imports."""
    paths = {".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__"): p
             for p in (SRC / "cllm").rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        if not name.startswith("cllm.decoding"):
            continue
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cllm"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                deps |= subs | ({node.module} if len(subs) < len(node.names) else set())
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("cllm")}
        graph[name] = deps - {name}
    return graph


def test_no_import_cycle_in_the_engine():
    graph = module_imports()
    assert "cllm.decoding.jacobi.verifiers" in graph
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if dep not in graph:
                continue
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [dep])}"
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_the_engine_imports_nothing_above_it():
    for name, deps in module_imports().items():
        outside = {d for d in deps if not d.startswith("cllm.decoding")}
        assert not outside, f"{name} imports {sorted(outside)}"
