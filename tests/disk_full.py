"""A disk that fills up: files a module opens for writing raise OSError(ENOSPC) once `room` bytes are written."""

from __future__ import annotations

import builtins
import errno
import os
from types import ModuleType
from typing import Any

import pytest


class _FillingFile:
    """A real file whose writes fail with ENOSPC past the shared budget (the rest of its API passes through)."""

    def __init__(self, file: Any, budget: list[int]) -> None:
        self._file, self._budget = file, budget

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self._budget[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= n
        return self._file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)

    def __enter__(self) -> _FillingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()


def fill_disk_after(monkeypatch: pytest.MonkeyPatch, module: ModuleType, room: int) -> None:
    """`module`'s open() for writing gives files that together take `room` bytes, then raise ENOSPC."""
    budget = [room]

    def filling_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        file = builtins.open(path, mode, *args, **kwargs)  # noqa: SIM115 (the caller closes it)
        return _FillingFile(file, budget) if any(c in mode for c in "wax+") else file

    monkeypatch.setattr(module, "open", filling_open, raising=False)


def raise_enospc(*_: Any, **__: Any) -> None:
    """A stand-in for a kernel copy (copy_file_range) that finds the disk full."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
