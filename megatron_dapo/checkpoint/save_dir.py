"""--save and --load, checked on global rank 0 before anything is built; the lock that gives --save one run.

`prepare_run_dirs` runs right after the flags are checked (train.py), before the rollout engine, the
prompt files and the model, and costs a few stat / open calls (milliseconds, also at 128 ranks: only
global rank 0 touches the file system here; the other ranks learn its verdict over gloo):

- `--load` must name a checkpoint: a `--save` directory with step_N directories, or `checkpoint_convert
  hf-to-mcore` output (its root or its `release/` directory). A typo, a file, an HF model directory, one
  step_N directory or a directory without any checkpoint is an error naming the path and what it holds.
  The one exception is the launchers' resume pattern, `--load` equal to `--save`: a save directory that
  does not exist yet, or holds no complete step (empty, or only a `.tmp` of a save that never finished),
  starts at step 0 with one line saying so.
- `--save` must be a writable directory (created if missing, a probe file written and removed), and
  `--log-dir` one or a path where one can be made (`check_dir_creatable`: nothing is created): a read-only
  directory, a file, or a path under a file is found now, not at the first save or metrics line after the
  model is built.
- `--save` is locked: global rank 0 holds an exclusive flock on `<save>/.megatron_dapo.lock` for the
  run's lifetime, so a second run on the same directory stops with an error naming the host and pid
  of the holder instead of interleaving its steps with the first one's. The kernel drops a flock when
  its holder dies (SIGKILL included), so a dead run's lock is simply taken over; the host, pid and start
  time written into the file (nothing else: the file is world-readable and stays after a kill, so no
  command line, which may hold a key) only serve the messages. A run that finds the lock held but its
  holder's name not yet written (both started at the same instant) reads it again for up to
  `NAME_WAIT_S`. A process forked by the holder (an --async-save writer) keeps the lock while it still
  writes into the directory. On a shared file system the lock is cluster-wide where flock is (NFSv4,
  Lustre mounted with `-o flock`, GPFS); where the file system has no flock the run continues with a
  warning.
- `--save` holding another run's steps (`step_N` directories) without `--load` of the same directory is
  refused, naming the steps: a new run would write over steps 1, 2, ... and move `latest` back, losing
  the old run's progress. `--overwrite-save` deletes them instead (`clear_previous_steps`, once rank 0
  has read every input).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from megatron_dapo.distributed.stale_dirs import pid_alive
from megatron_dapo.errors import UserError

LOCK_FILE = ".megatron_dapo.lock"
STEP_PREFIX = "step_"
LATEST = "latest"  # checkpoint.LATEST (not imported: that module imports megatron and torch)
HF_WEIGHT_SUFFIXES = (".safetensors", ".bin")
NAME_WAIT_S = 2.0
"""How long a run that finds --save locked re-reads the lock file for its holder's name. A holder writes it
microseconds after taking the lock; two seconds cover a holder descheduled on a loaded node."""
STEP_DIR = re.compile(rf"{STEP_PREFIX}(\d+)")


class SaveDirLock:
    """An exclusive flock on `<save>/.megatron_dapo.lock`, held until `release()` or the process exits."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the file (a clean exit leaves no holder to report) and drop the lock; idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):  # the lock goes with the close below either way
            os.ftruncate(fd, 0)
        os.close(fd)


def _holder_text(content: str) -> tuple[str, bool] | None:
    """("pid P on host H (started T)", whether that pid is known dead: same host, no such process); None when
    `content` names nobody (empty, or a record still being written)."""
    try:
        info = json.loads(content)
        host, pid, started = str(info["host"]), int(info["pid"]), str(info.get("started", "?"))
    except (ValueError, KeyError, TypeError):
        return None
    dead = host == socket.gethostname() and not pid_alive(pid)
    return f"pid {pid} on host {host} (started {started})", dead


def _read_holder(fd: int, wait_s: float = NAME_WAIT_S, poll_s: float = 0.01) -> tuple[str, bool]:
    """The holder of the lock file `fd` (held by another process), as `_holder_text`. Read again every `poll_s`
    for up to `wait_s` while the file names nobody or a dead process: a holder that took the lock an instant ago
    has not yet replaced the previous (dead) run's record with its own. A name still missing then is reported as
    such; a dead pid that stays is a process it forked (an --async-save writer) holding the lock."""
    deadline = time.monotonic() + wait_s
    while True:
        holder = _holder_text(os.pread(fd, 4096, 0).decode(errors="replace"))
        if (holder is not None and not holder[1]) or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    return holder or (f"a process that took the lock without writing its host and pid within {wait_s:.0f} s", False)


def lock_save_dir(save: Path) -> SaveDirLock:
    """Take the exclusive lock of the --save directory `save` (which exists) without waiting.

    Raises UserError naming the holder's host and pid when another process holds it. A lock file left by a
    run that died is taken over with a line naming that run.
    """
    path = save / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise UserError(f"--save {save}: cannot open its lock file {path}: {err.strerror}") from err
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder, dead = _read_holder(fd)
        os.close(fd)
        forked = (" (that pid is gone: a process it started, such as an --async-save writer, still holds the "
                  "lock)") if dead else ""
        raise UserError(f"--save {save} is in use by another run: {holder} holds {path}{forked}; wait for it to "
                        f"end or stop it, or give this run another --save") from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            os.close(fd)
            raise
        os.close(fd)
        print(f"[megatron-dapo] warning: --save {save}: the file system does not support flock "
              f"({err.strerror}): nothing stops a second run from writing into the same directory",
              file=sys.stderr)
        return SaveDirLock(path, None)
    previous = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    # Host, pid and start time only: the file is world-readable and outlives a killed run, and a command line
    # may hold a secret (--sglang-api-key). Written at once, so a run started at the same instant can name us.
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    if previous:
        holder = _holder_text(previous)
        print(f"[megatron-dapo] --save {save}: took over the lock of a run that ended without releasing it "
              f"({holder[0] if holder else 'a run that had not written its name'})")
    lock = SaveDirLock(path, fd)
    atexit.register(lock.release)
    return lock


def check_dir_writable(path: Path, flag: str) -> None:
    """Create the directory `path` (given as `flag`) if missing and write (then remove) a probe file in it;
    UserError naming the flag and the path if it is a file, lies under a file, or cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError as err:
        raise UserError(f"{flag} {path} is a file, not a directory") from err
    except OSError as err:
        blocker = _file_above(path)
        if blocker is not None:
            raise UserError(f"{flag} {path} cannot be created: {blocker} is a file, not a directory; give a "
                            f"directory path") from err
        raise UserError(f"{flag} {path} is not writable: {err.strerror} ({err.filename or path}); give a directory "
                        f"on a writable file system that this user may write to") from err


def check_dir_creatable(path: Path, flag: str) -> None:
    """`path` (given as `flag`) is a directory this user can write to, or can be made as one: its nearest existing
    ancestor is a writable directory. UserError naming the flag and the path otherwise. Creates nothing (a run that
    fails at start-up leaves no empty --log-dir behind); one stat per path component and an access(2)."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file, not a directory")
    blocker = _file_above(path)
    if blocker is not None:
        raise UserError(f"{flag} {path} cannot be created: {blocker} is a file, not a directory; give a directory path")
    target = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not os.access(target, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path} is not writable ({target}: permission denied or a read-only file system); "
                        f"give a directory this user may write to")


def _file_above(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (a file in the way), else None."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def check_save_writable(save: Path) -> None:
    """--save: `check_dir_writable`."""
    check_dir_writable(save, "--save")


def _same_dir(a: str, b: str | None) -> bool:
    return b is not None and os.path.realpath(a) == os.path.realpath(b)


def _is_converter_output(path: Path) -> bool:
    from megatron_dapo.checkpoint.dist_load import is_megatron_lm_checkpoint

    return is_megatron_lm_checkpoint(path)


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_load(load: str | None, save: str | None) -> str | None:
    """What --load holds: None to go on (a checkpoint to resume, or converter output), a note "no checkpoint in
    X: starting at step 0" for a fresh start of --load = --save, else UserError naming the path and its content.

    A directory with step_N directories is not verified here: checkpoint.load_checkpoint does that (falling back
    past damaged steps). Cost: one stat and one directory listing of --load.
    """
    if not load:
        return None
    path = Path(load)
    resume_pattern = _same_dir(load, save)
    fresh = f"no checkpoint in {path}: starting at step 0"
    if not path.exists():
        if resume_pattern:
            return fresh + " (--load is --save, which does not exist yet)"
        raise UserError(f"--load {path} does not exist; give a directory written by --save or "
                        f"`checkpoint_convert hf-to-mcore` output (without --load a run starts from --hf-checkpoint)")
    if not path.is_dir():
        raise UserError(f"--load {path} is a file, not a checkpoint directory; give the directory --save wrote, "
                        f"or `checkpoint_convert hf-to-mcore` output")
    if _is_converter_output(path):
        return None
    names = sorted(p.name for p in path.iterdir())
    steps = [n for n in names if n.startswith(STEP_PREFIX) and not n.endswith(".tmp") and (path / n).is_dir()]
    if steps:
        return None
    unfinished = [n for n in names if n.startswith(STEP_PREFIX) and n.endswith(".tmp")]
    others = [n for n in names if n not in unfinished and n not in (LOCK_FILE, f".{LATEST}.tmp")]
    if path.name.startswith(STEP_PREFIX) and {"metadata.json", ".metadata"} & set(names):
        raise UserError(f"--load {path} is one step of a checkpoint; give the directory that holds the steps: "
                        f"--load {path.parent} (the newest usable step is taken)")
    if "config.json" in names and any(n.endswith(HF_WEIGHT_SUFFIXES) for n in names):
        raise UserError(f"--load {path} is an HF model directory (config.json, weights): pass it as --hf-checkpoint, "
                        f"or convert it with `python -m checkpoint_convert hf-to-mcore` and pass that as --load")
    if LATEST in names:
        target = (path / LATEST).read_text().strip()
        raise UserError(f"--load {path} holds `latest` naming {target}, but no step directory; the checkpoint was "
                        f"moved or deleted in part")
    held = (f"only the unfinished save(s) {_listing(unfinished)}" if unfinished else "nothing") if not others \
        else _listing(others)
    if not others and resume_pattern:
        return f"{fresh} (it holds {held}; --load is --save)"
    raise UserError(f"--load {path} holds no checkpoint (no {STEP_PREFIX}N directory; it holds {held}); give a "
                    f"directory written by --save or `checkpoint_convert hf-to-mcore` output")


def step_numbers(save: Path) -> list[int]:
    """The steps of the complete step directories (`step_N`, not `step_N.tmp`) in `save`, ascending."""
    if not save.is_dir():
        return []
    return sorted(int(m[1]) for p in save.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir())


def _spans(steps: list[int]) -> str:
    """Ascending step numbers as ranges: [1, 2, 3, 5, 7, 8] -> "1-3, 5, 7-8"."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_save_steps(save: Path, load: str | None, overwrite: bool) -> list[int]:
    """The steps of another run in --save that `clear_previous_steps` is to delete (--overwrite-save), else [].

    --save with complete steps and without `--load` of the same directory is a UserError naming the steps and the
    ways out: a new run would write step 1, 2, ... over them and move `latest` back to its own step. With
    --overwrite-save and --load = --save it is one too: the run would delete what it resumes from."""
    resume = _same_dir(str(save), load)
    if overwrite and resume:
        raise UserError(f"--overwrite-save with --load {load} = --save: the run would delete the checkpoint it "
                        f"resumes from; drop --load to start afresh in {save}, or drop --overwrite-save to resume")
    steps = step_numbers(save)
    if not steps or resume:
        return []
    if not overwrite:
        held = f"step{'s' if len(steps) > 1 else ''} {_spans(steps)}"
        raise UserError(f"--save {save} already holds {held} of another run; resume it with --load {save}, or give "
                        f"this run a new --save (--overwrite-save deletes those steps)")
    return steps


def clear_previous_steps(save: Path, steps: list[int]) -> None:
    """--overwrite-save, on global rank 0 once it has read every input: delete the step directories `steps` of
    --save (`check_save_steps`), the unfinished ones and `latest`, and say so in one line. Costs the removal of
    the old checkpoints' files (459 GB a step at 32B: a few thousand files, seconds)."""
    if not steps:
        return
    for path in save.iterdir():
        if STEP_DIR.fullmatch(path.name.removesuffix(".tmp")) or path.name in (LATEST, f".{LATEST}.tmp"):
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
    print(f"[megatron-dapo] --overwrite-save: deleted step{'s' if len(steps) > 1 else ''} {_spans(steps)} "
          f"of a previous run from {save}")


def prepare_run_dirs(*, load: str | None, save: str | None, overwrite_save: bool, log_dir: str
                     ) -> tuple[SaveDirLock | None, list[int]]:
    """Global rank 0, before anything is built: check --load, make --save writable, lock it and check that it
    holds no other run's steps, check --log-dir.

    Returns the --save lock (held until exit; None without --save) and the steps --overwrite-save is to delete
    (`clear_previous_steps`). Prints the note of a fresh start."""
    if overwrite_save and not save:
        raise UserError("--overwrite-save without --save: there is no checkpoint directory to overwrite")
    note = check_load(load, save)
    lock, steps = None, []
    if save:
        save_dir = Path(save)
        check_save_writable(save_dir)
        lock = lock_save_dir(save_dir)
        steps = check_save_steps(save_dir, load, overwrite_save)
    check_dir_creatable(Path(log_dir), "--log-dir")
    if note:
        print(f"[megatron-dapo] {note}")
    return lock, steps
