"""make test's skip rule (tests/conftest.py): under --fail-on-skip a skip fails unless the test declares exactly
that reason with pytest.mark.designed_skip; without the flag a skip stays a skip. Checked on a throwaway test
module run by a real pytest with the suite's own hooks."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.torchrun import REPO

MODULE = '''
import pytest

DESIGNED = "an opt-in test"


@pytest.mark.skipif(True, reason="no server here")
def test_undeclared_skipif():
    pass


@pytest.mark.skipif(True, reason=DESIGNED)
@pytest.mark.designed_skip(DESIGNED)
def test_designed_skipif():
    pass


@pytest.mark.skipif(True, reason="another reason")
@pytest.mark.designed_skip(DESIGNED)
def test_declared_for_another_reason():
    pass


def test_skip_inside_the_test():
    pytest.skip("found nothing to check")


@pytest.mark.xfail(reason="known", strict=True)
def test_xfail_is_not_a_skip():
    assert False


def test_passes():
    pass
'''

CONFTEST = "from tests.conftest import pytest_addoption, pytest_configure, pytest_runtest_makereport  # noqa: F401\n"


def _run(tmp_path, *flags: str) -> tuple[int, dict[str, str]]:
    """Runs the module with pytest; returns its exit status and each test's outcome word (-v)."""
    (tmp_path / "test_mod.py").write_text(MODULE)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *flags,
                          str(tmp_path / "test_mod.py")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    outcomes = {}
    for name, word in re.findall(r"::(test_\w+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL)", out.stdout):
        outcomes[name] = word
    return out.returncode, outcomes


def test_without_the_flag_a_skip_is_a_skip(tmp_path):
    code, outcomes = _run(tmp_path)
    assert code == 0
    assert outcomes == {"test_undeclared_skipif": "SKIPPED", "test_designed_skipif": "SKIPPED",
                        "test_declared_for_another_reason": "SKIPPED", "test_skip_inside_the_test": "SKIPPED",
                        "test_xfail_is_not_a_skip": "XFAIL", "test_passes": "PASSED"}


def test_under_the_flag_only_a_designed_skip_for_its_reason_stays_a_skip(tmp_path):
    code, outcomes = _run(tmp_path, "--fail-on-skip")
    assert code == 1
    # A skipif skips in setup: its failure is reported as an error; pytest.skip() in the body as a failure.
    assert outcomes == {"test_undeclared_skipif": "ERROR", "test_designed_skipif": "SKIPPED",
                        "test_declared_for_another_reason": "ERROR", "test_skip_inside_the_test": "FAILED",
                        "test_xfail_is_not_a_skip": "XFAIL", "test_passes": "PASSED"}
