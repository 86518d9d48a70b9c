"""Per-stage push (SGLang servers, --weight-sync-mode distributed, PP > 1): every pipeline stage's source rank
sends its own stage to the servers over a group of its own, all stages at once (the mechanics, the lock and the
addresses: weight_sync/stage_sync.py).

Made on every rank by build_weight_sync when the run is built; Trainer.sync_weights calls `push` every step and
nothing decides the path per step. Per push, rank 0 sends the others the plan (SyncPlan, ~1 KB pickled over
the trainer's gloo wait group): which servers, their TP sizes, the group tag and ports, facts only rank 0's
engine has; or, when rank 0 failed before its push, the error, so no rank waits for a plan that never comes.

Cost at the production setting (Qwen2.5-32B, 65 GB bf16, TP8 x PP2 on 128 actor GPUs, 16 servers x TP4 as in the
32B recipe; the times: docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B"):
- bytes pushed per sync: 65 GB in all, 32.5 GB from each of the 2 stage sources over its own group of
  1 + 64 server ranks (97 buckets of up to 512 MiB each: plan_buckets on the stage's 385 tensors); the only PP
  traffic is stage 1's host copy to rank 0, 32.5 GB once after the push;
- host copy: rank 0 keeps the whole version, 61.03 GiB (planner.report.host_copy_bytes, per-stage PP2; the previous
  version is dropped as the push starts, so that is also the peak); stage 1's source holds its 30.5 GiB until it
  has sent it to rank 0;
- waits: the 16 ranks of DP replica 0 gather their stage (TP all-gather, 32.5 GB each); a source waits for the
  server lock at most (PP - 1) bucket pushes; the other 112 ranks move nothing and wait for rank 0 at the
  trainer's section after the push (one int64 all-reduce).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_dapo.distributed import comm
from megatron_dapo.weight_sync.base import WeightSync
from megatron_dapo.weight_sync.buckets import Bucket
from megatron_dapo.weight_sync.stage_sync import (
    StageOutcome,
    StageSender,
    StagesOutcome,
    SyncPlan,
    TicketLock,
    bucket_dtype,
    merge_outcomes,
)
from megatron_dapo.weight_sync.sync_group import WeightSyncStalled
from megatron_dapo.weight_sync.transports.distributed import SYNC_GROUP_IDS, DistributedPush
from megatron_dapo.weights.mapping import keep_together

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.engine import SGLangEngine


@dataclass
class RankStats:
    """What this rank moved in its last per-stage sync (for tools/bench_weight_sync.py and the tests)."""

    to_servers: int = 0
    pp_sent: int = 0
    pp_received: int = 0
    seconds: float = 0.0


class StageCoordinator:
    """Rank 0's side of a per-stage update: the targets, their update session, the stage groups' tag and ports,
    the whole version as the host copy (that of `full`, rank 0's DistributedPush, which also recovers a lost server
    from it and re-pushes it to the survivors after a broken push)."""

    def __init__(self, full: DistributedPush) -> None:
        self.full = full
        self.stage_groups: tuple[list[int], int, int] | None = None
        """(members, servers lost so far, tag) of the current stage groups; a change rebuilds them."""

    @property
    def engine(self) -> SGLangEngine:
        return self.full.engine

    def update(self, version: int, push_stages: Callable[..., StagesOutcome], *, stages: int) -> None:
        """Opens and closes the servers' update session around `push_stages`, keeps the whole version it gets back
        as the host copy, and, as ServerPush.update does, re-pushes that copy to the survivors after a broken push
        and recovers the lost servers from it. The previous host copy is dropped before the push, so rank 0's host
        memory peaks at one version (61.03 GiB at Qwen2.5-32B bf16), not the old and the new (122 GiB).

        `push_stages(urls, tps, tag, first_port)` runs the stages' pushes to the servers `urls` (TP sizes `tps`)
        and returns a StagesOutcome; `tag` changes whenever the stage groups must be rebuilt (new targets, a
        server lost since, a broken push), stage s's group then using port first_port + s."""
        engine, full = self.engine, self.full
        with engine.weight_update(version) as session:
            targets, lost = session.targets, session.lost
            live = engine.send(targets, "/begin_weight_update", {}, lost) if targets else []
            members, seen, tag = self.stage_groups or ([], -1, 0)
            losses = sum(engine.losses)
            if members != live or seen != losses:
                tag = next(SYNC_GROUP_IDS)
                full.generation += stages  # stage s's group gets port base + generation + s
            first_port = engine.client.sync_master_port + full.generation - stages
            # The old version goes before the new one arrives (rank 0 holds one, 61 GiB at 32B, not two): from here
            # a server lost mid-push is re-synced from the new copy, and a push that raises ends the run anyway.
            full.kept = []
            try:
                outcome = push_stages([engine.urls[i] for i in live], [engine.tps[i] for i in live], tag, first_port)
            except BaseException as e:
                self.stage_groups = None
                if not isinstance(e, WeightSyncStalled):  # else the servers may be stuck in a receive: no more calls
                    with contextlib.suppress(Exception):
                        engine.send(live, "/end_weight_update", {}, set())
                raise
            lost |= {live[k] for k in outcome.lost}
            self.stage_groups = None if outcome.broken else (live, losses, tag)
            live = engine.send([i for i in live if i not in lost], "/end_weight_update", {}, lost)
            full.kept, session.nbytes = outcome.kept, outcome.nbytes
            if outcome.broken:  # survivors may hold a partial version: the whole kept copy over rank 0's group
                lost |= {i for i in live if not engine.answers(i)}
                survivors = [i for i in live if i not in lost]
                if survivors:
                    copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in full.kept)
                    lost |= full.send(survivors, copies, version, session)
            else:
                engine.flush(live)


class StagePush(WeightSync):
    """Per-stage weight sync of one trainer process; made on every rank when the run is built (PP > 1).

    `full`: rank 0's DistributedPush (its engine, host copy and recovery), None on the other ranks; `wait_group`: the
    trainer's gloo group with the --rollout-timeout, over which rank 0 sends each push's plan."""

    def __init__(self, full: DistributedPush | None, wait_group: dist.ProcessGroup, *, lock_timeout_s: float = 3600.0):
        from megatron.core import parallel_state

        from megatron_dapo.weights.export import gathers_stage, is_stage_source

        self.rank = dist.get_rank()
        self.wait_group = wait_group
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.source, self.gathers = is_stage_source(), gathers_stage()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        if self.rank == 0 and not (self.source and self.stage == 0):
            raise RuntimeError("per-stage weight sync expects global rank 0 at DP 0, TP 0, PP stage 0")
        if self.source and self.pp_ranks[0] != 0:
            raise RuntimeError(f"stage source {self.rank}: its pipeline group {self.pp_ranks} does not start at "
                               f"global rank 0, which collects the host copy")
        if (self.rank == 0) != (full is not None):
            raise ValueError("StagePush: rank 0, and only rank 0, gets the engine's DistributedPush")
        self.coordinator = StageCoordinator(full) if full is not None else None
        self.sender = StageSender(self.stage) if self.source else None
        self.lock = TicketLock(dist.distributed_c10d._get_default_store(), timeout_s=lock_timeout_s)
        self.stats = RankStats()

    def recover(self, server: int) -> None:
        self.coordinator.full.recover(server)

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.full.close()

    def _push(self, actor: Any, version: int) -> dict[str, float]:
        """One per-stage update on every rank. Rank 0 returns the engine's metrics and the per-stage seconds
        (sync/stage<s>_s); the others {}."""
        from megatron_dapo.weights.export import iter_stage_hf_weights

        chunks, arch = actor.chunks, actor.arch
        self.stats = RankStats()
        t0 = time.perf_counter()
        if self.rank != 0:
            kind, payload = comm.broadcast_object(None, 0, self.wait_group)
            if kind == "abort":
                raise RuntimeError(f"global rank 0 failed before the weight sync: {payload}")
            if self.source:
                outcome = self.sender.push(payload, iter_stage_hf_weights(chunks, arch), self.lock,
                                           keep_together(arch))
                self.stats.to_servers = outcome.nbytes
                self._send_outcome(outcome)
            elif self.gathers:
                for _ in iter_stage_hf_weights(chunks, arch):  # the source's TP peers: in step with its gather
                    pass
            self.stats.seconds = time.perf_counter() - t0
            return {}
        engine = self.coordinator.engine
        announced = False
        seconds: list[float] = []

        def push_stages(urls: list[str], tps: list[int], tag: int, first_port: int) -> StagesOutcome:
            nonlocal announced
            c = engine.client
            plan = SyncPlan(version=version, urls=tuple(urls), tps=tuple(tps), tag=tag, first_port=first_port,
                            master_address=c.sync_master_address, rank0_host=socket.gethostname(),
                            backend=c.sync_backend, bucket_bytes=c.bucket_bytes, api_key=engine.api_key,
                            timeout_s=c.control_timeout_s, http_timeout_s=c.http_timeout_s,
                            broadcast_floor_s=c.broadcast_floor_s)
            comm.broadcast_object(("stage", plan), 0, self.wait_group)
            announced = True
            mine = self.sender.push(plan, iter_stage_hf_weights(chunks, arch), self.lock, keep_together(arch))
            self.stats.to_servers = mine.nbytes
            merged = merge_outcomes([mine] + [self._recv_outcome(s) for s in range(1, self.pp)])
            seconds[:] = merged.stage_seconds
            return merged

        try:
            self.coordinator.update(version, push_stages, stages=self.pp)
        except BaseException as e:
            if not announced:
                comm.broadcast_object(("abort", f"{type(e).__name__}: {e}"), 0, self.wait_group)
            raise
        self.stats.seconds = time.perf_counter() - t0
        return {f"sync/stage{s}_s": v for s, v in enumerate(seconds)} | engine.take_metrics()

    def _send_outcome(self, outcome: StageOutcome) -> None:
        """Source s > 0 -> rank 0 over the pipeline group: the outcome, then its host copy bucket by bucket."""
        kept, outcome.kept = outcome.kept, []
        comm.send_object((outcome, [b.metas for b in kept]), 0, self.pp_group)
        for b in kept:
            comm.send(b.flat, 0, self.pp_group)
            self.stats.pp_sent += b.nbytes

    def _recv_outcome(self, stage: int) -> StageOutcome:
        src = self.pp_ranks[stage]
        outcome, metas = comm.recv_object(src, self.pp_group)
        for bucket_metas in metas:
            flat = torch.empty(sum(m.numel for m in bucket_metas), dtype=bucket_dtype(bucket_metas))
            comm.recv(flat, src, self.pp_group)
            outcome.kept.append(Bucket(flat=flat, metas=bucket_metas))
            self.stats.pp_received += flat.numel() * flat.element_size()
        return outcome
