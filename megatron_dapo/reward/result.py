"""The value every reward function returns."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RewardResult:
    """Outcome of verifying one response."""

    score: float
    """Reward before any overlong shaping; +1.0 / -1.0 for the DAPO verifier."""
    acc: bool
    """Whether the response is counted as correct (drives dynamic sampling and avg@k)."""
    pred: str | None = None
    """The extracted (normalised) prediction, for logging; None when nothing was extracted."""

    def __post_init__(self) -> None:
        if isinstance(self.score, bool) or not isinstance(self.score, (int, float)):
            raise TypeError(f"RewardResult.score must be a float, got {type(self.score).__name__}")
        if not math.isfinite(self.score):
            raise ValueError(f"RewardResult.score must be finite, got {self.score}")
        if not isinstance(self.acc, bool):
            raise TypeError(f"RewardResult.acc must be a bool, got {type(self.acc).__name__}")
        if self.pred is not None and not isinstance(self.pred, str):
            raise TypeError(f"RewardResult.pred must be str or None, got {type(self.pred).__name__}")
        object.__setattr__(self, "score", float(self.score))
