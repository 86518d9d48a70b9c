"""Full push to the SGLang servers: the new version in flat buckets to every serving server, by one of three paths.

- "tensor": /update_weights_from_tensor, buckets passed by handle: CUDA IPC on GPU (servers that see the
  trainer's GPU), shared memory on CPU (weight_sync/tensor_ipc.py);
- "distributed": /init_weights_update_group once, then one broadcast per bucket (separate GPUs, NCCL) over the
  group of weight_sync/sync_group.py (at PP > 1 StagePush sends each stage from its own source instead);
- "disk": safetensors shards + /update_weights_from_disk (fallback; any topology with a shared disk).
The tensor and distributed paths are wrapped in /begin_weight_update ... /end_weight_update, which
SGLang 0.5.23 requires.

Every rank iterates the whole-model export (weights/export.py iter_hf_weights: TP all-gather, PP broadcast;
every one of the 128 actor ranks receives the whole model, 65 GB at Qwen2.5-32B bf16); rank 0 alone pushes it
through its engine's servers, the others drop it. The 127 other ranks then wait for rank 0's push at the
trainer's section (one int64 all-reduce). Bytes pushed per sync at 32B: "distributed" 65 GB once over the group
of rank 0 and the 16 servers' 128 TP ranks (~3-7 s at 10-25 GB/s); "tensor" 65 GB per server; "disk" 65 GB of
shards written once.

The host copy (this object's, on rank 0): "tensor" and "distributed" keep every bucket of the last update (one
copy of each bucket as it streams past; the previous version's bucket k is dropped as bucket k of the new one
arrives, so at most one version plus one bucket is held): 61.03 GiB of rank 0's host RAM at 32B (bf16,
planner.host_copy_bytes) and one device-to-host copy of 65 GB per update (~3 s at ~20 GB/s). "disk" keeps no
host copy: the last version's shards on disk (65 GB) are the copy. `recover(server)` re-syncs a lost server
from it (~4-7 s at 32B; from disk ~30 s).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_dapo.rollout.sglang.protocol import CALL_MARGIN_S, ServerDied, check_success
from megatron_dapo.rollout.sglang.setup import sync_group_layout
from megatron_dapo.weight_sync.base import WeightSync, export_to
from megatron_dapo.weight_sync.buckets import Bucket, iter_buckets
from megatron_dapo.weight_sync.tensor_ipc import IpcBucketPool, check_shm_space, serialize_named_tensors, stage_bucket

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.engine import SGLangEngine, UpdateSession

SYNC_GROUP_IDS = itertools.count(1)
"""Names of the weight-sync broadcast groups of this process (a name can be registered only once)."""


class ServerPush(WeightSync):
    """Full push through rank 0's SGLangEngine (None on the other ranks, which only iterate the export).

    Owns the host copy (`kept`, or the disk copy `disk_weights`) and the broadcast group with the servers; it
    attaches itself to the engine, which calls `recover(server)` for a lost server and `close()` at shutdown."""

    def __init__(self, engine: SGLangEngine | None) -> None:
        self.engine = engine
        self.kept: list[Bucket] = []
        """Host copy of the last pushed version (tensor / distributed modes), for re-syncing a lost server."""
        self.disk_weights: str | None = None
        """Disk mode: the directory of the last pushed version's shards."""
        self.generation = 0
        """Broadcast groups built so far (each gets a new name and port: sync_master_port + generation - 1);
        StagePush's stage groups take their ports from the same count."""
        self._group = None
        self._members: list[int] = []
        self._member_losses: list[int] = []
        self._name = ""
        if engine is not None:
            engine.attach_sync(self)

    def _push(self, actor: Any, version: int) -> dict[str, float]:
        if self.engine is None:
            export_to(actor, None)  # stay in step with the collective
            return {}
        export_to(actor, lambda named: self.update(named, version=version))
        return self.engine.take_metrics()  # this step's server recoveries (rollout and sync) and sync/*


    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Pushes the new version to every serving server (rank 0). A server lost during the push is left out of
        the rest of it and recovered in the background; the update completes on the others, and every tensor is
        consumed (iter_hf_weights is a collective the other ranks iterate too) and kept for the catch-up."""
        engine = self.engine
        buckets = iter_buckets(named_tensors, engine.client.bucket_bytes)
        mode = engine.client.update_mode
        with engine.weight_update(version) as session:
            if mode == "disk":
                session.lost |= self._push_disk(session.targets, buckets, version, session)
            else:
                kept = self._keeping(buckets)
                push = self._push_tensor if mode == "tensor" else self.push_distributed
                session.lost |= push(session.targets, kept, version, session)
                for _ in kept:  # every server was lost mid-way: still take (and keep) the whole version
                    pass

    def recover(self, server: int) -> None:
        """Pushes the current version from the host copy (or the disk copy) to one server that lost it."""
        engine = self.engine
        version = engine.weight_version
        if engine.client.update_mode == "disk":
            lost: set[int] = set()
            engine.send([server], "/update_weights_from_disk", {
                "model_path": self.disk_weights, "weight_version": str(version)}, lost)
            if lost:
                raise ServerDied(f"{engine.urls[server]} died again while being re-synced")
            engine.flush([server])
            return
        # A clone per bucket: the push moves its buffer to shared memory, the host copy stays put.
        copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in self.kept)
        push = self._push_tensor if engine.client.update_mode == "tensor" else self.push_distributed
        if push([server], copies, version, None):
            raise ServerDied(f"{engine.urls[server]} died again while being re-synced")

    def close(self) -> None:
        """At shutdown, before the servers stop: ends the broadcast group on the live servers and here, and drops
        the host copy (and the disk copy when it went to a temporary directory).

        A gloo group still alive when its process exits can abort it at interpreter exit ("terminate called
        without an active exception": its worker threads outlive the interpreter), and a server run outside
        this trainer would keep a group whose rank 0 is gone. Waits for a re-sync in flight (it uses the
        group) up to ClientConfig.control_timeout_s; costs one /health and one /destroy_weights_update_group
        per member server."""
        engine = self.engine
        if engine is None:
            return
        if self._group is not None:
            if engine.weights_lock.acquire(timeout=engine.client.control_timeout_s):
                try:
                    self.drop_group(self._members)
                finally:
                    engine.weights_lock.release()
            else:
                print(f"[megatron-dapo] warning: a re-sync still holds weight-sync group {self._name} after "
                      f"{engine.client.control_timeout_s:.0f} s; shutting down without ending it", flush=True)
        self.kept = []
        if self.disk_weights and engine.client.disk_dir is None:
            shutil.rmtree(self.disk_weights, ignore_errors=True)
            self.disk_weights = None

    def _keeping(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Yields `buckets`, keeping a host copy of each as the new `kept` (old bucket k dropped as the new
        bucket k arrives: one version plus one bucket in memory)."""
        old, self.kept = self.kept, []
        for k, bucket in enumerate(buckets):
            if k < len(old):
                old[k] = None
            self.kept.append(Bucket(flat=bucket.flat.detach().to("cpu", copy=True), metas=bucket.metas))
            yield bucket

    def _push_tensor(self, targets: list[int], buckets: Iterable[Bucket], version: int,
                     session: UpdateSession | None) -> set[int]:
        """Buckets by handle (weight_sync/tensor_ipc.py): CUDA IPC on GPU, /dev/shm on CPU.

        Returns the servers lost on the way (the others got every bucket)."""
        engine = self.engine
        cuda = torch.cuda.is_available()
        if not cuda:
            torch.multiprocessing.set_sharing_strategy("file_system")
            check_shm_space(engine.client.bucket_bytes)  # before the servers enter their update session
        lost: set[int] = set()
        pool = IpcBucketPool()  # CUDA: buckets outside the expandable segments (tensor_ipc.py), none on CPU
        live = engine.send(targets, "/begin_weight_update", {}, lost)
        try:
            for bucket in buckets:
                if not live:
                    break
                flat = stage_bucket(bucket.flat, cuda=cuda, pool=pool)
                views = Bucket(flat=flat, metas=bucket.metas).named_tensors()
                # One payload per server TP rank: each rank's deserialization takes one IPC reference.
                by_tp = {}
                for tp in sorted({engine.tps[i] for i in live}):
                    body = {"serialized_named_tensors": [serialize_named_tensors(views) for _ in range(tp)],
                            "flush_cache": False, "weight_version": str(version)}
                    by_tp[tp] = engine.send([i for i in live if engine.tps[i] == tp],
                                            "/update_weights_from_tensor", body, lost)
                live = [i for i in live if i in set().union(*by_tp.values())]
                if session is not None:
                    session.nbytes += bucket.flat.numel() * bucket.flat.element_size() * len(live)
                del flat, views, body  # the servers have loaded it: at most one bucket alive at a time
                if cuda:
                    torch.cuda.ipc_collect()  # free the bucket's GPU block now that no server holds it
        finally:
            pool.release()
            live = engine.send(live, "/end_weight_update", {}, lost)
        engine.flush(live)
        return lost

    def push_distributed(self, targets: list[int], buckets: Iterable[Bucket], version: int,
                         session: UpdateSession | None) -> set[int]:
        """One broadcast per bucket over a group of this process and the targets' TP ranks. The group is built
        for a set of servers and rebuilt when that set changes (a server lost or re-synced alone). A server
        lost mid-broadcast breaks the collective: the rest of the version is kept, the group torn down, and
        the survivors get the whole version again (from `kept`) over a fresh group. Returns the servers lost."""
        from megatron_dapo.weight_sync.sync_group import broadcast_tensors

        engine = self.engine
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
            return lost | self.push_distributed(survivors, buckets, version, session)
        live = engine.send(targets, "/begin_weight_update", {}, lost)
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
                futures = {i: engine.post_later(i, "/update_weights_from_distributed", body) for i in live}
                flat = bucket.flat.contiguous()
                if engine.client.sync_backend == "nccl":
                    flat = flat.cuda()
                try:
                    broadcast_tensors(self._group, [flat.view(torch.uint8)])
                    if session is not None:
                        session.nbytes += flat.numel() * flat.element_size()  # once over the group
                except RuntimeError:
                    broken = True
                for i, f in futures.items():
                    try:
                        check_success(f.result(engine.client.control_timeout_s + CALL_MARGIN_S),
                                      "update_weights_from_distributed")
                    except ServerDied:
                        lost.add(i)
                        broken = True
                live = [i for i in live if i not in lost]
        finally:
            live = engine.send(live, "/end_weight_update", {}, lost)
        if broken:
            lost |= set(i for i in targets if not engine.answers(i))
            self.drop_group([i for i in targets if i not in lost])
            survivors = [i for i in targets if i not in lost]
            if survivors:  # they may hold a partial version: send them the whole kept copy
                copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in self.kept)
                lost |= self.push_distributed(survivors, copies, version, session)
            return lost
        engine.flush(live)
        return lost

    def _ensure_group(self, targets: list[int]) -> str:
        """The broadcast group of exactly `targets` (rank 0 = this process, then each server's TP ranks), rebuilt
        when the targets changed or one of them was lost since it was built."""
        from megatron_dapo.weight_sync.sync_group import init_weight_sync_group

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
        self._group = init_weight_sync_group(
            master_address=client.sync_master_address, master_port=port, world_size=world,
            group_name=name, backend=client.sync_backend, timeout_s=client.control_timeout_s)
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

    def _push_disk(self, targets: list[int], buckets: Iterable[Bucket], version: int,
                   session: UpdateSession | None) -> set[int]:
        """Writes the version as safetensors shards, then /update_weights_from_disk on each target; returns the
        servers lost. The shards stay until the next version is written: they are the copy a lost server
        re-syncs from."""
        from safetensors.torch import save_file

        engine = self.engine
        root = Path(engine.client.disk_dir or tempfile.mkdtemp(prefix="sglang_weights_"))
        out = root / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        index: dict[str, str] = {}
        for k, bucket in enumerate(buckets):
            shard = f"model-{k:05d}.safetensors"
            save_file({n: t.clone() for n, t in bucket.named_tensors()}, str(out / shard))
            if session is not None:
                session.nbytes += bucket.flat.numel() * bucket.flat.element_size()
            index.update({m.name: shard for m in bucket.metas})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        if engine.model_path is not None:  # the servers need the config next to the weights
            src = Path(engine.model_path)
            for name in ("config.json", "generation_config.json"):
                if (src / name).is_file():
                    shutil.copy(src / name, out / name)
        lost: set[int] = set()
        live = engine.send(targets, "/update_weights_from_disk", {"model_path": str(out),
                                                                   "weight_version": str(version)}, lost)
        old, self.disk_weights = self.disk_weights, str(out)
        if old and old != str(out):
            shutil.rmtree(old, ignore_errors=True)
        engine.flush(live)
        return lost
