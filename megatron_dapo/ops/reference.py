"""Naive references, for tests and benchmarks only: materialise full [N, V] softmax / log-softmax.

`naive_logprob_entropy` is the textbook path (verl's torch path: log_softmax + gather, entropy as
logsumexp - sum softmax * logits). `float64_logprob_entropy` is the accuracy oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor


def naive_logprob_entropy(logits: Tensor, targets: Tensor, *,
                          compute_entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """logits [..., V], targets [...] -> (log p_t, entropy) in fp32 (fp64 for fp64 input), via autograd."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(x, dim=-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    if not compute_entropy:
        return logp, None
    probs = torch.softmax(x, dim=-1)
    entropy = torch.logsumexp(x, dim=-1) - (probs * x).sum(dim=-1)
    return logp, entropy


def float64_logprob_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Accuracy oracle: the same quantities computed in fp64 with the -sum p log p form of entropy."""
    logq = torch.log_softmax(logits.double(), dim=-1)
    logp = logq.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(logq.exp() * logq).sum(dim=-1)
    return logp, entropy
