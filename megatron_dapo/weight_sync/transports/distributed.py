"""The "distributed" transport: /init_weights_update_group once, then one broadcast per bucket (separate GPUs,
NCCL) over the group of weight_sync/sync_group.py, wrapped in /begin_weight_update ... /end_weight_update, which
SGLang 0.5.23 requires. At PP > 1 each stage sends its own part instead (`per_stage`: StagePush,
weight_sync/stage_push.py, around rank 0's DistributedPush, whose host copy, group ports and recovery it uses).

Bytes pushed per sync at Qwen2.5-32B: 65 GB once over the group of rank 0 and the 16 servers' 128 TP ranks (the
time: docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B"); rank 0 keeps the host copy (61.03 GiB,
weight_sync/server_push.py).
A server lost during a "distributed" broadcast. Over gloo the broadcast raises on every member: the
survivors get the whole version again over a fresh group and the lost one is recovered, as for any loss. Over
NCCL the broadcast never completes (the kernels spin) and SGLang 0.5.23 cannot abort its side of the group, so
the run ends at once: each bucket is broadcast with async_op=True and polled against a
deadline of ClientConfig.broadcast_floor_s + its bytes at 1 GB/s (sync_group.broadcast_deadline_s; no stream or
host sync meanwhile), given up at once when a server's call fails; then the group's communicator is aborted here,
and the update raises WeightSyncStalled naming the lost server and the step whenever another server of the group
answers (it may be stuck in the receive); the checkpoint is the recovery. A group left with no answering server
(the re-sync of one server, every target lost) is recovered as a loss over gloo is. At 32B a 512 MiB bucket gets
30.5 s (31.6 s for the 1.56 GB embedding): a dead server (its connection reset) is seen within a
poll (1 ms), a hung one at the deadline plus its /health check (<= --sglang-http-timeout, 60 s), instead of the
600 s NCCL watchdog (the group's timeout, ClientConfig.control_timeout_s) killing rank 0 with no server named. (A
group's first broadcast call also makes its NCCL communicator: that call is waited for up to the group's timeout, or
until a server's call fails, and the deadline counts from the enqueued broadcast.)
"""


from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from megatron_dapo.rollout.sglang.protocol import CALL_MARGIN_S, ServerDied, check_success
from megatron_dapo.rollout.sglang.setup import sync_group_layout
from megatron_dapo.weight_sync.buckets import Bucket
from megatron_dapo.weight_sync.server_push import ServerPush
from megatron_dapo.weight_sync.transports import register_transport

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.engine import SGLangEngine, UpdateSession

SYNC_GROUP_IDS = itertools.count(1)
"""Names of the weight-sync broadcast groups of this process (a name can be registered only once)."""


@register_transport("distributed")
class DistributedPush(ServerPush):
    """Broadcasts over a group with the servers' TP ranks, which it owns; the host copy re-syncs a lost server."""

    per_stage = True
    server_group = True

    def __init__(self, engine: SGLangEngine | None) -> None:
        super().__init__(engine)
        self.generation = 0
        """Broadcast groups built so far (each gets a new name and port: sync_master_port + generation - 1);
        StagePush's stage groups take their ports from the same count."""
        self._group = None
        self._members: list[int] = []
        self._member_losses: list[int] = []
        self._name = ""

    def close(self) -> None:
        """At shutdown, before the servers stop: ends the broadcast group on the live servers and here, and drops
        the host copy.

        A gloo group still alive when its process exits can abort it at interpreter exit ("terminate called
        without an active exception": its worker threads outlive the interpreter), and a server run outside
        this trainer would keep a group whose rank 0 is gone. Waits for a re-sync in flight (it uses the
        group) up to ClientConfig.control_timeout_s; costs one /health and one /destroy_weights_update_group
        per member server."""
        engine = self.engine
        if engine is not None and self._group is not None:
            if engine.weights_lock.acquire(timeout=engine.client.control_timeout_s):
                try:
                    self.drop_group(self._members)
                finally:
                    engine.weights_lock.release()
            else:
                print(f"[megatron-dapo] warning: a re-sync still holds weight-sync group {self._name} after "
                      f"{engine.client.control_timeout_s:.0f} s; shutting down without ending it", flush=True)
        super().close()

    def send(self, targets: list[int], buckets: Iterable[Bucket], version: int,
             session: UpdateSession | None) -> set[int]:
        """One broadcast per bucket over a group of this process and the targets' TP ranks. The group is built
        for a set of servers and rebuilt when that set changes (a server lost or re-synced alone). Returns the
        servers lost.

        A server lost mid-broadcast, over gloo: the broadcast raises; the rest of the version is kept, the group
        torn down, and the survivors get the whole version again (from `kept`) over a fresh group. Over NCCL the
        broadcast never completes: it is given up at its deadline (broadcast_deadline_s, 30.5 s a 512 MiB bucket),
        or at once when the lost server's call fails, and `_stalled` aborts the group; the run stops with
        WeightSyncStalled naming the lost server unless no other server of the group answers."""
        from megatron_dapo.weight_sync.sync_group import (
            any_died,
            broadcast_bucket,
            bucket_on_wire,
            distributed_update_body,
            raises_on_loss,
        )

        engine, client = self.engine, self.engine.client
        lost: set[int] = set()
        if not targets:
            return lost
        try:
            group_name = self._ensure_group(targets)
        except ServerDied:
            lost |= set(i for i in targets if not engine.answers(i))
            self.drop_group(targets)
            survivors = [i for i in targets if i not in lost]
            if not survivors or survivors == targets:
                raise
            return lost | self.send(survivors, buckets, version, session)
        live = engine.send(targets, "/begin_weight_update", {}, lost)
        broken = False
        try:
            for k, bucket in enumerate(buckets):
                if broken or live != targets:
                    broken = True
                    continue  # the group lost a member: keep draining (and keeping) the version
                body = distributed_update_body(bucket, group_name, version)
                # The servers block in their receive until we broadcast: post first, then send.
                futures = {i: engine.post_later(i, "/update_weights_from_distributed", body) for i in live}
                wire, nbytes, deadline = bucket_on_wire(bucket, client.sync_backend,
                                                        group_timeout_s=client.control_timeout_s,
                                                        floor_s=client.broadcast_floor_s)
                try:
                    done = broadcast_bucket(self._group, wire, deadline_s=deadline,
                                            call_timeout_s=client.control_timeout_s,
                                            gone=functools.partial(any_died, futures))
                except RuntimeError:  # gloo: a member died mid-broadcast (every member's receive failed with it)
                    done = broken = True
                if done and not broken and session is not None:
                    session.nbytes += nbytes  # once over the group
                died_now = self._replies(futures) if done else set()
                if died_now and not raises_on_loss(self._group):
                    done = False  # NCCL: rank 0's part can end before the lost server's successors got theirs
                if not done:  # NCCL: no more calls to anyone, the others may be stuck in the receive
                    live = []
                    return lost | self._stalled(targets, futures, version, k, nbytes, deadline)
                lost |= died_now
                broken = broken or bool(died_now)
                live = [i for i in live if i not in lost]
        finally:
            live = engine.send(live, "/end_weight_update", {}, lost)
        if broken:
            lost |= set(i for i in targets if not engine.answers(i))
            self.drop_group([i for i in targets if i not in lost])
            survivors = [i for i in targets if i not in lost]
            if survivors:  # they may hold a partial version: send them the whole kept copy
                copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in self.kept)
                lost |= self.send(survivors, copies, version, session)
            return lost
        engine.flush(live)
        return lost

    def _replies(self, futures: dict[int, Future]) -> set[int]:
        """Waits for each server's reply to a bucket (up to control_timeout_s); returns those lost meanwhile. A
        refusal is raised."""
        died_now: set[int] = set()
        for i, f in futures.items():
            try:
                check_success(f.result(self.engine.client.control_timeout_s + CALL_MARGIN_S),
                              "update_weights_from_distributed")
            except ServerDied:
                died_now.add(i)
        return died_now

    def _stalled(self, targets: list[int], futures: dict[int, Future], version: int, bucket: int, nbytes: int,
                 deadline_s: float) -> set[int]:
        """After an NCCL broadcast that did not complete: aborts the group here (the spinning kernels stop; the
        host never waited on them) and finds the lost servers (their call failed, or no /health answer within
        http_timeout_s). If no other server of the group answers, returns them: they are recovered as usual (a
        re-sync of one server is such a group). Else raises WeightSyncStalled naming them and the step: the
        others may be stuck in the receive for good (SGLang 0.5.23 cannot abort its side of the group; its
        destroy_process_group waits for the receive), so the run stops and the checkpoint is the recovery."""
        from megatron_dapo.weight_sync.sync_group import WeightSyncStalled, abort_group, died, stall_message

        engine = self.engine
        failed = {i for i, f in futures.items() if died(f)}
        for f in futures.values():
            f.cancel()
        group, self._group = self._group, None
        abort_group(group)
        lost = failed | {i for i in targets if i not in failed and not engine.answers(i)}
        answering = [i for i in targets if i not in lost]
        if not answering:
            return lost
        raise WeightSyncStalled(stall_message(
            version=version, lost=[engine.urls[i] for i in sorted(lost)], answering=len(answering), bucket=bucket,
            nbytes=nbytes, deadline_s=deadline_s, call_failed=bool(failed)))

    def _ensure_group(self, targets: list[int]) -> str:
        """The broadcast group of exactly `targets` (rank 0 = this process, then each server's TP ranks), rebuilt
        when the targets changed or one of them was lost since it was built."""
        from megatron_dapo.weight_sync.sync_group import died, join_weight_sync_group

        engine, client = self.engine, self.engine.client
        losses = [engine.losses[i] for i in targets]
        if self._group is not None and self._members == targets and self._member_losses == losses:
            return self._name
        if self._group is not None:
            self.drop_group(self._members)
        self.generation += 1
        # torch.distributed keeps group names per process: unique across every engine this process made
        name = f"megatron_dapo_weight_sync_{next(SYNC_GROUP_IDS)}"
        port = client.sync_master_port + self.generation - 1
        world, offsets = sync_group_layout([engine.tps[i] for i in targets])
        futures = [engine.post_later(i, "/init_weights_update_group", {
            "master_address": client.sync_master_address, "master_port": port,
            "rank_offset": offsets[k], "world_size": world, "group_name": name,
            "backend": client.sync_backend}) for k, i in enumerate(targets)]
        # Given up at once when a target's call fails: a server lost before the group formed never joins, and the
        # rendezvous would otherwise wait out control_timeout_s (600 s) before failing the update.
        group = join_weight_sync_group(
            master_address=client.sync_master_address, master_port=port, world_size=world, group_name=name,
            backend=client.sync_backend, timeout_s=client.control_timeout_s,
            gone=lambda: any(died(f) for f in futures))
        if group is None:
            for f in futures:
                if died(f):
                    f.result()  # its ServerDied, naming the server: send() counts it lost and goes on without it
            raise RuntimeError(f"weight sync group {name} did not form within {client.control_timeout_s:g} s "
                               f"(ClientConfig.control_timeout_s): a server answered /init_weights_update_group but "
                               f"never joined")
        self._group = group
        self._members, self._member_losses, self._name = list(targets), losses, name
        for f in futures:
            check_success(f.result(client.control_timeout_s + CALL_MARGIN_S), "init_weights_update_group")
        return name

    @property
    def group(self):
        """The broadcast group with the servers (None when there is none)."""
        return self._group

    def drop_group(self, members: list[int]) -> None:
        """Forgets the current broadcast group on this side and on the given (live) servers."""
        if self._group is None:
            return
        group, name, self._group = self._group, self._name, None
        with contextlib.suppress(Exception):  # a group with a dead member may not tear down cleanly
            torch.distributed.destroy_process_group(group)
        alive = [i for i in members if self.engine.answers(i)]
        # a restarted server never had the group and answers 400: nothing to do there
        self.engine.post_quietly(alive, "/destroy_weights_update_group", {"group_name": name})
