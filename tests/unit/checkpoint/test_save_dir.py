"""--save and --load checks before anything is built (megatron_dapo/checkpoint/save_dir.py).

One run per --save directory: a second launch on a locked directory stops at once with an error naming the
holder's host and pid (also when both started at the same instant), a dead holder's lock is taken over; the lock
file names host, pid and start time only (it is world-readable and outlives a kill). --load that names no
checkpoint (a typo, a file, an empty directory, an HF model, one step directory) is an error naming the path and
what it holds; only the launchers' `--load` = `--save` pattern starts fresh, with a line saying so. A --save that
holds another run's steps is refused without --load of it (or --overwrite-save). A --save or --log-dir that cannot
be written is found before the model is built.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from megatron_dapo.checkpoint import save_dir
from megatron_dapo.checkpoint.save_dir import (
    LOCK_FILE,
    check_dir_creatable,
    check_load,
    check_save_steps,
    check_save_writable,
    clear_previous_steps,
    lock_save_dir,
)
from megatron_dapo.errors import UserError
from tests.conftest import REPO, train_env

HOLD = ("import sys, time; from pathlib import Path; from megatron_dapo.checkpoint.save_dir import lock_save_dir; "
        "lock_save_dir(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)")


@pytest.fixture
def holder(tmp_path):
    """A process holding the lock of tmp_path / "ckpt" (killed at the end)."""
    save = tmp_path / "ckpt"
    save.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(save)], cwd=REPO, env=train_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield save, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_held_lock_is_an_error_naming_host_and_pid_and_a_dead_holders_lock_is_taken_over(holder, capsys):
    save, proc = holder
    with pytest.raises(UserError) as err:
        lock_save_dir(save)
    message = str(err.value)
    assert f"--save {save} is in use by another run: pid {proc.pid} on host {socket.gethostname()}" in message
    os.kill(proc.pid, signal.SIGKILL)  # no chance to release: the lock file still names it
    proc.wait()
    assert json.loads((save / LOCK_FILE).read_text())["pid"] == proc.pid
    lock = lock_save_dir(save)
    assert f"took over the lock of a run that ended without releasing it (pid {proc.pid} on host" \
           in capsys.readouterr().out
    assert json.loads((save / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert (save / LOCK_FILE).read_text() == ""  # a clean exit leaves no holder to report
    again = lock_save_dir(save)
    assert "took over" not in capsys.readouterr().out
    again.release()


def _launch(*flags: str) -> subprocess.CompletedProcess:
    """The trainer with inputs that do not exist: every check here comes before they are read."""
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", "/nonexistent/model", "--prompt-data",
           "/nonexistent/train.jsonl", "--num-steps", "2", "--no-wandb", "--no-progress", *flags]
    return subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)


def test_second_launch_on_a_locked_save_dir_is_an_error_before_anything_is_built(holder):
    save, proc = holder
    out = _launch("--save", str(save), "--load", str(save))
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr
    assert errors[0].startswith(f"error: --save {save} is in use by another run: pid {proc.pid} on host "
                                f"{socket.gethostname()} (started "), errors[0]
    assert "no checkpoint in" not in out.stdout and "decoder layers" not in out.stdout
    assert proc.poll() is None  # the holder is untouched


def test_load_typo_is_an_error_naming_the_path(tmp_path):
    out = _launch("--load", str(tmp_path / "ckpt-typo"), "--save", str(tmp_path / "ckpt"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"error: --load {tmp_path / 'ckpt-typo'} does not exist" in out.stderr
    assert not (tmp_path / "ckpt").exists()  # nothing was created for a run that cannot start


def _hf_dir(path: Path) -> Path:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.mark.parametrize("case, expected", [
    pytest.param("typo", "does not exist", id="typo"),
    pytest.param("file", "is a file, not a checkpoint directory", id="file"),
    pytest.param("empty", "holds no checkpoint (no step_N directory; it holds nothing)", id="empty-dir"),
    pytest.param("hf", "is an HF model directory (config.json, weights): pass it as --hf-checkpoint", id="hf-dir"),
    pytest.param("step", "is one step of a checkpoint; give the directory that holds the steps: --load ", id="step"),
    pytest.param("latest", "holds `latest` naming step_0000004, but no step directory", id="latest-only"),
    pytest.param("other", "holds no checkpoint (no step_N directory; it holds notes.txt, run.log)", id="other"),
])
def test_load_without_a_checkpoint_is_an_error_naming_path_and_content(tmp_path, case, expected):
    load = tmp_path / "load"
    if case == "file":
        load.write_text("x")
    elif case == "empty":
        load.mkdir()
    elif case == "hf":
        _hf_dir(load)
    elif case == "step":
        load = tmp_path / "ckpt" / "step_0000002"
        load.mkdir(parents=True)
        (load / "metadata.json").write_text("{}")
    elif case == "latest":
        load.mkdir()
        (load / "latest").write_text("step_0000004")
    elif case == "other":
        load.mkdir()
        (load / "notes.txt").write_text("x")
        (load / "run.log").write_text("x")
    with pytest.raises(UserError) as err:
        check_load(str(load), str(tmp_path / "save"))
    assert str(err.value).startswith(f"--load {load} ") and expected in str(err.value), str(err.value)
    if case == "step":
        assert str(err.value).endswith(f"--load {load.parent} (the newest usable step is taken)")


@pytest.mark.parametrize("content, says", [
    pytest.param((), "(--load is --save, which does not exist yet)", id="not-created"),
    pytest.param(("",), "(it holds nothing; --load is --save)", id="empty"),
    pytest.param(("", LOCK_FILE), "(it holds nothing; --load is --save)", id="lock-file-only"),
    pytest.param(("", "step_0000001.tmp/"), "(it holds only the unfinished save(s) step_0000001.tmp; --load is --save)",
                 id="unfinished-save"),
])
def test_load_equal_to_save_without_a_checkpoint_starts_fresh_with_a_line(tmp_path, content, says):
    save = tmp_path / "ckpt"
    for name in content:
        if name.endswith("/"):
            (save / name).mkdir(parents=True)
        elif name:
            (save / name).write_text("")
        else:
            save.mkdir()
    note = check_load(str(save), str(tmp_path / "." / "ckpt"))
    assert note == f"no checkpoint in {save}: starting at step 0 {says}"


def test_load_of_checkpoints_and_of_converter_output_goes_on(tmp_path):
    run = tmp_path / "run"
    (run / "step_0000003").mkdir(parents=True)
    assert check_load(str(run), str(run)) is None and check_load(str(run), None) is None
    converted = tmp_path / "mcore"
    (converted / "release").mkdir(parents=True)
    (converted / "latest_checkpointed_iteration.txt").write_text("release")
    (converted / "release" / ".metadata").write_bytes(b"")
    assert check_load(str(converted), str(tmp_path / "save")) is None
    assert check_load(str(converted / "release"), str(tmp_path / "save")) is None  # its iteration directory too
    from megatron_dapo.checkpoint.dist_load import initial_checkpoint

    assert initial_checkpoint(str(converted / "release"), None) == str(converted / "release")
    assert initial_checkpoint(str(run), None) is None  # a run's --save directory resumes instead


def test_save_that_cannot_be_written_is_an_error_naming_it(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(UserError) as err:
        check_save_writable(blocker / "ckpt" / "deeper")
    assert str(err.value) == (f"--save {blocker / 'ckpt' / 'deeper'} cannot be created: {blocker} is a file, not a "
                              f"directory; give a directory path")
    save = tmp_path / "ckpt"
    save.mkdir()

    def read_only(*args, **kwargs):  # what a read-only mount (EROFS) or a missing permission does at the write
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(save / ".write-probe-x"))

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(UserError) as err:
        check_save_writable(save)
    assert str(err.value).startswith(f"--save {save} is not writable: Read-only file system ({save}/.write-probe-x)")
    assert save_dir.tempfile is tempfile  # the check writes through the module patched above


def test_the_lock_file_names_host_pid_and_start_time_and_nothing_else(tmp_path, monkeypatch):
    """It is world-readable (0644: a second run of another user reads the holder's name) and stays after a kill, so
    the command line, which may hold --sglang-api-key, must not be in it."""
    monkeypatch.setattr(sys, "argv", ["megatron_dapo.train", "--sglang-api-key", "argvKEY-lock-5e1d"])
    lock = lock_save_dir(tmp_path)
    try:
        record = json.loads((tmp_path / LOCK_FILE).read_text())
        assert sorted(record) == ["host", "pid", "started"]
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        assert "argvKEY-lock-5e1d" not in (tmp_path / LOCK_FILE).read_text()
    finally:
        lock.release()


@pytest.mark.parametrize("left_by", [pytest.param("", id="empty-file"),
                                     pytest.param("dead-run", id="a-dead-runs-record")])
def test_a_lock_taken_an_instant_ago_is_reported_with_its_holders_host_and_pid(tmp_path, monkeypatch, left_by):
    """Two runs started at the same instant: the first holds the flock but has not yet written its name (the file
    is empty, or still names the run before it, which is dead). The second reads the file again until the name is
    there, instead of reporting "a process that has not written its name yet" or the dead run's pid."""
    path = tmp_path / LOCK_FILE
    if left_by:
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "started": "earlier"}))
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # another open file description: flock conflicts
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    record = json.dumps({"host": "node-7", "pid": os.getpid(), "started": "2025-01-01T00:00:00+0000"})
    real_sleep, waits = time.sleep, []

    def holder_writes_its_name(seconds: float) -> None:  # while the second run waits, the first writes its name
        waits.append(seconds)
        os.ftruncate(holder, 0)
        os.pwrite(holder, record.encode(), 0)
        real_sleep(0)

    monkeypatch.setattr(time, "sleep", holder_writes_its_name)
    try:
        with pytest.raises(UserError) as err:
            lock_save_dir(tmp_path)
    finally:
        os.close(holder)
    assert f"is in use by another run: pid {os.getpid()} on host node-7 (started 2025-01-01T00:00:00+0000)" \
           in str(err.value), str(err.value)
    assert waits  # it did wait for the name


def _steps(save: Path, *steps: int) -> Path:
    for step in steps:
        (save / f"step_{step:07d}").mkdir(parents=True)
        (save / f"step_{step:07d}" / "metadata.json").write_text("{}")
    (save / "latest").write_text(f"step_{max(steps):07d}")
    return save


def test_save_holding_another_runs_steps_is_refused_without_load_and_nothing_is_touched(tmp_path):
    """A run that wrote steps 1-6; a new run with --save on it and no --load used to write steps 1, 2 over them
    and move `latest` back to 2: the old run's progress lost, silently."""
    save = _steps(tmp_path / "ckpt", 1, 2, 3, 4, 5, 6)
    (save / "step_0000007.tmp").mkdir()
    before = sorted(p.name for p in save.iterdir())
    out = _launch("--save", str(save))
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --save {save} already holds steps 1-6 of another run; resume it with --load {save}, "
                      f"or give this run a new --save (--overwrite-save deletes those steps)"], out.stderr[-3000:]
    after = sorted(p.name for p in save.iterdir() if p.name != LOCK_FILE)  # the lock was taken, and released
    assert after == before and (save / "latest").read_text() == "step_0000006" and (save / LOCK_FILE).read_text() == ""
    # --load of another directory is no resume of this one: refused too; --load of this one resumes
    with pytest.raises(UserError, match="already holds steps 1-6 of another run"):
        check_save_steps(save, str(tmp_path / "other"), overwrite=False)
    assert check_save_steps(save, str(save), overwrite=False) == []
    assert check_save_steps(tmp_path / "new", None, overwrite=False) == []


def test_overwrite_save_deletes_the_old_steps_once_the_inputs_are_read(tmp_path, capsys):
    save = _steps(tmp_path / "ckpt", 2, 4, 5, 6)
    (save / "step_0000008.tmp").mkdir()
    (save / "notes.txt").write_text("mine")
    out = _launch("--save", str(save), "--overwrite-save")  # inputs that do not exist: nothing deleted
    assert out.returncode == 2 and "--hf-checkpoint" in out.stderr, out.stderr[-3000:]
    assert (save / "step_0000006").is_dir() and (save / "latest").is_file()
    steps = check_save_steps(save, None, overwrite=True)
    assert steps == [2, 4, 5, 6]
    clear_previous_steps(save, steps)
    assert sorted(p.name for p in save.iterdir()) == [LOCK_FILE, "notes.txt"]  # the lock of the launch above
    assert capsys.readouterr().out == f"[megatron-dapo] --overwrite-save: deleted steps 2, 4-6 of a previous run " \
                                      f"from {save}\n"
    with pytest.raises(UserError, match="--overwrite-save with --load .* = --save: the run would delete the checkpoint "
                                        "it resumes from"):
        check_save_steps(save, str(save), overwrite=True)


@pytest.mark.parametrize("where", ["file", "under-a-file"])
def test_log_dir_on_or_under_a_file_is_an_error_before_anything_is_built(tmp_path, monkeypatch, where):
    """It used to pass the start-up and fail with a traceback once the model was built and the first metrics line
    was written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    log_dir = blocker if where == "file" else blocker / "log"
    out = _launch("--log-dir", str(log_dir))
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    expected = f"--log-dir {log_dir} is a file, not a directory" if where == "file" else \
        f"--log-dir {log_dir} cannot be created: {blocker} is a file, not a directory; give a directory path"
    assert errors == [f"error: {expected}"], out.stderr[-3000:]
    assert "Traceback" not in out.stderr and blocker.read_text() == "x"
    check_dir_creatable(tmp_path / "fresh" / "log", "--log-dir")  # to be made by the run's logger, not here
    assert not (tmp_path / "fresh").exists()
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != read_only)  # as access(2) says on EROFS
    with pytest.raises(UserError, match=f"--log-dir {read_only / 'log'} is not writable \\({read_only}: permission "):
        check_dir_creatable(read_only / "log", "--log-dir")
