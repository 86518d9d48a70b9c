"""Full push to the SGLang servers: the new version in flat buckets to every serving server, by one transport.

ServerPush is what the transports share (the export, the update session, the host copy, the re-sync of a lost
server); each transport is one subclass in weight_sync/transports/ ("tensor": CUDA IPC / shared-memory handles;
"distributed": a broadcast group with the servers; "disk": safetensors shards), registered there under its
--weight-sync-mode name and chosen once when the run is built (weight_sync/build.py).

Every rank iterates the whole-model export (weights/export.py iter_hf_weights: TP all-gather, PP broadcast;
every one of the 128 actor ranks receives the whole model, 65 GB at Qwen2.5-32B bf16); rank 0 alone pushes it
through its engine's servers, the others drop it. The 127 other ranks then wait for rank 0's push at the
trainer's section (one int64 all-reduce). Bytes pushed per sync at 32B: "distributed" 65 GB once over the group
of rank 0 and the 16 servers' 128 TP ranks; "tensor" 65 GB per server; "disk" 65 GB of shards written once (the
time each takes: docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B").

The host copy (this object's, on rank 0): "tensor" and "distributed" keep every bucket of the last update (one
copy of each bucket as it streams past; the previous version's bucket k is dropped as bucket k of the new one
arrives, so at most one version plus one bucket is held): 61.03 GiB of rank 0's host RAM at 32B (bf16,
planner.report.host_copy_bytes) and one device-to-host copy of 65 GB per update. "disk" keeps no host copy: the
last version's shards on disk (65 GB) are the copy. `recover(server)` re-syncs a lost server from it.

This module imports rollout/sglang/ (the engine's protocol), never the reverse (weight_sync/transports/__init__.py).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megatron_dapo.rollout.sglang.protocol import ServerDied
from megatron_dapo.weight_sync.base import WeightSync, export_to
from megatron_dapo.weight_sync.buckets import Bucket, iter_buckets
from megatron_dapo.weights.mapping import keep_together

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.engine import SGLangEngine, UpdateSession


class ServerPush(WeightSync):
    """Full push through rank 0's SGLangEngine (None on the other ranks, which only iterate the export), by the
    transport of the subclass (`send`).

    Owns the host copy (`kept`; a transport may keep another, as disk's shards) and whatever the transport holds
    with the servers; it attaches itself to the engine, which calls `recover(server)` for a lost server and
    `close()` at shutdown."""

    per_stage: ClassVar[bool] = False
    """Whether at PP > 1 each pipeline stage sends its own part (StagePush around this transport,
    weight_sync/stage_push.py) instead of rank 0 the whole model."""
    server_group: ClassVar[bool] = False
    """Whether it broadcasts over a torch.distributed group with the servers' TP ranks (NCCL on CUDA), whose
    NCCL_CUMEM_ENABLE must match SGLang's where both run on one node (weight_sync/nccl_env.py)."""

    def __init__(self, engine: SGLangEngine | None) -> None:
        self.engine = engine
        self.kept: list[Bucket] = []
        """Host copy of the last pushed version, for re-syncing a lost server (the transports that keep one)."""
        if engine is not None:
            engine.attach_sync(self)

    @classmethod
    def check_placement(cls, *, cuda: bool, trainer_gpu: str | None, server_gpus: str | None) -> None:
        """Raises ValueError if this transport cannot reach servers placed so (`trainer_gpu`: global rank 0's
        physical GPU; `server_gpus`: --sglang-gpus of launched servers, None when attached). Pure, before any
        server starts."""

    @classmethod
    def check_host(cls, *, cuda: bool, bucket_bytes: int) -> None:
        """Raises if rank 0's machine cannot hold what this transport needs per bucket; before minutes of server
        start-up (rollout/build.py)."""

    def _push(self, actor: Any, version: int) -> dict[str, float]:
        if self.engine is None:
            export_to(actor, None)  # stay in step with the collective
            return {}
        glue = keep_together(actor.arch)
        export_to(actor, lambda named: self.update(named, version=version, keep_together=glue))
        return self.engine.take_metrics()  # this step's server recoveries (rollout and sync) and sync/*

    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
               keep_together: Mapping[str, str] | None = None) -> None:
        """Pushes the new version to every serving server (rank 0). A server lost during the push is left out of
        the rest of it and recovered in the background; the update completes on the others, and every tensor is
        consumed (iter_hf_weights is a collective the other ranks iterate too) and kept for the catch-up.
        `keep_together`: pairs a bucket carries together (`weights.mapping.keep_together`)."""
        engine = self.engine
        buckets = iter_buckets(named_tensors, engine.client.bucket_bytes, keep_together)
        with engine.weight_update(version) as session:
            session.lost |= self._update(session.targets, buckets, version, session)

    def _update(self, targets: list[int], buckets: Iterable[Bucket], version: int,
                session: UpdateSession) -> set[int]:
        """Sends the version to `targets`, keeping it as the host copy; returns the servers lost."""
        kept = self._keeping(buckets)
        lost = self.send(targets, kept, version, session)
        for _ in kept:  # every server was lost mid-way: still take (and keep) the whole version
            pass
        return lost

    def recover(self, server: int) -> None:
        """Pushes the current version from the host copy (or the transport's own copy) to one server that lost
        it."""
        engine = self.engine
        if self._resync(server, engine.weight_version):
            raise ServerDied(f"{engine.urls[server]} died again while being re-synced")

    def _resync(self, server: int, version: int) -> set[int]:
        """Sends the host copy to `server`; returns it if it was lost again."""
        # A clone per bucket: the push moves its buffer to shared memory, the host copy stays put.
        copies = (Bucket(flat=b.flat.clone(), metas=b.metas) for b in self.kept)
        return self.send([server], copies, version, None)

    @abc.abstractmethod
    def send(self, targets: list[int], buckets: Iterable[Bucket], version: int,
             session: UpdateSession | None) -> set[int]:
        """Sends `buckets` (one version) to the servers `targets` (indices into the engine's urls); adds the bytes
        moved to `session.nbytes` (None: a re-sync). Returns the servers lost on the way (the others got every
        bucket)."""

    def close(self) -> None:
        """At shutdown, before the servers stop: drops the host copy (a transport also ends what it holds with
        the servers, and its own copy)."""
        if self.engine is None:
            return
        self.kept = []

    def _keeping(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        """Yields `buckets`, keeping a host copy of each as the new `kept` (old bucket k dropped as the new
        bucket k arrives: one version plus one bucket in memory)."""
        old, self.kept = self.kept, []
        for k, bucket in enumerate(buckets):
            if k < len(old):
                old[k] = None
            self.kept.append(Bucket(flat=bucket.flat.detach().to("cpu", copy=True), metas=bucket.metas))
            yield bucket
