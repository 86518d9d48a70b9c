"""The "disk" transport: safetensors shards + /update_weights_from_disk (the fallback; any topology with a disk
the servers see, --weight-sync-mode disk).

Bytes per sync at Qwen2.5-32B: 65 GB of shards written once, read by every server. No host copy: the last
version's shards on disk (65 GB) are the copy a lost server re-syncs from (its time: docs/BENCHMARKS.md, "Weight
sync at Qwen2.5-32B").
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_dapo.weight_sync.buckets import Bucket
from megatron_dapo.weight_sync.server_push import ServerPush
from megatron_dapo.weight_sync.transports import register_transport

if TYPE_CHECKING:
    from megatron_dapo.rollout.sglang.engine import SGLangEngine, UpdateSession


@register_transport("disk")
class DiskPush(ServerPush):
    """Writes each version as shards (ClientConfig.disk_dir, else a temporary directory) that the servers load."""

    def __init__(self, engine: SGLangEngine | None) -> None:
        super().__init__(engine)
        self.disk_weights: str | None = None
        """The directory of the last pushed version's shards."""

    def _update(self, targets: list[int], buckets: Iterable[Bucket], version: int,
                session: UpdateSession) -> set[int]:
        return self.send(targets, buckets, version, session)  # the shards are the copy: no host copy

    def _resync(self, server: int, version: int) -> set[int]:
        """The last version's shards, loaded again by `server`."""
        engine = self.engine
        lost: set[int] = set()
        engine.send([server], "/update_weights_from_disk", {
            "model_path": self.disk_weights, "weight_version": str(version)}, lost)
        if not lost:
            engine.flush([server])
        return lost

    def close(self) -> None:
        """At shutdown: drops the shards when they went to a temporary directory."""
        super().close()
        if self.engine is not None and self.disk_weights and self.engine.client.disk_dir is None:
            shutil.rmtree(self.disk_weights, ignore_errors=True)
            self.disk_weights = None

    def send(self, targets: list[int], buckets: Iterable[Bucket], version: int,
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
