"""Rank 0's open-file limit covers --sglang-max-concurrency (issue 24, defect 6).

Each case runs in a subprocess whose RLIMIT_NOFILE a preexec_fn lowers first (soft 256; hard as the case needs),
so the test sees what a shell with that `ulimit -n` gives the trainer.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.fd_limit import fds_needed
from tests.torchrun import REPO, subprocess_env
from tests.unit.trainer.test_validation import error_lines, make_model_dir

OPEN_ALL = textwrap.dedent("""
    import os, resource, sys
    from megatron_dapo.rollout.sglang.fd_limit import ensure_fd_limit
    concurrency, world = int(sys.argv[1]), int(sys.argv[2])
    print(ensure_fd_limit(concurrency, world), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(concurrency)]  # the connections rank 0 opens
    print(len(fds))
""")


def _limited(soft: int, hard: int):
    def preexec() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return preexec


def _run(cmd: list[str], hard: int, soft: int = 256) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited(min(soft, hard), hard))


def test_production_need_is_stated():
    assert fds_needed(2048, 128) == 2048 + 16 + 256 + 256


def test_soft_limit_is_raised_to_what_the_concurrency_needs():
    out = _run([sys.executable, "-c", OPEN_ALL, "2048", "128"], hard=8192)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-3:] == ["2576 2576", "2048", ""]
    assert "open-file limit raised from 256 to 2576 for --sglang-max-concurrency 2048" in out.stdout


def test_a_limit_already_high_enough_is_left_alone():
    out = _run([sys.executable, "-c", OPEN_ALL, "8", "1"], hard=8192, soft=300)  # needs 8 + 16 + 2 + 256
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["None 300", "8"]


def test_a_hard_limit_below_the_need_is_an_error_naming_the_flag_and_ulimit(tmp_path: Path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n' * 4)
    argv = ["--hf-checkpoint", str(make_model_dir(tmp_path)), "--prompt-data", str(data), "--num-steps", "1",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--max-prompt-length", "16",
            "--max-response-length", "8", "--overlong-buffer-length", "4", "--no-wandb", "--no-progress",
            "--log-dir", str(tmp_path / "log"), "--rollout-engine", "sglang",
            "--sglang-server-urls", "http://127.0.0.1:9", "--sglang-max-concurrency", "2048"]
    out = _run([sys.executable, "-m", "megatron_dapo.train", *argv], hard=1024)
    assert out.returncode == 2, out.stderr[-3000:]
    assert error_lines(out.stderr) == [
        "error: --sglang-max-concurrency 2048 needs 2322 open files on rank 0 (the HTTP connections plus 274 for "
        "sockets to the other ranks, files and pool headroom), but the hard limit is 1024: lower "
        "--sglang-max-concurrency to 750 or raise the limit (`ulimit -n 2322` in the launching shell, or nofile "
        "in /etc/security/limits.conf / LimitNOFILE for a service)"]
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("hard", [pytest.param(200, id="nothing-fits")])
def test_no_concurrency_fits_says_only_raise(hard):
    code = "from megatron_dapo.rollout.sglang.fd_limit import ensure_fd_limit; ensure_fd_limit(64, 1)"
    out = _run([sys.executable, "-c", code], hard=hard)
    assert out.returncode != 0 and "lower --sglang-max-concurrency" not in out.stderr
    assert "but the hard limit is 200: raise the limit (`ulimit -n 338`" in out.stderr
