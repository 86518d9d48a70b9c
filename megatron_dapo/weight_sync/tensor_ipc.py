"""How a weight bucket crosses to SGLang's processes in 'tensor' mode (/update_weights_from_tensor).

The request body carries only handles (base64 of ForkingPickler bytes, SGLang's MultiprocessingSerializer
format); the bytes stay where they are:
- CUDA: the bucket stays on the trainer's GPU and travels as a CUDA IPC handle. The device index inside
  the handle is replaced by the GPU's UUID, which SGLang's `monkey_patch_torch_reductions` (applied before
  every deserialization, sglang/srt/utils/patch_torch.py) maps back to its own device index, since the
  server numbers GPUs by its own CUDA_VISIBLE_DEVICES. The server must see that GPU: colocated servers do.
  The bucket is copied into a private `torch.cuda.MemPool` (IpcBucketPool), not left in the trainer's
  allocator: the launchers set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, and a tensor in an
  expandable segment is shared by a POSIX file descriptor that the receiver imports with pidfd_getfd, which
  needs ptrace permission over the sender (refused under Yama ptrace_scope >= 1 between sibling processes
  and in containers without CAP_SYS_PTRACE: pytorch issue 165685, verl issue 3377). A private pool alone is
  not enough: older torch kept private pools out of expandable segments (CUDACachingAllocator alloc_block:
  "our checkpointing logic for private pools doesn't support the expandable_segments_ structure"), but a
  recent `MemPool()` without its own allocator "follows the default/current configuration of the
  CUDACachingAllocator" (torch 2.13's MemPool docstring), expandable segments included. So the pool's
  allocations are made with the setting switched off (`expandable_segments:False` for the duration of the
  allocation, the way torch's own Note [Expandable Segments] suggests for tensors shared across processes)
  and each new segment is checked in `torch.cuda.memory_snapshot()`: a pool block is then a plain cudaMalloc
  segment, shared with cudaIpcGetMemHandle like any pre-2.x torch tensor.
- CPU: the bucket is copied to shared memory (a file in /dev/shm, `file_system` sharing strategy) and
  travels as that file's name. Containers default to a 64 MB /dev/shm, so the free space is checked first.

Cost at the production setting (Qwen2.5-32B, 64 GiB of bf16 weights, 512 MiB buckets): on CUDA, the bucket
and its copy in the IPC pool (2 x 512 MiB; 2 x 1.5 GiB for the embedding, which gets its own bucket) of GPU
memory on each pushing rank while a bucket is being read, one device copy per bucket, no host copy;
the pool's cached segment is returned to the driver when the push ends (IpcBucketPool.release). On CPU, the
same bytes in /dev/shm.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from multiprocessing.reduction import ForkingPickler

import torch

SHM_DIR = "/dev/shm"
# Position of `storage_device` in torch.multiprocessing.reductions.rebuild_cuda_tensor's arguments (the
# same constant SGLang 0.5.23 patches: _REDUCE_TENSOR_ARG_DEVICE_INDEX).
CUDA_DEVICE_ARG = 6


def cuda_device_uuid(index: int) -> str:
    """The UUID of CUDA device `index` of this process, as SGLang's patch_torch compares it."""
    return str(torch.cuda.get_device_properties(index).uuid)


def reduce_tensor_by_uuid(tensor: torch.Tensor, uuid_of: Callable[[int], str] = cuda_device_uuid):
    """torch's tensor reduction, with a CUDA tensor's device index replaced by its GPU UUID."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        args = (*args[:CUDA_DEVICE_ARG], uuid_of(args[CUDA_DEVICE_ARG]), *args[CUDA_DEVICE_ARG + 1:])
    return rebuild, args


class _HandlePickler(ForkingPickler):
    """ForkingPickler (shared-memory / CUDA IPC tensor handles) whose CUDA handles name the GPU by UUID."""

    def __init__(self, file, uuid_of: Callable[[int], str]):
        import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler

        super().__init__(file)
        # ForkingPickler copies its dispatch table per instance: this changes only this pickler.
        self.dispatch_table[torch.Tensor] = lambda t: reduce_tensor_by_uuid(t, uuid_of)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]], *,
                            uuid_of: Callable[[int], str] = cuda_device_uuid) -> str:
    """SGLang's MultiprocessingSerializer format: base64 of ForkingPickler bytes of [(name, tensor)].

    CPU tensors must be in shared memory and this process must use
    torch.multiprocessing.set_sharing_strategy('file_system') (a file descriptor cannot cross over HTTP).
    Serialize once per receiving process (per server TP rank): each deserialization releases one
    reference of the producer-side CUDA IPC ref count.
    """
    buf = io.BytesIO()
    _HandlePickler(buf, uuid_of).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def bucket_device(flat_device: torch.device, *, cuda: bool,
                  current_cuda: Callable[[], int] = torch.cuda.current_device) -> torch.device:
    """Where a tensor-mode bucket lives while the servers read it: the GPU when CUDA is available (the
    bucket's own GPU, else this process's current one), otherwise the CPU (shared memory)."""
    if not cuda:
        return torch.device("cpu")
    if flat_device.type == "cuda":
        return flat_device
    return torch.device("cuda", current_cuda())


def check_shm_space(nbytes: int, shm_dir: str = SHM_DIR,
                    free_bytes: Callable[[str], int] = lambda p: shutil.disk_usage(p).free) -> None:
    """Raise (naming the flags to change) unless `shm_dir` has room for an `nbytes` bucket."""
    try:
        free = free_bytes(shm_dir)
    except OSError as e:
        raise RuntimeError(f"tensor-mode weight sync on CPU shares buckets through {shm_dir}, which is not "
                           f"usable ({e}); use --weight-sync-mode disk or distributed") from e
    if free < nbytes:
        raise RuntimeError(
            f"tensor-mode weight sync on CPU needs {nbytes / 2**20:.0f} MiB of {shm_dir} per bucket, only "
            f"{free / 2**20:.0f} MiB are free: lower --weight-sync-bucket-mb, use --weight-sync-mode disk "
            f"(or distributed), or give the container a larger /dev/shm (docker run's shm-size option)"
        )


def conf_value(conf: str, key: str) -> str | None:
    """The value of `key` in a caching-allocator config string ("k1:v1,k2:v2"), the last one when repeated;
    None when the string does not name it."""
    value = None
    for item in conf.split(","):
        name, sep, val = item.partition(":")
        if sep and name.strip() == key:
            value = val.strip()
    return value


def expandable_segments_on(last_settings: str | None, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the CUDA caching allocator puts new blocks in expandable segments now: the last settings string
    torch was given at run time (`last_settings`, torch._C._accelerator_getAllocatorSettings where the torch has
    it) when it names the key, else what torch read at start-up (PYTORCH_ALLOC_CONF, which newer torch reads
    first, then PYTORCH_CUDA_ALLOC_CONF). torch has no getter for the flag itself."""
    for conf in (last_settings, environ.get("PYTORCH_ALLOC_CONF"), environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        value = conf_value(conf or "", "expandable_segments")
        if value is not None:
            return value == "True"
    return False


def _last_allocator_settings() -> str | None:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch 2.13 has it; older may not
    return getter() if getter is not None else None


def _set_allocator_settings(conf: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # older torch: the (later deprecated) wrapper
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)


@contextlib.contextmanager
def expandable_segments_off() -> Iterator[None]:
    """New CUDA blocks in plain cudaMalloc segments while inside, the setting given back after (also on error);
    nothing is touched when expandable segments are off already. The setting is process-wide: another thread
    allocating meanwhile gets a plain segment too, which costs it nothing but fragmentation. Costs one settings
    parse each way (microseconds)."""
    if not expandable_segments_on(_last_allocator_settings()):
        yield
        return
    _set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        _set_allocator_settings("expandable_segments:True")


def segment_is_expandable(ptr: int) -> bool | None:
    """Whether the caching-allocator segment holding device pointer `ptr` is an expandable segment
    (torch.cuda.memory_snapshot's `is_expandable`); None when no segment holds it."""
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return bool(seg.get("is_expandable"))
    return None


class IpcBucketPool:
    """GPU memory for tensor-mode buckets that another process can open with a plain cudaIpcOpenMemHandle:
    a private torch.cuda.MemPool whose allocations are made with expandable segments switched off
    (`expandable_segments_off`; see the module docstring), made on the first CUDA allocation, so building one
    costs nothing on CPU. A bucket that grew the pool (a new segment) is checked in the allocator's snapshot
    and refused if expandable anyway, naming the way out, rather than failing in SGLang's import. One pool per
    push: `release()` at its end drops the pool and returns its cached segment (the largest bucket, up to
    1.5 GiB at 32B) before SGLang takes its KV cache back.

    `make_pool` / `use_pool`: torch.cuda.MemPool / torch.cuda.use_mem_pool; `non_expandable`: the context
    that switches expandable segments off; `reserved` / `is_expandable`: torch.cuda.memory_reserved /
    segment_is_expandable (all injected by CPU tests)."""

    def __init__(self, make_pool: Callable[[], object] | None = None,
                 use_pool: Callable[..., AbstractContextManager] | None = None,
                 non_expandable: Callable[[], AbstractContextManager] = expandable_segments_off,
                 reserved: Callable[[torch.device], int] | None = None,
                 is_expandable: Callable[[int], bool | None] = segment_is_expandable) -> None:
        self._make_pool = make_pool or torch.cuda.MemPool
        self._use_pool = use_pool or torch.cuda.use_mem_pool
        self._non_expandable = non_expandable
        self._reserved = reserved or torch.cuda.memory_reserved
        self._is_expandable = is_expandable
        self._pool: object | None = None

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D CUDA tensor allocated in the pool, in a segment that is not expandable."""
        if self._pool is None:
            self._pool = self._make_pool()
        before = self._reserved(device)
        with self._non_expandable(), self._use_pool(self._pool, device):
            t = torch.empty(numel, dtype=dtype, device=device)
        # Only a new segment needs a look (a snapshot lists every segment of the process: ~ms, once per growth).
        if self._reserved(device) != before and self._is_expandable(t.data_ptr()):
            raise RuntimeError(
                "tensor-mode weight sync: a bucket of the IPC pool landed in an expandable segment although "
                "expandable segments were switched off for it (this torch's private pools ignore the setting); "
                "SGLang could not open it without ptrace permission. Drop expandable_segments:True from "
                "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, or use --weight-sync-mode distributed")
        return t

    def release(self) -> None:
        """Drops the pool (its blocks go back to the driver once no tensor and no receiver holds them)."""
        if self._pool is None:
            return
        self._pool = None
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


def stage_bucket(flat: torch.Tensor, *, cuda: bool, shm_dir: str = SHM_DIR, pool: IpcBucketPool | None = None,
                 current_cuda: Callable[[], int] = torch.cuda.current_device) -> torch.Tensor:
    """`flat` where SGLang can map it: copied into `pool` on the GPU (CUDA IPC without pidfd_getfd), or into
    shared memory on CPU. `pool` is required on CUDA (the caller releases it when its push ends)."""
    device = bucket_device(flat.device, cuda=cuda, current_cuda=current_cuda)
    if device.type == "cuda":
        if pool is None:
            raise ValueError("stage_bucket: a CUDA bucket needs an IpcBucketPool (expandable segments cannot be "
                             "shared without ptrace permission)")
        staged = pool.empty(flat.numel(), flat.dtype, device)
        staged.copy_(flat.detach().reshape(-1))
        return staged
    check_shm_space(flat.numel() * flat.element_size(), shm_dir)
    return flat.detach().cpu().contiguous().share_memory_()
