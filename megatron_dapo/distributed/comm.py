"""Collectives that put each tensor on the device its group's backend works on.

NCCL groups take CUDA tensors only; gloo groups take CPU tensors (gloo's CUDA support is partial). Every
collective of the trainer goes through these wrappers (tests/unit/distributed/test_comm.py checks the package
statically; only the TP reductions of the logits in ops/ and actor/logprob.py, on tensors already on the model's device,
call torch directly): they pick the device from `dist.get_backend`,
copy the tensor there when it is elsewhere, run the collective and copy the result back in place, so a
caller never has to know which backend Megatron gave a group. CPU data (the rollout batch, the sampler
state) travels over gloo groups (`gloo_group`), which also carry their own timeout: the rollout wait
group of megatron_dapo/trainer/dataplane.py is made with `--rollout-timeout` hours while Megatron's NCCL groups
keep their 30-minute watchdog.

Cost: a CPU tensor reduced on an NCCL group pays one host->device and one device->host copy (the
trainer's metric reductions: <= 16 float64 values, microseconds); CUDA tensors on NCCL groups and CPU
tensors on gloo groups are not copied. Objects (`broadcast_object`, `all_gather_object`, `gather_object`,
`send_object`) travel as pickles in uint8 tensors through the same wrappers, so they go to the same device as
every other tensor of the group. On NCCL that is `torch.cuda.current_device()` (as for torch's own object
collectives), which megatron_dapo/actor/dist_init.py sets from LOCAL_RANK before the first collective.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup | None


def group_device(group: ProcessGroup = None) -> torch.device:
    """The device a collective on `group` needs its tensors on: cuda for an NCCL-only backend, else cpu.

    A mixed backend ("cpu:gloo,cuda:nccl", torch's default when no backend is named) takes CPU tensors over
    gloo, so CPU is returned and nothing is copied."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    if "nccl" in backend:
        if not torch.cuda.is_available():
            raise RuntimeError(f"process group backend {backend!r} needs CUDA, which is not available")
        return torch.device("cuda", torch.cuda.current_device())
    raise ValueError(f"unknown process group backend {backend!r}; expected gloo, nccl or mpi")


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _back(result: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    if result is not tensor:
        tensor.copy_(result)
    return tensor


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group: ProcessGroup = None) -> torch.Tensor:
    """In-place all-reduce of `tensor` (any device) over `group`; returns `tensor`."""
    work = _on(tensor, group_device(group))
    dist.all_reduce(work, op=op, group=group)
    return _back(work, tensor)


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup = None) -> torch.Tensor:
    """In-place broadcast of `tensor` from global rank `src` over `group`; returns `tensor`."""
    work = _on(tensor, group_device(group))
    dist.broadcast(work, src=src, group=group)
    return _back(work, tensor)


def broadcast_async(tensor: torch.Tensor, src: int, group: ProcessGroup = None) -> dist.Work:
    """Starts an in-place broadcast of `tensor` from global rank `src` over `group` (async_op=True) and returns its
    Work without waiting. `tensor` must already be on the group's device: copying the result back would wait for it.
    On NCCL the kernel runs on the group's own stream, and Work.is_completed() asks without blocking anything."""
    device = group_device(group)
    if tensor.device != device:
        raise ValueError(f"broadcast_async: the tensor is on {tensor.device}, the group works on {device}")
    return dist.broadcast(tensor, src=src, group=group, async_op=True)


def send(tensor: torch.Tensor, dst: int, group: ProcessGroup = None) -> None:
    """Point-to-point send to global rank `dst` over `group` (blocks until delivered)."""
    dist.send(_on(tensor, group_device(group)), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: ProcessGroup = None) -> torch.Tensor:
    """Receive into `tensor` from global rank `src` over `group`; waits up to the group's timeout."""
    work = _on(tensor, group_device(group))
    dist.recv(work, src=src, group=group)
    return _back(work, tensor)


def all_gather(tensor: torch.Tensor, group: ProcessGroup = None) -> list[torch.Tensor]:
    """Every rank's `tensor` (same shape on all ranks), in group-rank order, on `tensor`'s device."""
    work = _on(tensor, group_device(group))
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, work, group=group)
    return [t.to(tensor.device) for t in out]


def gather(tensor: torch.Tensor, dst: int, group: ProcessGroup = None) -> list[torch.Tensor] | None:
    """Every rank's `tensor` (same shape on all ranks) on global rank `dst`, in group-rank order, on `tensor`'s
    device; None on the other ranks."""
    work = _on(tensor, group_device(group))
    out = [torch.empty_like(work) for _ in range(dist.get_world_size(group))] if dist.get_rank() == dst else None
    dist.gather(work, out, dst=dst, group=group)
    return None if out is None else [t.to(tensor.device) for t in out]


def barrier(group: ProcessGroup = None) -> None:
    """Wait for every rank of `group` (a one-float all-reduce; waits up to the group's timeout).

    The host blocks until the all-reduce is done on every backend: on NCCL the result's copy back into the
    CPU tensor waits for it (a bare NCCL all-reduce would only order the CUDA streams)."""
    all_reduce(torch.zeros(1), group=group)


def status_barrier(what: str, *, failed: bool = False, group: ProcessGroup = None) -> None:
    """A barrier that carries whether this rank failed `what`: one int64 all-reduce (MIN) over `group` of this
    rank's global rank when `failed`, else the world size. Every rank waits for the slowest (up to the group's
    timeout). When a rank failed, every other rank raises RuntimeError "global rank <lowest failed> failed
    <what>; see its log"; a failed rank returns, to re-raise its own error."""
    world = dist.get_world_size()
    status = torch.tensor([dist.get_rank() if failed else world], dtype=torch.int64)
    first = int(all_reduce(status, op=dist.ReduceOp.MIN, group=group))
    if first < world and not failed:
        raise RuntimeError(f"global rank {first} failed {what}; see its log")


@contextmanager
def section(what: str, group: ProcessGroup = None) -> Iterator[None]:
    """Work some ranks of `group` do while the others wait (rank 0's part of a save, its evaluation): every rank
    runs the body, then `status_barrier`. A rank whose body raises reports it there and re-raises, so the waiting
    ranks raise at once, naming it, instead of waiting until the failed process is gone or the group times out."""
    try:
        yield
    except BaseException:
        status_barrier(what, failed=True, group=group)
        raise
    status_barrier(what, group=group)


def broadcast_object(obj, src: int, group: ProcessGroup = None):
    """Pickle `obj` on global rank `src`, return it on every rank of `group` (two broadcasts: size, bytes).

    For small control state (the sampler's state dict, a few hundred bytes); the rollout batch travels as
    tensors (megatron_dapo/trainer/dataplane.py)."""
    rank = dist.get_rank()
    payload = _pickled(obj) if rank == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast(size, src, group)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    broadcast(payload, src, group)
    return obj if rank == src else _unpickled(payload, payload.numel())


def gloo_group(ranks: list[int] | None = None, *, timeout: timedelta) -> ProcessGroup:
    """A gloo group over `ranks` (None: the whole world) whose collectives wait up to `timeout`.

    Collective: every rank of the world must call it with the same arguments, in the same order."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


def send_object(obj, dst: int, group: ProcessGroup = None) -> None:
    """Pickle `obj` and send it to global rank `dst` over `group` (two sends: size, bytes). Small control state."""
    payload = _pickled(obj)
    send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group)
    send(payload, dst, group)


def recv_object(src: int, group: ProcessGroup = None):
    """The object `send_object` sent from global rank `src` over `group`."""
    size = recv(torch.zeros(1, dtype=torch.int64), src, group)
    payload = recv(torch.empty(int(size), dtype=torch.uint8), src, group)
    return _unpickled(payload, payload.numel())


def _padded_payload(obj, group: ProcessGroup) -> tuple[torch.Tensor, list[int]]:
    """This rank's pickled `obj` zero-padded to the longest pickle of `group`, and every rank's pickle length
    in group-rank order (one all-gather of an int64 per rank; collective)."""
    payload = _pickled(obj)
    sizes = [int(s) for s in all_gather(torch.tensor([payload.numel()], dtype=torch.int64), group)]
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[: payload.numel()] = payload
    return padded, sizes


def all_gather_object(obj, group: ProcessGroup = None) -> list:
    """Every rank's `obj`, in group-rank order, on every rank of `group` (two all-gathers: pickle lengths, then
    the pickles padded to the longest). Small control state.

    Each rank receives world x longest-pickle bytes. Unlike torch's `all_gather_object` the result is returned
    rather than written into a list."""
    padded, sizes = _padded_payload(obj, group)
    return [_unpickled(t, n) for t, n in zip(all_gather(padded, group), sizes, strict=True)]


def gather_object(obj, dst: int, group: ProcessGroup = None) -> list | None:
    """Every rank's `obj` on global rank `dst`, in group-rank order; None on the other ranks (an all-gather of
    pickle lengths, then a gather of the pickles padded to the longest). Small control state.

    `dst` receives world x longest-pickle bytes; every rank waits for the slowest rank of `group` to arrive
    (the length all-gather), not only `dst`."""
    padded, sizes = _padded_payload(obj, group)
    chunks = gather(padded, dst, group)
    return None if chunks is None else [_unpickled(t, n) for t, n in zip(chunks, sizes, strict=True)]


def _pickled(obj) -> torch.Tensor:
    """`obj`'s pickle as a uint8 CPU tensor."""
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(payload: torch.Tensor, size: int):
    """The object pickled in the first `size` bytes of the uint8 CPU tensor `payload`."""
    return pickle.loads(payload[:size].numpy().tobytes())
