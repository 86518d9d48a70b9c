"""The stop signal handler (megatron_dapo/trainer/stop.py) in a process of its own: what a second SIGINT, a second
SIGTERM and the --exit-save-timeout-s bound do, with an unfinished save (`step_N.tmp`) in --save as a save that was
being written when the process had to go. The trainer's use of it: tests/e2e/test_trainer_e2e.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_dapo.trainer.stop import StopRequested, StopSignal
from tests.conftest import REPO, train_env

HANDLER = """
import sys, time
from pathlib import Path
from megatron_dapo.trainer.stop import StopSignal
StopSignal(float(sys.argv[2]), save_dir=Path(sys.argv[1])).install()
print("ready", flush=True)
while True:  # a trainer busy in a save or an update, as far as the handler can tell
    time.sleep(0.05)
"""


def _save_dir(tmp_path: Path) -> Path:
    """A --save with a complete step 4 (`latest`) and step 5 being written."""
    save = tmp_path / "ckpt"
    for name in ("step_0000004", "step_0000005.tmp"):
        (save / name / "sub").mkdir(parents=True)
        (save / name / "__0_0.distcp").write_bytes(b"x" * 1000)
        (save / name / "sub" / "common.pt").write_bytes(b"y")
    (save / "latest").write_text("step_0000004")
    return save


def _start(save: Path, timeout_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HANDLER, str(save), str(timeout_s)], cwd=REPO, env=train_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _left_in(save: Path) -> list[str]:
    return sorted(p.name for p in save.iterdir())


def test_a_second_sigint_exits_at_once_without_a_traceback_removing_the_unfinished_save(tmp_path):
    save = _save_dir(tmp_path)
    proc = _start(save, timeout_s=600)
    proc.send_signal(signal.SIGINT)
    first = proc.stderr.readline()  # the handler has run: the next SIGINT is a second one
    assert first.startswith("[megatron-dapo] SIGINT: stopping at the next safe point") and "Ctrl-C again" in first
    assert proc.poll() is None  # the first one only asks the trainer to stop
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.splitlines() == ["[megatron-dapo] SIGINT: exiting now (a second SIGINT); removed the unfinished "
                                "step_0000005.tmp; a run with --load resumes from the newest complete step"], err
    assert _left_in(save) == ["latest", "step_0000004"]  # the previous checkpoint stays whole
    assert (save / "step_0000004" / "__0_0.distcp").read_bytes() == b"x" * 1000


def test_the_bound_ends_the_process_and_a_second_sigterm_does_not(tmp_path):
    """Slurm signals every process of a step and torchrun passes its own SIGTERM on: a rank sees two. The second
    changes nothing (the default action would have killed it at once); the bound ends it, with status 143."""
    save = _save_dir(tmp_path)
    proc = _start(save, timeout_s=3)
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr.readline().startswith("[megatron-dapo] SIGTERM: stopping at the next safe point")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert err.splitlines() == ["[megatron-dapo] SIGTERM: exiting now (--exit-save-timeout-s 3 s passed); removed "
                                "the unfinished step_0000005.tmp; a run with --load resumes from the newest complete "
                                "step"], err
    assert _left_in(save) == ["latest", "step_0000004"]


def test_a_stop_before_or_inside_an_abandonable_region_raises_there_only():
    stop = StopSignal(600.0)
    with stop.abandonable():
        pass  # no request: the region runs to its end
    stop.signum, stop.received = signal.SIGTERM, 0.0  # as the handler records a request (no watchdog started)
    with pytest.raises(StopRequested) as err, stop.abandonable():
        raise AssertionError("a region entered after the request must not run")
    assert err.value.status == 143 and not stop._abandonable
    with pytest.raises(ValueError, match="--exit-save-timeout-s must be >= 0 seconds, got -1"):
        StopSignal(-1.0)
