"""Distributed weight sync from every pipeline stage at once (--weight-sync-mode distributed, PP > 1).

The (DP 0, TP 0) rank of each pipeline stage is that stage's *source*. It TP-gathers only its own stage's
tensors (weights/export.py `iter_stage_hf_weights`, with the stage's other TP ranks of DP replica 0; no PP
broadcast), packs them in buckets and broadcasts each bucket to the servers over a weight-sync group of its
own: rank 0 = that source (host of the group's TCP store), then every target server's TP ranks
(server_setup.sync_group_layout), named `megatron_dapo_stage_sync_<tag>_pp<stage>`, master port
first_port + stage. Ranks of DP replicas > 0 do nothing; nobody holds the whole model on the device.

Global rank 0 (stage 0's source and the engine owner) still decides the targets (serving servers), opens and
closes their update session (/begin_weight_update, /end_weight_update), flushes and sets the version
(weight_sync/stage_push.py StageCoordinator). The sources learn the plan (targets, TP sizes, group tag and
ports) from rank 0 over the trainer's gloo wait group, and each posts its own HTTP calls with a small client
(StageClient: the sources s > 0 run in other processes than rank 0's engine and its asyncio client).

One bucket at a time on the servers (TicketLock). An SGLang 0.5.23 server runs one request at a time on its
scheduler, and /init_weights_update_group and /update_weights_from_distributed block in a collective of one
group until the group's source and every member join (model_runner weight_updater: init_custom_process_group,
then torch.distributed.broadcast of the flat bucket). Two servers that took two stages' requests in opposite
orders would each wait in a collective the other one has not entered (NCCL's ring or tree broadcast, and
gloo's, need every member): a deadlock. So every request that enters a server collective (group init,
bucket broadcast, group teardown) is posted and broadcast under a FIFO ticket lock on the torch.distributed
store, and its replies are awaited before the lock is released (slime serialises its per-stage broadcasts
the same way). What runs in parallel across stages is everything else: TP gather, HF conversion, bucket
packing and the device-to-host copy of the host copy, while another stage's bucket is on the wire.

A server lost during a stage's NCCL broadcast: that broadcast is given up at its deadline (or at once
when the server's call fails), the source aborts its group, and when other servers answer it reports the stall
(StageOutcome.stalled, and STALLED on the store for the other stages, which abort their groups too); rank 0 then
raises WeightSyncStalled without another call to the servers (they may be stuck in the receive): the run stops,
as in the full push (weight_sync/transports/distributed.py). Over gloo the broadcast raises and the push is
recovered as below.

The host copy for re-syncing a lost server stays whole on rank 0: after its push each source s > 0 sends its
stage's host copy (CPU buckets) to rank 0 over the pipeline group (point-to-point, megatron_dapo.distributed.comm), so
the recovery (ServerPush.recover of one server, its re-push to the survivors after a broken push) is unchanged.

Cost at 32B (Qwen2.5-32B, 65 GB bf16, TP8 x PP2, 16 servers at TP4, 512 MiB buckets; the times and the
whole-model push this replaces at PP > 1: docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B"):
- bytes: the 2 stage sources each push 32.5 GB (97 buckets: plan_buckets on the stage's 385 tensors) over their
  own group of 1 + 64 ranks; the only PP traffic is stage 1's host copy to rank 0, 32.5 GB once, after the push;
  only the 16 ranks of DP replica 0 gather (32.5 GB each); the other 112 ranks move nothing.
- host memory: rank 0 keeps 65 GB (the whole version; the previous version is dropped when the push starts, so
  that is also the peak); stage 1's source holds its 32.5 GB host copy until it has sent it to rank 0.
- waits: a source waits for the lock at most (PP - 1) bucket pushes; the stage's TP peers wait in the TP
  all-gather for their source meanwhile.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
import torch
import torch.distributed as dist

from megatron_dapo.rollout.sglang.protocol import ServerDied, check_success, read_reply
from megatron_dapo.rollout.sglang.setup import sync_group_layout
from megatron_dapo.weight_sync.buckets import Bucket, TensorMeta, iter_buckets

STALLED = b"stalled"
"""The value of a push's broken key on the store when a stage's broadcast stalled with servers answering (else 1)."""
SYNC_ADDR_ENV = "MEGATRON_DAPO_WEIGHT_SYNC_ADDR"
"""Set on the node of a stage source s > 0: the address the servers reach that node at (its group's master
address). Unset: rank 0's --weight-sync-master-addr on rank 0's own host, else the local address of the interface
that reaches --weight-sync-master-addr (stage_master_address)."""


@dataclass(frozen=True, kw_only=True)
class SyncPlan:
    """What rank 0 tells every rank before a per-stage push (pickled over the gloo wait group, ~1 KB)."""

    version: int
    urls: tuple[str, ...]
    """The target servers, in order; outcomes name them by index."""
    tps: tuple[int, ...]
    """Each target's TP size (its ranks in every stage's group)."""
    tag: int
    """Group generation: a new tag makes every source build a new group."""
    first_port: int
    """Stage s's group master port is first_port + s."""
    master_address: str
    """Rank 0's --weight-sync-master-addr (stage 0's master address)."""
    rank0_host: str
    backend: str
    bucket_bytes: int
    api_key: str | None
    timeout_s: float
    """Each weight-update call (ClientConfig.control_timeout_s)."""
    http_timeout_s: float = 60.0
    """A /health check of a target (--sglang-http-timeout)."""
    broadcast_floor_s: float = 30.0
    """The fixed part of each NCCL bucket broadcast's deadline (ClientConfig.broadcast_floor_s)."""

    def __post_init__(self) -> None:
        if len(self.urls) != len(self.tps):
            raise ValueError(f"SyncPlan: {len(self.urls)} urls but {len(self.tps)} TP sizes")
        if self.bucket_bytes < 1 or self.timeout_s <= 0:
            raise ValueError("SyncPlan: bucket_bytes (--weight-sync-bucket-mb) and timeout_s must be > 0")
        if self.broadcast_floor_s <= 0:
            raise ValueError(f"SyncPlan: broadcast_floor_s must be > 0, got {self.broadcast_floor_s}")

    def group_name(self, stage: int) -> str:
        return f"megatron_dapo_stage_sync_{self.tag}_pp{stage}"

    def port(self, stage: int) -> int:
        return self.first_port + stage


@dataclass
class StageOutcome:
    """One source's push: servers lost (indices into SyncPlan.urls), whether its group broke, its host copy."""

    stage: int
    lost: set[int] = field(default_factory=set)
    broken: bool = False
    kept: list[Bucket] = field(default_factory=list)
    nbytes: int = 0
    """Bytes this source broadcast to the servers (each bucket once over its group)."""
    seconds: float = 0.0
    error: str | None = None
    """An unexpected failure (a refusal by a server, a bad address): rank 0 raises it after the push."""
    stalled: str | None = None
    """An NCCL broadcast of this stage that did not complete while other servers answer (sync_group.stall_message):
    rank 0 raises WeightSyncStalled with it and makes no more calls to the servers."""


@dataclass
class StagesOutcome:
    """All stages' pushes merged on rank 0, for StageCoordinator.update."""

    lost: set[int]
    broken: bool
    kept: list[Bucket]
    """The whole version (stage 0's buckets first), the engine's host copy."""
    nbytes: int
    stage_seconds: list[float]


def merge_outcomes(outcomes: list[StageOutcome]) -> StagesOutcome:
    """Stage order; raises WeightSyncStalled when a stage's broadcast stalled with other servers answering, and
    RuntimeError naming the stage when a source failed unexpectedly."""
    from megatron_dapo.weight_sync.sync_group import WeightSyncStalled

    for o in outcomes:
        if o.stalled is not None:
            raise WeightSyncStalled(o.stalled)
    for o in outcomes:
        if o.error is not None:
            raise RuntimeError(f"weight sync: the source of pipeline stage {o.stage} failed: {o.error}")
    return StagesOutcome(lost=set().union(*(o.lost for o in outcomes)), broken=any(o.broken for o in outcomes),
                         kept=[b for o in outcomes for b in o.kept], nbytes=sum(o.nbytes for o in outcomes),
                         stage_seconds=[o.seconds for o in outcomes])


def routed_address(target: str) -> str:
    """The local address this host sends from to reach `target` (an address or a name): connect() on a UDP socket
    makes the kernel pick the route and its source address; no packet is sent. OSError when `target` does not
    resolve or has no route."""
    family, _, _, _, sockaddr = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(sockaddr)
        return sock.getsockname()[0]


def choose_source_address(candidates: Iterable[str], *, servers_remote: bool) -> str | None:
    """The first candidate the servers can reach: a non-loopback one, else a loopback one when no server is on
    another host; None when there is none."""
    seen = list(dict.fromkeys(c for c in candidates if c))
    for addr in seen:
        if not ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            return addr
    return seen[0] if seen and not servers_remote else None


def stage_master_address(stage: int, plan: SyncPlan, *, env: dict[str, str] | None = None,
                         hostname: Callable[[], str] = socket.gethostname,
                         resolve: Callable[[str], str] = socket.gethostbyname,
                         route: Callable[[str], str] = routed_address) -> str:
    """The master address of stage `stage`'s group: the address of that stage's source as the servers see it.

    Stage 0 (global rank 0): --weight-sync-master-addr. Stage s > 0: MEGATRON_DAPO_WEIGHT_SYNC_ADDR if set on
    that rank; else, on rank 0's host, --weight-sync-master-addr too; else the local address of the interface
    that reaches --weight-sync-master-addr, then the address the hostname resolves to (on stock Ubuntu
    127.0.1.1): the first that is not loopback, or a loopback one when every server runs on this host."""
    env = os.environ if env is None else env
    if stage == 0:
        return plan.master_address
    given = env.get(SYNC_ADDR_ENV, "").strip()
    host = hostname()
    if given:
        try:
            resolve(given)
        except OSError as e:
            raise ValueError(f"{SYNC_ADDR_ENV}={given!r} on {host} (source of pipeline stage {stage}) does not "
                             f"resolve: {e}") from e
        return given
    if host == plan.rank0_host:
        return plan.master_address
    candidates = []
    for find, target in ((route, plan.master_address), (resolve, host)):
        with contextlib.suppress(OSError):
            candidates.append(find(target))
    here = {host} | {c for c in candidates if not ipaddress.ip_address(c.split("%")[0]).is_loopback}
    servers_remote = any(urlsplit(u).hostname not in here for u in plan.urls)
    addr = choose_source_address(candidates, servers_remote=servers_remote)
    if addr is None:
        raise ValueError(f"the source of pipeline stage {stage} runs on {host}, whose only addresses found "
                         f"({', '.join(candidates) or 'none'}: the route to --weight-sync-master-addr "
                         f"{plan.master_address}, then its hostname) are loopback, where the SGLang servers on "
                         f"other hosts cannot join its weight-sync group; set {SYNC_ADDR_ENV} on that node to the "
                         f"address they reach it at")
    return addr


class TicketLock:
    """A FIFO lock of the stage sources on a torch.distributed store: one server collective at a time.

    acquire: ticket = add(counter, 1) - 1, then wait for the key `turn<ticket>` that the holder of the previous
    ticket sets on release. One store round trip each way per bucket."""

    def __init__(self, store: dist.Store, prefix: str = "megatron_dapo/stage_sync_lock", timeout_s: float = 600.0):
        self.store, self.prefix, self.timeout = store, prefix, timedelta(seconds=timeout_s)
        self.waited_s = 0.0
        """Seconds spent waiting for the lock since this object was made."""

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        ticket = self.store.add(f"{self.prefix}/ticket", 1) - 1
        if ticket > 0:
            t0 = time.perf_counter()
            key = f"{self.prefix}/turn{ticket}"
            self.store.wait([key], self.timeout)
            self.store.delete_key(key)
            self.waited_s += time.perf_counter() - t0
        try:
            yield
        finally:
            self.store.set(f"{self.prefix}/turn{ticket + 1}", "1")


class StageClient:
    """The HTTP calls of one stage source: its posts to the target servers (API key, timeouts, errors as in
    SGLangEngine._post), concurrent over the servers on a small thread pool."""

    def __init__(self, urls: Iterable[str], *, api_key: str | None, timeout_s: float, http_timeout_s: float = 60.0):
        self.urls = list(urls)
        self.http_timeout_s = http_timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max(1, len(self.urls)), thread_name_prefix="stage-sync-http")

    def close(self, *, wait: bool = True) -> None:
        """Ends the client; `wait=False` after a stalled broadcast: posts still in flight to servers that may never
        answer are dropped instead of waited for (up to the plan's timeout_s each)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        self._http.close()

    def post(self, server: int, path: str, body: dict) -> Any:
        url = self.urls[server]
        try:
            resp = self._http.post(f"{url}{path}", json=body)
        except httpx.TransportError as e:
            raise ServerDied(f"{url}{path}: {type(e).__name__}: {e}") from e
        reply = read_reply(resp, url, path)
        check_success(reply, f"{url}{path}")
        return reply

    def submit(self, servers: Iterable[int], path: str, body: Callable[[int], dict] | dict) -> dict[int, Future]:
        """Posts to each server on the pool (bodies per server when `body` is a function); their futures."""
        return {i: self._pool.submit(self.post, i, path, body(i) if callable(body) else body) for i in servers}

    def alive(self, server: int) -> bool:
        try:
            return self._http.get(f"{self.urls[server]}/health", timeout=self.http_timeout_s).status_code == 200
        except httpx.HTTPError:
            return False


def _settle(futures: dict[int, Future], out: StageOutcome, timeout_s: float) -> None:
    """Waits for every reply; a lost server goes to `out.lost` and breaks the push. A refusal or a reply that
    never came is raised, unless the group broke meanwhile: a survivor's receive then fails or hangs with it
    (it is then counted lost, and recovered), and rank 0 re-pushes the whole version to the survivors."""
    failures: list[tuple[int, BaseException]] = []
    for i, f in futures.items():
        try:
            f.result(timeout_s)
        except ServerDied:
            out.lost.add(i)
        except (RuntimeError, TimeoutError) as e:
            failures.append((i, e))
    out.broken = out.broken or bool(out.lost)
    for i, e in failures:
        if not out.broken:
            raise e
        if isinstance(e, TimeoutError):
            out.lost.add(i)


class StageSender:
    """One stage source's weight-sync group with the servers, kept across updates while the plan's tag stays."""

    def __init__(self, stage: int):
        self.stage = stage
        self.group: dist.ProcessGroup | None = None
        self.name: str | None = None
        self.members: list[str] = []

    def push(self, plan: SyncPlan, named: Iterable[tuple[str, torch.Tensor]], lock: TicketLock,
             keep_together: Mapping[str, str] | None = None) -> StageOutcome:
        """Buckets this stage's tensors, broadcasts each to the plan's servers, keeps a host copy of each.

        Consumes `named` to the end whatever happens (the stage's TP peers iterate the same collective). Once a
        stage's push breaks (a server lost), it says so on the store and the other stages stop sending too: their
        broadcasts would wait on the dead member, and rank 0 re-pushes the whole version to the survivors. When the
        break is a stalled NCCL broadcast with servers still answering (out.stalled), every source ends its group
        here only (abort) and calls no server again: they may be stuck in the receive, and the run stops."""
        t0 = time.perf_counter()
        out = StageOutcome(stage=self.stage)
        client = StageClient(plan.urls, api_key=plan.api_key, timeout_s=plan.timeout_s,
                             http_timeout_s=plan.http_timeout_s)
        broken_key = f"megatron_dapo/stage_sync_broken/{plan.tag}/{plan.version}"
        stalled = False
        try:
            for k, bucket in enumerate(iter_buckets(named, plan.bucket_bytes, keep_together)):
                out.kept.append(Bucket(flat=bucket.flat.detach().to("cpu", copy=True), metas=bucket.metas))
                if out.broken or out.error is not None or not plan.urls:
                    continue  # keep draining (and keeping) the version
                try:
                    with lock.held():
                        if lock.store.check([broken_key]):  # another stage's push broke: rank 0 re-pushes it all
                            out.broken, stalled = True, lock.store.get(broken_key) == STALLED
                            continue
                        self._ensure_group(plan, client, out)
                        if not out.broken:
                            self._send_bucket(plan, client, bucket, k, out)
                        if out.broken:
                            stalled = out.stalled is not None
                            lock.store.set(broken_key, STALLED if stalled else b"1")
                except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
                    out.error = f"{type(e).__name__}: {e}"
            if stalled:
                self.abort()
            elif out.broken:
                out.lost |= {i for i in range(len(plan.urls)) if not client.alive(i)}
                with lock.held():
                    self.drop(client, [i for i in range(len(plan.urls)) if i not in out.lost])
        finally:
            client.close(wait=not stalled)
        out.seconds = time.perf_counter() - t0
        return out

    def _ensure_group(self, plan: SyncPlan, client: StageClient, out: StageOutcome) -> None:
        name = plan.group_name(self.stage)
        if self.name == name:
            return
        from megatron_dapo.weight_sync.sync_group import any_died, join_weight_sync_group

        self.drop(client, [i for i, u in enumerate(plan.urls) if u in self.members])
        world, offsets = sync_group_layout(plan.tps)
        address, port = stage_master_address(self.stage, plan), plan.port(self.stage)
        futures = client.submit(range(len(plan.urls)), "/init_weights_update_group", lambda k: {
            "master_address": address, "master_port": port, "rank_offset": offsets[k], "world_size": world,
            "group_name": name, "backend": plan.backend})
        group = join_weight_sync_group(master_address=address, master_port=port, world_size=world, group_name=name,
                                       backend=plan.backend, timeout_s=plan.timeout_s,
                                       gone=functools.partial(any_died, futures))
        if group is None:  # a server never joined: its call failed (lost before this stage's push), or a timeout
            out.broken = True
            _settle(futures, out, plan.timeout_s)
            return
        self.group, self.name, self.members = group, name, list(plan.urls)
        _settle(futures, out, plan.timeout_s)

    def _send_bucket(self, plan: SyncPlan, client: StageClient, bucket: Bucket, index: int,
                     out: StageOutcome) -> None:
        """Posts the bucket's receive to every server, broadcasts it (sync_group.broadcast_bucket) and settles the
        replies. A lost server breaks the push; over NCCL it is a stall (`_stalled`), as is a broadcast not done by
        its deadline (broadcast_deadline_s: 30.5 s a 512 MiB bucket)."""
        from megatron_dapo.weight_sync.sync_group import (
            any_died,
            broadcast_bucket,
            bucket_on_wire,
            distributed_update_body,
            raises_on_loss,
        )

        body = distributed_update_body(bucket, self.name, plan.version)
        # The servers block in their receive until the source broadcasts: post first, then send.
        futures = client.submit(range(len(plan.urls)), "/update_weights_from_distributed", body)
        wire, nbytes, deadline = bucket_on_wire(bucket, plan.backend, group_timeout_s=plan.timeout_s,
                                                floor_s=plan.broadcast_floor_s)
        try:
            done = broadcast_bucket(self.group, wire, deadline_s=deadline, call_timeout_s=plan.timeout_s,
                                    gone=functools.partial(any_died, futures))
        except RuntimeError:  # gloo: a member died mid-broadcast (every member's receive failed with it)
            out.broken = True
            _settle(futures, out, plan.timeout_s)
            return
        if done:
            out.nbytes += nbytes
            before = len(out.lost)
            _settle(futures, out, plan.timeout_s)
            # NCCL: rank 0's part can end before a lost server's successors got theirs; they may be stuck
            if len(out.lost) == before or raises_on_loss(self.group):
                return
        self._stalled(plan, client, futures, out, index, nbytes, deadline)

    def _stalled(self, plan: SyncPlan, client: StageClient, futures: dict[int, Future], out: StageOutcome,
                 bucket: int, nbytes: int, deadline_s: float) -> None:
        """After an NCCL broadcast of this stage that did not complete, as DistributedPush._stalled: aborts the group
        here and counts the servers whose call failed or that do not answer /health as lost. If others answer,
        out.stalled gets the one-line error (rank 0 raises it: the run stops); else the push is only broken, and
        the lost servers are recovered."""
        from megatron_dapo.weight_sync.sync_group import died, stall_message

        failed = {i for i, f in futures.items() if died(f)} | out.lost
        for f in futures.values():
            f.cancel()
        self.abort()
        lost = failed | {i for i in range(len(plan.urls)) if i not in failed and not client.alive(i)}
        out.lost |= lost
        out.broken = True
        answering = len(plan.urls) - len(lost)
        if answering:
            out.stalled = stall_message(version=plan.version, lost=[plan.urls[i] for i in sorted(lost)],
                                        answering=answering, bucket=bucket, nbytes=nbytes, deadline_s=deadline_s,
                                        call_failed=bool(failed), stage=self.stage)

    def abort(self) -> None:
        """Ends this source's group here only, without waiting for what is in flight on it (sync_group.abort_group)
        and without a call to the servers."""
        from megatron_dapo.weight_sync.sync_group import abort_group

        if self.group is None:
            return
        group, self.group, self.name, self.members = self.group, None, None, []
        abort_group(group)

    def drop(self, client: StageClient, alive: list[int], timeout_s: float = 60.0) -> None:
        """Forgets this source's group here and on the given servers (a restarted server answers 400: ignored)."""
        if self.group is None:
            return
        group, name, self.group, self.name, self.members = self.group, self.name, None, None, []
        with contextlib.suppress(Exception):  # a group with a dead member may not tear down cleanly
            dist.destroy_process_group(group)
        for f in client.submit(alive, "/destroy_weights_update_group", {"group_name": name}).values():
            with contextlib.suppress(Exception):
                f.result(timeout_s)


def bucket_dtype(metas: list[TensorMeta]) -> torch.dtype:
    return metas[0].dtype
