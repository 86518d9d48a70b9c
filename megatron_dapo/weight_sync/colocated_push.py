"""Weight push of colocated mode (--colocate): every GPU hands its own copy of each bucket to the SGLang TP
rank on the same GPU, by handle; nothing goes through global rank 0.

Engine e runs on the GPUs of global ranks e x g ... (e + 1) x g - 1 (g = --rollout-num-gpus-per-engine), its
TP rank j on rank e x g + j's GPU. iter_hf_weights gives every model-parallel rank the whole model, so every
rank already holds each full bucket: it stages the bucket (on its GPU, or in /dev/shm on CPU), serializes
one handle, and the handles of an engine's g ranks are gathered (gloo, a few hundred bytes each) to the
engine's first rank, which posts /update_weights_from_tensor with the list, entry j for server TP rank j:
the format SGLang expects for TP > 1 (verl's sglang rollout gathers the per-rank handles the same way,
`gather_object` over the TP group to the rank that calls the engine). Each SGLang rank then reads the bucket
from its own GPU: no cross-GPU copy, no NCCL group with the servers.

Cost at the production setting (Qwen2.5-32B bf16, 65 GB, 512 MiB buckets, 32 engines of TP4; the times:
docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B"): each GPU stages 65 GB through one 512 MiB bucket at a time
(one device copy each); each engine reads 65 GB per TP rank from its own GPU; the 32 posting ranks send 194 HTTP
calls each, in parallel over the engines. Per bucket the other ranks of an engine wait on its post (a gloo
barrier), so the push takes as long as the slowest engine's 194 loads (plan_buckets on the 771 tensors); rank 0
holds no host copy (the separate-server path keeps 65 GB of host RAM for re-syncs, this one keeps nothing: a
colocated engine lost mid-run is not re-synced, the run stops).

ColocatedSync is the WeightSync the trainer calls (build_weight_sync picks it under --colocate): every rank's
ColocatedPusher push, then rank 0's engine takes the version. The phase switch around it (release, offload,
resume) stays PhaseSwitcher's (trainer/colocate.py), which calls Trainer.sync_weights between its halves.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import httpx
import torch
import torch.distributed as dist

from megatron_dapo.distributed import comm
from megatron_dapo.weight_sync.base import WeightSync
from megatron_dapo.weight_sync.buckets import Bucket, iter_buckets
from megatron_dapo.weight_sync.tensor_ipc import IpcBucketPool, check_shm_space, serialize_named_tensors, stage_bucket
from megatron_dapo.weights.mapping import keep_together


@dataclass(frozen=True, kw_only=True)
class EngineGroups:
    """This rank's place among the colocated engines, and the gloo group of its engine's ranks."""

    rank: int
    gpus_per_engine: int
    urls: Sequence[str]
    group: object | None
    """gloo group of the engine's ranks (None when an engine has one GPU)."""

    @property
    def engine(self) -> int:
        return self.rank // self.gpus_per_engine

    @property
    def poster(self) -> int:
        """The global rank that posts this engine's updates (its TP rank 0's GPU)."""
        return self.engine * self.gpus_per_engine

    @property
    def url(self) -> str:
        return self.urls[self.engine]


def make_engine_groups(urls: Sequence[str], gpus_per_engine: int) -> EngineGroups:
    """Collective over the world: one gloo group per engine (every rank creates every group, in order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % gpus_per_engine or world // gpus_per_engine != len(urls):
        raise ValueError(f"{world} ranks / --rollout-num-gpus-per-engine {gpus_per_engine} engines, but "
                         f"{len(urls)} engine URLs (--sglang-server-urls, or the launched servers)")
    mine = None
    if gpus_per_engine > 1:
        for e in range(len(urls)):
            g = dist.new_group(list(range(e * gpus_per_engine, (e + 1) * gpus_per_engine)), backend="gloo")
            if e == rank // gpus_per_engine:
                mine = g
    return EngineGroups(rank=rank, gpus_per_engine=gpus_per_engine, urls=list(urls), group=mine)


class ColocatedPusher:
    """Pushes a weight version to this rank's engine as part of a collective over every rank."""

    def __init__(self, groups: EngineGroups, *, bucket_bytes: int, api_key: str | None = None,
                 timeout_s: float = 600.0, http_timeout_s: float = 60.0) -> None:
        """`timeout_s`: each weight-update call; `http_timeout_s`: the cache flush (--sglang-http-timeout)."""
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 (--weight-sync-bucket-mb), got {bucket_bytes}")
        self.groups = groups
        self.bucket_bytes = bucket_bytes
        self.timeout_s, self.http_timeout_s = timeout_s, http_timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    @property
    def posts(self) -> bool:
        return self.groups.rank == self.groups.poster

    def _post(self, path: str, body: dict) -> dict | None:
        resp = httpx.post(f"{self.groups.url.rstrip('/')}{path}", json=body, headers=self._headers,
                          timeout=self.timeout_s)
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang {self.groups.url}{path} answered {resp.status_code}: {resp.text[:500]}")
        reply = resp.json() if resp.content else None
        if isinstance(reply, dict) and reply.get("success") is False:
            raise RuntimeError(f"SGLang {self.groups.url}{path} failed: {reply.get('message')}")
        return reply

    def _gather(self, handle: str) -> list[str] | None:
        """Every rank's handle of this engine on the poster, in TP-rank order (None elsewhere).

        Over the engine's gloo group (CPU): the poster receives g handles of a few hundred bytes; each rank
        waits for the slowest of its engine to stage the bucket (a device copy of it)."""
        g = self.groups
        if g.group is None:
            return [handle]
        return comm.gather_object(handle, g.poster, g.group)

    def _section(self, what: str) -> AbstractContextManager[None]:
        """The poster's HTTP call, then the engine's ranks meet (comm.section over the engine's gloo group: one
        int64 all-reduce; CPU, outside any NCCL watchdog). They wait on the poster's /update_weights_from_tensor
        (a bucket loaded on every TP rank: well under a second per 512 MiB bucket; the post gives up after
        `timeout_s`); if the poster's call fails, the others raise "global rank r failed <what>" at once instead of
        waiting for it in the next gather until its process is gone or the group's 30-minute timeout."""
        return comm.section(what, self.groups.group) if self.groups.group is not None else nullcontext()

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
             keep_together: Mapping[str, str] | None = None) -> dict[str, float]:
        """Every rank calls this with the same tensors (iter_hf_weights). Returns sync/seconds and sync/gbytes
        (bytes this engine loaded, over its TP ranks, / 1e9: on the poster; 0 elsewhere). `keep_together`: HF
        names a bucket may not end with (`weights.mapping.keep_together`)."""
        cuda = torch.cuda.is_available()
        if not cuda:
            torch.multiprocessing.set_sharing_strategy("file_system")
            check_shm_space(self.bucket_bytes)
        t0, nbytes = time.perf_counter(), 0
        pool = IpcBucketPool()  # CUDA: buckets outside the expandable segments (tensor_ipc.py), none on CPU
        with self._section(f"starting a weight update of {self.groups.url}"):
            if self.posts:
                self._post("/begin_weight_update", {})
        try:
            for bucket in iter_buckets(named_tensors, self.bucket_bytes, keep_together):
                flat = stage_bucket(bucket.flat, cuda=cuda, pool=pool)
                handle = serialize_named_tensors(Bucket(flat=flat, metas=bucket.metas).named_tensors())
                handles = self._gather(handle)
                with self._section(f"posting a weight bucket to {self.groups.url}"):
                    if self.posts:
                        self._post("/update_weights_from_tensor", {
                            "serialized_named_tensors": handles, "flush_cache": False,
                            "weight_version": str(version)})
                        nbytes += bucket.nbytes * self.groups.gpus_per_engine
                # past the section the engine has read every rank's bucket: each may drop its own
                del flat
                if cuda:
                    torch.cuda.ipc_collect()
        finally:
            pool.release()
            if self.posts:
                self._post("/end_weight_update", {})
        if self.posts:  # drop prefix-cache entries computed with the old weights (its reply is plain text)
            httpx.post(f"{self.groups.url.rstrip('/')}/flush_cache", headers=self._headers,
                       timeout=self.http_timeout_s)
        return {"sync/seconds": time.perf_counter() - t0, "sync/gbytes": nbytes / 1e9}


class ColocatedSync(WeightSync):
    """--colocate: every rank pushes its own bucket handles to the engine on its GPU (ColocatedPusher); rank 0's
    engine (None elsewhere) then serves the new version. Keeps no host copy: `recover` refuses, so a colocated
    engine lost mid-run stops the run instead of serving old weights."""

    def __init__(self, pusher: ColocatedPusher, engine: Any | None) -> None:
        self.pusher, self.engine = pusher, engine
        if engine is not None:
            engine.attach_sync(self)

    def _push(self, actor: Any, version: int) -> dict[str, float]:
        from megatron_dapo.weights.export import iter_hf_weights

        metrics = self.pusher.push(iter_hf_weights(actor.chunks, actor.arch), version=version,
                                   keep_together=keep_together(actor.arch))
        if self.engine is not None:
            self.engine.set_weight_version(version)
            metrics = self.engine.take_metrics() | metrics  # its sync/* stay 0: the push went around it
        return metrics

    def recover(self, server: int) -> None:
        raise RuntimeError(f"{self.engine.urls[server]} was lost in colocated mode at weight version "
                           f"{self.engine.weight_version}: its weights came from the actor ranks on its GPUs, not "
                           f"from rank 0, which keeps no copy; restart the run from its last checkpoint (--load)")
