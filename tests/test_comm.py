"""megatron_dapo/comm.py picks the device of a group's backend, and every collective of the trainer goes
through it (an NCCL group fed CPU tensors crashes at DP > 1; gloo tests cannot see it)."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_dapo import comm

REPO = Path(__file__).resolve().parent.parent
COLLECTIVES = {"all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
               "all_gather_into_tensor", "scatter", "scatter_object_list", "gather", "gather_object", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "barrier", "monitored_barrier", "batch_isend_irecv"}
ROUTED = ["megatron_dapo/trainer.py", "megatron_dapo/train.py", "megatron_dapo/collect.py",
          "megatron_dapo/dataplane.py", "megatron_dapo/actor/actor.py", "megatron_dapo/weights/export.py"]


@pytest.mark.parametrize("path", ROUTED)
def test_no_direct_collective_calls(path):
    """Static: these modules call no torch.distributed collective except through megatron_dapo.comm."""
    tree = ast.parse((REPO / path).read_text())
    direct = [f"line {n.lineno}: dist.{n.func.attr}" for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in COLLECTIVES
              and isinstance(n.func.value, ast.Name) and n.func.value.id in {"dist", "torch.distributed"}]
    imported = [f"line {n.lineno}: from torch.distributed import {a.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module == "torch.distributed"
                for a in n.names if a.name in COLLECTIVES]
    assert not direct + imported, f"{path} bypasses megatron_dapo.comm: {direct + imported}"


@pytest.mark.parametrize("backend, device", [
    ("gloo", "cpu"), ("nccl", "cuda:3"), ("cpu:gloo,cuda:nccl", "cpu"), ("NCCL", "cuda:3"), ("mpi", "cpu"),
])
def test_group_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.group_device(object()) == torch.device(device)


def test_group_device_errors(monkeypatch):
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA"):
        comm.group_device(None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "ucc")
    with pytest.raises(ValueError, match="unknown process group backend 'ucc'"):
        comm.group_device(None)


def test_wrappers_hand_the_collective_a_tensor_on_the_group_device(monkeypatch):
    """A fake group whose device is 'meta' (stands in for cuda): the collective sees the moved tensor, and
    the result lands back in the caller's CPU tensor."""
    seen = []

    def fake_all_reduce(t, op=None, group=None):
        seen.append(t.device)

    monkeypatch.setattr(comm, "group_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(comm, "_back", lambda result, tensor: seen.append(("back", result.device)) or tensor)
    x = torch.ones(3)
    assert comm.all_reduce(x, group=object()) is x
    assert seen == [torch.device("meta"), ("back", torch.device("meta"))]


def test_single_rank_gloo_roundtrip():
    """A world of one over gloo: the wrappers run the real collectives (CPU tensors, no copies)."""
    from megatron_dapo.actor.dist_init import _init_process_group

    _init_process_group(1)
    assert comm.group_device(None) == torch.device("cpu")
    group = comm.gloo_group(None, timeout=timedelta(seconds=30))
    x = torch.arange(4, dtype=torch.float64)
    assert comm.all_reduce(x, group=group) is x and x.tolist() == [0, 1, 2, 3]
    assert comm.broadcast_object({"epoch": 2, "order": [3, 1]}, 0, group=group) == {"epoch": 2, "order": [3, 1]}
    assert [t.tolist() for t in comm.all_gather(torch.tensor([7]), group=group)] == [[7]]
    comm.barrier(group)
