"""The manifest of a checkpoint step directory: every file's name, size and CRC-32, checked at --load.

Written into `step_<N>.tmp/manifest.json` after every rank's files are complete and before the
rename, so a step directory without `.tmp` carries the list of what it must contain. A truncated
`.distcp` / `common.pt`, a deleted file or flipped bytes are then found before dist_checkpointing
would fail on them with a bare EOFError / zip error that names no file. A step without a manifest is
checked against its own torch_dist index instead (`check_unverified`).

Checksum: CRC-32 (zlib), not SHA-256. It detects truncation and accidental corruption, not a crafted file (its
writer rewrites the manifest too: no checksum in the checkpoint is a defence; what is, checkpoint/safe_read.py and
docs/FAULT_TOLERANCE.md's trust model), and is faster (docs/BENCHMARKS.md, "Checkpoint manifest").
The work is split, never centralised: at save each rank checksums the `__<rank>_*.distcp` files it wrote
itself (rank 0 also the small common files); at load the files are verified round-robin over all ranks.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 16 << 20


def crc32_file(path: Path) -> str:
    """CRC-32 of a file's bytes as 8 hex digits, read in 16 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, int | str]]:
    """{name: {"size": bytes, "crc32": hex}} of the given files of `directory`."""
    return {name: {"size": (directory / name).stat().st_size, "crc32": crc32_file(directory / name)}
            for name in names}


def files_written_by(directory: Path, rank: int, world: int) -> list[str]:
    """The files of a torch_dist step directory that `rank` describes in the manifest.

    Each rank wrote its own `__<rank>_<i>.distcp` (FileSystemWriterAsync's per-rank prefix); rank 0
    also takes every other file (common.pt, metadata.json, .metadata: small, written by rank 0).
    """
    own = re.compile(r"^__(\d+)_\d+\.distcp$")
    out = []
    for path in sorted(directory.iterdir()):
        if not path.is_file() or path.name == MANIFEST:
            continue
        match = own.match(path.name)
        owner = int(match.group(1)) if match and int(match.group(1)) < world else 0
        if owner == rank:
            out.append(path.name)
    return out


def write_manifest(directory: Path, files: dict[str, dict[str, int | str]]) -> None:
    """Write `manifest.json` (fsync'd) into directory."""
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": FORMAT_VERSION, "checksum": "crc32", "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: Path) -> dict[str, dict[str, int | str]] | None:
    """The manifest's file table, or None when the directory has no manifest."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if data.get("format") != FORMAT_VERSION or data.get("checksum") != "crc32":
        raise ValueError(f"{path}: unknown manifest format {data.get('format')!r} / checksum {data.get('checksum')!r}")
    return data["files"]


def check_files(directory: Path, files: dict[str, dict[str, int | str]], names: Iterable[str]) -> list[str]:
    """Problems of the named manifest entries: missing, wrong size (truncated / grown), CRC mismatch."""
    problems = []
    for name in names:
        want = files[name]
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{path} has {size} bytes, the manifest says {want['size']} (truncated or overwritten)")
        elif (crc := crc32_file(path)) != want["crc32"]:
            problems.append(f"{path} has CRC-32 {crc}, the manifest says {want['crc32']} (corrupted)")
    return problems


def check_unverified(directory: Path, rank: int, world: int) -> list[str]:
    """Problems of a step without a manifest, found from its own torch_dist index (`.metadata`).

    Every rank reads `.metadata` (the same pickle megatron's load reads anyway: ~23 KB for the test model,
    tens of MB at Qwen2.5-32B over 128 ranks) and checks its round-robin share of the `.distcp` files it
    names: present and at least as long as the last byte range it records. Rank 0 also reads the small
    common files back: metadata.json parses, common.pt's zip members match their own CRC-32s. This finds a
    missing `.metadata`, a deleted or truncated `.distcp` or common.pt before dist_checkpointing would fail on
    them with an AssertionError or a bare EOFError; a flipped byte inside a `.distcp` shows only when loading.
    `.metadata` is read by safe_read.read_metadata: one pickling a class torch does not write there raises
    UnsafeCheckpointError (a crafted file is not damage to fall back from).
    """
    from megatron_dapo.checkpoint import safe_read
    from megatron_dapo.weights.safetensors_io import CheckpointError

    try:
        storage = safe_read.read_metadata(directory).storage_data
    except FileNotFoundError:
        return [f"{directory}/.metadata is missing (the index of the step's tensors): not written by --save, "
                f"or damaged"]
    except safe_read.UnsafeCheckpointError:
        raise
    except CheckpointError as err:  # truncated, or not a pickle: the file is damaged
        return [f"{directory}/.metadata is unreadable ({err})"]
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name in sorted(needed)[rank::world]:
        path = directory / name
        if not path.is_file():
            problems.append(f"{path} is missing (named by {directory}/.metadata)")
        elif (size := path.stat().st_size) < needed[name]:
            problems.append(f"{path} has {size} bytes, {directory}/.metadata reads up to byte {needed[name]} "
                            f"(truncated)")
    if rank == 0:
        problems += _check_common_files(directory)
    return problems


def _check_common_files(directory: Path) -> list[str]:
    """Rank 0's part of check_unverified: metadata.json parses, common.pt is a complete zip with good CRCs."""
    import zipfile

    problems = []
    try:
        json.loads((directory / "metadata.json").read_text())
    except FileNotFoundError:
        pass  # step_problems reports it
    except ValueError as err:
        problems.append(f"{directory}/metadata.json is not JSON ({err})")
    common = directory / "common.pt"
    try:
        with zipfile.ZipFile(common) as zf:
            bad = zf.testzip()
        if bad is not None:
            problems.append(f"{common}: member {bad} fails its CRC-32 (corrupted)")
    except FileNotFoundError:
        problems.append(f"{common} is missing")
    except (zipfile.BadZipFile, OSError) as err:
        problems.append(f"{common} is not a complete torch.save file ({err}; truncated?)")
    return problems
