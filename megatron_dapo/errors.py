"""The error class of mistakes a user fixes with a flag or a file.

`python -m megatron_dapo.train` prints a `UserError` as one line, `error: <message>`, on stderr and
exits with status 2 (argparse's status for bad usage); `--debug` shows the traceback instead. Every
message names what is wrong and the flag (or file and field) that fixes it.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path


class UserError(ValueError):
    """Bad input: a flag value, a data file, a model directory. A ValueError, so callers that catch those still do.

    `echo=False` marks the copy raised on ranks that only learned of rank 0's verdict: rank 0 prints it,
    the others exit quietly with the same status.
    """

    def __init__(self, message: str, *, echo: bool = True) -> None:
        super().__init__(message)
        self.echo = echo


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""The errnos of a write that found no room: the file system is full, or the user's quota is spent."""


def is_disk_full(err: BaseException | None,
                 children: Callable[[BaseException], Iterable[BaseException]] = lambda _: ()) -> bool:
    """Whether `err`, or an exception it was raised from or while handling (or one of `children(e)` for any of
    them), is an OSError of a write that found no room (DISK_FULL_ERRNOS), or carries its text ("[Errno 28]":
    another rank's error arrives pickled, its cause dropped). torch.save reports a full disk as a RuntimeError
    raised during the OSError."""
    seen: set[int] = set()
    todo = [err] if err is not None else []
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if (isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS) or any(
                f"[Errno {code}]" in str(e) for code in DISK_FULL_ERRNOS):
            return True
        todo += [c for c in (e.__cause__, e.__context__, *children(e)) if c is not None]
    return False


def disk_full_error(path: str | os.PathLike, what: str) -> UserError:
    """The UserError for a write of `what` to `path` that failed with ENOSPC (or EDQUOT).

    Its one line names what was being written, the path and the free space on the file system of the
    nearest existing parent of `path` (GiB, 2 decimals), so the user knows where to make room.
    """
    where = Path(os.path.abspath(path))
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free"
    except OSError as err:
        free = f"free space unknown ({err.strerror or err})"
    return UserError(f"no space left on device writing {what} to {where} ({free} on {probe}); "
                     "free disk space there or choose another directory")
