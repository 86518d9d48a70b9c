"""The library's import graph: no cycles, no library module imports the command line, and weight_sync/ and
rollout/sglang/ import one way.

Every import counts, also those inside functions (a cycle broken only by a deferred import is still two
modules that cannot be understood, tested or moved apart). The entry points that may read the CLI module:
`train.py` (it parses the flags), `planner.py` (`python -m megatron_dapo.planner`) and `launch/server_args.py`
(`python -m megatron_dapo.launch.server_args`: the servers' flags from the trainer's). A module importing its
own package (`megatron_dapo.x.y` -> `megatron_dapo.x`) is not an edge: Python runs the package first anyway.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "megatron_dapo"
CLI = "megatron_dapo.arguments"
ENTRY_POINTS = {"megatron_dapo.train", "megatron_dapo.planner", "megatron_dapo.launch.server_args"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its body (`from pkg import name` resolves to the
    submodule `pkg.name` when one exists, else to `pkg`)."""
    modules = {module_name(p): p for p in root.rglob("*.py")}

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("megatron_dapo.") else None
                if found and found != name and not name.startswith(found + "."):
                    edges.add(found)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle_and_a_clean_graph():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_the_graph_resolves_names_to_submodules(tmp_path):
    pkg = tmp_path / "megatron_dapo"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "one.py").write_text("def f():\n    from megatron_dapo.sub import two\n")
    (pkg / "sub" / "two.py").write_text("from megatron_dapo.sub.one import f\nimport megatron_dapo.sub\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        graph = import_graph(pkg)
    finally:
        REPO = saved
    assert graph["megatron_dapo.sub.one"] == {"megatron_dapo.sub.two"}
    assert graph["megatron_dapo.sub.two"] == {"megatron_dapo.sub.one"}  # its own package is not an edge
    assert cycles(graph) == [["megatron_dapo.sub.one", "megatron_dapo.sub.two"]]


def test_the_library_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_no_library_module_imports_the_command_line():
    importers = sorted(m for m, edges in import_graph().items() if CLI in edges and m not in ENTRY_POINTS)
    assert importers == [], f"library modules importing {CLI} (take values as arguments instead): {importers}"


def test_weight_sync_and_sglang_import_one_way():
    """weight_sync/ drives the SGLang servers (it imports rollout/sglang/: the engine, its protocol, the group
    layout); rollout/sglang/ knows its sync only as the `Recovers` protocol and imports nothing of weight_sync/, so
    a transport is chosen and added in weight_sync/ alone (weight_sync/transports/__init__.py)."""
    graph = import_graph()
    back = sorted(f"{m} -> {t}" for m, edges in graph.items() if m.startswith("megatron_dapo.rollout.sglang")
                  for t in edges if t.startswith("megatron_dapo.weight_sync"))
    assert back == [], f"rollout/sglang/ importing weight_sync/: {back}"
    assert any(t.startswith("megatron_dapo.rollout.sglang") for m, edges in graph.items()
               if m.startswith("megatron_dapo.weight_sync") for t in edges)  # the one direction, still used
