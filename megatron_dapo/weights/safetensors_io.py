"""Streaming safetensors I/O: read one tensor at a time, write a file whose header is known up front.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each name to
{dtype, shape, data_offsets}, then the raw bytes. Because the converter knows every shape from the
config, it writes the header first and then each tensor's bytes in order, so it never holds more
than the tensor being written. Reading uses pread into a fresh tensor instead of mmap, so the bytes
of tensors already processed do not stay resident (mmap pages would count in RSS), and several
threads can read one file at once.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in DTYPE_TO_ST.items()}
_ALIGN = 8  # the safetensors package pads the header to 8 bytes; keep files byte-compatible


def map_file_tensor(fd: int, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A read-only CPU tensor over file bytes at `offset` (mmap, pre-faulted with MAP_POPULATE).

    No copy: writing it to another file moves each byte once (page cache -> page cache), like a byte
    copy. The mapping lives as long as the tensor (or a view of it); its pages count in RSS only
    meanwhile, so a caller that drops each tensor after use holds one tensor's pages at a time.
    """
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    region = mmap.mmap(fd, offset + nbytes - start, flags=flags, prot=mmap.PROT_READ, offset=start)
    with warnings.catch_warnings():  # read-only is intended: nothing writes to these tensors
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset - start)
    return raw.view(dtype).reshape(tuple(shape))


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, corrupt, or does not match the expected model."""


_FALLBACK_PIECE = 64 << 20  # bytes mapped at a time where the kernel cannot copy


def copy_file_bytes(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, nbytes: int, *, what: str) -> None:
    """Copy `nbytes` from `src_fd` at `src_offset` to `dst_fd` at `dst_offset` (file positions unchanged).

    In the kernel (os.copy_file_range: page cache to page cache, as `cp`'s sendfile; no byte enters this
    process, RSS does not grow). Where the kernel or file system refuses, part way or from the start (no
    copy_file_range, EXDEV across file systems, EINVAL, EOPNOTSUPP), the rest is memory-mapped and pwritten
    in pieces of at most 64 MiB. Thread-safe (no shared file position). Raises CheckpointError, naming
    `what`, when the source ends early.
    """
    done = 0
    try:
        while done < nbytes:
            n = os.copy_file_range(src_fd, dst_fd, nbytes - done, src_offset + done, dst_offset + done)
            if n <= 0:
                raise CheckpointError(f"{what}: source ended {nbytes - done} bytes early (truncated file?)")
            done += n
    except (AttributeError, OSError):  # no copy_file_range (not Linux), or EXDEV/EINVAL/ENOSYS/EOPNOTSUPP
        if os.fstat(src_fd).st_size < src_offset + nbytes:  # mapping past the end would SIGBUS
            raise CheckpointError(f"{what}: source ended {nbytes - done} bytes early (truncated file?)") from None
        while done < nbytes:
            piece = min(nbytes - done, _FALLBACK_PIECE)
            data = memoryview(map_file_tensor(src_fd, src_offset + done, (piece,), torch.uint8).numpy())
            wrote = 0
            while wrote < piece:
                wrote += os.pwrite(dst_fd, data[wrote:], dst_offset + done + wrote)
            del data  # unmap before the next piece
            done += piece


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a CPU tensor (bf16 and fp8 too, which numpy cannot hold)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def safetensors_header(
    path: str | os.PathLike[str], specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """(8-byte length + JSON header, padded, as the safetensors package writes it; each tensor's file offset)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate tensor names in {names}")
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset, offsets = 0, []
    for spec in specs:
        if spec.dtype not in DTYPE_TO_ST:
            raise ValueError(f"{path}: dtype {spec.dtype} of {spec.name} has no safetensors code")
        header[spec.name] = {
            "dtype": DTYPE_TO_ST[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offsets.append(offset)
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw, [8 + len(raw) + o for o in offsets]


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order of `specs`.

    The header (names, dtypes, shapes, offsets) is written at construction; each `write` must pass
    the next tensor with exactly its declared dtype and shape. `close` fails if any is missing.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        specs: Sequence[TensorSpec],
        metadata: dict[str, str] | None = None,
    ) -> None:
        head, _ = safetensors_header(path, specs, metadata)
        self.path = os.fspath(path)
        self._specs = list(specs)
        self._next = 0
        self._file: BinaryIO = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(head)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise ValueError(f"{self.path}: {name} written but all declared tensors are already written")
        spec = self._specs[self._next]
        if name != spec.name or tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{self.path}: expected {spec.name} {spec.dtype} {list(spec.shape)} next, got {name} "
                f"{tensor.dtype} {list(tensor.shape)}"
            )
        self._file.write(_tensor_bytes(tensor.cpu()))
        self._next += 1

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        if self._next != len(self._specs):
            missing = [s.name for s in self._specs[self._next :]]
            raise ValueError(f"{self.path}: closed with {len(missing)} tensor(s) unwritten: {missing[:4]}")

    def abort(self) -> None:
        """Close without the completeness check (the caller discards the file)."""
        self._file.close()

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class PositionalSafetensorsWriter:
    """A safetensors file whose tensors (or row ranges of them) may be written in any order, from several
    threads at once.

    The header is written at construction; `write` puts a tensor's bytes at its offset with pwrite
    (no shared file position). Writes into one file are serialized by the file system anyway (ext4 holds
    the inode lock through each buffered write) and threads waiting for it in the kernel spin on it,
    burning the CPU the writing thread needs (measured: 4 threads copying into one 2 GB file took ~4x
    the CPU of one); so the threads take turns on a lock here, where waiting costs nothing, while
    casting and the writes of other shard files still run in parallel. `close` fails naming any
    tensor never written.
    """

    def __init__(
        self, path: str | os.PathLike[str], specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None
    ) -> None:
        head, offsets = safetensors_header(path, specs, metadata)
        self.path = os.fspath(path)
        self._at = {s.name: (s, o) for s, o in zip(specs, offsets, strict=True)}
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one writer of this file at a time (see the class docstring)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, head, 0)
        if specs:  # size the file now, so a tensor written early lands before the end
            os.ftruncate(self._fd, offsets[-1] + specs[-1].nbytes)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the whole tensor `name` (thread-safe)."""
        spec = self._spec(name)
        if tuple(tensor.shape) != spec.shape:
            raise ValueError(f"{self.path}: {name} declared {spec.dtype} {list(spec.shape)}, got "
                             f"{tensor.dtype} {list(tensor.shape)}")
        self.write_rows(name, 0, tensor.reshape(-1) if not spec.shape else tensor)

    def write_rows(self, name: str, start: int, rows: torch.Tensor) -> None:
        """Write rows start:start+len(rows) (dim 0) of tensor `name` (thread-safe; each row once)."""
        spec = self._spec(name)
        n_rows = spec.shape[0] if spec.shape else 1
        trailing = spec.shape[1:] if spec.shape else ()
        fits = 0 <= start <= start + len(rows) <= n_rows
        if rows.dtype != spec.dtype or tuple(rows.shape[1:]) != trailing or not fits:
            raise ValueError(f"{self.path}: {name} declared {spec.dtype} {list(spec.shape)}, got rows {start}:"
                             f"{start + len(rows)} of {rows.dtype} {list(rows.shape)}")
        data = _tensor_bytes(rows.cpu())
        offset = self._at[name][1] + start * (spec.nbytes // n_rows if n_rows else 0)
        done = 0
        with self._write_lock:
            while done < len(data):
                done += os.pwrite(self._fd, data[done:], offset + done)
        with self._lock:
            self._rows[name] = self._rows.get(name, 0) + len(rows)

    def copy_rows(self, name: str, start: int, rows: int, src_fd: int, src_offset: int) -> None:
        """Write rows start:start+rows of `name` from the same bytes at `src_offset` of file `src_fd`, in the
        kernel where it can (`copy_file_bytes`; thread-safe)."""
        spec = self._spec(name)
        n_rows = spec.shape[0] if spec.shape else 1
        if not 0 <= start <= start + rows <= n_rows:
            raise ValueError(f"{self.path}: {name} declared {list(spec.shape)}, got rows {start}:{start + rows}")
        row_bytes = spec.nbytes // n_rows if n_rows else 0
        with self._write_lock:
            copy_file_bytes(src_fd, src_offset, self._fd, self._at[name][1] + start * row_bytes, rows * row_bytes,
                            what=f"{self.path}: {name}")
        with self._lock:
            self._rows[name] = self._rows.get(name, 0) + rows

    def _spec(self, name: str) -> TensorSpec:
        if name not in self._at:
            raise ValueError(f"{self.path}: {name} is not declared in its header")
        return self._at[name][0]

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        missing = [n for n, (s, _) in self._at.items() if self._rows.get(n, 0) != (s.shape[0] if s.shape else 1)]
        if missing:
            raise ValueError(f"{self.path}: closed with {len(missing)} tensor(s) unwritten: {missing[:4]}")

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SafetensorsFile:
    """Lazy reader: parses and validates the header on open, reads a tensor only on `get`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise CheckpointError(f"missing safetensors file {self.path}")
        try:
            size = os.path.getsize(self.path)
            self._file: BinaryIO = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read it ({e.strerror})") from e
        try:
            self.specs, self.metadata, self._offsets = self._parse_header(size)
        except Exception:
            self._file.close()
            raise
        self._fd = self._file.fileno()

    def _parse_header(self, size: int) -> tuple[dict[str, TensorSpec], dict[str, str], dict[str, int]]:
        head = self._file.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{self.path} is not a safetensors file ({size} bytes, truncated?)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(
                f"{self.path}: header claims {n} bytes but the file has {size} (truncated?)"
            )
        try:
            header = json.loads(self._file.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (a JSON {type(header).__name__}, "
                                  "not an object of tensors)")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (__metadata__ is not an object)")
        specs: dict[str, TensorSpec] = {}
        offsets: dict[str, int] = {}
        spans = []
        for name, info in header.items():
            try:
                dtype = ST_TO_DTYPE[info["dtype"]]
                start, end = info["data_offsets"]
                shape = tuple(info["shape"])
                if not all(type(v) is int and v >= 0 for v in (start, end, *shape)):  # no floats, bools, negatives
                    raise ValueError("offsets and shape must be non-negative integers")
                spec = TensorSpec(name, dtype, shape)
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{self.path}: bad header entry for {name}: {info}") from e
            if end - start != spec.nbytes:
                raise CheckpointError(
                    f"{self.path}: {name} spans {end - start} bytes, its shape needs {spec.nbytes}"
                )
            specs[name], offsets[name] = spec, 8 + n + start
            spans.append((start, end, name))
        position = 0
        for start, end, name in sorted(spans):
            if start != position:
                raise CheckpointError(f"{self.path}: data of {name} starts at {start}, expected {position}")
            position = end
        if 8 + n + position != size:
            raise CheckpointError(
                f"{self.path}: header describes {8 + n + position} bytes, file has {size} (truncated/corrupt)"
            )
        return specs, metadata, offsets

    def names(self) -> list[str]:
        return list(self.specs)

    def get(self, name: str) -> torch.Tensor:
        """Read tensor `name` into a new CPU tensor (no mmap; the only copy is the returned one)."""
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        return self.get_rows(name, 0, spec.shape[0] if spec.shape else 1)

    def _row_span(self, name: str, start: int, stop: int) -> tuple[TensorSpec, int]:
        """(spec of `name`, bytes per dim-0 row), after checking that rows start:stop exist."""
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.path} has no tensor {name!r}")
        rows = spec.shape[0] if spec.shape else 1
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"{self.path}: rows {start}:{stop} of {name} outside 0:{rows}")
        return spec, spec.nbytes // rows if rows else 0

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop (dim 0) of tensor `name` as a new CPU tensor; thread-safe (pread)."""
        spec, row_bytes = self._row_span(name, start, stop)
        out = torch.empty((stop - start, *spec.shape[1:]) if spec.shape else (), dtype=spec.dtype)
        want = (stop - start) * row_bytes
        if want:
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
            got = 0
            while got < want:  # pread may return less than asked for very large reads
                n = os.preadv(self._fd, [view[got:]], self._offsets[name] + start * row_bytes + got)
                if n <= 0:
                    break
                got += n
            if got != want:
                raise CheckpointError(f"{self.path}: short read of {name} ({got} of {want} bytes)")
        return out

    def byte_range(self, name: str, start: int, stop: int) -> tuple[int, int]:
        """(fd, file offset) of rows start:stop of tensor `name`: its raw little-endian bytes lie there contiguously,
        (stop - start) x bytes per row, for a caller to copy file to file in the kernel (`copy_file_bytes`)."""
        spec, row_bytes = self._row_span(name, start, stop)
        return self._fd, self._offsets[name] + start * row_bytes

    def map_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of tensor `name` as a read-only memory-mapped tensor (see map_file_tensor)."""
        spec, row_bytes = self._row_span(name, start, stop)
        shape = (stop - start, *spec.shape[1:]) if spec.shape else ()
        return map_file_tensor(self._fd, self._offsets[name] + start * row_bytes, shape, spec.dtype)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write in-memory tensors in one pass (no copy of their bytes: each is written from its own storage);
    a write error is the OSError of Python's file (ENOSPC stays recognisable), unlike safetensors' save_file."""
    items = list(tensors)
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in items]
    with StreamingSafetensorsWriter(path, specs, metadata) as w:
        for n, t in items:
            w.write(n, t)
