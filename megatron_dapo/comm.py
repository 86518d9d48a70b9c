"""Collectives that put each tensor on the device its group's backend works on.

NCCL groups take CUDA tensors only; gloo groups take CPU tensors (gloo's CUDA support is partial). Every
collective of the trainer goes through these wrappers: they pick the device from `dist.get_backend`,
copy the tensor there when it is elsewhere, run the collective and copy the result back in place, so a
caller never has to know which backend Megatron gave a group. CPU data (the rollout batch, the sampler
state) travels over gloo groups (`gloo_group`), which also carry their own timeout: the rollout wait
group of megatron_dapo/dataplane.py is made with `--rollout-timeout` hours while Megatron's NCCL groups
keep their 30-minute watchdog.

Cost: a CPU tensor reduced on an NCCL group pays one host->device and one device->host copy (the
trainer's metric reductions: <= 16 float64 values, microseconds); CUDA tensors on NCCL groups and CPU
tensors on gloo groups are not copied.
"""

from __future__ import annotations

import pickle
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


def barrier(group: ProcessGroup = None) -> None:
    """Wait for every rank of `group` (a zero-byte all-reduce; waits up to the group's timeout)."""
    all_reduce(torch.zeros(1), group=group)


def broadcast_object(obj, src: int, group: ProcessGroup = None):
    """Pickle `obj` on global rank `src`, return it on every rank of `group` (two broadcasts: size, bytes).

    For small control state (the sampler's state dict, a few hundred bytes); the rollout batch travels as
    tensors (megatron_dapo/dataplane.py)."""
    rank = dist.get_rank()
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if rank == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    broadcast(size, src, group)
    if payload is None:
        payload = torch.empty(int(size), dtype=torch.uint8)
    broadcast(payload, src, group)
    return obj if rank == src else pickle.loads(payload.numpy().tobytes())


def gloo_group(ranks: list[int] | None = None, *, timeout: timedelta) -> ProcessGroup:
    """A gloo group over `ranks` (None: the whole world) whose collectives wait up to `timeout`.

    Collective: every rank of the world must call it with the same arguments, in the same order."""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)


def send_object(obj, dst: int, group: ProcessGroup = None) -> None:
    """Pickle `obj` and send it to global rank `dst` over `group` (two sends: size, bytes). Small control state."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group)
    send(payload, dst, group)


def recv_object(src: int, group: ProcessGroup = None):
    """The object `send_object` sent from global rank `src` over `group`."""
    size = recv(torch.zeros(1, dtype=torch.int64), src, group)
    payload = recv(torch.empty(int(size), dtype=torch.uint8), src, group)
    return pickle.loads(payload.numpy().tobytes())
