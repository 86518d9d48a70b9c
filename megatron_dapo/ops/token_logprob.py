"""token_logprob_entropy: per-token log p(target) and entropy from (vocab-parallel) logits.

One autograd.Function over three implementations of the same maths (stats.py): the Triton kernels, the
chunked torch twin (eager or compiled), and reference.py (tests only). Forward keeps only [N]-sized stats;
backward recomputes softmax from the saved logits, so no [N, V] fp32 softmax or log-softmax is stored.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from megatron_dapo.ops.backend import Kernels, resolve_backend
from megatron_dapo.ops.stats import finalize, local_targets
from megatron_dapo.ops.vocab_parallel import combine_stats, global_vocab_size, vocab_range


def check_targets(targets: Tensor, vocab: int) -> None:
    """Raise if any target id is outside [0, vocab); on CUDA an async assert (no host sync)."""
    if targets.numel() == 0:
        return
    ok = ((targets >= 0) & (targets < vocab)).all()
    if targets.is_cuda:
        torch._assert_async(ok, f"target ids must lie in [0, {vocab})")
    elif not bool(ok):
        lo, hi = int(targets.min()), int(targets.max())
        raise ValueError(f"targets must be token ids in [0, {vocab}) (the global vocab size), got range "
                         f"[{lo}, {hi}]: set padding positions to a valid id and mask them out of the loss")


def check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"chunk_size must be a positive int or None (backend default), got {chunk_size!r}")


class _TokenLogprobEntropy(torch.autograd.Function):
    """logits [N, V_local] -> (log p_t [N], entropy [N] or None); both full-vocabulary values."""

    @staticmethod
    def forward(ctx, logits: Tensor, local_t: Tensor, kernels: Kernels, tp_group, compute_entropy: bool,
                chunk_size: int | None):
        stats = kernels.local_stats(logits, local_t, compute_entropy=compute_entropy, chunk_size=chunk_size)
        lse, logp, entropy = finalize(combine_stats(stats, tp_group))
        ctx.save_for_backward(logits, local_t, lse, entropy if compute_entropy else lse)
        ctx.kernels, ctx.chunk_size, ctx.compute_entropy = kernels, chunk_size, compute_entropy
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp: Tensor | None, g_h: Tensor | None):
        logits, local_t, lse, entropy = ctx.saved_tensors
        if not ctx.compute_entropy:
            entropy, g_h = None, None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_h = None if g_h is None else g_h.to(lse.dtype)
        dx = ctx.kernels.logits_grad(logits, local_t, lse, entropy if g_h is not None else None, g_lp, g_h,
                                     chunk_size=ctx.chunk_size)
        return dx, None, None, None, None, None


def token_logprob_entropy(logits: Tensor, targets: Tensor, *, tp_group: dist.ProcessGroup | None = None,
                          compute_entropy: bool = True, backend: str = "auto",
                          chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-token log p(target) and entropy of softmax(logits), differentiable w.r.t. logits.

    logits: [..., V_local], any float dtype; with `tp_group`, rank r holds vocab ids
        [r * V_local, (r + 1) * V_local) (Megatron VocabParallel layout, e.g. [s, b, v/tp]).
    targets: [...] global vocab ids (int), same leading shape as logits.
    Returns (logp [...], entropy [...] or None) in fp32 (fp64 for fp64 logits), full-vocabulary values,
    identical on every TP rank. Entropy is in nats.
    backend: "auto" | "triton" | "torch" | "torch_compile" (see backend.py).
    chunk_size: torch backends: tokens per chunk; triton: vocab tile width (rounded up to a power of 2).
    """
    if not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError(f"logits must be a float tensor [..., V], got {logits.dtype} {tuple(logits.shape)}")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal the logits shape without its vocab dim "
                         f"{tuple(logits.shape[:-1])}")
    if targets.device != logits.device:
        raise ValueError(f"targets on {targets.device} but logits on {logits.device}")
    check_chunk_size(chunk_size)
    kernels = resolve_backend(backend, logits.device)
    vocab_local = logits.shape[-1]
    check_targets(targets, global_vocab_size(vocab_local, tp_group))
    start, _ = vocab_range(vocab_local, tp_group)
    flat_t = local_targets(targets.reshape(-1), start, vocab_local)
    logp, entropy = _TokenLogprobEntropy.apply(logits.reshape(-1, vocab_local), flat_t, kernels, tp_group,
                                               compute_entropy, chunk_size)
    shape = targets.shape
    return logp.view(shape), None if entropy is None else entropy.view(shape)
