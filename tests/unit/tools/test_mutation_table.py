"""The mutation pass stays runnable as the code moves: every mutant of tools/mutation_pass.py still names text that
occurs exactly once in its file (else the pass reports it `bad-mutant` and proves nothing), every test path it runs
exists, and docs/MUTATIONS.md's row for it names the file and the function (class.method) whose body holds that text:
a name, not a line number, so an edit above a mutant does not make its row wrong."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys

import pytest

from tests.torchrun import REPO

ROW = re.compile(r"^\| \d+ \| `(?P<id>[^`]+)` \|[^|]*\| `(?P<path>[^`:]+)::(?P<where>[^`]+)`( \([^)]*\))? \|")


def _mutants():
    spec = importlib.util.spec_from_file_location("mutation_pass", REPO / "tools" / "mutation_pass.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _mutants()


def _table() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in (REPO / "docs" / "MUTATIONS.md").read_text().splitlines():
        if match := ROW.match(line):
            rows[match["id"]] = (match["path"], match["where"])
    return rows


def enclosing(source: str, line: int) -> str:
    """Dotted name of the innermost def/class whose lines hold 1-based `line` ("Cls.method"), `<module>` if none."""
    names: list[str] = []

    def visit(node: ast.AST, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.lineno <= line <= child.end_lineno:
                    names[:] = [*stack, child.name]
                    visit(child, [*stack, child.name])
            else:
                visit(child, stack)

    visit(ast.parse(source), [])
    return ".".join(names) or "<module>"


def where(mutant) -> tuple[str, str]:
    """(path, function enclosing the line where the mutant's old text starts); AssertionError unless it occurs
    exactly once."""
    text = (REPO / mutant.path).read_text()
    count = text.count(mutant.old)
    assert count == 1, f"{mutant.id}: its old text occurs {count} times in {mutant.path} (must be once)"
    return mutant.path, enclosing(text, text[:text.index(mutant.old)].count("\n") + 1)


def test_enclosing_names_the_innermost_def():
    source = "X = 1\nclass A:\n    def f(self):\n        y = 2\n\n    z = 3\ndef g():\n    pass\n"
    assert [enclosing(source, n) for n in (1, 2, 4, 6, 8)] == ["<module>", "A", "A.f", "A", "g"]


def test_every_mutant_has_one_row_and_the_ids_are_unique():
    ids = [mutant.id for mutant in MUTANTS]
    assert len(ids) == len(set(ids))
    assert set(_table()) == set(ids)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda mutant: mutant.id)
def test_a_mutant_still_applies_and_its_row_says_where(mutant):
    missing = [path for path in mutant.tests if path.endswith(".py") and not (REPO / path.split("::")[0]).is_file()]
    assert not missing, f"{mutant.id}: test files that do not exist: {missing}"
    assert _table()[mutant.id] == where(mutant), f"docs/MUTATIONS.md's row for {mutant.id}"
