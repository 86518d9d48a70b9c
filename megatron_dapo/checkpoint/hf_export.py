"""Write the live actor as an HF checkpoint (safetensors shards + index + config + tokenizer files).

Every rank iterates the collective `weights.export.iter_hf_weights` (TP all-gather, PP broadcast);
global rank 0 writes. Shards are filled in export order up to `max_shard_bytes` (any grouping is a
valid HF sharded checkpoint, the index names each tensor's file), so rank 0 holds at most one shard.

Nothing the exporter did not write is ever deleted. The export is written into a fresh sibling
directory `.<name>.export-*`, marked with `EXPORT_MARKER`, and renamed into place when complete. The
target may be absent, an empty directory, or an earlier export (it has the marker), which is replaced;
any other directory or file makes `check_export_target` raise, at start-up and again before the rename.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.errors import UserError, disk_full_error, is_disk_full
from megatron_dapo.models.hf_config import read_config_json
from megatron_dapo.weights.export import iter_hf_weights
from megatron_dapo.weights.hf_format import copy_assets
from megatron_dapo.weights.safetensors_io import write_safetensors

DEFAULT_SHARD_BYTES = 5 * 2**30
EXPORT_MARKER = "megatron_dapo_export.json"
"""Written into every export; only a directory holding it may be replaced by a later export."""
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def check_export_target(out_dir: str | os.PathLike) -> None:
    """Raise UserError unless `out_dir` is absent, an empty directory, or an earlier export (has the marker)."""
    out = Path(out_dir)
    if out.is_symlink():
        raise UserError(f"--export-hf {out} is a symbolic link; pass the directory it points to, or a new one")
    if not out.exists():
        return
    if not out.is_dir():
        raise UserError(f"--export-hf {out} exists and is not a directory; pass a new or empty directory")
    if (out / EXPORT_MARKER).is_file() or not any(out.iterdir()):
        return
    raise UserError(
        f"--export-hf {out} is a non-empty directory that is not an earlier export of this trainer (it has no "
        f"{EXPORT_MARKER}); it would be replaced, so pass a new or empty directory instead"
    )


def export_hf(actor, out_dir: str | os.PathLike, source_hf_dir: str | os.PathLike, *,
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path | None:
    """Export `actor`'s current weights to `out_dir` (all ranks call; rank 0 writes and returns the path).

    config.json and the tokenizer files come from `source_hf_dir` (the architecture does not change
    in training); the dtype is the actor's parameter dtype. At the production setting (Qwen2.5-32B,
    bf16) rank 0 writes 65 GB in 5 GiB shards and holds one shard (5 GiB of host memory) at a time;
    the disk briefly holds the new export next to the previous one. When the target has become
    unreplaceable during the run, the export is left in its temporary directory and UserError names it;
    a full disk removes the partial export and raises UserError naming the path and the free space.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = Path(out_dir)
    tmp = None
    if rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _fresh_sibling(out, "export")
    try:
        files, total_bytes, weight_map = _write_shards(actor, tmp, max_shard_bytes)
        if tmp is None:
            return None
        if len(files) == 1:
            os.replace(tmp / files[0], tmp / "model.safetensors")
        else:
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
        dtype = _DTYPE_NAMES.get(actor.config.torch_params_dtype, "float32")
        config = read_config_json(Path(source_hf_dir) / "config.json")
        for key in ("torch_dtype", "dtype"):
            if key in config:
                config[key] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_assets(source_hf_dir, tmp)
        (tmp / EXPORT_MARKER).write_text(json.dumps({"source_hf_checkpoint": os.fspath(source_hf_dir),
                                                      "dtype": dtype, "files": sorted(files)}, indent=2))
    except BaseException as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)  # our own partial output
        if is_disk_full(err):  # the free space is measured with the partial export removed
            raise disk_full_error(out, "the HF export (--export-hf)") from err
        raise
    try:
        check_export_target(out)
    except UserError as err:
        raise UserError(f"{err}; this export was left in {tmp}") from None
    _move_into_place(tmp, out)
    return out


def _write_shards(actor, tmp: Path | None, max_shard_bytes: int) -> tuple[list[str], int, dict[str, str]]:
    """Iterate the collective export (every rank); rank 0 (tmp not None) writes shards of <= max_shard_bytes."""
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    files: list[str] = []
    shard_bytes = total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(files) + 1:05d}.safetensors"
        # Python writes (not safetensors' Rust save_file, whose SafetensorError hides the errno): a full disk is
        # an OSError that export_hf turns into one line
        write_safetensors(tmp / name, shard.items(), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for name, tensor in iter_hf_weights(actor.chunks, actor.arch):
        if tmp is None:
            continue  # every rank iterates the collective; rank 0 writes
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += nbytes
        total_bytes += nbytes
    if tmp is not None:
        flush()
    return files, total_bytes, weight_map


def _fresh_sibling(out: Path, kind: str) -> Path:
    """A new empty directory `.<name>.<kind>-<random>` next to `out` (permissions from the umask, not 0700)."""
    while True:
        path = out.parent / f".{out.name}.{kind}-{secrets.token_hex(4)}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the complete export `tmp` to `out`, moving an earlier export (or empty dir) aside first.

    `out` is at every moment either the previous complete export or the new one, save the instant
    between the two renames when it is absent (a crash there leaves the previous one in `.<name>.old-*`).
    """
    old = None
    if out.exists():
        old = _fresh_sibling(out, "old")
        os.replace(out, old)  # onto the fresh empty directory
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old)
