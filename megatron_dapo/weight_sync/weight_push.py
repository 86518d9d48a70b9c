"""The weight updates of SGLangEngine: the new version in flat buckets to every serving server, by one of three paths.

- "tensor": /update_weights_from_tensor, buckets passed by handle: CUDA IPC on GPU (servers that see the
  trainer's GPU, i.e. colocated), shared memory on CPU (megatron_dapo/weight_sync/tensor_ipc.py);
- "distributed": /init_weights_update_group once, then one broadcast per bucket (separate GPUs, NCCL) over the
  group of megatron_dapo/weight_sync/sync_group.py; at PP > 1 each pipeline stage's source rank broadcasts its own
  stage over a group of its own (update_weights_by_stage, megatron_dapo/weight_sync/stage_sync.py);
- "disk": safetensors shards + /update_weights_from_disk (fallback; any topology with a shared disk).
The tensor and distributed paths are wrapped in /begin_weight_update ... /end_weight_update, which
SGLang 0.5.23 requires.

The last pushed weights: "tensor" and "distributed" keep a host copy of every bucket of the last update (one
copy of each bucket as it streams past; the previous version's bucket k is dropped as bucket k of the new one
arrives, so at most one version plus one bucket is held). At 32B that is 65 GB of rank 0's host RAM (bf16) and
one device-to-host copy of 65 GB per update (~3 s at ~20 GB/s). "disk" keeps no host copy: the last version's
shards on disk (65 GB) are the copy. SGLangEngine re-syncs a lost server from that copy (sglang_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from megatron_dapo.rollout.sglang.protocol import CALL_MARGIN_S, ServerDied
from megatron_dapo.rollout.sglang.setup import server_info, sync_group_layout, sync_ranks
from megatron_dapo.weight_sync.buckets import Bucket, iter_buckets
from megatron_dapo.weight_sync.tensor_ipc import IpcBucketPool, check_shm_space, serialize_named_tensors, stage_bucket

_SYNC_GROUP_IDS = itertools.count(1)
"""Names of the weight-sync broadcast groups of this process (a name can be registered only once)."""


class WeightPush:
    """The weight-update methods of SGLangEngine (a mixin: SGLangEngine(WeightPush, RolloutEngine)).

    They use the engine's state, set in SGLangEngine.__init__: `client` (ClientConfig), `urls`, `group`, `_tps`,
    `_headers`, `_http` / `_loop` / `_call` / `_post` (the HTTP client on the loop thread), the update state
    (`_version`, `_kept`, `_disk_weights`, `_weights_lock`, `_sync_bytes`, `_sync_*`, `_stage_groups`, `_losses`)
    and its recovery hooks (`_check_open`, `_serving`, `_lost_unseen`, `_start_recoveries`, `_raise_fatal`,
    `_lock`, `_metrics`)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Pushes the new version to every serving server. A server lost during the push is left out of the
        rest of it and recovered in the background; the update completes on the others, and every tensor is
        consumed (iter_hf_weights is a collective the other ranks iterate too) and kept for the catch-up."""
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        buckets = iter_buckets(named_tensors, self.client.bucket_bytes)
        mode = self.client.update_mode
        unseen = self._call(self._lost_unseen(), self.client.control_timeout_s)
        if unseen:
            self._call(self._start_recoveries(unseen), self.client.control_timeout_s)
        with self._weights_lock:
            start, self._sync_bytes = time.perf_counter(), 0
            targets = self._serving()
            if mode == "disk":
                lost = self._push_disk(targets, buckets, version)
            else:
                kept = self._keeping(buckets)
                push = self._push_tensor if mode == "tensor" else self._push_distributed
                lost = push(targets, kept, version)
                for _ in kept:  # every server was lost mid-way: still take (and keep) the whole version
                    pass
            self._version = version
            self._sync_report(version, time.perf_counter() - start, len(targets) - len(lost))
        if lost:
            self._call(self._start_recoveries(lost), self.client.control_timeout_s)
        self._raise_fatal()

    def update_weights_by_stage(self, version: int, push_stages: Callable[..., Any], *, stages: int) -> None:
        """Distributed mode at PP > 1: every pipeline stage's source rank sends its own stage over a group of its
        own (megatron_dapo/weight_sync/stage_sync.py); this engine (global rank 0) decides the targets (the serving
        servers), opens and closes their update session around `push_stages`, keeps the whole version it gets
        back as the host copy, and, as update_weights does, re-pushes that copy to the survivors after a broken
        push and recovers the lost servers from it. The previous host copy is dropped before the push, so rank
        0's host memory peaks at one version (65 GB at Qwen2.5-32B bf16), not the old and the new (130 GB).

        `push_stages(urls, tps, tag, first_port)` runs the stages' pushes to the servers `urls` (TP sizes `tps`)
        and returns a stage_sync.StagesOutcome; `tag` changes whenever the stage groups must be rebuilt (new
        targets, a server lost since, a broken push), stage s's group then using port first_port + s."""
        self._check_open()
        if self.client.update_mode != "distributed":
            raise RuntimeError(f"update_weights_by_stage needs --weight-sync-mode distributed, not "
                               f"{self.client.update_mode!r}")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights_by_stage: version must be an int >= 0, got {version!r}")
        unseen = self._call(self._lost_unseen(), self.client.control_timeout_s)  # restarted behind a router
        if unseen:
            self._call(self._start_recoveries(unseen), self.client.control_timeout_s)
        with self._weights_lock:
            start, lost = time.perf_counter(), set()
            targets = self._serving()
            live = self._send(targets, "/begin_weight_update", {}, lost) if targets else []
            members, seen, tag = self._stage_groups or ([], -1, 0)
            if members != live or seen != self._losses:
                tag = next(_SYNC_GROUP_IDS)
                self._sync_generation += stages  # stage s's group gets port base + generation + s
            first_port = self.client.sync_master_port + self._sync_generation - stages
            # The old version goes before the new one arrives (rank 0 holds one, 65 GB at 32B, not two): from here
            # a server lost mid-push is re-synced from the new copy, and a push that raises ends the run anyway.
            self._kept = []
            try:
                outcome = push_stages([self.urls[i] for i in live], [self.tps[i] for i in live], tag, first_port)
            except BaseException:
                self._stage_groups = None
                with contextlib.suppress(Exception):
                    self._send(live, "/end_weight_update", {}, set())
                raise
            lost |= {live[k] for k in outcome.lost}
            self._stage_groups = None if outcome.broken else (live, self._losses, tag)
            live = self._send([i for i in live if i not in lost], "/end_weight_update", {}, lost)
            self._kept, self._sync_bytes = outcome.kept, outcome.nbytes
            if outcome.broken:  # survivors may hold a partial version: the whole kept copy over rank 0's group
                lost |= {i for i in live if not self._answers(i)}
                survivors = [i for i in live if i not in lost]
                if survivors:
                    copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in self._kept)
                    lost |= self._push_distributed(survivors, copies, version)
            else:
                self._flush(live)
            self._version = version
            self._sync_report(version, time.perf_counter() - start, len(targets) - len(lost))
        if lost:
            self._call(self._start_recoveries(lost), self.client.control_timeout_s)
        self._raise_fatal()

    @property
    def tps(self) -> list[int]:
        """Each server's TP size: its ranks in the sync group, its payloads per tensor push. Attached servers
        are asked once (/server_info tp_size; dp_size > 1 is refused, naming the URL)."""
        if self._tps is None:
            self._tps = [sync_ranks(u, server_info(u, headers=self._headers, timeout_s=self.client.http_timeout_s))
                         for u in self.urls]
        return self._tps

    def _sync_report(self, version: int, seconds: float, servers: int) -> None:
        """sync/seconds, sync/gbytes (bytes pushed / 1e9), sync/gbps of this update into take_metrics(), and
        one line on stdout. At 32B (bf16) one server copy is 65 GB: "distributed" broadcasts it once over the
        group of the trainer and the 16 servers' 64 TP ranks (65 GB, ~3-7 s at 10-25 GB/s); "tensor" hands it
        to each server (65 GB per server); "disk" writes it once (65 GB of shards)."""
        gbytes = self._sync_bytes / 1e9
        gbps = gbytes / seconds if seconds > 0 else 0.0
        with self._lock:
            self._metrics["sync/seconds"] += seconds
            self._metrics["sync/gbytes"] += gbytes
            self._metrics["sync/gbps"] = gbps
        print(f"[megatron-dapo] weight sync v{version}: {gbytes:.2f} GB in {seconds:.2f} s ({gbps:.2f} GB/s) "
              f"to {servers} servers", flush=True)


    def _keeping(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Yields `buckets`, keeping a host copy of each as the new `_kept` (old bucket k dropped as the new
        bucket k arrives: one version plus one bucket in memory)."""
        old, self._kept = self._kept, []
        for k, bucket in enumerate(buckets):
            if k < len(old):
                old[k] = None
            self._kept.append(Bucket(flat=bucket.flat.detach().to("cpu", copy=True), metas=bucket.metas))
            yield bucket

    def _send(self, targets: list[int], path: str, body: dict, lost: set[int]) -> list[int]:
        """POSTs `body` to each target; returns those that answered. A ServerDied adds the server to `lost`;
        a refusal (success: false, 4xx) is raised."""
        async def go():
            return await asyncio.gather(*(self._post(self.urls[i], path, body) for i in targets),
                                        return_exceptions=True)

        ok = []
        for i, reply in zip(targets, self._call(go(), self.client.timeout_for(path) + CALL_MARGIN_S)):
            if isinstance(reply, ServerDied):
                lost.add(i)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                _check_success(reply, path.lstrip("/"))
                ok.append(i)
        return ok

    def _push_tensor(self, targets: list[int], buckets: Iterable[Bucket], version: int) -> set[int]:
        """Buckets by handle (megatron_dapo/weight_sync/tensor_ipc.py): CUDA IPC on GPU, /dev/shm on CPU.

        Returns the servers lost on the way (the others got every bucket)."""
        cuda = torch.cuda.is_available()
        if not cuda:
            torch.multiprocessing.set_sharing_strategy("file_system")
            check_shm_space(self.client.bucket_bytes)  # before the servers enter their update session
        lost: set[int] = set()
        pool = IpcBucketPool()  # CUDA: buckets outside the expandable segments (tensor_ipc.py), none on CPU
        live = self._send(targets, "/begin_weight_update", {}, lost)
        try:
            for bucket in buckets:
                if not live:
                    break
                flat = stage_bucket(bucket.flat, cuda=cuda, pool=pool)
                views = Bucket(flat=flat, metas=bucket.metas).named_tensors()
                # One payload per server TP rank: each rank's deserialization takes one IPC reference.
                by_tp = {}
                for tp in sorted({self.tps[i] for i in live}):
                    body = {"serialized_named_tensors": [serialize_named_tensors(views) for _ in range(tp)],
                            "flush_cache": False, "weight_version": str(version)}
                    by_tp[tp] = self._send([i for i in live if self.tps[i] == tp],
                                           "/update_weights_from_tensor", body, lost)
                live = [i for i in live if i in set().union(*by_tp.values())]
                self._sync_bytes += bucket.flat.numel() * bucket.flat.element_size() * len(live)
                del flat, views, body  # the servers have loaded it: at most one bucket alive at a time
                if cuda:
                    torch.cuda.ipc_collect()  # free the bucket's GPU block now that no server holds it
        finally:
            pool.release()
            live = self._send(live, "/end_weight_update", {}, lost)
        self._flush(live)
        return lost

    def _push_distributed(self, targets: list[int], buckets: Iterable[Bucket], version: int) -> set[int]:
        """One broadcast per bucket over a group of the trainer and the targets' TP ranks. The group is built
        for a set of servers and rebuilt when that set changes (a server lost or re-synced alone). A server
        lost mid-broadcast breaks the collective: the rest of the version is kept, the group torn down, and
        the survivors get the whole version again over a fresh group."""
        from megatron_dapo.weight_sync.sync_group import broadcast_tensors

        lost: set[int] = set()
        if not targets:
            return lost
        try:
            group_name = self._ensure_sync_group(targets)
        except ServerDied:
            lost |= set(i for i in targets if not self._answers(i))
            self._drop_sync_group(targets)
            survivors = [i for i in targets if i not in lost]
            if not survivors or survivors == targets:
                raise
            return lost | self._push_distributed(survivors, buckets, version)
        live = self._send(targets, "/begin_weight_update", {}, lost)
        broken = False
        try:
            for bucket in buckets:
                if broken or live != targets:
                    broken = True
                    continue  # the group lost a member: keep draining (and keeping) the version
                body = {"names": [m.name for m in bucket.metas],
                        "dtypes": [str(m.dtype).removeprefix("torch.") for m in bucket.metas],
                        "shapes": [list(m.shape) for m in bucket.metas], "group_name": group_name,
                        "load_format": "flattened_bucket", "flush_cache": False,
                        "weight_version": str(version)}
                # The servers block in their receive until we broadcast: post first, then send.
                futures = {i: asyncio.run_coroutine_threadsafe(
                    self._post(self.urls[i], "/update_weights_from_distributed", body), self._loop) for i in live}
                flat = bucket.flat.contiguous()
                if self.client.sync_backend == "nccl":
                    flat = flat.cuda()
                try:
                    broadcast_tensors(self._sync_group, [flat.view(torch.uint8)])
                    self._sync_bytes += flat.numel() * flat.element_size()  # once over the group
                except RuntimeError:
                    broken = True
                for i, f in futures.items():
                    try:
                        _check_success(f.result(self.client.control_timeout_s + CALL_MARGIN_S),
                                       "update_weights_from_distributed")
                    except ServerDied:
                        lost.add(i)
                        broken = True
                live = [i for i in live if i not in lost]
        finally:
            live = self._send(live, "/end_weight_update", {}, lost)
        if broken:
            lost |= set(i for i in targets if not self._answers(i))
            self._drop_sync_group([i for i in targets if i not in lost])
            survivors = [i for i in targets if i not in lost]
            if survivors:  # they may hold a partial version: send them the whole kept copy
                copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in self._kept)
                lost |= self._push_distributed(survivors, copies, version)
            return lost
        self._flush(live)
        return lost

    def _ensure_sync_group(self, targets: list[int]) -> str:
        """The broadcast group of exactly `targets` (rank 0 = this process, then each server's TP ranks)."""
        from megatron_dapo.weight_sync.sync_group import init_weight_sync_group

        if self._sync_group is not None and self._sync_members == targets and not self._sync_dirty:
            return self._sync_name
        if self._sync_group is not None:
            self._drop_sync_group(self._sync_members)
        self._sync_dirty = False
        self._sync_generation += 1
        # torch.distributed keeps group names per process: unique across every engine this process made
        name = f"megatron_dapo_weight_sync_{next(_SYNC_GROUP_IDS)}"
        port = self.client.sync_master_port + self._sync_generation - 1
        world, offsets = sync_group_layout([self.tps[i] for i in targets])
        futures = [asyncio.run_coroutine_threadsafe(self._post(self.urls[i], "/init_weights_update_group", {
            "master_address": self.client.sync_master_address, "master_port": port,
            "rank_offset": offsets[k], "world_size": world, "group_name": name,
            "backend": self.client.sync_backend}), self._loop) for k, i in enumerate(targets)]
        self._sync_group = init_weight_sync_group(
            master_address=self.client.sync_master_address, master_port=port, world_size=world,
            group_name=name, backend=self.client.sync_backend, timeout_s=self.client.control_timeout_s)
        self._sync_members, self._sync_name = list(targets), name
        for f in futures:
            _check_success(f.result(self.client.control_timeout_s + CALL_MARGIN_S), "init_weights_update_group")
        return name

    def _drop_sync_group(self, members: list[int]) -> None:
        """Forgets the current broadcast group on this side and on the given (live) servers."""
        if self._sync_group is None:
            return
        group, name, self._sync_group = self._sync_group, self._sync_name, None
        with contextlib.suppress(Exception):  # a group with a dead member may not tear down cleanly
            torch.distributed.destroy_process_group(group)
        alive = [i for i in members if self._answers(i)]

        async def go():  # a restarted server never had the group and answers 400: nothing to do there
            await asyncio.gather(*(self._post(self.urls[i], "/destroy_weights_update_group", {"group_name": name})
                                   for i in alive), return_exceptions=True)

        self._call(go(), self.client.control_timeout_s + CALL_MARGIN_S)

    def _close_sync_group(self) -> None:
        """At shutdown, before the servers stop: ends the broadcast group on the live servers and here.

        A gloo group still alive when its process exits can abort it at interpreter exit ("terminate called
        without an active exception": its worker threads outlive the interpreter), and a server run outside
        this trainer would keep a group whose rank 0 is gone. Waits for a re-sync in flight (it uses the
        group) up to ClientConfig.control_timeout_s; costs one /health and one /destroy_weights_update_group
        per member server."""
        if self._sync_group is None:
            return
        if not self._weights_lock.acquire(timeout=self.client.control_timeout_s):
            print(f"[megatron-dapo] warning: a re-sync still holds weight-sync group {self._sync_name} after "
                  f"{self.client.control_timeout_s:.0f} s; shutting down without ending it", flush=True)
            return
        try:
            self._drop_sync_group(self._sync_members)
        finally:
            self._weights_lock.release()

    def _answers(self, server: int) -> bool:
        async def check():
            try:
                return (await self._http.get(f"{self.urls[server]}/health")).status_code == 200  # http_timeout_s
            except httpx.HTTPError:
                return False

        return self._call(check(), self.client.http_timeout_s + CALL_MARGIN_S)

    def _push_disk(self, targets: list[int], buckets: Iterable[Bucket], version: int) -> set[int]:
        """Writes the version as safetensors shards, then /update_weights_from_disk on each target; returns the
        servers lost. The shards stay until the next version is written: they are the copy a lost server
        re-syncs from."""
        from safetensors.torch import save_file

        root = Path(self.client.disk_dir or tempfile.mkdtemp(prefix="sglang_weights_"))
        out = root / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        index: dict[str, str] = {}
        for k, bucket in enumerate(buckets):
            shard = f"model-{k:05d}.safetensors"
            save_file({n: t.clone() for n, t in bucket.named_tensors()}, str(out / shard))
            self._sync_bytes += bucket.flat.numel() * bucket.flat.element_size()
            index.update({m.name: shard for m in bucket.metas})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        if self.group is not None:  # the servers need the config next to the weights
            src = Path(self.group.config.model_path)
            for name in ("config.json", "generation_config.json"):
                if (src / name).is_file():
                    shutil.copy(src / name, out / name)
        lost: set[int] = set()
        live = self._send(targets, "/update_weights_from_disk", {"model_path": str(out),
                                                                 "weight_version": str(version)}, lost)
        old, self._disk_weights = self._disk_weights, str(out)
        if old and old != str(out):
            shutil.rmtree(old, ignore_errors=True)
        self._flush(live)
        return lost

    def _flush(self, targets: list[int]) -> None:
        async def go():
            await asyncio.gather(*(self._http.post(f"{self.urls[i]}/flush_cache") for i in targets),  # http_timeout_s
                                 return_exceptions=True)  # a server that died since is being recovered

        self._call(go(), self.client.http_timeout_s + CALL_MARGIN_S)


def _check_success(reply: Any, what: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {reply.get('message')}")
