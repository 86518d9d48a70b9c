"""python -m tests.probes.full_disk SIZE DIR -- ARGS...: run `python ARGS...` with DIR on a file system of SIZE bytes.

A tmpfs of SIZE (tmpfs's own syntax: 1m) is mounted on DIR in a private mount namespace (`unshare -Urm`: no root
needed where user namespaces are allowed), so the command meets the kernel's own ENOSPC. Where that cannot be had,
the command runs in this process with the files megatron's checkpoint writer and the common.pt save open failing
with ENOSPC once SIZE bytes are written into them (tests/disk_full.py), the errors a full disk gives torch.save.
Either way, after the command every entry left in DIR is printed as a line `left in DIR: NAME` (the tmpfs is gone
once the namespace ends), and its exit status is this one's.
"""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys

MOUNT = 'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 97; d="$2"; shift 2; "$@"; rc=$?; ' \
        'for f in $(ls -A "$d"); do echo "left in $d: $f"; done; exit $rc'


def _namespaces_work() -> bool:
    """Whether `unshare -Urm` can mount a tmpfs here."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


def _in_process(size: str, directory: str, args: list[str]) -> int:
    """The fallback: `python -m MODULE ...` run here with the checkpoint writes filling up after SIZE bytes."""
    import pytest
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_dapo.checkpoint import training
    from tests.disk_full import fill_disk_after

    room = int(size[:-1]) * {"k": 1 << 10, "m": 1 << 20}[size[-1]] if size[-1] in "km" else int(size)
    patch = pytest.MonkeyPatch()
    for module in (filesystem_async, training):
        fill_disk_after(patch, module, room)
    if args[:1] != ["-m"]:
        raise SystemExit("full_disk: the command must be `-m MODULE ...`")
    sys.argv = [args[1], *args[2:]]
    status = 0
    try:
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        print(f"left in {directory}: {name}", flush=True)
    return status


def main(argv: list[str]) -> int:
    size, directory, dashes, *args = argv
    if dashes != "--":
        raise SystemExit(__doc__)
    os.makedirs(directory, exist_ok=True)
    if _namespaces_work():
        return subprocess.run(["unshare", "-Urm", "sh", "-c", MOUNT, "sh", size, directory, sys.executable,
                               *args]).returncode
    return _in_process(size, directory, args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
