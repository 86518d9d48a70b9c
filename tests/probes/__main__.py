"""python -m tests.probes [-k SUBSTRING]: every probe of tests/probes/cases_*.py, one line each, and the count."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.probes.case import run_case
from tests.probes.registry import all_cases


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.probes", description=__doc__)
    p.add_argument("-k", default="", help="only the cases whose name contains this")
    a = p.parse_args(argv)
    cases = [c for c in all_cases() if a.k in c.name]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="probes-") as tmp:
        for i, case in enumerate(cases):
            why = run_case(case, Path(tmp) / str(i))
            bad += why is not None
            print(f"{'good' if why is None else 'BAD '}  {case.name}" + (f": {why}" if why else ""), flush=True)
    print(f"{len(cases) - bad} of {len(cases)} cases good")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
