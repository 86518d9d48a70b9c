"""Shared fixtures: a tiny HF Qwen2 base policy built once per session by tools/make_tiny_base.py."""

from __future__ import annotations

import gc
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


def pytest_sessionfinish(session, exitstatus) -> None:
    """Freeze the heap the suite leaves behind (torch modules, in-process process groups; 1.7 GB at the end of
    `make test`), so the interpreter's final garbage collections skip it: without this, pytest spent 2-3 minutes
    after its summary in Py_FinalizeEx's collections (seen with gdb: finalize_modules -> gc_collect_main)."""
    gc.freeze()
