"""Per-token log-probs and entropy from vocab-parallel logits: the fused kernel or megatron's path.

`token_log_probs` is the single switch: megatron_dapo.ops' fused kernel when enabled and importable,
else megatron's `vocab_parallel_cross_entropy` plus `vocab_parallel_entropy` below. Both see logits
whose padded-vocab columns (ids >= the HF vocab) are masked out, so log-probs equal HF's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch import Tensor

try:
    from megatron_dapo.ops import token_logprob_entropy as _fused_logprob_entropy
except ImportError:  # ops not built / not present: megatron's vocab-parallel path is used
    _fused_logprob_entropy = None

# Finite stand-in for -inf: exp() underflows to exactly 0 and 0 * fill stays 0 (no inf - inf NaNs).
_MASK_FILL = torch.finfo(torch.float32).min / 2


def fused_available() -> bool:
    return _fused_logprob_entropy is not None


def mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Fill columns of global id >= vocab_size in this TP rank's [..., V/tp] slice; returns fp32."""
    logits = logits.float()
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    ids = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, _MASK_FILL)


@torch.no_grad()
def vocab_parallel_entropy(logits: Tensor) -> Tensor:
    """Entropy [...] (nats) of softmax over the full vocab from [..., V/tp] fp32 logits; no gradient.

    H = lse - E_p[x] with lse = m + log sum exp(x - m), reduced over the TP group in three all-reduces.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    m = logits.max(dim=-1).values
    if tp > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(logits - m.unsqueeze(-1))
    sums = torch.stack([e.sum(dim=-1), (e * logits).sum(dim=-1)])
    if tp > 1:
        dist.all_reduce(sums, group=group)
    return m + torch.log(sums[0]) - sums[1] / sums[0]


def token_log_probs(
    logits: Tensor, targets: Tensor, *, vocab_size: int, use_fused: bool = True, compute_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(log p(target) [b, s] fp32 with gradient, entropy [b, s] or None) from logits [b, s, V/tp].

    targets [b, s] are global token ids < vocab_size; vocab_size is the unpadded (HF) vocab.
    """
    logits = mask_padded_vocab(logits, vocab_size)
    if use_fused and _fused_logprob_entropy is not None:
        tp_group = (parallel_state.get_tensor_model_parallel_group()
                    if parallel_state.get_tensor_model_parallel_world_size() > 1 else None)
        logp, entropy = _fused_logprob_entropy(logits, targets, tp_group=tp_group,
                                               compute_entropy=compute_entropy)
        return logp, (entropy.detach() if entropy is not None else None)
    # Entropy first: vocab_parallel_cross_entropy shifts fp32 logits in place by their max.
    entropy = vocab_parallel_entropy(logits.detach()) if compute_entropy else None
    # It works on [s, b, v/tp] or [b, s, v/tp] alike (last dim is vocab).
    logp = -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    return logp, entropy
