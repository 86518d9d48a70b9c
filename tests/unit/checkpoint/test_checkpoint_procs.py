"""No checkpoint process outlives the trainer: SIGKILL mid-save, or a normal exit.

The worker (tests/dist/checkpoint_save_kill.py) saves a tiny actor's checkpoint, sync or --async-save.
Processes are tracked by (pid, start time), so a reused pid is not mistaken for a survivor and a
survivor reparented to pid 1 is still found.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist.checkpoint_save_kill import descendants
from tests.procs import stat_fields
from tests.torchrun import REPO, subprocess_env

pytestmark = pytest.mark.slow
WORKER = REPO / "tests" / "dist" / "checkpoint_save_kill.py"


def alive(pid: int, start: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z" and int(fields[19]) == start


def survivors(tracked: set[tuple[int, int]], wait_s: float = 15.0) -> list[str]:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        left = [(p, s) for p, s in tracked if alive(p, s)]
        if not left:
            return []
        time.sleep(0.1)
    return [f"{p}: {Path(f'/proc/{p}/cmdline').read_bytes()[:100]!r}" for p, s in tracked if alive(p, s)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sigkill_mid_save_leaves_no_process(tmp_path, mode):
    proc = subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), mode, "1"], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    tracked: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 300
    count = tmp_path / "writers.count"
    try:
        # Every writer is inside its (slowed) write: no process of the save is still to be forked. The deadline
        # only bounds a hang (a save of the tiny model starts within seconds).
        while not (count.is_file() and len(list(tmp_path.glob("writer_*"))) == int(count.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            tracked |= set(descendants(proc.pid))
            time.sleep(0.05)
        tracked |= set(descendants(proc.pid))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    writers = {int(p.name.split("_")[1]) for p in tmp_path.glob("writer_*")}
    assert len(writers) == int(count.read_text()) >= 1 and writers <= {pid for pid, _ in tracked}
    assert survivors(tracked) == []
    assert not (tmp_path / "ckpt" / "latest").exists() and (tmp_path / "ckpt" / "step_0000001.tmp").is_dir()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_normal_exit_leaves_no_process(tmp_path, mode):
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path), mode, "0"], cwd=REPO, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("DESCENDANTS "))
    tracked = {tuple(x) for x in json.loads(line.removeprefix("DESCENDANTS "))}
    if mode == "async":
        assert tracked, "an async save in flight should have its writer (and results Manager) processes"
    assert survivors(tracked, wait_s=5.0) == []
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_0000001"
