"""The library's import graph: no cycles, no library module imports the command line, none reads the flags,
weight_sync/ and rollout/sglang/ import one way, and no import goes back up the layers (LAYERS) but those listed
with their reason (UPWARD_IMPORTS).

Every import counts, also those inside functions (a cycle broken only by a deferred import is still two
modules that cannot be understood, tested or moved apart); a module's `if __name__ == "__main__":` block does
not (it runs as the module `__main__`, a script). The entry points that may read the CLI module: `train.py` (it
parses the flags), `startup.py` (the flags into the run's typed configs, and the dry run of `python -m
megatron_dapo.planner`) and `launch/server_args.py` (`python -m megatron_dapo.launch.server_args`: the servers'
flags from the trainer's). A module importing its own package (`megatron_dapo.x.y` -> `megatron_dapo.x`) is not an
edge: Python runs the package first anyway.

Below them nothing takes the parsed flags: every builder takes the typed config it needs
(`test_no_module_below_the_cli_reads_the_flags`), and --hf-checkpoint's config.json is parsed once, at start-up,
into the ModelArch they are handed (`test_config_json_is_parsed_only_at_start_up`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.torchrun import REPO

PACKAGE = REPO / "megatron_dapo"
CLI = "megatron_dapo.arguments"
ENTRY_POINTS = {"megatron_dapo.train", "megatron_dapo.startup", "megatron_dapo.launch.server_args"}
FLAG_READERS = ENTRY_POINTS | {CLI}
"""The modules that hold or read the trainer's parsed flags (an argparse.Namespace); nothing below them does."""
NAMESPACE_PARAMS = {"args", "flags", "namespace", "ns", "opts"}
"""Parameter names that mean "the parsed flags" unless annotated with another type (a hook's `args: tuple`, the
flag names `flags: str` an error message cites, the record's `flags: Mapping`)."""
NAMESPACE_AS_DATA = {
    "megatron_dapo.checkpoint.safe_read": "Megatron-LM pickles its args (a Namespace) into common.pt: the "
                                          "checkpoint reader's allowlist names the class",
}
"""Library modules that name argparse.Namespace as data, never as flags they read; each with why."""


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":` at module level: the module run as a script, not the library."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators))


def library_nodes(tree: ast.Module):
    """Every node of a module but its `if __name__ == "__main__":` block (a script's imports run in `__main__`, a
    module of their own)."""
    for top in tree.body:
        if not is_main_guard(top):
            yield from ast.walk(top)


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
        for node in library_nodes(ast.parse(path.read_text(), str(path))):
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


LAYERS = (
    ("", "errors", "dotted_path", "flag_field", "compat", "distributed", "models", "ops"),
    ("weights", "checkpoint", "planner"),
    ("actor", "algorithm", "data", "reward", "tool_use"),
    ("rollout",),
    ("weight_sync",),
    ("trainer", "simulate"),
    ("startup", "arguments", "train", "launch"),
)
"""The library's layers, lowest first, by top-level package or module of megatron_dapo/ ("": the package itself), as
docs/ARCHITECTURE.md describes them: the model, its parallel layout and kernels; what reads and writes their weights
and checkpoints, and the memory planner (config.json and the layout, nothing built); the actor and the maths of
DAPO, its data, rewards and the tool-use sandbox; rank 0's rollout; the weight sync, which drives rollout/'s SGLang
servers; the trainer, which wires them, and the simulation of its schedules at the production setting; the entry
points and the command line. A module imports its own layer and those below."""
UPWARD_IMPORTS = {
    "megatron_dapo.data.prompt_set -> megatron_dapo.rollout.types":
        "a prompt file becomes the engine's `Prompt`: rollout/types.py is the plain data crossing the engine "
        "(no code of rollout/ runs)",
    "megatron_dapo.rollout.build -> megatron_dapo.weight_sync.transports":
        "rank 0's engine builder resolves the run's transport (weight_sync_mode) and checks its placement and host "
        "before any server starts; only the registry of weight_sync/transports/ is read",
}
"""The imports that remain from a layer into one above it, each with why. A new one is a failure: move the shared
piece down to the layer that owns it, or add it here with its reason."""


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: place megatron_dapo/{top} in a layer of tests/unit/test_import_graph.py LAYERS")


def upward_imports(graph: dict[str, set[str]]) -> set[str]:
    """`a -> b` for every import of a module in a higher layer than the importer's."""
    return {f"{m} -> {t}" for m, edges in graph.items() for t in edges if layer_of(t) > layer_of(m)}


def test_the_layer_check_finds_an_import_back_up():
    graph = {"megatron_dapo.models.gpt": {"megatron_dapo.trainer.loop", "megatron_dapo.ops.fused_linear"},
             "megatron_dapo.trainer.loop": {"megatron_dapo.models.gpt", "megatron_dapo.weight_sync.build"},
             "megatron_dapo.planner.report": {"megatron_dapo.planner.stages"}}
    assert upward_imports(graph) == {"megatron_dapo.models.gpt -> megatron_dapo.trainer.loop"}
    with pytest.raises(AssertionError, match="megatron_dapo/nowhere"):
        layer_of("megatron_dapo.nowhere.x")


def test_no_import_goes_back_up_the_layers_but_the_listed_ones():
    """Issue 40 item 6: the planner (config.json and the layout only) imports nothing of rollout/, weight_sync/ or
    the trainer; every import from a layer into one above it is listed, with its reason, in UPWARD_IMPORTS."""
    found = upward_imports(import_graph())
    new = sorted(found - UPWARD_IMPORTS.keys())
    assert new == [], f"imports back up the layers (LAYERS), not in UPWARD_IMPORTS: {new}"
    gone = sorted(UPWARD_IMPORTS.keys() - found)
    assert gone == [], f"UPWARD_IMPORTS lists imports that are gone (remove them from the list): {gone}"
    assert all(why.strip() for why in UPWARD_IMPORTS.values())

def trainer_flag_dests() -> set[str]:
    from megatron_dapo.arguments import build_parser

    return {action.dest for action in build_parser()._actions}


def flag_reads(tree: ast.Module, *, own_parser: bool, dests: set[str] = frozenset({"context_parallel_size"})
               ) -> list[str]:
    """Where a module outside FLAG_READERS takes or reads a flags namespace: a parameter annotated
    argparse.Namespace, or named like one (NAMESPACE_PARAMS) without another annotation; a getattr of a flag's
    dest (`dests`) from a variable, with a default (how code reads a flag a namespace may lack); argparse imported
    where the module defines no parser of its own (`own_parser`: it calls argparse.ArgumentParser, as the launch/
    tools do for their own flags)."""
    found = []
    for node in library_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            name = getattr(node, "name", "<lambda>")
            for param in params:
                annotation = ast.unparse(param.annotation) if param.annotation is not None else ""
                if "Namespace" in annotation or (param.arg in NAMESPACE_PARAMS and not annotation):
                    found.append(f"line {node.lineno}: {name}({param.arg}{': ' + annotation if annotation else ''})")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) == 3 and isinstance(node.args[0], ast.Name)
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in dests):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not own_parser:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if "argparse" in names:
                found.append(f"line {node.lineno}: imports argparse without a parser of its own")
    return found


def defines_own_parser(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) in ("argparse.ArgumentParser", "ArgumentParser")
               for n in library_nodes(tree))


def test_no_module_below_the_cli_reads_the_flags():
    """Issue 40 item 1: the flags are parsed once, at start-up (startup.py), into typed per-component configs;
    every builder below takes the config it needs, never the namespace."""
    offenders, dests = {}, trainer_flag_dests()
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        if name in FLAG_READERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        found = flag_reads(tree, own_parser=defines_own_parser(tree) or name in NAMESPACE_AS_DATA, dests=dests)
        if found:
            offenders[name] = found
    assert offenders == {}, f"modules below the CLI that take or read the parsed flags: {offenders}"


@pytest.mark.parametrize("source, caught", [
    pytest.param("def load(args):\n    return args.hf_checkpoint\n", True, id="args-param"),
    pytest.param("import argparse\ndef load(cfg: argparse.Namespace):\n    return cfg.lr\n", True,
                 id="namespace-annotation"),
    pytest.param("def load(cfg: 'Namespace'):\n    return cfg.lr\n", True, id="string-annotation"),
    pytest.param("def load(flags):\n    return flags.lr\n", True, id="unannotated-flags"),
    pytest.param("def load(args: argparse.Namespace):\n    return args.lr\n", True, id="annotated-args"),
    pytest.param("def load(cfg):\n    return getattr(cfg, 'context_parallel_size', 1)\n", True,
                 id="getattr-default"),
    pytest.param("import argparse\n", True, id="argparse-without-parser"),
    pytest.param("def f(*args, **kwargs):\n    return args\n", False, id="varargs"),
    pytest.param("def f(flags: str):\n    return flags\n", False, id="typed-flags"),
    pytest.param("def hook(module, args: tuple, output):\n    return args\n", False, id="typed-args"),
    pytest.param("def f(m):\n    return getattr(m, 'output_layer', None)\n", False, id="getattr-not-a-flag"),
    pytest.param("def load(cfg):\n    return cfg.lr\n"
                 "if __name__ == '__main__':\n    import argparse\n    args = argparse.Namespace()\n", False,
                 id="main-guard"),
])
def test_the_flags_check_catches_a_namespace_passed_down(source, caught):
    assert bool(flag_reads(ast.parse(source), own_parser=False)) is caught


HF_CONFIG_READERS = {
    "megatron_dapo.startup": "--hf-checkpoint's architecture, parsed once for the run (model_arch) and for the dry "
                             "run; every builder below is handed the ModelArch (the embedded engine: "
                             "RolloutEngineConfig.arch)",
    "megatron_dapo.models.hf_config": "the parse itself (ModelArch.from_hf, read_config_json)",
    "megatron_dapo.checkpoint.hf_export": "copies --hf-checkpoint's config.json into the export as it is (all its "
                                          "fields, the dtype rewritten), not an architecture",
    "megatron_dapo.checkpoint.dist_load": "a checkpoint's stored HF config: a dict already read, no file",
    "megatron_dapo.trainer.build": "--ref-load's own config.json (another model's file), parsed once where the "
                                   "reference is built, to refuse an architecture other than the actor's",
}
"""The library modules that call read_config_json or ModelArch.from_hf, each with why."""


def config_json_parses(tree: ast.Module) -> list[str]:
    """`line N: f` for each call of read_config_json or a `from_hf` in a module's library code."""
    found = []
    for node in library_nodes(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name in ("read_config_json", "from_hf"):
                found.append(f"line {node.lineno}: {ast.unparse(func)}")
    return found


def test_config_json_is_parsed_only_at_start_up():
    """Issue 40: the embedded engine took the model family from config.json itself, a second parse of what start-up
    had parsed; now it is handed the ModelArch. A new parse site is a failure: take the ModelArch from the config
    that start-up built (or list the module here with its reason)."""
    found = {module_name(p): hits for p in sorted(PACKAGE.rglob("*.py"))
             if (hits := config_json_parses(ast.parse(p.read_text(), str(p))))}
    assert sorted(found.keys() - HF_CONFIG_READERS.keys()) == [], \
        f"config.json parsed outside start-up: { {m: found[m] for m in found.keys() - HF_CONFIG_READERS.keys()} }"
    assert sorted(HF_CONFIG_READERS.keys() - found.keys()) == [], "HF_CONFIG_READERS lists modules that parse none"
    assert len(found["megatron_dapo.startup"]) == 3  # model_arch, dry_run and the planned teacher's (planned_teacher)


@pytest.mark.parametrize("source, caught", [
    pytest.param("from x import read_config_json\nc = read_config_json(p)\n", True, id="read_config_json"),
    pytest.param("a = ModelArch.from_hf(d)\n", True, id="from_hf"),
    pytest.param("a = arch.family.hf_causal_lm()\n", False, id="family"),
    pytest.param("if __name__ == '__main__':\n    ModelArch.from_hf(d)\n", False, id="main-guard"),
])
def test_the_parse_check_finds_a_parse(source, caught):
    assert bool(config_json_parses(ast.parse(source))) is caught
