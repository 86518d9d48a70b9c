"""HF Qwen2 safetensors -> Megatron per-rank safetensors, streamed one parameter at a time.

Peak memory is one parameter's HF tensors plus its TP shards (the embedding is the largest: vocab x
hidden), independent of model size: headers are written first from config-derived shapes, then each
TP rank's file receives its shard's bytes in order.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint_convert.atomic_dir import atomic_output_dir
from megatron_dapo.models.hf_config import Qwen2Arch
from megatron_dapo.parallel import ParallelLayout, validate_layout
from megatron_dapo.weights.hf_format import HFCheckpointReader, copy_assets
from megatron_dapo.weights.mcore_format import (
    ARGS_FILE,
    ASSETS_DIR,
    DTYPES,
    TRACKER_FILE,
    check_args,
    megatron_args,
    rank_file,
    read_args,
)
from megatron_dapo.weights.plan import hf_tensor_specs, iter_mcore_shards, mcore_stage_specs
from megatron_dapo.weights.safetensors_io import CheckpointError, StreamingSafetensorsWriter


@dataclass(kw_only=True)
class HfToMcoreConfig:
    hf_path: str
    """--hf-path: HF model directory (config.json + safetensors; only config.json for --dry-run)."""
    save: str
    """--save: output Megatron checkpoint directory."""
    tp: int = 1
    """--tp: tensor-parallel size the checkpoint is sharded for."""
    pp: int = 1
    """--pp: pipeline-parallel size."""
    dtype: str | None = None
    """--dtype: fp32 | bf16 | fp16; default keeps the HF checkpoint's dtype (bit-exact)."""
    overwrite: bool = False
    """--overwrite: replace an existing --save directory."""
    dry_run: bool = False
    """--dry-run: print the Megatron args and per-rank shapes; read only config.json, write nothing."""

    def __post_init__(self) -> None:
        if not os.path.isdir(self.hf_path):
            raise FileNotFoundError(f"--hf-path {self.hf_path} is not a directory")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.layout = ParallelLayout(tp=self.tp, pp=self.pp)


def describe(arch: Qwen2Arch, layout: ParallelLayout, dtype: torch.dtype, args: dict[str, Any]) -> str:
    """Megatron args and per-stage shard shapes as printable text (every TP rank of a stage is alike)."""
    lines = ["megatron args:", json.dumps({k: v for k, v in args.items() if k != "hf_config"}, indent=2)]
    for pp_rank in range(layout.pp):
        specs = mcore_stage_specs(arch, layout, pp_rank, dtype)
        nbytes = sum(s.nbytes for s in specs)
        lines.append(
            f"pp stage {pp_rank}: each of {layout.tp} TP rank(s) holds {len(specs)} tensors, "
            f"{nbytes / 1e9:.3f} GB"
        )
        lines += [f"  {s.name} {list(s.shape)}" for s in specs]
    return "\n".join(lines)


def _check_existing(save: str, arch: Qwen2Arch, layout: ParallelLayout) -> None:
    """A --save that already holds a checkpoint of another model/layout is named in the error."""
    if os.path.isfile(os.path.join(save, ARGS_FILE)):
        check_args(read_args(save), arch, layout, source=f"existing checkpoint {save}")


def hf_to_mcore(cfg: HfToMcoreConfig) -> dict[str, Any]:
    """Convert; returns the Megatron args written to args.json (or that would be, for a dry run)."""
    with open(os.path.join(cfg.hf_path, "config.json")) as f:
        hf_config = json.load(f)
    arch = Qwen2Arch.from_hf(hf_config)
    validate_layout(arch, cfg.layout)
    if cfg.dry_run:
        dtype = DTYPES[cfg.dtype or "bf16"]
        args = megatron_args(arch, cfg.layout, dtype=dtype, hf_config=hf_config)
        print(describe(arch, cfg.layout, dtype, args))
        return args
    if os.path.exists(cfg.save) and not cfg.overwrite:
        try:
            _check_existing(cfg.save, arch, cfg.layout)
        except CheckpointError as e:
            raise FileExistsError(f"--save {cfg.save} already exists and differs: {e}") from e
    with HFCheckpointReader(cfg.hf_path) as reader:
        src_dtype = reader.dtype()
        reader.check_expected(hf_tensor_specs(arch, src_dtype))
        dtype = DTYPES[cfg.dtype] if cfg.dtype else src_dtype
        args = megatron_args(arch, cfg.layout, dtype=dtype, hf_config=hf_config)
        with atomic_output_dir(cfg.save, overwrite=cfg.overwrite) as tmp:
            for pp_rank in range(cfg.layout.pp):
                _write_stage(reader, arch, cfg.layout, pp_rank, dtype, tmp)
            copy_assets(cfg.hf_path, os.path.join(tmp, ASSETS_DIR))
            with open(os.path.join(tmp, ARGS_FILE), "w") as f:
                json.dump(args, f, indent=2)
            with open(os.path.join(tmp, TRACKER_FILE), "w") as f:
                f.write("release")
    return args


def _write_stage(
    reader: HFCheckpointReader,
    arch: Qwen2Arch,
    layout: ParallelLayout,
    pp_rank: int,
    dtype: torch.dtype,
    out_dir: str,
) -> None:
    """Stream stage `pp_rank` into one open file per TP rank."""
    specs = mcore_stage_specs(arch, layout, pp_rank, dtype)
    writers = []
    try:
        for tp_rank in range(layout.tp):
            path = rank_file(out_dir, "release", tp_rank, pp_rank)
            os.makedirs(os.path.dirname(path))
            writers.append(StreamingSafetensorsWriter(path, specs, metadata={"format": "pt"}))
        for name, shards in iter_mcore_shards(lambda n: reader.get(n).to(dtype), arch, layout, pp_rank):
            for writer, shard in zip(writers, shards):
                writer.write(name, shard)
        for writer in writers:
            writer.close()
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
