"""Write the live actor as an HF checkpoint (safetensors shards + index + config + tokenizer files).

Every rank iterates the collective `weights.export.iter_hf_weights` (TP all-gather, PP broadcast);
global rank 0 writes. Shards are filled in export order up to `max_shard_bytes` (any grouping is a
valid HF sharded checkpoint, the index names each tensor's file), so rank 0 holds at most one shard.
The directory is written under `<out>.tmp` and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from megatron_dapo.weights.export import iter_hf_weights
from megatron_dapo.weights.hf_format import copy_assets

DEFAULT_SHARD_BYTES = 5 * 2**30
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def export_hf(actor, out_dir: str | os.PathLike, source_hf_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path | None:
    """Export `actor`'s current weights to `out_dir` (all ranks call; rank 0 writes and returns the path).

    config.json and the tokenizer files come from `source_hf_dir` (the architecture does not change
    in training); the dtype is the actor's parameter dtype.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out, tmp = Path(out_dir), Path(f"{out_dir}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(tmp / name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for name, tensor in iter_hf_weights(actor.model, actor.arch):
        if rank != 0:
            continue  # every rank iterates the collective; rank 0 writes
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += nbytes
        total_bytes += nbytes
    if rank != 0:
        return None
    flush()
    if len(files) == 1:
        os.replace(tmp / files[0], tmp / "model.safetensors")
    else:
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
    config = json.loads((Path(source_hf_dir) / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        if key in config:
            config[key] = _DTYPE_NAMES.get(actor.config.torch_params_dtype, "float32")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    copy_assets(source_hf_dir, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out
