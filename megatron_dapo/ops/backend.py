"""Explicit backend choice: which implementation of (local_stats, logits_grad) a call uses.

"auto" picks Triton for CUDA tensors and the chunked torch twin otherwise. Triton is never picked
implicitly on CPU: launching it there fails with "0 active drivers" unless TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_dapo.ops import torch_kernels, triton_kernels

BACKENDS = ("auto", "triton", "torch", "torch_compile")


@dataclass(frozen=True, kw_only=True)
class Kernels:
    """One backend's two steps. local_stats(x [N,V], lt [N], compute_entropy=, chunk_size=) -> RowStats;
    logits_grad(x, lt, lse, entropy, g_lp, g_h, chunk_size=) -> dx [N, V]."""

    name: str
    local_stats: Callable
    logits_grad: Callable


_TORCH = Kernels(name="torch", local_stats=torch_kernels.local_stats, logits_grad=torch_kernels.logits_grad)
_TORCH_COMPILE = Kernels(
    name="torch_compile",
    local_stats=functools.partial(torch_kernels.local_stats, compile_=True),
    logits_grad=functools.partial(torch_kernels.logits_grad, compile_=True),
)
_TRITON = Kernels(name="triton", local_stats=triton_kernels.local_stats,
                  logits_grad=triton_kernels.logits_grad)


def resolve_backend(backend: str, device: torch.device) -> Kernels:
    """Map a backend name and the tensors' device to kernels, or raise naming the fix."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_kernels.triton_available() else "torch"
    if backend == "triton":
        if not triton_kernels.triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton); "
                               "use backend='torch' instead")
        if device.type != "cuda" and not triton_kernels.interpret_enabled():
            raise RuntimeError(f"backend='triton' on {device.type} tensors needs the Triton interpreter: "
                               "set TRITON_INTERPRET=1 (tests only, slow) or use backend='torch'")
        return _TRITON
    return _TORCH_COMPILE if backend == "torch_compile" else _TORCH
