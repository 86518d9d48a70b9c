"""Crafted checkpoints: a pickle payload planted in a real checkpoint the way an attacker would (issue 38 item 1).

Each payload runs `open(marker, "w")` when unpickled and then hands back the value it replaced, so a checkpoint
loaded by an unrestricted unpickler still loads as if nothing happened: the marker file is the only sign. The
manifest's size and CRC-32 of every rewritten file are updated to match, as an attacker would.
"""

from __future__ import annotations

import io
import operator
import pickle
from pathlib import Path
from typing import Any

import torch


class _Run:
    """Unpickles as `exec(code)`."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (self.code,)


class RunThen:
    """Unpickles as `value`, after running `code`: getitem((exec(code), value), 1)."""

    def __init__(self, code: str, value: Any) -> None:
        self.code, self.value = code, value

    def __reduce__(self) -> tuple[Any, ...]:
        return operator.getitem, ((_Run(self.code), self.value), 1)


def touch(marker: Path) -> str:
    """The payload's code: create `marker`."""
    return f"open({str(marker)!r}, 'w').write('ran')"


def _index(directory: Path) -> Any:
    """The directory's `.metadata`, read the way torch does (these are the test's own, trusted files)."""
    with open(directory / ".metadata", "rb") as f:
        return pickle.load(f)


def _write_index(directory: Path, md: Any, wrap: str | None = None) -> None:
    with open(directory / ".metadata", "wb") as f:
        pickle.dump(RunThen(wrap, md) if wrap else md, f)


def _rehash(directory: Path, *names: str) -> None:
    """Update the manifest's size and CRC-32 of `names` (no manifest: nothing to do)."""
    from megatron_dapo.checkpoint import manifest

    files = manifest.read_manifest(directory)
    if files is not None:
        files.update(manifest.describe_files(directory, names))
        manifest.write_manifest(directory, files)


def plant_in_metadata(directory: Path, marker: Path) -> None:
    """`.metadata` unpickles as itself after running the payload."""
    _write_index(directory, _index(directory), touch(marker))
    _rehash(directory, ".metadata")


def plant_in_common(directory: Path, marker: Path) -> None:
    """`common.pt` unpickles as itself after running the payload."""
    common = torch.load(directory / "common.pt", weights_only=False)
    torch.save(RunThen(touch(marker), common), directory / "common.pt")
    _rehash(directory, "common.pt")


def object_keys(directory: Path) -> list[str]:
    """The ShardedObject keys of a checkpoint (RNG states, `_extra_state`s, ...)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    return [k for k, v in _index(directory).state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]


def plant_in_object(directory: Path, key_prefix: str, marker: Path) -> str:
    """The first ShardedObject whose key starts with `key_prefix` unpickles as its old value after running the
    payload: a new record appended to its `.distcp` file and the index pointed at it. Returns the object's key."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = _index(directory)
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn.startswith(key_prefix))
    path = directory / info.relative_path
    with open(path, "rb") as f:
        f.seek(info.offset)
        value = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)
    record = io.BytesIO()
    torch.save(RunThen(touch(marker), value), record)
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(record.getvalue())
    md.storage_data[index] = _StorageInfo(info.relative_path, offset, len(record.getvalue()))
    _write_index(directory, md)
    _rehash(directory, ".metadata", info.relative_path)
    return index.fqn


def point_outside(directory: Path) -> str:
    """Point the index's first storage record at `../<its file>` (torch would read a file outside the checkpoint
    directory). Returns the new name."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = _index(directory)
    index, info = next(iter(md.storage_data.items()))
    name = f"../{info.relative_path}"
    md.storage_data[index] = _StorageInfo(name, info.offset, info.length)
    _write_index(directory, md)
    _rehash(directory, ".metadata")
    return name
