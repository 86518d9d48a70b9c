"""Shared fixtures: a tiny HF Qwen2 base policy built once per session by tools/make_tiny_base.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def train_env() -> dict[str, str]:
    """Environment for trainer subprocesses: one thread per process, the repo on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """A barely warmed-up tiny model (hidden 32) with train/eval prompt files: fast, not accurate."""
    out = tmp_path_factory.mktemp("tiny-base")
    cmd = [sys.executable, "tools/make_tiny_base.py", "--out", str(out), "--sft-steps", "20", "--num-train",
           "300", "--num-eval", "16", "--hidden-size", "32", "--ffn-hidden-size", "64", "--sft-batch-size", "16"]
    subprocess.run(cmd, cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=300)
    return out
