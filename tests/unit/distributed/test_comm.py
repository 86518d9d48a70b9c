"""megatron_dapo/distributed/comm.py picks the device of a group's backend, and every collective of the trainer goes
through it (an NCCL group fed CPU tensors crashes at DP > 1; gloo tests cannot see it)."""

from __future__ import annotations

import ast
import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.distributed import comm
from tests.torchrun import REPO

COLLECTIVES = {"all_reduce", "broadcast", "broadcast_object_list", "all_gather", "all_gather_object",
               "all_gather_into_tensor", "scatter", "scatter_object_list", "gather", "gather_object", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "barrier", "monitored_barrier", "batch_isend_irecv"}
EXEMPT = {
    "megatron_dapo/distributed/comm.py": "the wrappers themselves",
    "megatron_dapo/ops/fused_linear.py": "TP all-reduce of d_hidden in the autograd backward, made on hidden's device",
    "megatron_dapo/ops/vocab_parallel.py": "TP all-reduces of row statistics of the logits (forward), on their device",
    "megatron_dapo/actor/logprob.py": "TP all-reduces of the entropy's max and sums (no_grad), made from the logits",
}
"""Modules allowed to call torch.distributed collectives directly, and why: their tensor-parallel reductions run
on tensors computed from the model's logits or hidden states, so already on the device the TP group works on
(CUDA under NCCL, CPU under gloo); comm would hand torch the very same tensor."""
ROUTED = sorted(str(p.relative_to(REPO)) for p in (REPO / "megatron_dapo").rglob("*.py")
                if str(p.relative_to(REPO)) not in EXEMPT)
"""Every other module of the package: the trainer, train.py, dataplane, checkpoint, validation, the weight push
paths (colocated_push, sync_group, sglang_engine, stage_sync), ..."""


DIST_MODULES = {"torch.distributed", "torch.distributed.distributed_c10d"}


def direct_collective_calls(source: str) -> list[str]:
    """`dist.X(...)` / `torch.distributed.X(...)` calls (any alias of torch.distributed) and
    `from torch.distributed import X` of a collective X, as 'line N: ...' strings."""
    tree = ast.parse(source)
    aliases = {"dist"} | {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                          for a in n.names if a.name == "torch.distributed"}
    aliases |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "torch"
                for a in n.names if a.name == "distributed"}
    direct = [f"line {n.lineno}: {ast.unparse(n.func)}" for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in COLLECTIVES
              and ast.unparse(n.func.value) in aliases | DIST_MODULES]
    imported = [f"line {n.lineno}: from {n.module} import {a.name}" for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom) and n.module in DIST_MODULES
                for a in n.names if a.name in COLLECTIVES]
    return direct + imported


@pytest.mark.parametrize("path", ROUTED)
def test_no_direct_collective_calls(path):
    """Static: these modules call no torch.distributed collective except through megatron_dapo.distributed.comm."""
    found = direct_collective_calls((REPO / path).read_text())
    assert not found, f"{path} bypasses megatron_dapo.distributed.comm: {found}"


def test_the_static_check_finds_each_spelling():
    """The checker itself: every way of calling a collective directly is found, comm's wrappers and
    same-named methods of other objects are not."""
    source = (
        "import torch\nimport torch.distributed as dist\nimport torch.distributed as tdist\n"
        "from torch import distributed as D\nfrom torch.distributed import barrier\n"
        "from megatron_dapo.distributed import comm\n"
        "dist.all_gather_object(a, b)\ntorch.distributed.broadcast(t, src=0)\ntdist.gather_object(o, l)\n"
        "D.barrier()\ntorch.distributed.distributed_c10d.all_reduce(t)\n"
        "comm.broadcast(t, 0)\nx.gather(1, i)\nasyncio.gather(f)\nconn.send(b)\ndist.new_group([0])\n")
    assert direct_collective_calls(source) == [
        "line 7: dist.all_gather_object", "line 8: torch.distributed.broadcast", "line 9: tdist.gather_object",
        "line 10: D.barrier", "line 11: torch.distributed.distributed_c10d.all_reduce",
        "line 5: from torch.distributed import barrier"]


def test_the_routed_modules_include_the_collective_callers():
    """The modules that once called collectives directly are among those checked (not exempted by a rename)."""
    assert {"megatron_dapo/checkpoint/training.py", "megatron_dapo/trainer/validation.py",
            "megatron_dapo/weight_sync/colocated_push.py", "megatron_dapo/weight_sync/sync_group.py",
            "megatron_dapo/rollout/sglang/engine.py", "megatron_dapo/trainer/loop.py",
            "megatron_dapo/trainer/dataplane.py"} <= set(ROUTED)
    assert all((REPO / path).is_file() for path in EXEMPT)


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


def test_object_wrappers_hand_the_collectives_tensors_on_the_group_device(monkeypatch):
    """gather, all_gather_object and gather_object on a fake group whose device is 'meta' (stands in for cuda):
    every tensor a collective is given (input and outputs) is on that device, and the objects come back.

    A world of one: the fake collectives hand back the CPU tensor that `_on` moved to meta (a meta tensor holds
    no data), in place of the meta outputs, as the real ones would fill them."""
    seen, sources = [], {}
    real_on = comm._on

    def recording_on(tensor, device):
        moved = real_on(tensor, device)
        sources[id(moved)] = tensor
        return moved

    def fake_all_gather(out, tensor, group=None):
        seen.append(("all_gather", tensor.device, *[t.device for t in out]))
        out[:] = [sources[id(tensor)].clone()]

    def fake_gather(tensor, gather_list=None, dst=None, group=None):
        seen.append(("gather", tensor.device, *[t.device for t in gather_list or []]))
        if gather_list is not None:
            gather_list[:] = [sources[id(tensor)].clone()]

    meta = torch.device("meta")
    monkeypatch.setattr(comm, "group_device", lambda group=None: meta)
    monkeypatch.setattr(comm, "_on", recording_on)
    monkeypatch.setattr(dist, "all_gather", fake_all_gather)
    monkeypatch.setattr(dist, "gather", fake_gather)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    group = object()

    assert comm.all_gather_object({"step": 3, "files": ["a"]}, group=group) == [{"step": 3, "files": ["a"]}]
    assert seen == [("all_gather", meta, meta)] * 2  # pickle lengths, then the padded pickles
    seen.clear()
    assert comm.gather_object("handle-0", 0, group=group) == ["handle-0"]
    assert seen == [("all_gather", meta, meta), ("gather", meta, meta)]
    seen.clear()
    assert comm.gather_object("handle-1", 5, group=group) is None  # this rank (0) is not dst: no output list
    assert seen == [("all_gather", meta, meta), ("gather", meta)]
    seen.clear()
    got = comm.gather(torch.arange(3.0), 0, group=group)
    assert [t.device for t in got] == [torch.device("cpu")] and got[0].tolist() == [0.0, 1.0, 2.0]
    assert seen == [("gather", meta, meta)]


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
    assert [t.tolist() for t in comm.gather(torch.tensor([5, 6]), 0, group=group)] == [[5, 6]]
    table = {"__0_0.distcp": {"size": 12, "crc32": "0a1b2c3d"}}
    assert comm.all_gather_object(table, group=group) == [table]
    assert comm.all_gather_object([], group=None) == [[]]  # the default group (gloo here)
    assert comm.gather_object("handle", 0, group=group) == ["handle"]
    comm.barrier(group)
    comm.barrier()


@pytest.mark.slow
def test_object_collectives_match_torch_over_three_gloo_ranks(tmp_path):
    """tests/dist/comm_objects.py (one launch, 3 ranks, ~10 s): comm's all_gather_object / gather_object give
    what torch.distributed's own give, for pickles of different sizes, on the world and on subgroups whose
    group ranks are not the global ones (dst is a global rank); gather of tensors; validation.share_verdict
    raises rank 0's error everywhere (echo only on rank 0) and nothing without one. comm.section and a checkpoint
    save whose rank-0 step fails, and a colocated push whose poster cannot reach its server: the other ranks raise
    naming the failed rank instead of waiting for it."""
    from tests.ports import free_port
    from tests.torchrun import run_torchrun

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the colocated poster's first call fails
    run_torchrun(REPO / "tests" / "dist" / "comm_objects.py", str(tmp_path), url, nproc=3, timeout=180)
    got = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)}
    objs = [{"rank": r, "payload": "x" * (100 * r), "list": list(range(r))} for r in range(3)]
    for r in range(3):
        assert got[r]["all_gather"] == got[r]["all_gather_torch"] == objs
        assert got[r]["gather_2"] == got[r]["gather_2_torch"] == (objs if r == 2 else None)
        assert got[r]["tensor_gather_0"] == ([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]] if r == 0 else None)
        assert got[r]["verdict_ok"] is None
        assert got[r]["verdict_error"] == f"--max-prompt-length 9 is too long echo={r == 0}"
    assert got[1]["section"] == "ValueError: rank 1's part failed"
    assert got[0]["section"] == got[2]["section"] == "RuntimeError: global rank 1 failed while testing; see its log"
    assert got[0]["save"].startswith(("FileExistsError", "NotADirectoryError"))
    tmp = tmp_path / "not_a_dir" / "step_0000001.tmp"
    for r in (1, 2):
        assert got[r]["save"] == f"RuntimeError: global rank 0 failed while preparing {tmp}; see its log"
    assert got[0]["push"].startswith("ConnectError")
    for r in (1, 2):
        assert got[r]["push"] == f"RuntimeError: global rank 0 failed starting a weight update of {url}; see its log"
    assert got[1]["sub_12_gather_2"] == got[1]["sub_12_gather_2_torch"] is None
    assert got[2]["sub_12_gather_2"] == got[2]["sub_12_gather_2_torch"] == objs[1:]
    assert "sub_12_gather_2" not in got[0] and "sub_02_all_gather" not in got[1]
    for r in (0, 2):
        assert got[r]["sub_02_all_gather"] == got[r]["sub_02_all_gather_torch"] == [objs[0], objs[2]]
