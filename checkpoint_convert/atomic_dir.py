"""Write a directory all-or-nothing: build it under a temporary sibling, then rename it into place.

A crash or error mid-conversion leaves at most a `.<name>.tmp-<pid>` sibling (removed on a clean
error), never a half-written checkpoint under the final name.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def atomic_output_dir(
    final: str | os.PathLike[str], *, overwrite: bool, flag: str = "--save"
) -> Iterator[str]:
    """Yield an empty temporary directory that becomes `final` when the block exits without error."""
    final = os.path.abspath(os.fspath(final))
    if os.path.exists(final) and not overwrite:
        raise FileExistsError(f"{flag} {final} already exists; pass --overwrite to replace it")
    parent, name = os.path.split(final)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        # Same filesystem, so both renames are atomic; the old copy is only deleted once replaced.
        old = os.path.join(parent, f".{name}.old-{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
