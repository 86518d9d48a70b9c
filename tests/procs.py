"""What the tests read of other processes from /proc (Linux): one process's stat fields, or every process's."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: state (0), ppid (1), pgrp (2), ..., utime (11),
    stime (12), ..., starttime (19), in clock ticks; None once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, stat_fields) of every process that still exists while it is read."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            yield int(entry), fields
