"""The trainer's side of the weight-sync group under torchrun: rank 0 must host the TCP store itself.

torchrun sets TORCHELASTIC_USE_AGENT_STORE=True, under which dist.rendezvous on rank 0 only connects as a client
to the agent's store; at the sync port nobody hosts one and the first weight sync of a torchrun-launched trainer
waited for ever (found by the multi-node rehearsal). The peer here joins the way SGLang 0.5.23's
init_custom_process_group does (tcp:// rendezvous, store prefixed by the group name) and must receive the
broadcast tensors.

Both ends destroy the group and drop it before they exit, as the trainer and SGLang do at shutdown
(SGLangEngine.shutdown -> /destroy_weights_update_group). Issue 24: the peer exited with the group alive and
aborted 1 run in 30 under load ("terminate called without an active exception", exit -6). A gloo worker can
still hold the last collective's work, and with it the tensor, after wait() returns; if the interpreter is
finalizing when the worker drops it, freeing the tensor's Python object takes the GIL, which ends that thread
inside a noexcept C++ frame. destroy_process_group alone does not end the worker threads (they end with the
group object), so the peer also drops its last reference.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from megatron_dapo.weight_sync.sync_group import broadcast_tensors, init_weight_sync_group
from tests.torchrun import REPO, free_port, subprocess_env

PEER = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world
    port, name = int(sys.argv[1]), sys.argv[2]
    threads = len(os.listdir("/proc/self/task"))
    store, rank, world = next(dist.rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timedelta(seconds=60)))
    store = dist.PrefixStore(name, store)
    group, _ = _new_process_group_helper(world, rank, [], dist.Backend("gloo"), store, group_name=name,
                                         timeout=timedelta(seconds=60))
    _world.pg_group_ranks[group] = {i: i for i in range(world)}
    t = torch.zeros(3)
    dist.broadcast(t, src=0, group=group)
    dist.destroy_process_group(group)  # unregisters it; its worker threads end with the object, here and not at exit
    del group, store
    print(t.tolist(), len(os.listdir("/proc/self/task")) - threads)
""")


def _broadcast_to_peer(form_group, name: str, values: list[float], env: dict) -> tuple[int, str, str]:
    """Starts PEER (the SGLang-side member), forms the group here with `form_group(port, name)`, broadcasts `values`
    and ends the group; returns the peer's (exit code, stdout, stderr)."""
    port = free_port()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port), name], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    group = None
    try:
        group = form_group(port, name)
        assert group is not None
        broadcast_tensors(group, [torch.tensor(values)])
        out, err = peer.communicate(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
        if group is not None:
            torch.distributed.destroy_process_group(group)
    return peer.returncode, out, err


def test_sync_group_forms_under_torchrun_agent_store_env(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # what torchrun sets in every rank
    env = {k: v for k, v in subprocess_env().items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    code, out, err = _broadcast_to_peer(
        lambda port, name: init_weight_sync_group(master_address="127.0.0.1", master_port=port, world_size=2,
                                                  group_name=name, backend="gloo", timeout_s=60),
        "megatron_dapo_weight_sync_test_agent_store", [1.0, 2.0, 3.0], env)
    assert code == 0, err[-2000:]
    assert out.strip() == "[1.0, 2.0, 3.0] 0"  # the tensors arrived; no gloo thread left running at exit


def test_joining_gives_up_when_a_member_is_gone_and_forms_the_group_otherwise():
    """A server lost before its stage's group forms never joins: rank 0's rendezvous would wait out the group's
    timeout (300 s: CI once saw a per-stage push held that long). join_weight_sync_group stops at the first sign that
    a member's /init_weights_update_group call failed (`gone`), leaving the rendezvous to its thread."""
    import threading

    from megatron_dapo.weight_sync.sync_group import join_weight_sync_group

    calls = []

    def gone() -> bool:
        calls.append(1)
        return len(calls) >= 3

    group = join_weight_sync_group(master_address="127.0.0.1", master_port=free_port(), world_size=2,
                                   group_name="megatron_dapo_weight_sync_test_gone", backend="gloo", timeout_s=30,
                                   gone=gone)
    assert group is None and len(calls) == 3  # given up at the first True
    assert any(t.name == "weight-sync-group" and t.is_alive() for t in threading.enumerate())  # still waiting

    code, out, err = _broadcast_to_peer(
        lambda port, name: join_weight_sync_group(master_address="127.0.0.1", master_port=port, world_size=2,
                                                  group_name=name, backend="gloo", timeout_s=60, gone=lambda: False),
        "megatron_dapo_weight_sync_test_join", [4.0, 5.0, 6.0], subprocess_env())
    assert code == 0, err[-2000:]
    assert out.strip().startswith("[4.0, 5.0, 6.0]")
