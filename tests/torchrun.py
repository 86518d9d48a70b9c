"""Run a worker script under torchrun (gloo, CPU) from a pytest test and return its output.

Multi-process tests write a small script under tests/dist/ and call `run_torchrun`; the script
prints or saves what the test compares, and any rank's failure fails the test with its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port  # noqa: F401  (re-exported: the tests' one port picker)

REPO = Path(__file__).resolve().parent.parent


def subprocess_env() -> dict[str, str]:
    """Environment for test subprocesses: one thread per process (2 cores), the repo on PYTHONPATH."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run_torchrun(script: str | Path, *args: str, nproc: int = 2, timeout: float = 600) -> str:
    """Launch `script` on `nproc` local ranks; return combined stdout+stderr, raise on failure."""
    env = subprocess_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script), *map(str, args)]
    # Own process group: on a time-out the launcher *and* its ranks are killed, so a hung collective
    # fails the test instead of leaving orphaned workers behind.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun {script} timed out after {timeout:.0f} s (hung collective?):\n"
                             f"{out[-8000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out
