"""fused_linear_logprob_entropy: log p(target) and entropy from hidden states and the output weight,
chunked over tokens, so the [N, V] logits never exist (only one [chunk, V_local] block at a time).

For the last pipeline stage: logits = hidden @ weight.T is recomputed chunk by chunk in backward (one
extra GEMM per chunk), and the logits block is overwritten in place by its gradient before the two
gradient GEMMs. Under TP the hidden states must be replicated on the group (the input of Megatron's
ColumnParallelLinear output layer); d hidden is summed over the group, as that layer's backward does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from megatron_dapo.ops.backend import Kernels, resolve_backend
from megatron_dapo.ops.stats import compute_dtype, concat_stats, finalize, local_targets
from megatron_dapo.ops.token_logprob import check_chunk_size, check_targets
from megatron_dapo.ops.vocab_parallel import combine_stats, global_vocab_size, vocab_range

# Tokens per chunk default to ~16 M logits (64 MiB fp32) per block: large GEMMs, bounded memory.
DEFAULT_CHUNK_LOGITS = 1 << 24


def default_chunk_tokens(vocab_local: int) -> int:
    return max(16, DEFAULT_CHUNK_LOGITS // max(vocab_local, 1))


def _block(hidden: Tensor, weight: Tensor, invalid: Tensor | None) -> Tensor:
    """One [chunk, V_local] logits block; columns in `invalid` (padded vocab ids) get a finite -inf."""
    logits = hidden @ weight.t()
    if invalid is not None:
        logits.masked_fill_(invalid, torch.finfo(logits.dtype).min / 2)
    return logits


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    """hidden [N, H], weight [V_local, H] -> (log p_t [N], entropy [N] or None)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, local_t: Tensor, kernels: Kernels, tp_group,
                compute_entropy: bool, chunk: int, invalid: Tensor | None):
        parts = []
        for i in range(0, hidden.shape[0], chunk):
            logits = _block(hidden[i:i + chunk], weight, invalid)  # [chunk, V_local], freed after the stats
            parts.append(kernels.local_stats(logits, local_t[i:i + chunk], compute_entropy=compute_entropy,
                                             chunk_size=None))
        lse, logp, entropy = finalize(combine_stats(concat_stats(parts), tp_group))
        ctx.save_for_backward(hidden, weight, local_t, lse, entropy if compute_entropy else lse)
        ctx.kernels, ctx.tp_group, ctx.chunk, ctx.compute_entropy = kernels, tp_group, chunk, compute_entropy
        ctx.invalid = invalid
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, g_lp: Tensor | None, g_h: Tensor | None):
        hidden, weight, local_t, lse, entropy = ctx.saved_tensors
        if not ctx.compute_entropy:
            g_h = None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype)
        g_h = None if g_h is None else g_h.to(lse.dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        d_hidden = torch.empty_like(hidden) if need_h else None
        # Accumulate d weight across chunks in fp32 even for bf16 weights (many small GEMM sums).
        d_weight = torch.zeros(weight.shape, dtype=compute_dtype(weight.dtype), device=weight.device) \
            if need_w else None
        for i in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(i, i + ctx.chunk)
            logits = _block(hidden[sl], weight, ctx.invalid)  # masked columns: p = 0, so zero gradient
            d_logits = ctx.kernels.logits_grad(logits, local_t[sl], lse[sl],
                                               None if g_h is None else entropy[sl], g_lp[sl],
                                               None if g_h is None else g_h[sl], chunk_size=None, out=logits)
            if need_h:
                torch.matmul(d_logits, weight, out=d_hidden[sl])
            if need_w:
                d_weight.add_((d_logits.t() @ hidden[sl]).to(d_weight.dtype))
        if need_h and ctx.tp_group is not None and dist.get_world_size(group=ctx.tp_group) > 1:
            dist.all_reduce(d_hidden, op=dist.ReduceOp.SUM, group=ctx.tp_group)
        if need_w:
            d_weight = d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None


def fused_linear_logprob_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                                 tp_group: dist.ProcessGroup | None = None, compute_entropy: bool = True,
                                 backend: str = "auto", chunk_size: int | None = None,
                                 vocab_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """log p(target) and entropy of softmax(hidden @ weight.T) without materialising the logits.

    hidden: [N, H] (replicated across `tp_group`); weight: [V_local, H], rank r holding vocab rows
    [r * V_local, (r + 1) * V_local); targets: [N] global vocab ids.
    Returns (logp [N], entropy [N] or None), fp32 (fp64 for fp64 inputs), differentiable w.r.t. hidden and
    weight. chunk_size: tokens per chunk (default ~16 M logits per chunk). backend as token_logprob_entropy.
    vocab_size: the real (unpadded) vocab; weight rows of global id >= vocab_size (Megatron's TP padding)
    are left out of the softmax, as if their logits were -inf (default: every row is a real token).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden must be [N, H] and weight [V_local, H] with the same H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not hidden.is_floating_point():
        raise ValueError(f"hidden and weight must share one float dtype, got {hidden.dtype}, {weight.dtype}")
    if targets.dim() != 1 or targets.shape[0] != hidden.shape[0] or targets.is_floating_point():
        raise ValueError(f"targets must be integer ids [N={hidden.shape[0]}], got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    check_chunk_size(chunk_size)
    kernels = resolve_backend(backend, hidden.device)
    vocab_local = weight.shape[0]
    padded_vocab = global_vocab_size(vocab_local, tp_group)
    if vocab_size is not None and not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size must be in [1, {padded_vocab}] (the weight's global rows), got {vocab_size}")
    check_targets(targets, padded_vocab if vocab_size is None else vocab_size)
    start, _ = vocab_range(vocab_local, tp_group)
    local_t = local_targets(targets, start, vocab_local)
    chunk = chunk_size or default_chunk_tokens(vocab_local)
    invalid = None
    if vocab_size is not None and start + vocab_local > vocab_size:
        invalid = torch.arange(start, start + vocab_local, device=weight.device) >= vocab_size
    return _FusedLinearLogprobEntropy.apply(hidden, weight, local_t, kernels, tp_group, compute_entropy,
                                            chunk, invalid)
