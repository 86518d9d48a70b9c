"""The "tensor" transport: /update_weights_from_tensor, buckets passed by handle: CUDA IPC on GPU (servers that see
the trainer's GPU: colocated, or on --sglang-gpus that include it), shared memory on CPU (weight_sync/tensor_ipc.py).
Wrapped in /begin_weight_update ... /end_weight_update, which SGLang 0.5.23 requires.

Bytes pushed per sync at Qwen2.5-32B: 65 GB per server (each reads the bucket through its handle); rank 0 keeps
the host copy (61.03 GiB, weight_sync/server_push.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from megatron_dapo.rollout.sglang.setup import gpu_list
from megatron_dapo.weight_sync.buckets import Bucket
from megatron_dapo.weight_sync.server_push import ServerPush
from megatron_dapo.weight_sync.tensor_ipc import IpcBucketPool, check_shm_space, serialize_named_tensors, stage_bucket
from megatron_dapo.weight_sync.transports import register_transport

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.engine import UpdateSession


@register_transport("tensor")
class TensorPush(ServerPush):
    """Buckets by handle to every server TP rank; the host copy re-syncs a lost server."""

    @classmethod
    def check_placement(cls, *, cuda: bool, trainer_gpu: str | None, server_gpus: str | None) -> None:
        """On CUDA the servers open CUDA IPC handles of global rank 0's GPU `trainer_gpu`: launched servers must
        see it among `server_gpus`."""
        if cuda and server_gpus is not None and trainer_gpu is not None and trainer_gpu not in gpu_list(server_gpus):
            raise ValueError(
                f"--weight-sync-mode tensor hands the servers CUDA IPC handles of global rank 0's GPU {trainer_gpu}, "
                f"which servers on --sglang-gpus {server_gpus} cannot open: use --weight-sync-mode distributed "
                f"(NCCL) or disk, or run the servers on the actor's GPUs with --colocate"
            )

    @classmethod
    def check_host(cls, *, cuda: bool, bucket_bytes: int) -> None:
        """On CPU a bucket crosses through /dev/shm: its free space must hold one (tensor_ipc.check_shm_space)."""
        if not cuda:
            check_shm_space(bucket_bytes)

    def send(self, targets: list[int], buckets: Iterable[Bucket], version: int,
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
