"""Per-token log-probs and entropy from vocab-parallel logits: the fused kernel or megatron's path.

`token_log_probs` is the single switch: megatron_dapo.ops' fused kernel when enabled and importable,
else megatron's `vocab_parallel_cross_entropy` plus `vocab_parallel_entropy` below. Both see logits
whose padded-vocab columns (ids >= the HF vocab) are masked out, so log-probs equal HF's. The fused
kernel reads the logits in their own dtype (bf16 on GPU) and upcasts one chunk at a time; only megatron's
path gets an fp32 copy of the whole [b, s, V/tp] tensor.

`linear_token_log_probs` starts one step earlier, from the last stage's hidden states and the output
weight (--fused-linear-logprob): no [tokens x V/tp] tensor exists. At the 32B setting (24576 tokens per
micro-batch, V/tp = 152576 / 8 = 19072 with TP padding) that is 0.87 GiB of bf16 logits, 1.75 GiB for an fp32 copy and
0.87 GiB for their gradient per micro-batch in flight, against one ~16 M-entry block and, in backward,
an fp32 [V/tp, h] d weight accumulator (0.36 GiB): planner.activations.logits_bytes, 1.75 -> 0.66 GiB with SP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch import Tensor

try:
    from megatron_dapo.ops import fused_linear_logprob_entropy as _fused_linear
    from megatron_dapo.ops import token_logprob_entropy as _fused_logprob_entropy
except ImportError:  # ops not built / not present: megatron's vocab-parallel path is used
    _fused_logprob_entropy = _fused_linear = None

# Finite stand-in for -inf: exp() underflows to exactly 0 and 0 * fill stays 0 (no inf - inf NaNs).
_MASK_FILL = torch.finfo(torch.float32).min / 2


def fused_available() -> bool:
    return _fused_logprob_entropy is not None


def _tp_group():
    return (parallel_state.get_tensor_model_parallel_group()
            if parallel_state.get_tensor_model_parallel_world_size() > 1 else None)


def mask_padded_vocab(logits: Tensor, vocab_size: int, *, upcast: bool = True) -> Tensor:
    """Fill columns of global id >= vocab_size in this TP rank's [..., V/tp] slice; fp32 when upcast,
    else the logits' dtype (a copy only on a rank that holds padded columns)."""
    if upcast:
        logits = logits.float()
    local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * local
    if start + local <= vocab_size:
        return logits
    ids = torch.arange(start, start + local, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, _MASK_FILL if upcast else torch.finfo(logits.dtype).min / 2)


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
    if use_fused and _fused_logprob_entropy is not None:
        logits = mask_padded_vocab(logits, vocab_size, upcast=False)  # the kernel upcasts chunk by chunk
        logp, entropy = _fused_logprob_entropy(logits, targets, tp_group=_tp_group(),
                                               compute_entropy=compute_entropy)
        return logp, (entropy.detach() if entropy is not None else None)
    logits = mask_padded_vocab(logits, vocab_size)
    # Entropy first: vocab_parallel_cross_entropy shifts fp32 logits in place by their max.
    entropy = vocab_parallel_entropy(logits.detach()) if compute_entropy else None
    # It works on [s, b, v/tp] or [b, s, v/tp] alike (last dim is vocab).
    logp = -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    return logp, entropy


def linear_token_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, *, vocab_size: int,
                           compute_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """(log p(target) [b, s] fp32 with gradient, entropy [b, s] or None) from the last stage's hidden
    states [b, s, h] (replicated over TP) and this rank's output weight [V/tp, h], chunk by chunk.

    Same values as token_log_probs(hidden @ weight.T, ...); d hidden is summed over the TP group inside
    (what ColumnParallelLinear's backward all-reduce would do). Raises when megatron_dapo.ops is missing.
    """
    if _fused_linear is None:
        raise RuntimeError("--fused-linear-logprob needs megatron_dapo.ops (fused_linear_logprob_entropy); "
                           "pass --no-fused-linear-logprob")
    b, s, h = hidden.shape
    logp, entropy = _fused_linear(hidden.reshape(b * s, h), weight, targets.reshape(b * s), tp_group=_tp_group(),
                                  compute_entropy=compute_entropy, vocab_size=vocab_size)
    return logp.view(b, s), (entropy.detach().view(b, s) if entropy is not None else None)
