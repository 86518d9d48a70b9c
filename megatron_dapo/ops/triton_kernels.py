"""Triton kernels: one program per token row, online log-sum-exp over vocab tiles of BLOCK_V.

Forward (`_stats_kernel`) makes one pass over the row, keeping the running (max, sum-exp, shifted entropy
accumulator) and merging each tile into it as `stats.rescale_to` does; it writes RowStats, nothing [N, V].
Backward (`_grad_kernel`) recomputes p_j = exp(x_j - lse) tile by tile and writes the logits gradient.

The kernels are plain functions wrapped on demand: `JITFunction` for CUDA tensors (and `triton.compile`),
`InterpretedFunction` under TRITON_INTERPRET=1 (CPU tensors, tests). Triton itself fixes the mode of its
own library functions (tl.sum, tl.max, ...) when it is first imported, so the interpreter only works in a
process that had TRITON_INTERPRET=1 in its environment before importing triton; `interpret_enabled` checks.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from megatron_dapo.ops.stats import NEG_FINITE, RowStats, compute_dtype

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a hard dependency on GPU, optional on CPU
    triton = None
    tl = None

# Kernels may only read constexpr globals.
_NEG_FINITE = tl.constexpr(NEG_FINITE) if tl is not None else None

# Vocab tile on GPU: 4096 fp32 per row tile keeps registers bounded at V=152064 (37 tiles per row).
DEFAULT_BLOCK_V = 4096


def interpret_enabled() -> bool:
    """True when TRITON_INTERPRET=1; raises if it was set only after triton had been imported."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    from triton.runtime.interpreter import InterpretedFunction
    if triton is not None and not isinstance(tl.sum, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; set it in the environment "
                           "before the process starts (e.g. TRITON_INTERPRET=1 python ...)")
    return True


def triton_available() -> bool:
    return triton is not None


def _stats_kernel(x_ptr, lt_ptr, m_ptr, s_ptr, a_ptr, xt_ptr, stride_row, V,
                  COMPUTE_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_row
    acc_dtype = m_ptr.dtype.element_ty
    m = tl.full((), float("-inf"), acc_dtype)
    s = tl.zeros((), acc_dtype)
    a = tl.zeros((), acc_dtype)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(acc_dtype)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # Shift by a finite max so all -inf rows/tiles never form -inf - -inf (nan).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        m_old_safe = tl.where(m == float("-inf"), 0.0, m)
        shift = m_old_safe - m_safe
        scale = tl.exp(shift)
        d = tl.maximum(x - m_safe, _NEG_FINITE)
        e = tl.exp(d)
        if COMPUTE_ENTROPY:
            a = tl.where(s > 0, scale * (a + shift * s), 0.0) + tl.sum(e * d, axis=0)
        s = s * scale + tl.sum(e, axis=0)
        m = m_new
    lt = tl.load(lt_ptr + row)
    here = lt >= 0
    xt = tl.load(x_row + tl.where(here, lt, 0)).to(acc_dtype)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if COMPUTE_ENTROPY:
        tl.store(a_ptr + row, a)
    tl.store(xt_ptr + row, tl.where(here, xt, 0.0))


def _grad_kernel(x_ptr, lt_ptr, lse_ptr, h_ptr, glp_ptr, gh_ptr, dx_ptr, stride_row, stride_drow, V,
                 HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    acc_dtype = lse_ptr.dtype.element_ty
    lse = tl.load(lse_ptr + row)
    g_lp = tl.load(glp_ptr + row)
    lt = tl.load(lt_ptr + row)
    if HAS_ENTROPY_GRAD:
        g_h = tl.load(gh_ptr + row)
        h = tl.load(h_ptr + row)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        x = tl.load(x_ptr + row * stride_row + cols, mask=mask, other=0.0).to(acc_dtype)
        logp = tl.maximum(x - lse, _NEG_FINITE)
        p = tl.exp(logp)
        coef = g_lp
        if HAS_ENTROPY_GRAD:
            coef = coef + g_h * (logp + h)
        dx = -p * coef + tl.where(cols == lt, g_lp, 0.0)
        tl.store(dx_ptr + row * stride_drow + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernel(name: str, interpret: bool):
    fn = {"stats": _stats_kernel, "grad": _grad_kernel}[name]
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(fn)
    return triton.runtime.jit.JITFunction(fn)


def stats_kernel(interpret: bool = False):
    """The forward kernel as a launchable (also used by tests to `triton.compile` it for sm_80/sm_90)."""
    return _kernel("stats", interpret)


def grad_kernel(interpret: bool = False):
    return _kernel("grad", interpret)


def _block(vocab: int, chunk_size: int | None) -> int:
    block = chunk_size or DEFAULT_BLOCK_V
    return min(triton.next_power_of_2(block), triton.next_power_of_2(max(vocab, 1)))


def _num_warps(block: int) -> int:
    # 8 warps for 4096-wide tiles: 16 fp32 values per thread instead of 32 keeps registers from spilling.
    return 8 if block >= 4096 else 4


def _row_major(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def local_stats(x: Tensor, lt: Tensor, *, compute_entropy: bool, chunk_size: int | None) -> RowStats:
    """Row statistics of x [N, V]; lt [N] local target ids or -1. chunk_size = vocab tile (power of 2)."""
    x = _row_major(x)
    n, vocab = x.shape
    acc = compute_dtype(x.dtype)
    m, s, a, xt = (torch.empty(n, dtype=acc, device=x.device) for _ in range(4))
    if n > 0:
        block = _block(vocab, chunk_size)
        stats_kernel(interpret_enabled())[(n,)](
            x, lt.contiguous(), m, s, a, xt, x.stride(0), vocab,
            COMPUTE_ENTROPY=compute_entropy, BLOCK_V=block, num_warps=_num_warps(block))
    return RowStats(max=m, sumexp=s, ent_acc=a if compute_entropy else None, target_logit=xt)


def logits_grad(x: Tensor, lt: Tensor, lse: Tensor, entropy: Tensor | None, g_lp: Tensor,
                g_h: Tensor | None, *, chunk_size: int | None, out: Tensor | None = None) -> Tensor:
    """d(loss)/dx [N, V] in x's dtype (see stats.py for the formula); written into `out` when given."""
    x = _row_major(x)
    n, vocab = x.shape
    dx = torch.empty_like(x) if out is None else out
    if n > 0:
        has_h = g_h is not None
        block = _block(vocab, chunk_size)
        grad_kernel(interpret_enabled())[(n,)](
            x, lt.contiguous(), lse.contiguous(), entropy.contiguous() if has_h else lse,
            g_lp.contiguous(), g_h.contiguous() if has_h else g_lp, dx, x.stride(0), dx.stride(0), vocab,
            HAS_ENTROPY_GRAD=has_h, BLOCK_V=block, num_warps=_num_warps(block))
    return dx
