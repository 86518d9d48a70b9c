"""The trainer's side of SGLang's weight-update process group (update_weights_from_distributed).

SGLang's /init_weights_update_group makes each server TP rank join a process group through a TCP
rendezvous at tcp://master_address:master_port, with its store prefixed by the group name, ranks
rank_offset + tp_rank. The trainer joins the same group as rank 0 (the TCP store master) and broadcasts
each tensor from there. It is a group of its own, outside the trainer's default (Megatron) process group.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.distributed import comm


def init_weight_sync_group(
    *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Joins the weight-update group as rank 0 (blocks until every server rank has joined)."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    if world_size < 2:
        raise ValueError(f"weight sync group needs the trainer plus >= 1 server rank, got "
            f"world_size={world_size}")
    timeout = timedelta(seconds=timeout_s)
    rank = 0
    # This process hosts the store itself. Not dist.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True)
    # it would only connect as a client to a store nobody hosts at this port, and wait for ever.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
    # The same prefix SGLang puts on its side, so both ends meet under the same keys.
    store = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_tensors(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Broadcasts each tensor from rank 0 of `group`, in order (the order the servers were told).

    Through comm.broadcast: a tensor already on the group's device (the CUDA bucket on an NCCL group, made
    with `.cuda()` on the current device; a CPU bucket on gloo) goes to torch.distributed.broadcast as is, the
    same call and bytes SGLang's side receives with torch.distributed directly; a tensor elsewhere is copied
    there first instead of failing. Rank 0 waits for every server rank to enter the receive (they do once their
    /update_weights_from_distributed arrives), up to the group's `timeout_s`."""
    for tensor in tensors:
        comm.broadcast(tensor, src=0, group=group)
