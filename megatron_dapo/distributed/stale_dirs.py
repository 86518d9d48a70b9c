"""Temporary directories named after the process that owns them, and the removal of those whose owner died.

An error, SIGINT or SIGTERM lets a process remove its own temporary directory; a SIGKILL cannot be caught.
So each such directory carries `<host>-<pid>` in its name, and the next process that makes one first removes
those of this host whose pid is no longer alive (the converter's `.<name>.tmp-<host>-<pid>` siblings,
checkpoint_convert/atomic_dir.py; the launched SGLang servers' `sglang_key-<host>-<pid>-*` key directories,
megatron_dapo/rollout/sglang/api_key.py). A directory of a live process, this one's included, is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import socket


def owner_tag() -> str:
    """`<host>-<pid>` of this process: the part of a directory name that says who owns it."""
    return f"{socket.gethostname()}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists on this host (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_owners(parent: str | os.PathLike[str], pattern: re.Pattern[str]) -> list[str]:
    """Removes the entries of `parent` whose name matches `pattern` (named groups `host` and `pid`) when `host`
    is this host and no process `pid` is alive; returns their names. A missing `parent` removes nothing."""
    host = socket.gethostname()
    removed = []
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m and m["host"] == host and int(m["pid"]) != os.getpid() and not pid_alive(int(m["pid"])):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            removed.append(name)
    return removed
