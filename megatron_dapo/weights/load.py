"""Load a checkpoint written by `checkpoint_convert hf-to-mcore` into this rank's live GPTModel.

Each rank reads only its own `mp_rank_{tp:02d}_{pp:03d}/model.safetensors`, so the layout of the
checkpoint must equal the running one (convert again for another TP/PP: conversion is cheap and
exact). Names are matched through the mapping table, so a Transformer Engine spec model (fused
`layer_norm_weight` names) loads the same file as a local-spec model.
"""

from __future__ import annotations

import os

import torch
from megatron.core import parallel_state

from megatron_dapo.parallel import ParallelLayout
from megatron_dapo.weights.mapping import canonical_mcore_name
from megatron_dapo.weights.mcore_format import (
    arch_from_args,
    layout_from_args,
    rank_file,
    read_args,
    read_iteration,
)
from megatron_dapo.weights.safetensors_io import CheckpointError, SafetensorsFile


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (each keeps the real model in `.module`)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def load_mcore_checkpoint(
    model: torch.nn.Module | list[torch.nn.Module], ckpt_dir: str | os.PathLike[str], layout: ParallelLayout
) -> str | int:
    """Copy this rank's shard into `model`'s parameters; return the checkpoint's iteration.

    Strict: raises CheckpointError naming every missing, unexpected or wrongly shaped tensor, and
    when the checkpoint's TP/PP or model args differ from `layout` / the model. dtype is cast on
    copy (a bf16 checkpoint loads into fp32 params exactly).
    """
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) != 1:
        raise ValueError("load_mcore_checkpoint supports one model chunk per rank (no virtual pipeline)")
    ckpt_dir = os.fspath(ckpt_dir)
    args = read_args(ckpt_dir)
    saved = layout_from_args(args)
    if (saved.tp, saved.pp) != (layout.tp, layout.pp):
        raise CheckpointError(
            f"{ckpt_dir} is sharded for tp={saved.tp}, pp={saved.pp} but the run uses "
            f"--tensor-model-parallel-size {layout.tp} --pipeline-model-parallel-size {layout.pp}: convert "
            f"again with `python -m checkpoint_convert hf-to-mcore --tp {layout.tp} --pp {layout.pp}`"
        )
    arch_from_args(args, source=ckpt_dir)  # the args and embedded HF config must agree
    iteration = read_iteration(ckpt_dir)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    params = {canonical_mcore_name(n): p for n, p in unwrap(chunks[0]).named_parameters()}
    with SafetensorsFile(rank_file(ckpt_dir, iteration, tp_rank, pp_rank)) as f:
        missing = sorted(set(params) - set(f.specs))
        unexpected = sorted(set(f.specs) - set(params))
        wrong = [
            f"{n}: file {list(f.specs[n].shape)}, model {list(p.shape)}"
            for n, p in params.items()
            if n in f.specs and f.specs[n].shape != tuple(p.shape)
        ]
        if missing or unexpected or wrong:
            raise CheckpointError(
                f"{f.path} does not fit the model on tp rank {tp_rank}, pp rank {pp_rank}: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}, shape mismatch {wrong[:5]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(f.get(name))
    return iteration
