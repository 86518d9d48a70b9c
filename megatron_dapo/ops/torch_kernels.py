"""Chunked torch twin of the Triton kernels: the CPU fallback (eager or torch.compile'd).

Rows (tokens) are processed `chunk_size` at a time, so temporaries are [chunk, V] in the compute dtype
instead of [N, V]; nothing but the per-row RowStats is kept between forward and backward (the backward
recomputes softmax from the saved logits and lse, as the Triton kernel does).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from megatron_dapo.ops.stats import NEG_FINITE, RowStats, compute_dtype, concat_stats, safe_max

# ~1 M elements (4 MiB fp32) per chunk: small enough to stay cache-resident on CPU, large enough that
# per-chunk Python overhead is negligible at V=32000 (measured in tools/bench_loss.py).
DEFAULT_CHUNK_ELEMENTS = 1 << 20


def default_chunk_rows(vocab: int) -> int:
    return max(1, DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))


def _chunk_stats(x: Tensor, lt: Tensor,
                 compute_entropy: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """One chunk: x [n, V] (any float dtype), lt [n] local target or -1 -> (m, s, a, x_t), each [n]."""
    x = x.to(compute_dtype(x.dtype))
    m = x.amax(dim=-1)
    d = (x - safe_max(m).unsqueeze(-1)).clamp_min_(NEG_FINITE)
    e = torch.exp(d)
    s = e.sum(dim=-1)
    a = (e * d).sum(dim=-1) if compute_entropy else None
    here = lt >= 0
    xt = x.gather(-1, lt.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    xt = torch.where(here, xt, torch.zeros_like(xt))
    return m, s, a, xt


def _chunk_grad(x: Tensor, lt: Tensor, lse: Tensor, entropy: Tensor | None, g_lp: Tensor,
                g_h: Tensor | None) -> Tensor:
    """One chunk of d(loss)/dx [n, V] in x's dtype: g_lp (1[j=t] - p_j) - g_h p_j (log p_j + H)."""
    xc = x.to(compute_dtype(x.dtype))
    logp = (xc - lse.unsqueeze(-1)).clamp_min_(NEG_FINITE)
    p = torch.exp(logp)
    coef = g_lp.unsqueeze(-1)
    if g_h is not None:
        coef = coef + g_h.unsqueeze(-1) * (logp + entropy.unsqueeze(-1))
    grad = -p * coef
    # Rows whose target is on another TP rank get no one-hot term (g_lp is zeroed for them).
    onehot = torch.where(lt >= 0, g_lp, torch.zeros_like(g_lp)).unsqueeze(-1)
    grad.scatter_add_(-1, lt.clamp_min(0).unsqueeze(-1), onehot)
    return grad.to(x.dtype)


@functools.cache
def _compiled(fn):
    # dynamic=True: the last chunk is ragged; one graph for all chunk lengths instead of two.
    return torch.compile(fn, dynamic=True)


def _pick(fn, compile_: bool):
    return _compiled(fn) if compile_ else fn


def local_stats(x: Tensor, lt: Tensor, *, compute_entropy: bool, chunk_size: int | None,
                compile_: bool = False) -> RowStats:
    """Row statistics of x [N, V] over its (local) vocab slice; lt [N] local target ids or -1."""
    n, vocab = x.shape
    rows = chunk_size or default_chunk_rows(vocab)
    fn = _pick(_chunk_stats, compile_)
    parts = [fn(x[i:i + rows], lt[i:i + rows], compute_entropy) for i in range(0, n, rows)]
    if not parts:  # zero tokens
        empty = x.new_empty(0, dtype=compute_dtype(x.dtype))
        return RowStats(max=empty, sumexp=empty, ent_acc=empty if compute_entropy else None,
                        target_logit=empty)
    return concat_stats([RowStats(max=m, sumexp=s, ent_acc=a, target_logit=xt) for m, s, a, xt in parts])


def logits_grad(x: Tensor, lt: Tensor, lse: Tensor, entropy: Tensor | None, g_lp: Tensor,
                g_h: Tensor | None, *, chunk_size: int | None, compile_: bool = False,
                out: Tensor | None = None) -> Tensor:
    """d(loss)/dx [N, V] in x's dtype, chunk by chunk; written into `out` when given (may alias x)."""
    n, vocab = x.shape
    rows = chunk_size or default_chunk_rows(vocab)
    grad = torch.empty_like(x) if out is None else out
    fn = _pick(_chunk_grad, compile_)
    for i in range(0, n, rows):
        sl = slice(i, i + rows)
        grad[sl] = fn(x[sl], lt[sl], lse[sl], None if entropy is None else entropy[sl], g_lp[sl],
                      None if g_h is None else g_h[sl])
    return grad
