"""A response's terms computed on the HF model directly: the independent reference the actor's loss tests use."""

from __future__ import annotations

import torch


def response_terms(hf, sample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs [L] of `sample`'s response tokens under `hf`, with grad; its old log-probs [L]: the recorded ones,
    else these detached; its loss mask [L]: the sample's, else ones). `sample` is an actor TrainSample."""
    logits = hf(torch.tensor([sample.tokens])).logits[0]
    logp = torch.log_softmax(logits.float(), -1)[torch.arange(sample.prompt_len - 1, len(sample.tokens) - 1),
                                                 torch.tensor(sample.tokens[sample.prompt_len:])]
    old = logp.detach() if sample.old_log_probs is None else sample.old_log_probs
    mask = torch.ones(sample.response_len) if sample.loss_mask is None else sample.loss_mask
    return logp, old, mask
