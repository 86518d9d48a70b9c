"""Shared fixtures (a tiny HF Qwen2 base policy built once per session by tools/make_tiny_base.py) and the suite's
skip rule: under `--fail-on-skip` (what `make test` passes) a skipped test fails, unless its skip is declared part of
the suite's design with `pytest.mark.designed_skip(reason)` and skips for exactly that reason."""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.torchrun import REPO, subprocess_env

train_env = subprocess_env

FAIL_ON_SKIP = "--fail-on-skip"


def pytest_addoption(parser) -> None:
    parser.addoption(FAIL_ON_SKIP, action="store_true",
                     help="a skipped test fails, unless it carries pytest.mark.designed_skip(reason) with the "
                          "reason it skipped for (make test passes this: a skip where CI runs proved nothing)")


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "designed_skip(reason): this test may skip for exactly this reason under "
                                       f"{FAIL_ON_SKIP} (an opt-in test, a test another covers where it runs)")


def skip_reason(report) -> str:
    """The reason a skipped report gives: pytest stores (path, line, "Skipped: <reason>")."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def designed_reasons(item) -> set[str]:
    """The skip reasons `item` declares as part of the suite's design (pytest.mark.designed_skip(reason))."""
    return {mark.args[0] for mark in item.iter_markers("designed_skip")}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under --fail-on-skip, turn an undeclared skip into a failure that names the reason and how to leave the test
    out on purpose (SKIP_SGLANG=1 / SKIP_REHEARSAL=1 deselect the server and Slurm tests)."""
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and item.config.getoption(FAIL_ON_SKIP)) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if reason in designed_reasons(item):
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} skipped under {FAIL_ON_SKIP} (make test): {reason}. A skip where CI runs "
                       "proves nothing: give this machine what the test needs, or leave the test out on purpose "
                       "(SKIP_SGLANG=1 for the real-server tests, SKIP_REHEARSAL=1 for the Slurm ones).")


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A barely warmed-up tiny model (hidden 32) with train/eval prompt files: fast, not accurate."""
    out = tmp_path_factory.mktemp("tiny-base")
    cmd = [sys.executable, "tools/make_tiny_base.py", "--out", str(out), "--sft-steps", "20", "--num-train",
           "300", "--num-eval", "16", "--hidden-size", "32", "--ffn-hidden-size", "64", "--sft-batch-size", "16"]
    subprocess.run(cmd, cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="session")
def teacher(tmp_path_factory) -> Path:
    """The distillation teacher: tiny_base's recipe with 150 SFT steps instead of 20, another policy over the same
    tokenizer (its HF model directory). One build for the in-process and the served teacher's tests."""
    out = tmp_path_factory.mktemp("teacher")
    subprocess.run([sys.executable, "tools/make_tiny_base.py", "--out", str(out), "--sft-steps", "150", "--num-train",
                    "300", "--num-eval", "16", "--hidden-size", "32", "--ffn-hidden-size", "64", "--sft-batch-size",
                    "16"], cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=300)
    return out / "model"


_SESSION: list = []


def pytest_sessionstart(session) -> None:
    _SESSION.append(session)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    """Once pytest has printed its summary and unconfigured every plugin, run the atexit handlers (temporary
    directories, multiprocessing's children, logging) and leave with pytest's own exit status, skipping the
    interpreter's teardown of the heap the suite leaves behind (torch and megatron modules, in-process process
    groups: 1.7 GB at the end of `make test`). That teardown took 2-3 minutes after the summary (gdb:
    Py_FinalizeEx -> finalize_modules -> gc_collect_main) and checks nothing; freezing the heap instead left it
    alive into nanobind's exit check, which then printed triton's bindings as leaks. Only for the pytest command
    line: a program calling pytest.main() keeps its process."""
    if not _SESSION or not _invoked_as_pytest_cli():
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    os._exit(int(_SESSION[-1].exitstatus))


def _invoked_as_pytest_cli() -> bool:
    """`python -m pytest` (argv[0] .../pytest/__main__.py) or the `pytest` / `py.test` script."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return argv0.name in ("pytest", "py.test") or (argv0.name == "__main__.py" and argv0.parent.name == "pytest")
