"""Helpers shared by the weight paths that read a live model."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from megatron_dapo.weights.mapping import resolve_mcore_name

if TYPE_CHECKING:
    from megatron_dapo.models.hf_config import ModelArch


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (each keeps the real model in `.module`)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def mapped_tensors(model: torch.nn.Module, arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter of an unwrapped model, then of each buffer `arch`'s table maps (an MoE
    router's expert_bias: DeepSeek-V3's e_score_correction_bias, a buffer in megatron-core and HF alike)."""
    yield from model.named_parameters()
    for name, buffer in model.named_buffers():
        try:
            resolve_mcore_name(name, arch)
        except KeyError:
            continue  # rotary tables, token counters: not weights
        yield name, buffer
