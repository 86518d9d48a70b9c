"""Overlong reward shaping and filtering (DAPO, arXiv 2503.14476 Sec. 3.4, Eq. 13).

Soft overlong punishment, with L_max the maximum response length and L_cache the buffer:

    R_length(y) = 0                              if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
                = -1                             if |y| > L_max

added to the verifier's reward. A response truncated by the rollout engine has |y| = L_max exactly
and so gets -1 from the buffer formula at its end point (continuous at L_max). Overlong *filtering*
(Sec. 3.4, first experiment) instead masks truncated samples out of the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    max_response_length: int
    """L_max, in tokens (--max-response-length)."""
    buffer_length: int = 0
    """L_cache, in tokens (--overlong-buffer-length); 0 disables the soft penalty."""
    penalty_factor: float = 1.0
    """Scale of the penalty (--overlong-penalty-factor); 1.0 is the paper's."""
    filter_truncated: bool = False
    """Mask responses that hit L_max out of the loss (--overlong-filter)."""

    def __post_init__(self) -> None:
        if self.max_response_length <= 0:
            raise ValueError(f"max_response_length (--max-response-length) must be > 0, got "
                             f"{self.max_response_length}")
        if not 0 <= self.buffer_length <= self.max_response_length:
            raise ValueError(
                f"buffer_length (--overlong-buffer-length, {self.buffer_length}) must be in "
                f"[0, --max-response-length={self.max_response_length}]"
            )
        if self.penalty_factor < 0:
            raise ValueError(f"penalty_factor (--overlong-penalty-factor) must be >= 0, got {self.penalty_factor}")


def overlong_penalty(length: int, config: OverlongConfig) -> float:
    """Eq. 13 for one response of `length` tokens (<= 0), scaled by penalty_factor."""
    if config.buffer_length == 0:
        return 0.0
    expected = config.max_response_length - config.buffer_length
    if length <= expected:
        return 0.0
    if length > config.max_response_length:
        return -config.penalty_factor
    return config.penalty_factor * (expected - length) / config.buffer_length


def overlong_penalties(lengths: Sequence[int], config: OverlongConfig) -> Tensor:
    """Eq. 13 for a batch of response lengths [N] -> penalties [N] (float32)."""
    return torch.tensor([overlong_penalty(int(n), config) for n in lengths], dtype=torch.float32)


def overlong_keep_mask(truncated: Sequence[bool], config: OverlongConfig) -> Tensor:
    """[N] 1.0 for samples that stay in the loss, 0.0 for truncated ones when filtering is on."""
    keep = [0.0 if (config.filter_truncated and t) else 1.0 for t in truncated]
    return torch.tensor(keep, dtype=torch.float32)
