"""Write a directory all-or-nothing: build it under a temporary sibling, then rename it into place.

The temporary sibling is `.<name>.tmp-<host>-<pid>`. An error or a SIGINT/SIGTERM (the CLI turns
SIGTERM into SystemExit) removes it; a SIGKILL cannot be caught, so every run first removes the
temporaries that runs on this host left behind when their pid is no longer alive (a converted 32B
model leaves ~64 GB there otherwise; megatron_dapo/distributed/stale_dirs.py). A half-written checkpoint never
appears under the final name.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_dapo.distributed.stale_dirs import owner_tag, remove_dead_owners

_TMP = re.compile(r"^\..+\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)$")


def remove_stale_temporaries(parent: str) -> list[str]:
    """Remove `.*.tmp-<host>-<pid>` / `.old-` siblings of this host whose process is gone; return them."""
    return remove_dead_owners(parent, _TMP)


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
    remove_stale_temporaries(parent)
    tag = owner_tag()
    tmp = os.path.join(parent, f".{name}.tmp-{tag}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(final):
        # Same filesystem, so both renames are atomic; the old copy is only deleted once replaced.
        old = os.path.join(parent, f".{name}.old-{tag}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
