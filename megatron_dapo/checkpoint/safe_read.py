"""Every read of a checkpoint's pickled parts, without running code that a crafted checkpoint carries.

A torch_dist checkpoint holds three kinds of pickle, and each is read here, never with a plain unpickler:

- `.metadata`, torch.distributed.checkpoint's index of the tensors and objects, which torch's own
  `FileSystemReader.read_metadata` reads with `pickle.load`: `read_metadata` admits exactly the classes torch
  writes there (`_metadata_classes`, plus the torch dtypes) and refuses the file at the first other one, before
  anything of it is built; it also refuses a record naming a file outside the checkpoint directory.
- `common.pt`, rank 0's common state (scheduler, step, the trainer's `extra`; in converter output Megatron-LM's
  args): `load_common`, `torch.load(weights_only=True)` with `argparse.Namespace` admitted.
- the ShardedObjects inside the `.distcp` files (each rank's RNG state, TransformerEngine's `_extra_state`, the
  distributed optimizer's param groups and bucket sizes, the layer implementation), which torch's
  `DefaultLoadPlanner.load_bytes` reads with `torch.load(weights_only=False)`: `load_object`, weights_only with
  the numpy types of an RNG state admitted; `check_extra_states` then refuses a TransformerEngine `_extra_state`
  holding bytes, which TE itself would unpickle with plain `pickle.loads`.

`load` is `dist_checkpointing.load` with strategies that read through these (`SafeTorchDistLoadStrategy`,
`SafeCommonLoadStrategy`), so megatron-core unpickles nothing itself. Every loader of this project goes through
this module: --load of converter output (checkpoint/dist_load.py), resume (checkpoint/training.py), the extra-state
detection (weights/extra_state.py), the verifier of a step without a manifest (checkpoint/manifest.py) and
`checkpoint_convert mcore-to-hf` (DistCheckpointReader). A refused file is an `UnsafeCheckpointError`: one line
naming the file and what it pickles. What this does and does not defend: docs/FAULT_TOLERANCE.md, "Checkpoints
from elsewhere".

Cost: the restricted unpickler is the C unpickler with `find_class` overridden, which runs once per distinct
class (pickle memoizes them: ~16 calls for a whole `.metadata`), so a read costs what `pickle.load` costs, plus
one pass over the storage records to check their file names (`read_metadata`); a ShardedObject costs the
pure-Python weights_only unpickler (`load_object`). Measured: docs/CHECKPOINTS.md, "Checkpoints from elsewhere".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import os
import pickle
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from megatron_dapo.errors import UserError
from megatron_dapo.weights.safetensors_io import CheckpointError

DCP_METADATA = ".metadata"
TRUST = "docs/FAULT_TOLERANCE.md, 'Checkpoints from elsewhere'"


class UnsafeCheckpointError(UserError, CheckpointError):
    """A checkpoint file pickles something no checkpoint of this project holds (a crafted or foreign file): refused
    before it is built. A UserError (one `error:` line) and a CheckpointError (what callers catch as a bad file)."""


def refuse(path: str | os.PathLike[str], what: str) -> UnsafeCheckpointError:
    """The error for file `path` holding `what`; printed by global rank 0 only (every rank reads the same file)."""
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return UnsafeCheckpointError(f"{path}: refused, it {what}, which no checkpoint written by this trainer or "
                                 f"checkpoint_convert holds (a crafted or foreign file; nothing of it was run); "
                                 f"give --load a checkpoint you trust ({TRUST})", echo=rank0)


# ---- .metadata: an allowlist of classes ------------------------------------------------------------------------

@functools.cache
def _metadata_classes() -> dict[tuple[str, str], Any]:
    """(module, name) -> object for every class torch 2.x's `Metadata` pickle refers to (as measured on converter
    output and training checkpoints of both optimizers: tests/unit/checkpoint/test_checkpoint_safe_read.py), torch.Size,
    the layout helper and the memory-format enum of TensorProperties, the path type of StorageMeta.checkpoint_id, the
    SavePlans megatron-core keeps in `all_local_plans`, and megatron-core's placeholders for older checkpoints."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata, planner

    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("pathlib", "PosixPath"): pathlib.PosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # how Python >= 3.13 pickles it
        ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
    }
    for module, names in (
        (metadata, ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                    "ChunkStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        (filesystem, ("_StorageInfo",)),
        (planner, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")),
    ):
        allowed.update({(module.__name__, name): getattr(module, name) for name in names if hasattr(module, name)})
    return allowed


_MEGATRON_PLACEHOLDERS = ("MCoreMetadata", "MCoreSavePlan")
"""Empty classes megatron-core keeps so that checkpoints of mcore <= 0.15 unpickle (strategies/torch.py)."""
_MEGATRON_TORCH_STRATEGY = "megatron.core.dist_checkpointing.strategies.torch"


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's C unpickler, resolving only the allowlisted classes and torch's dtypes; anything else raises
    _Refused before it is looked up (so no module is even imported for it)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _metadata_classes().get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == _MEGATRON_TORCH_STRATEGY and name in _MEGATRON_PLACEHOLDERS:
            import importlib

            return getattr(importlib.import_module(module), name)
        raise _Refused(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({str(pid)[:60]})")


class _Refused(pickle.UnpicklingError):
    """An unpickler met a global outside its allowlist (the message is the global's dotted name)."""


def read_metadata(directory: str | os.PathLike[str]) -> Any:
    """`directory/.metadata` as torch's `Metadata`, unpickled with only the classes torch writes there.

    Raises UnsafeCheckpointError for another class, or for a storage record whose file is not a plain name in
    `directory` (torch reads `directory / relative_path`: '../x' or '/x' would read a file outside it); a
    CheckpointError for a damaged file (truncated, not a pickle); FileNotFoundError when absent.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / DCP_METADATA
    with open(path, "rb") as f:
        try:
            found = _MetadataUnpickler(f).load()
        except _Refused as err:
            raise refuse(path, f"pickles {err}") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
            raise CheckpointError(f"{path} is corrupt: {type(err).__name__}: {err}") from err
    if not isinstance(found, Metadata):
        raise refuse(path, f"holds a {type(found).__name__}, not torch's checkpoint Metadata")
    _check_records(found, path)
    return found


def _check_records(md: Any, path: Path) -> None:
    """The index's tables have torch's types and every storage record names a plain file of the directory."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    if not isinstance(md.state_dict_metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata))
            for k, v in md.state_dict_metadata.items()):
        raise refuse(path, "holds a state_dict_metadata table of other types than torch's")
    for info in (md.storage_data or {}).values():
        name = getattr(info, "relative_path", None) if isinstance(info, _StorageInfo) else None
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise refuse(path, f"has a storage record naming {name!r}, not a file of its own directory")


# ---- common.pt and ShardedObjects: torch's weights_only unpickler ---------------------------------------------

COMMON_GLOBALS: list[Any] = [argparse.Namespace]
"""Classes common.pt may hold beyond weights_only's defaults (tensors, dtypes, containers): converter output's
Megatron-LM `args`. A training checkpoint's common state is plain (scheduler, step, `extra`, optimizer_layout)."""


def _object_globals() -> list[Any]:
    """What a ShardedObject may hold beyond weights_only's defaults: numpy's legacy RNG state
    ('MT19937', uint32[624], pos, has_gauss, cached_gaussian), saved per rank by the trainer. numpy >= 2 pickles
    its array helper as numpy._core.multiarray._reconstruct, 1.x as numpy.core.multiarray._reconstruct."""
    import numpy as np

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x (requirements: numpy>=1.26,<3)
        from numpy.core.multiarray import _reconstruct

    names = ("numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct")
    return [*((_reconstruct, n) for n in names), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _torch_load(f: str | os.PathLike[str] | BinaryIO, admitted: list[Any], where: str) -> Any:
    """torch.load(weights_only=True) of `f` with `admitted` classes. UnsafeCheckpointError naming the globals
    weights_only refused (listed from the pickle's opcodes, nothing run); CheckpointError when it refused the file
    for another reason (a damaged pickle)."""
    try:
        with torch.serialization.safe_globals(admitted):
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if hasattr(f, "seek"):
            f.seek(0)
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(f)
        except Exception:  # not a readable torch.save zip: take weights_only's own verdict
            found = re.findall(r"GLOBAL ([\w.]+)", str(err))[:1]
        allowed = {_dotted(a) for a in admitted}
        names = [n for n in found if n not in allowed]
        if not names:
            raise CheckpointError(f"{where} is corrupt: {str(err).splitlines()[0]}") from err
        raise refuse(where, f"pickles {', '.join(names[:3])}") from None


def _dotted(obj: Any) -> str:
    if isinstance(obj, tuple):
        return obj[1]
    return f"{obj.__module__}.{obj.__qualname__}"


def load_common(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """`directory/common.pt` (FileNotFoundError when absent), unpickled by weights_only with COMMON_GLOBALS.
    Cost: the file's size (~3 KB; up to ~0.7 GB with an --async-rollout batch at 32B), read by the caller's rank."""
    path = Path(directory) / "common.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    return _torch_load(path, COMMON_GLOBALS, str(path))


def load_object(data: io.BytesIO, where: str) -> Any:
    """One ShardedObject record (torch.save bytes) unpickled by weights_only with the RNG state's numpy types;
    `where` names the file and object in the error. A few KB per object (an RNG state: 5 KB)."""
    return _torch_load(data, _object_globals(), where)


def check_extra_states(loaded: Any, directory: str | os.PathLike[str]) -> None:
    """Refuse a loaded TransformerEngine `_extra_state` that holds bytes: TE (and megatron-core's TE wrapper)
    unpickle a non-empty one with plain `pickle.loads` when the model loads it (its FP8 scaling state); this trainer
    trains in bf16, where TE writes an empty tensor, and writes none. None and empty tensors pass."""
    for key, value in _leaves(loaded, ""):
        if not key.endswith("_extra_state") or value is None:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            continue
        held = f"{value.numel() * value.element_size()} bytes" if isinstance(value, torch.Tensor) \
            else f"a {type(value).__name__}"
        raise refuse(directory, f"holds {held} at {key.lstrip('.')} (FP8 scaling state, which TransformerEngine "
                                f"unpickles as code when the model loads it; this trainer trains in bf16 and writes "
                                f"an empty one)")


def _leaves(node: Any, prefix: str) -> Iterable[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}")
    else:
        yield prefix, node


# ---- dist_checkpointing.load through the above ---------------------------------------------------------------

@functools.cache
def _strategy_classes() -> tuple[type, type]:
    """(SafeTorchDistLoadStrategy, SafeCommonLoadStrategy): megatron-core's torch_dist and common load strategies
    reading through this module. Built on first use: the converter imports this module without megatron-core."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner, TorchDistLoadShardedStrategy
    from torch.distributed.checkpoint import FileSystemReader

    class SafeFileSystemReader(FileSystemReader):
        """torch's reader with `.metadata` read by `read_metadata` (once: megatron asks again after the load)."""

        def __init__(self, path: str | os.PathLike[str]) -> None:
            super().__init__(path)
            self._metadata = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if self._metadata is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                self._metadata = read_metadata(self.path)
                if getattr(self._metadata, "storage_meta", None) is None:
                    self._metadata.storage_meta = StorageMeta()
                self._metadata.storage_meta.load_id = self.load_id  # as torch's read_metadata does
            return self._metadata

    class SafeLoadPlanner(MCoreLoadPlanner):
        """megatron-core's planner; a ShardedObject's bytes go through `load_object`, not
        `torch.load(weights_only=False)` (torch's DefaultLoadPlanner.load_bytes, otherwise the same)."""

        def __init__(self, directory: str, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.directory = directory

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            from torch.distributed.checkpoint._traverse import set_element

            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            where = f"{self.directory}/{info.relative_path if info else '?'} (object {read_item.dest_index.fqn})"
            obj = load_object(value, where)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        """megatron-core's torch_dist load, run as it is with its reader and planner swapped for the two above: that
        method builds both itself from its module's `_get_filesystem_reader` and `MCoreLoadPlanner`, which name
        SafeFileSystemReader and SafeLoadPlanner for the duration of the call (one load at a time per process)."""

        def load(self, sharded_state_dict: Any, checkpoint_dir: Any) -> Any:
            from megatron.core.dist_checkpointing.strategies import torch as mtorch

            def reader(path: Any, cache_metadata: bool = False) -> SafeFileSystemReader:
                return SafeFileSystemReader(path)

            with _module_names(mtorch, _get_filesystem_reader=reader,
                               MCoreLoadPlanner=functools.partial(SafeLoadPlanner, str(checkpoint_dir))):
                return super().load(sharded_state_dict, checkpoint_dir)

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        """common.pt through `load_common` (megatron-core's own torch.load relies on torch's default weights_only,
        which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns off)."""

        def load_common(self, checkpoint_dir: Any) -> Any:
            return load_common(checkpoint_dir)

    return SafeTorchDistLoadStrategy, SafeCommonLoadStrategy


@contextlib.contextmanager
def _module_names(module: Any, **names: Any) -> Iterator[None]:
    """`module`'s attributes `names` set to the given objects while inside, given back after (also on error). Each
    must exist: a megatron-core that renamed one fails here, loudly, rather than reading through torch's pickle."""
    missing = [n for n in names if not hasattr(module, n)]
    if missing:
        raise RuntimeError(f"safe_read: {module.__name__} has no {missing}: this megatron-core's load path changed")
    saved = {n: getattr(module, n) for n in names}
    for n, obj in names.items():
        setattr(module, n, obj)
    try:
        yield
    finally:
        for n, obj in saved.items():
            setattr(module, n, obj)


def load(sharded_state_dict: Any, directory: str | os.PathLike[str], **kwargs: Any) -> Any:
    """`dist_checkpointing.load(sharded_state_dict, directory, **kwargs)` reading every pickle through this module.

    A refusal on any rank reaches every rank (torch gathers each rank's read errors) and is raised everywhere as
    UnsafeCheckpointError, printed by global rank 0. Cost: that of dist_checkpointing.load; each ShardedObject is
    unpickled by the pure-Python weights_only unpickler (a few KB each: 128 RNG states at 32B, one per rank)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    sharded, common = _strategy_classes()
    try:
        return dist_checkpointing.load(sharded_state_dict, str(directory), sharded_strategy=sharded(),
                                       common_strategy=common(), **kwargs)
    except CheckpointException as err:
        refused = [f[0] for f in err.failures.values() if isinstance(f[0], UnsafeCheckpointError)]
        if refused:
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            raise UnsafeCheckpointError(str(refused[0]), echo=rank0) from err
        raise
