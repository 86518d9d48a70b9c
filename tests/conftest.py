"""Shared fixtures: a tiny HF Qwen2 base policy built once per session by tools/make_tiny_base.py."""

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


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A barely warmed-up tiny model (hidden 32) with train/eval prompt files: fast, not accurate."""
    out = tmp_path_factory.mktemp("tiny-base")
    cmd = [sys.executable, "tools/make_tiny_base.py", "--out", str(out), "--sft-steps", "20", "--num-train",
           "300", "--num-eval", "16", "--hidden-size", "32", "--ffn-hidden-size", "64", "--sft-batch-size", "16"]
    subprocess.run(cmd, cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=300)
    return out


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
