"""Every case module's CASES, in file name order."""

from __future__ import annotations

import importlib
from pathlib import Path

from tests.probes.case import Case


def all_cases() -> list[Case]:
    cases: list[Case] = []
    for path in sorted(Path(__file__).parent.glob("cases_*.py")):
        cases += importlib.import_module(f"tests.probes.{path.stem}").CASES
    names = [c.name for c in cases]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"tests/probes: case names must be unique, repeated: {dupes}")
    return cases
