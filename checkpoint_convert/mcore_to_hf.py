"""Megatron per-rank safetensors -> HF safetensors shards + index + config.json + tokenizer files.

Streams one parameter at a time: its TP shards are read from the stage's rank files, merged with
the mapping table's layout function and appended to the current HF shard.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint_convert.atomic_dir import atomic_output_dir
from megatron_dapo.models.hf_config import Qwen2Arch
from megatron_dapo.parallel import ParallelLayout
from megatron_dapo.weights.hf_format import DEFAULT_SHARD_BYTES, HFShardedWriter, copy_assets
from megatron_dapo.weights.layout import mcore_to_hf_tensors
from megatron_dapo.weights.mcore_format import (
    ASSETS_DIR,
    DTYPES,
    arch_from_args,
    check_args,
    layout_from_args,
    rank_file,
    read_args,
    read_iteration,
)
from megatron_dapo.weights.plan import hf_tensor_specs, layers_per_stage, mcore_stage_specs, stage_tensors
from megatron_dapo.weights.safetensors_io import CheckpointError, SafetensorsFile

_UNITS = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1234' -> bytes (binary units, as transformers' max_shard_size)."""
    t = text.strip().upper()
    for unit, scale in _UNITS.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or a byte count")


@dataclass(kw_only=True)
class McoreToHfConfig:
    load: str
    """--load: Megatron checkpoint directory written by hf-to-mcore."""
    save: str
    """--save: output HF model directory."""
    hf_config: str | None = None
    """--hf-config: config.json (or its dir) to write instead of the embedded one; checked against args."""
    tokenizer_path: str | None = None
    """--tokenizer-path: copy tokenizer files from here instead of <load>/hf_assets."""
    max_shard_size: str = "5GB"
    """--max-shard-size: largest HF shard."""
    dtype: str | None = None
    """--dtype: fp32 | bf16 | fp16; default keeps the checkpoint's dtype."""
    overwrite: bool = False
    """--overwrite: replace an existing --save directory."""

    def __post_init__(self) -> None:
        if not os.path.isdir(self.load):
            raise FileNotFoundError(f"--load {self.load} is not a directory")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.max_shard_bytes = parse_size(self.max_shard_size) if self.max_shard_size else DEFAULT_SHARD_BYTES


def _open_ranks(
    cfg: McoreToHfConfig, iteration: str | int, arch: Qwen2Arch, layout: ParallelLayout
) -> list[list[SafetensorsFile]]:
    """files[pp][tp], every header checked against the config-derived names and shapes up front."""
    expected_dtype = DTYPES[read_args(cfg.load)["params_dtype"]]
    files: list[list[SafetensorsFile]] = []
    try:
        for pp_rank in range(layout.pp):
            want = {s.name: s for s in mcore_stage_specs(arch, layout, pp_rank, expected_dtype)}
            row = []
            for tp_rank in range(layout.tp):
                f = SafetensorsFile(rank_file(cfg.load, iteration, tp_rank, pp_rank))
                row.append(f)
                if f.specs != want:
                    bad = sorted(set(want) ^ set(f.specs)) or [n for n in want if f.specs[n] != want[n]]
                    raise CheckpointError(f"{f.path}: tensors differ from args.json's model: {bad[:5]}")
            files.append(row)
    except BaseException:
        for f in (f for row in files for f in row):
            f.close()
        raise
    return files


def _hf_config(cfg: McoreToHfConfig, args: dict[str, Any], layout: ParallelLayout) -> dict[str, Any]:
    if cfg.hf_config is None:
        return dict(args["hf_config"])
    path = os.path.join(cfg.hf_config, "config.json") if os.path.isdir(cfg.hf_config) else cfg.hf_config
    with open(path) as f:
        hf_config = json.load(f)
    check_args(
        args, Qwen2Arch.from_hf(hf_config), layout, source=f"--load {cfg.load} (vs --hf-config {path})"
    )
    return hf_config


def mcore_to_hf(cfg: McoreToHfConfig) -> list[str]:
    """Convert; returns the HF tensor names written, in file order."""
    args = read_args(cfg.load)
    iteration = read_iteration(cfg.load)
    arch = arch_from_args(args, source=f"--load {cfg.load}")
    layout = layout_from_args(args)
    hf_config = _hf_config(cfg, args, layout)
    dtype = DTYPES[cfg.dtype or args["params_dtype"]]
    specs = hf_tensor_specs(arch, dtype)
    files = _open_ranks(cfg, iteration, arch, layout)
    per_stage = layers_per_stage(arch, layout)
    try:
        with atomic_output_dir(cfg.save, overwrite=cfg.overwrite) as tmp:
            writer = HFShardedWriter(tmp, specs, cfg.max_shard_bytes)
            try:
                for pp_rank, row in enumerate(files):
                    for t in stage_tensors(arch, layout, pp_rank):
                        shards = [f.get(t.mcore_name) for f in row]
                        if t.entry.kind == "replicated" and any(
                            not torch.equal(shards[0], s) for s in shards
                        ):
                            raise CheckpointError(
                                f"{t.mcore_name} of pp stage {pp_rank} differs across TP ranks"
                            )
                        for name, tensor in mcore_to_hf_tensors(
                            t.mcore_name, shards, arch, layer_offset=pp_rank * per_stage
                        ):
                            writer.write(name, tensor.to(dtype))
                writer.close()
            except BaseException:
                writer.abort()
                raise
            dtype_name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
                dtype
            ]
            # transformers >= 5 writes "dtype", older versions "torch_dtype": update whichever is there.
            for key in [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]:
                hf_config[key] = dtype_name
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf_config, f, indent=2)
            copy_assets(cfg.tokenizer_path or os.path.join(cfg.load, ASSETS_DIR), tmp)
    finally:
        for f in (f for row in files for f in row):
            f.close()
    return [s.name for s in specs]
