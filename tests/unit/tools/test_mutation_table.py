"""The mutation pass stays runnable as the code moves: every mutant of tools/mutation_pass.py still names text that
occurs exactly once in its file (else the pass reports it `bad-mutant` and proves nothing), every test path it runs
exists, and docs/MUTATIONS.md's row for it points at the file and line where that text now starts."""

from __future__ import annotations

import importlib.util
import re
import sys

import pytest

from tests.torchrun import REPO

ROW = re.compile(r"^\| \d+ \| `(?P<id>[^`]+)` \|[^|]*\| `(?P<path>[^`:]+):(?P<line>\d+)`( \([^)]*\))? \|")


def _mutants():
    spec = importlib.util.spec_from_file_location("mutation_pass", REPO / "tools" / "mutation_pass.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module.MUTANTS


MUTANTS = _mutants()


def _table() -> dict[str, tuple[str, int]]:
    rows = {}
    for line in (REPO / "docs" / "MUTATIONS.md").read_text().splitlines():
        if match := ROW.match(line):
            rows[match["id"]] = (match["path"], int(match["line"]))
    return rows


def where(mutant) -> tuple[str, int]:
    """(path, 1-based line where the mutant's old text starts); AssertionError unless it occurs exactly once."""
    text = (REPO / mutant.path).read_text()
    count = text.count(mutant.old)
    assert count == 1, f"{mutant.id}: its old text occurs {count} times in {mutant.path} (must be once)"
    return mutant.path, text[:text.index(mutant.old)].count("\n") + 1


def test_every_mutant_has_one_row_and_the_ids_are_unique():
    ids = [mutant.id for mutant in MUTANTS]
    assert len(ids) == len(set(ids))
    assert set(_table()) == set(ids)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda mutant: mutant.id)
def test_a_mutant_still_applies_and_its_row_says_where(mutant):
    missing = [path for path in mutant.tests if path.endswith(".py") and not (REPO / path.split("::")[0]).is_file()]
    assert not missing, f"{mutant.id}: test files that do not exist: {missing}"
    assert _table()[mutant.id] == where(mutant), f"docs/MUTATIONS.md's row for {mutant.id}"
