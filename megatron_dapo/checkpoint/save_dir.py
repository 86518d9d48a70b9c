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
- `--save` must be writable (created if missing, a probe file written and removed): a read-only
  directory is found now, not at the first save after a full training step.
- `--save` is locked: global rank 0 holds an exclusive flock on `<save>/.megatron_dapo.lock` for the
  run's lifetime, so a second run on the same directory stops with an error naming the host and pid
  of the holder instead of interleaving its steps with the first one's. The kernel drops a flock when
  its holder dies (SIGKILL included), so a dead run's lock is simply taken over; the host and pid
  written into the file only serve the messages. A process forked by the holder (an --async-save
  writer) keeps the lock while it still writes into the directory. On a shared file system the lock
  is cluster-wide where flock is (NFSv4, Lustre mounted with `-o flock`, GPFS); where the file system
  has no flock the run continues with a warning.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import errno
import fcntl
import json
import os
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


def _holder_text(content: str) -> tuple[str, bool]:
    """("pid P on host H (started T)", whether that pid is known dead: same host, no such process)."""
    try:
        info = json.loads(content)
        host, pid, started = str(info["host"]), int(info["pid"]), str(info.get("started", "?"))
    except (ValueError, KeyError, TypeError):
        return "a process that has not written its name yet", False
    dead = host == socket.gethostname() and not pid_alive(pid)
    return f"pid {pid} on host {host} (started {started})", dead


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
        holder, dead = _holder_text(os.pread(fd, 4096, 0).decode(errors="replace"))
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
    if previous:
        holder, _ = _holder_text(previous)
        print(f"[megatron-dapo] --save {save}: took over the lock of a run that ended without releasing it "
              f"({holder})")
    record = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    lock = SaveDirLock(path, fd)
    atexit.register(lock.release)
    return lock


def check_save_writable(save: Path) -> None:
    """Create --save if missing and write (then remove) a probe file in it; UserError naming the path if not."""
    try:
        save.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=save)
        os.close(fd)
        os.unlink(probe)
    except FileExistsError as err:
        raise UserError(f"--save {save} is a file, not a directory") from err
    except OSError as err:
        raise UserError(f"--save {save} is not writable: {err.strerror} ({err.filename or save}); give a directory "
                        f"on a writable file system that this user may write to") from err


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


def prepare_run_dirs(args: argparse.Namespace) -> SaveDirLock | None:
    """Global rank 0, before anything is built: check --load, make --save writable and lock it.

    Returns the --save lock (held until exit), None without --save. Prints the note of a fresh start.
    """
    note = check_load(args.load, args.save)
    lock = None
    if args.save:
        save = Path(args.save)
        check_save_writable(save)
        lock = lock_save_dir(save)
    if note:
        print(f"[megatron-dapo] {note}")
    return lock
