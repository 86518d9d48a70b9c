"""Helpers shared by the weight paths that read a live model."""

from __future__ import annotations

import torch


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers (each keeps the real model in `.module`)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module
