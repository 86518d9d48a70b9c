"""Issue 38's adversarial probes (tests/probes/): every case must get a good answer. One test a case, so a
regression names its case; `python -m tests.probes` runs the same list and prints the count."""

from __future__ import annotations

import pytest

from tests.probes.case import run_case
from tests.probes.registry import all_cases

CASES = all_cases()


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in CASES])
def test_probe(case, tmp_path):
    why = run_case(case, tmp_path)
    assert why is None, f"{case.name}: {why}"
