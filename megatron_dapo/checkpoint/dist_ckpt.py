"""Megatron-core dist checkpoints (torch_dist) of a registered model family, written and read without building one.

Layout written (Megatron-LM's, so `--load DIR` here and Megatron-LM's torch_dist loader
open it)::

    <dir>/latest_checkpointed_iteration.txt   "release"
    <dir>/release/metadata.json         {"sharded_backend": "torch_dist", ...}
    <dir>/release/common.pt             args (argparse.Namespace), iteration 0, hf_config
    <dir>/release/.metadata, __0_*.distcp  torch.distributed.checkpoint files

"release" (not `iter_0000000` + "0"): Megatron-LM's read_metadata asserts `iteration > 0 or release`, and
a release checkpoint is what it starts from at iteration 0 with a fresh optimizer and RNG.

A tensor is stored under its `mapping.dist_key` with its global (TP=1) shape, decoder layers stacked on a
leading axis (per-layer keys in a mixed dense / MoE model), an MoE layer's experts on a global expert axis;
megatron-core reshards at load, so one checkpoint serves every TP/PP/EP. Each tensor is a
list of chunks (global offset, shape, where its bytes lie in a file or a function producing them): a
writer thread copies a chunk's bytes file to file in the kernel into the record torch.save would write
(`record_template`), or produces it only when it reaches it, so memory holds at most one produced
chunk per writer thread, not the model. Training
checkpoints (`megatron_dapo.checkpoint.training`, `<save>/step_N/`) share the storage format; readers take the
model keys and ignore optimizer state.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.weights.safetensors_io import CheckpointError, copy_file_bytes, map_file_tensor

TRACKER_FILE = "latest_checkpointed_iteration.txt"
ITERATION_DIR = "release"
METADATA_JSON = "metadata.json"
COMMON_FILE = "common.pt"
DCP_METADATA = ".metadata"
TRAINING_LATEST = "latest"  # megatron_dapo.checkpoint.training's marker of the newest step_N
FORMAT = "megatron_dapo.dist_ckpt/1"
# megatron-core's CheckpointingConfig for torch_dist (dist_checkpointing/core.py), as metadata.json holds it
MEGATRON_CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}

Offset = tuple[int, ...]
Shape = tuple[int, ...]
Index = int | tuple[int, ...] | None
"""Leading indices of a stored tensor: a layer (stacked layers), (layer, expert), (expert,) or none."""


def _leading(index: Index) -> tuple[int, ...]:
    return () if index is None else (index,) if isinstance(index, int) else tuple(index)


@dataclass(frozen=True)
class Chunk:
    """One stored piece of a global tensor; `produce()` returns a contiguous tensor of `shape`.

    `source()`, when given, returns (fd, file offset) where the chunk's raw bytes (its dtype, little-endian,
    row-major) lie contiguously in a file this process holds open: the writer then copies them file to
    file in the kernel and never calls `produce`. `page_offset`, when given, is where in a 4 KiB page
    the copied bytes should start: the writer leaves a gap of up to 4 KiB before the record so they do
    (torch_dist readers read a record by its offset and length, so gaps between records are allowed).
    A kernel copy between offsets that differ modulo the page size costs ~1.4x the CPU of an aligned
    one (each destination page is assembled from two source pages).
    """

    offset: Offset
    shape: Shape
    produce: Callable[[], torch.Tensor]
    source: Callable[[], tuple[int, int]] | None = None
    page_offset: int | None = None


@dataclass
class LazyTensor:
    """A global tensor of a dist checkpoint as chunks whose data is produced on demand.

    Implements torch.distributed.checkpoint's `_Checkpointable` protocol (write items and chunk list
    from metadata alone); `_LazyPlanner.lookup_object` calls `produce` when a writer thread needs it.
    """

    shape: Shape
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)

    def __create_write_items__(self, fqn: str, _obj: object) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(c.offset), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)),
                    properties=TensorProperties(dtype=self.dtype),
                    size=torch.Size(self.shape),
                ),
            )
            for i, c in enumerate(self.chunks)
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(c.offset), sizes=torch.Size(c.shape)) for c in self.chunks]

    def chunk_at(self, index: Any) -> Chunk:
        """The chunk a write item's MetadataIndex names (by its position, checked against its offset)."""
        chunk = self.chunks[index.index] if index.index is not None else None
        if chunk is None or tuple(chunk.offset) != tuple(index.offset):
            chunk = next(c for c in self.chunks if tuple(c.offset) == tuple(index.offset))
        return chunk

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        chunk = self.chunk_at(index)
        tensor = chunk.produce()
        if tuple(tensor.shape) != chunk.shape or tensor.dtype != self.dtype:
            raise CheckpointError(
                f"{index.fqn} chunk at {list(chunk.offset)}: produced {tensor.dtype} {list(tensor.shape)}, "
                f"declared {self.dtype} {list(chunk.shape)}"
            )
        return tensor.contiguous()


def sharded_object_key(key: str, offset: Offset, shape: Shape) -> str:
    """The storage key of a megatron-core ShardedObject (its `unique_key`), without importing megatron.

    Importing megatron.core costs ~3-25 s and ~500 MB RSS (it compiles fusions and imports wandb); the
    converter needs none of it. tests/unit/checkpoint_convert/test_convert.py checks this equals megatron-core's own.
    """
    return f"{key}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}"


def serialized_object(value: Any) -> io.BytesIO:
    """A megatron-core ShardedObject's stored bytes (torch_dist keeps `[data]` torch.save'd)."""
    buf = io.BytesIO()
    torch.save([value], buf)
    return buf


class _SkipRecorder:
    """A sink for torch.save under skip_data: keeps the bytes written around each storage it leaves out (a
    relative seek past them) without materialising the skipped bytes (a BytesIO would zero-fill them)."""

    def __init__(self) -> None:
        self.parts: list[bytearray] = [bytearray()]
        self.skips: list[tuple[int, int]] = []  # (position, bytes) of each storage left out
        self.pos = 0

    def write(self, data: bytes | memoryview) -> int:
        self.parts[-1] += data
        self.pos += len(data)
        return len(data)

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if whence != io.SEEK_CUR:
            raise io.UnsupportedOperation("torch.save under skip_data only seeks past a storage")
        self.skips.append((self.pos, pos))
        self.pos += pos
        self.parts.append(bytearray())
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


_TEMPLATES: dict[tuple[Shape, torch.dtype], tuple[bytes, bytes]] = {}
_TEMPLATES_LOCK = threading.Lock()


def record_template(shape: Shape, dtype: torch.dtype) -> tuple[bytes, bytes]:
    """(bytes before, bytes after the raw tensor bytes) of torch.save(contiguous tensor of `shape`, `dtype`) with
    CRC32 records off, which is how `write_dist_checkpoint` stores a chunk (torch's FileSystemWriter too, but
    with CRC32 on: then only the CRC fields and the serialization id differ).

    torch.save of one tensor is a zip whose only data-dependent part is its storage record `data/0`; with
    CRC32 off, the rest (data.pkl, the record's local header padded to torch's storage alignment, the
    central directory, the serialization id) depends on shape and dtype alone. Made once per (shape,
    dtype) by torch.save itself under torch.serialization.skip_data (which writes everything but the
    storage bytes), so head + the tensor's bytes + tail is byte for byte what torch.save writes.
    ~1 KB each; a checkpoint has a few dozen distinct chunk shapes.
    """
    key = (tuple(shape), dtype)
    with _TEMPLATES_LOCK:
        found = _TEMPLATES.get(key)
    if found is None:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        buf = _SkipRecorder()
        crc = torch.serialization.get_crc32_options()  # torch's config is per thread
        torch.serialization.set_crc32_options(False)
        try:
            with torch.serialization.skip_data():
                torch.save(torch.empty(shape, dtype=dtype), buf)  # never touched: no page of it becomes resident
        finally:
            torch.serialization.set_crc32_options(crc)
        if len(buf.skips) != 1 or buf.skips[0][1] != nbytes:
            raise RuntimeError(f"torch.save under skip_data left out {buf.skips} (position, bytes), expected one "
                               f"storage of {nbytes} bytes: this torch version's format is not supported")
        found = (bytes(buf.parts[0]), bytes(buf.parts[1]))
        with _TEMPLATES_LOCK:
            _TEMPLATES[key] = found
    return found


PAGE = 4096


def _copy_record(f: io.BufferedWriter, chunk: Chunk, dtype: torch.dtype, what: str) -> int:
    """Append to `f` the record torch.save(chunk's tensor) writes (CRC32 off), the tensor bytes copied from
    `chunk.source()` in the kernel (copy_file_bytes): the chunk's bytes never enter this process. With
    `chunk.page_offset`, zero bytes before the record put the tensor bytes at that offset in a page.
    Returns the record's file offset."""
    fd, offset = chunk.source()
    head, tail = record_template(chunk.shape, dtype)
    if chunk.page_offset is not None:
        f.write(bytes((chunk.page_offset - f.tell() - len(head)) % PAGE))
    start = f.tell()
    f.write(head)
    f.flush()
    at = f.tell()
    nbytes = torch.Size(chunk.shape).numel() * dtype.itemsize
    copy_file_bytes(fd, offset, f.fileno(), at, nbytes, what=what)
    f.seek(at + nbytes)
    f.write(tail)
    return start


def _planner(cancelled: threading.Event):
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    class _LazyPlanner(DefaultSavePlanner):
        """Resolves LazyTensor chunks on demand; BytesIO values are stored as they are (megatron's way).

        Once `cancelled` is set (the main thread failed or got SIGTERM), writer threads stop at their next
        chunk instead of writing the rest of the checkpoint into a directory being removed.
        """

        def lookup_object(self, index: Any) -> Any:
            if cancelled.is_set():
                raise RuntimeError("checkpoint write cancelled")
            obj = self.state_dict[index.fqn]
            return obj.__get_tensor_shard__(index) if isinstance(obj, LazyTensor) else super().lookup_object(index)

        def lookup_source(self, index: Any) -> tuple[Chunk, torch.dtype] | None:
            """(chunk, dtype) when the chunk at `index` is copied from a file (`Chunk.source`), else None."""
            if cancelled.is_set():
                raise RuntimeError("checkpoint write cancelled")
            obj = self.state_dict[index.fqn]
            chunk = obj.chunk_at(index) if isinstance(obj, LazyTensor) else None
            return (chunk, obj.dtype) if chunk is not None and chunk.source is not None else None

        def transform_object(self, write_item: Any, obj: Any) -> Any:
            return obj if isinstance(obj, io.BytesIO) else super().transform_object(write_item, obj)

    return _LazyPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _assign_files(items: list[Any], files: int) -> list[list[Any]]:
    """Write items -> `files` lists, in plan order, each tensor to the list with the fewest bytes so far.

    Deterministic (the same checkpoint gives the same files) and balanced to within one chunk.
    """
    from torch.distributed.checkpoint.planner import WriteItemType

    buckets: list[list[Any]] = [[] for _ in range(files)]
    loads = [0] * files
    for n, item in enumerate(items):
        if item.type == WriteItemType.BYTE_IO:
            buckets[n % files].append(item)
            continue
        i = loads.index(min(loads))
        buckets[i].append(item)
        loads[i] += torch.Size(item.tensor_data.chunk.sizes).numel() * item.tensor_data.properties.dtype.itemsize
    return buckets


def _storage_writer(iter_dir: str, threads: int, cancelled: threading.Event):
    """A FileSystemWriter whose threads each hold one chunk at a time (torch's keeps chunks until a file ends).

    torch's own write loop keeps every written tensor of a file referenced (`tensor_dict`, for its
    safetensors format) and leaves each thread's freed buffers in its malloc arena; with memory-mapped
    chunks that is up to one chunk per tensor key per thread resident. Here `threads` threads (the
    calling one included) each write their own `.distcp` file, item by item. A chunk with a `source`
    is written as its torch.save record template around its bytes copied in the kernel (`_copy_record`:
    nothing resident); any other is produced, torch.save'd and dropped (unmapped) before the next: at
    most `threads` chunks are resident at any time. Each record is what torch's writer stores (a
    torch.save per chunk, CRC32 off; its offset and length in `.metadata`).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    class _Writer(dcp.FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            prefix = plan.storage_data.prefix
            buckets = [b for b in _assign_files(list(plan.items), self.thread_count) if b]

            failures: list[BaseException] = []  # in the order they happened: the first is the cause

            def write_file(i: int, items: list[Any]) -> list[Any]:
                name = f"{prefix}{i}{DEFAULT_SUFFIX}"
                results = []
                # No CRC32 per record: torch.load (how megatron-core reads torch_dist) does not check it, and
                # computing it costs as much as writing the bytes. torch's config is per thread: set it here.
                crc = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
                try:
                    with open(os.path.join(iter_dir, name), "wb") as f:
                        for item in items:
                            offset = f.tell()
                            copied = planner.lookup_source(item.index) if item.type != WriteItemType.BYTE_IO else None
                            if copied is not None:
                                offset = _copy_record(f, *copied, what=f"{name}: {item.index.fqn} "
                                                      f"{list(item.index.offset)}")
                            else:
                                data = planner.resolve_data(item)
                                if item.type == WriteItemType.BYTE_IO:
                                    f.write(data.getbuffer())
                                else:
                                    # serialized in memory, then one write: torch's writer to a file object can turn a
                                    # full disk into a RuntimeError without the errno; f.write keeps the OSError.
                                    # Costs one record (<= --chunk-mb) more per writer thread.
                                    record = io.BytesIO()
                                    torch.save(data, record)
                                    f.write(record.getbuffer())
                                    del record
                                del data  # unmap before the next chunk is produced
                            length = f.tell() - offset
                            results.append(WriteResult(item.index, length, _StorageInfo(name, offset, length)))
                        if self.sync_files:
                            f.flush()
                            os.fsync(f.fileno())
                except BaseException as e:
                    failures.append(e)
                    cancelled.set()  # the other threads stop at their next chunk
                    raise
                finally:
                    torch.serialization.set_crc32_options(crc)
                return results

            pool = ThreadPoolExecutor(max_workers=max(1, len(buckets) - 1))
            others = [pool.submit(write_file, i, b) for i, b in enumerate(buckets[1:], start=1)]
            try:
                results = write_file(0, buckets[0]) if buckets else []
            except BaseException as e:
                if failures[0] is e:  # this thread failed first (or got SIGTERM): unwind now, as torch's
                    pool.shutdown(wait=False)  # writer does; the others stop at their next chunk
                    raise
                results = []  # cancelled by another thread's failure: wait for all, raise that one
            futures.wait(others)
            pool.shutdown()
            if failures:
                raise failures[0]
            results += [r for future in others for r in future.result()]
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(results)
            return done

    return _Writer(iter_dir, thread_count=threads, sync_files=False)


def write_dist_checkpoint(
    iter_dir: str | os.PathLike[str],
    tensors: dict[str, LazyTensor],
    objects: dict[str, io.BytesIO],
    common: dict[str, Any],
    *,
    threads: int = 4,
) -> None:
    """Write one torch_dist iteration directory from a single process (no process group needed).

    `objects` maps ShardedObject unique keys to their serialized bytes. `threads` writer threads each
    fill their own `.distcp` file, one chunk at a time (`_storage_writer`). Chunks with a `source` (HF
    bytes, no dtype cast) are copied in the kernel: nothing resident, each byte moved once page cache
    to page cache, as `cp` does. Produced chunks (a cast) hold at most `threads` chunks resident, each with
    its serialized record. At Qwen2.5-32B (65.5 GB bf16, --chunk-mb 16, --threads 4: ~6.9k records) that is
    ~0 without a cast and 128 MiB with one; the time is a byte copy of 65.5 GB plus ~1 KB of record framing per chunk
    (no CRC32 is computed, in any writer thread).
    """
    import torch.distributed.checkpoint as dcp

    iter_dir = os.fspath(iter_dir)
    os.makedirs(iter_dir, exist_ok=True)
    state: dict[str, Any] = {**tensors, **objects}
    cancelled = threading.Event()
    writer = _storage_writer(iter_dir, threads, cancelled)
    try:
        dcp.save(state, storage_writer=writer, planner=_planner(cancelled), no_dist=True)
    except dcp.api.CheckpointException as e:
        # DCP wraps what failed (a missing shard, a full disk) in a BaseException; raise the cause itself
        raise next(exc for exc, _ in e.failures.values()) from e
    except BaseException:
        cancelled.set()
        raise
    torch.save(common, os.path.join(iter_dir, COMMON_FILE))
    with open(os.path.join(iter_dir, METADATA_JSON), "w") as f:
        json.dump(MEGATRON_CONFIG, f)  # last: megatron treats a directory without it as incomplete


def write_tracker(ckpt_dir: str | os.PathLike[str]) -> None:
    with open(os.path.join(os.fspath(ckpt_dir), TRACKER_FILE), "w") as f:
        f.write(ITERATION_DIR)


def resolve_iteration_dir(path: str | os.PathLike[str], *, flag: str = "--load") -> Path:
    """The directory holding `.metadata` for any checkpoint path of this project.

    Accepts a Megatron-LM root (`latest_checkpointed_iteration.txt` -> `iter_%07d` or `release`), a
    training run's --save root (`latest` -> `step_%07d`), or an iteration/step directory itself.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{flag} {root} is not a directory")
    if (root / DCP_METADATA).is_file():
        return root
    tracker = root / TRACKER_FILE
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise CheckpointError(f"{tracker} holds {text!r}; expected an iteration number or 'release'")
        found = root / ("release" if text == "release" else f"iter_{int(text):07d}")
    elif (root / TRAINING_LATEST).is_file() or any(root.glob("step_*")):
        from megatron_dapo.checkpoint.training import candidate_step_dirs

        # newest step with its torch_dist metadata (`--load` also verifies the manifest; this reads weights only)
        found = next((p for p in candidate_step_dirs(root) if (p / DCP_METADATA).is_file()), None)
        if found is None:
            raise CheckpointError(f"{flag} {root} holds no complete step_N checkpoint")
    elif (root / "args.json").is_file():
        raise CheckpointError(
            f"{flag} {root} is in the per-rank safetensors format of checkpoint_convert before torch_dist, "
            "which is no longer read: convert the HF model again with `python -m checkpoint_convert hf-to-mcore`"
        )
    else:
        raise CheckpointError(
            f"{flag} {root} is not a megatron-core dist checkpoint: no {DCP_METADATA}, {TRACKER_FILE} or "
            f"{TRAINING_LATEST} in it"
        )
    if not (found / DCP_METADATA).is_file():
        raise CheckpointError(f"{found} has no {DCP_METADATA}: the checkpoint is incomplete or not torch_dist")
    return found


def load_common(iter_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """common.pt of an iteration directory ({} when absent); Megatron-LM stores `args` as a Namespace. Read by
    weights_only (safe_read.load_common): a class no checkpoint of this project holds is an UnsafeCheckpointError."""
    from megatron_dapo.checkpoint import safe_read

    if not (Path(iter_dir) / COMMON_FILE).is_file():
        return {}
    return safe_read.load_common(iter_dir)


class DistCheckpointReader:
    """Random access to the tensors of a torch_dist checkpoint: metadata parsed once, chunks read on demand.

    Reading a layer slice touches only the chunks that overlap it (one per TP shard of that layer in a
    training checkpoint, exactly one in converter output), so memory is one layer's tensor.
    """

    def __init__(self, path: str | os.PathLike[str], *, flag: str = "--load") -> None:
        from megatron_dapo.checkpoint import safe_read

        self.dir = resolve_iteration_dir(path, flag=flag)
        self.metadata = safe_read.read_metadata(self.dir)  # CheckpointError when corrupt, UnsafeCheckpointError
        self.tensors = {
            k: md for k, md in self.metadata.state_dict_metadata.items() if hasattr(md, "chunks")
        }
        self.common = load_common(self.dir)
        self._fds: dict[str, int] = {}
        self._starts: dict[tuple[str, int], int | None] = {}
        self._by_index: dict[tuple[str, int], dict[tuple[int, ...], list[Any]]] = {}
        self._lock = threading.Lock()

    def shape(self, key: str) -> Shape:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def _fd(self, relative_path: str) -> int:
        with self._lock:  # reader threads share one fd per file (pread / mmap need no file position)
            fd = self._fds.get(relative_path)
            if fd is None:
                fd = self._fds[relative_path] = os.open(self.dir / relative_path, os.O_RDONLY)
            return fd

    def _record_start(self, key: str, offsets: Offset, sizes: Shape) -> tuple[int, int | None]:
        """(fd, file offset of the chunk's raw tensor bytes, or None when not a plain record: see `_map_chunk`)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.metadata.storage_data[MetadataIndex(key, torch.Size(offsets))]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{key}: stored with transforms {info.transform_descriptors}, not supported")
        fd = self._fd(info.relative_path)
        where = (info.relative_path, info.offset)
        with self._lock:
            if where in self._starts:
                return fd, self._starts[where]
        dtype = self.tensors[key].properties.dtype
        nbytes = torch.Size(sizes).numel() * dtype.itemsize
        head, tail = record_template(tuple(sizes), dtype)  # converter output: one pread instead of a zip parse
        if info.length == len(head) + nbytes + len(tail) and os.pread(fd, len(head), info.offset) == head:
            start = info.offset + len(head)
        else:  # e.g. a training checkpoint's records (CRC32 on)
            start = _zip_record_start(fd, info.offset, info.length, nbytes)
        with self._lock:
            self._starts[where] = start
        return fd, start

    def _map_chunk(
        self, key: str, offsets: Offset, sizes: Shape, axis: int = 0, skip: int = 0, rows: int | None = None
    ) -> torch.Tensor:
        """A stored chunk, or `rows` of it along `axis` from `skip` (axes before `axis` must have size 1).

        Fast path: a read-only memory-mapped tensor over just those bytes (no copy). torch_dist stores a
        chunk as a torch.save zip of uncompressed records; its bytes are the record `<archive>/data/0`,
        found through the zip's central directory. Anything else falls back to torch.load of the record.
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex

        dtype = self.tensors[key].properties.dtype
        rows = sizes[axis] - skip if rows is None else rows
        shape = (*sizes[:axis], rows, *sizes[axis + 1 :])
        fd, start = self._record_start(key, offsets, sizes)
        if start is not None:
            return map_file_tensor(fd, start + skip * dtype.itemsize * torch.Size(sizes[axis + 1 :]).numel(), shape,
                                   dtype)
        info = self.metadata.storage_data[MetadataIndex(key, torch.Size(offsets))]
        buf = bytearray(info.length)
        _pread_exact(fd, memoryview(buf), info.offset, self.dir / info.relative_path)
        whole = torch.load(io.BytesIO(buf), map_location="cpu", weights_only=True).reshape(sizes)
        return whole.narrow(axis, skip, rows)

    def _locate(self, key: str, index: Index, rows: tuple[int, int] | None) -> tuple[
        list[tuple[int, int]], int, list[Any], Any
    ]:
        """(region per axis, the row axis, the stored chunks overlapping the region, the one chunk holding the
        region as a contiguous byte range, or None)."""
        if key not in self.tensors:
            raise CheckpointError(f"{self.dir} has no tensor {key!r}")
        md = self.tensors[key]
        lead = _leading(index)
        if len(lead) >= len(md.size):
            raise CheckpointError(f"{key} has {len(md.size)} axes; indices {list(lead)} leave no row axis")
        region = [(0, n) for n in md.size]
        for axis, i in enumerate(lead):
            region[axis] = (i, i + 1)
        row_axis = len(lead)
        if rows is not None:
            region[row_axis] = rows
        candidates = md.chunks if not lead else self._chunks_at(key, lead)
        pieces = [
            c for c in candidates
            if all(o < hi and o + n > lo for o, n, (lo, hi) in zip(c.offsets, c.sizes, region, strict=True))
        ]
        inside = [
            c for c in pieces
            if all(o <= lo and hi <= o + n for o, n, (lo, hi) in zip(c.offsets, c.sizes, region, strict=True))
        ]
        contiguous = inside and all(  # the region only narrows the row axis, axes before it have size 1
            (i == row_axis) or (i < row_axis and n == 1) or (i > row_axis and (lo, hi) == (o, o + n))
            for i, (o, n, (lo, hi)) in enumerate(zip(inside[0].offsets, inside[0].sizes, region, strict=True))
        )
        return region, row_axis, pieces, inside[0] if contiguous else None

    def _chunks_at(self, key: str, lead: tuple[int, ...]) -> list[Any]:
        """Stored chunks of `key` covering leading indices `lead` (a layer; (layer, expert) of a stacked expert
        tensor; (expert,) of a per-layer one): a lookup scans those chunks only, not the key's all (at
        Qwen3-30B-A3B a stacked expert key holds 48 x 128 x 2 chunks)."""
        with self._lock:
            found = self._by_index.get((key, len(lead)))
        if found is None:
            found = {}
            for c in self.tensors[key].chunks:
                spans = [range(o, o + n) for o, n in zip(c.offsets[: len(lead)], c.sizes[: len(lead)], strict=True)]
                for at in itertools.product(*spans):
                    found.setdefault(at, []).append(c)
            with self._lock:
                self._by_index[(key, len(lead))] = found
        return found.get(lead, [])

    def byte_range(
        self, key: str, layer: Index = None, rows: tuple[int, int] | None = None
    ) -> tuple[int, int] | None:
        """(fd, file offset) where the bytes of `read(key, layer, rows)` lie contiguously in one stored record,
        or None (the request spans chunks, or the record is not a plain torch.save): lets a caller copy them
        file to file in the kernel (os.copy_file_range), without mapping or reading them."""
        region, row_axis, _, whole = self._locate(key, layer, rows)
        if whole is None:
            return None
        fd, start = self._record_start(key, tuple(whole.offsets), tuple(whole.sizes))
        if start is None:
            return None
        row_bytes = self.tensors[key].properties.dtype.itemsize * torch.Size(whole.sizes[row_axis + 1 :]).numel()
        return fd, start + (region[row_axis][0] - whole.offsets[row_axis]) * row_bytes

    def read(self, key: str, layer: Index = None, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The global tensor `key`, or its `layer` slice (without the layer axis), or rows lo:hi of that.

        `layer` may be a tuple of leading indices: (layer, expert) of a stacked expert tensor [L, E, rows, ...],
        (expert,) of a per-layer one [E, rows, ...]; the rows are the axis after them. Reads only the stored
        chunks overlapping the request; when one chunk holds it (converter output always, training checkpoints
        at TP=1 / expert-TP 1), the result is a memory-mapped view of just those bytes.
        """
        region, row_axis, pieces, whole = self._locate(key, layer, rows)
        if whole is not None:
            lo, hi = region[row_axis]
            c = whole
            out = self._map_chunk(key, tuple(c.offsets), tuple(c.sizes), row_axis, lo - c.offsets[row_axis], hi - lo)
        else:
            out = torch.empty(tuple(hi - lo for lo, hi in region), dtype=self.tensors[key].properties.dtype)
            for c in pieces:
                data = self._map_chunk(key, tuple(c.offsets), tuple(c.sizes))
                spans = list(zip(c.offsets, c.sizes, region, strict=True))
                src = tuple(slice(max(lo, o) - o, min(hi, o + n) - o) for o, n, (lo, hi) in spans)
                dst = tuple(slice(max(lo, o) - lo, min(hi, o + n) - lo) for o, n, (lo, hi) in spans)
                out[dst] = data.reshape(tuple(c.sizes))[src]
        return out[(0,) * len(_leading(layer))]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> DistCheckpointReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _Window(io.RawIOBase):
    """A read-only file-like view of bytes [offset, offset + length) of fd (for zipfile), via pread."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n < 0 else min(n, self.length - self.pos)
        data = os.pread(self.fd, max(n, 0), self.offset + self.pos)
        self.pos += len(data)
        return data


def _zip_record_start(fd: int, offset: int, length: int, nbytes: int) -> int | None:
    """File offset of the tensor bytes inside a torch.save zip stored at [offset, offset+length), or None
    unless it holds exactly one uncompressed `data/0` record of `nbytes` bytes, little-endian."""
    import struct
    import zipfile

    try:
        with zipfile.ZipFile(_Window(fd, offset, length)) as z:
            infos = z.infolist()
    except zipfile.BadZipFile:
        return None
    records = [i for i in infos if "/data/" in i.filename and not i.filename.endswith(".pkl")]
    order = [i for i in infos if i.filename.endswith("/byteorder")]
    if len(records) != 1 or not records[0].filename.endswith("/data/0") or records[0].compress_type != 0:
        return None
    if records[0].file_size != nbytes:
        return None

    def data_start(info: zipfile.ZipInfo) -> int | None:
        header = os.pread(fd, 30, offset + info.header_offset)  # CRCs may be 0: never read via zipfile
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return offset + info.header_offset + 30 + name_len + extra_len

    if order:
        at = data_start(order[0])
        if at is None or os.pread(fd, order[0].file_size, at) != b"little":
            return None
    return data_start(records[0])


def _pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CheckpointError(f"{path}: short read at byte {offset + got} (truncated checkpoint?)")
        got += n
