"""Dynamic sampling (DAPO, arXiv 2503.14476 Sec. 3.2, Eq. 11 constraint 0 < |{o_i correct}| < G).

A prompt group whose G responses are all correct or all wrong has zero advantage for every token, so
it adds no gradient but still dilutes the token-level mean. DAPO drops such groups and keeps
generating until the batch holds `rollout_batch_size` informative groups.

The filter looks at *accuracy* (did the verifier accept the answer), not at the shaped reward: with
overlong shaping two correct answers of different lengths have different rewards, and a group that
is all correct is still uninformative about correctness (paper's definition; verl filters on the
metric chosen by `filter_groups.metric`, "acc" in its DAPO recipe).

Deviation: when `max_num_gen_batches` rounds are spent without filling the batch, the paper does not
say what happens; verl raises. Here `on_exhausted` chooses: "error" (default, names the flag) or
"partial" (train on the groups kept so far; the token-level mean needs no fixed batch size).

Round size: verl asks a fixed batch (e.g. 3x) every round; asking only `factor x groups still needed`
falls short geometrically at low keep rates (at keep rate 0.3 and factor 1.3 the batch is still short
after 10 rounds). `BatchFiller.round_size` divides by the keep rate measured so far in the step
(floored at KEEP_RATE_FLOOR), so a step fills in about two rounds at any keep rate >= 0.1. The first
round has no measurement and asks `factor x needed`. The previous step's rate is deliberately not used:
it is not in the checkpoint, and with it a resumed step would ask for a different number of prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

G = TypeVar("G")

ON_EXHAUSTED: tuple[str, ...] = ("error", "partial")
"""--on-gen-exhausted choices."""
KEEP_RATE_FLOOR = 0.05
"""Lowest keep rate a round is sized for: a round asks at most factor x needed / 0.05 = 20 x factor x
needed prompts (a step whose measured rate is 0 still asks a bounded number)."""


def group_is_informative(accuracies: Sequence[bool | float]) -> bool:
    """True when the group's accuracies are neither all correct nor all wrong (needs >= 2 samples)."""
    values = [bool(a) for a in accuracies]
    return len(values) >= 2 and any(values) and not all(values)


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    rollout_batch_size: int
    """Prompt groups kept per training step (--rollout-batch-size)."""
    enabled: bool = True
    """Drop uninformative groups (--dynamic-sampling / --no-dynamic-sampling)."""
    max_num_gen_batches: int = 0
    """Generation rounds allowed per step before giving up (--max-num-gen-batches); 0 = unlimited."""
    on_exhausted: Literal["error", "partial"] = "error"
    """What to do when the rounds run out (--on-gen-exhausted)."""

    def __post_init__(self) -> None:
        if self.rollout_batch_size <= 0:
            raise ValueError(f"--rollout-batch-size must be > 0, got {self.rollout_batch_size}")
        if self.max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches (--max-num-gen-batches) must be >= 0, got "
                             f"{self.max_num_gen_batches}")
        if self.on_exhausted not in ON_EXHAUSTED:
            raise ValueError(f"on_exhausted (--on-gen-exhausted) must be one of {ON_EXHAUSTED}, got "
                             f"{self.on_exhausted!r}")


class GenerationBudgetExhausted(RuntimeError):
    """Raised when dynamic sampling used every allowed generation round without filling the batch."""


@dataclass
class FillStats:
    rounds: int = 0
    requested_groups: int = 0
    """Prompts sent to the engine (set by the caller)."""
    seen_groups: int = 0
    """Groups decided on (kept or dropped) before the batch was full."""
    kept_groups: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    surplus_groups: int = 0
    """Groups that finished generating but were offered after the batch was full."""

    @property
    def keep_rate(self) -> float:
        """Kept / decided groups so far (0 before any decision)."""
        return self.kept_groups / self.seen_groups if self.seen_groups else 0.0

    def as_metrics(self) -> dict[str, float]:
        generated = self.seen_groups + self.surplus_groups
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/requested_groups": float(self.requested_groups),
            "dynamic_sampling/generated_groups": float(generated),
            "dynamic_sampling/seen_groups": float(self.seen_groups),
            "dynamic_sampling/kept_groups": float(self.kept_groups),
            "dynamic_sampling/surplus_groups": float(self.surplus_groups),
            "dynamic_sampling/all_correct": float(self.all_correct),
            "dynamic_sampling/all_wrong": float(self.all_wrong),
            "dynamic_sampling/keep_ratio": self.keep_rate,
            "dynamic_sampling/generated_per_kept": generated / self.kept_groups if self.kept_groups else 0.0,
        }


@dataclass
class BatchFiller(Generic[G]):
    """Accumulates kept groups across generation rounds until the training batch is full.

    Usage per training step: `start_round()` before each generation round, ask for `round_size(factor)`
    prompts, `offer(group, accs)` for every finished group in the order the prompts were submitted (so
    the kept set does not depend on which groups generate fastest), stop generating once `full`; then
    `batch()`. Groups offered after the batch is full are counted as surplus and not trained on (they
    came from the same policy, but keeping them for the next step would make that step off-policy);
    --partial-rollout keeps them for the next step instead (collect.py, partial_rollout.py), off-policy by
    one version, which --use-tis corrects.
    """

    config: DynamicSamplingConfig
    kept: list[G] = field(default_factory=list)
    stats: FillStats = field(default_factory=FillStats)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.config.rollout_batch_size

    @property
    def needed(self) -> int:
        return max(0, self.config.rollout_batch_size - len(self.kept))

    def round_size(self, over_sample_factor: float) -> int:
        """Prompts to ask for in the next round: ceil(factor x needed / r), r the keep rate measured so
        far in this step floored at KEEP_RATE_FLOOR, or r = 1 before the first decision."""
        rate = max(self.stats.keep_rate, KEEP_RATE_FLOOR) if self.stats.seen_groups else 1.0
        return math.ceil(over_sample_factor * self.needed / rate)

    def start_round(self) -> bool:
        """Count a new generation round and return True, or return False when the budget is spent
        under on_exhausted='partial'; raise GenerationBudgetExhausted under 'error'."""
        if self.exhausted:
            if self.config.on_exhausted == "partial":
                return False
            raise GenerationBudgetExhausted(
                f"dynamic sampling kept {len(self.kept)}/{self.config.rollout_batch_size} groups after "
                f"{self.stats.rounds} generation rounds (--max-num-gen-batches="
                f"{self.config.max_num_gen_batches}); most groups are all correct or all wrong. Raise "
                f"--max-num-gen-batches (0 = unlimited), use --on-gen-exhausted partial, or use prompts "
                f"closer to the model's level."
            )
        self.stats.rounds += 1
        return True

    @property
    def exhausted(self) -> bool:
        """True when max_num_gen_batches rounds have been started."""
        limit = self.config.max_num_gen_batches
        return bool(limit) and self.stats.rounds >= limit

    def offer(self, group: G, accuracies: Sequence[bool | float]) -> bool:
        """Consider one finished group; return True if it joins the batch."""
        if self.full:
            self.stats.surplus_groups += 1
            return False
        self.stats.seen_groups += 1
        values = [bool(a) for a in accuracies]
        if self.config.enabled and not group_is_informative(values):
            if all(values):
                self.stats.all_correct += 1
            else:
                self.stats.all_wrong += 1
            return False
        self.kept.append(group)
        self.stats.kept_groups += 1
        return True

    def note_surplus(self) -> None:
        """Count a group that finished generating after the batch was full (not scored, not offered)."""
        self.stats.surplus_groups += 1

    def batch(self) -> list[G]:
        """The kept groups, at most rollout_batch_size; fewer only after a 'partial' exhaustion."""
        if not self.full and not (self.exhausted and self.config.on_exhausted == "partial"):
            raise RuntimeError(
                f"batch requested with {len(self.kept)}/{self.config.rollout_batch_size} groups kept and "
                f"generation budget left; keep generating until BatchFiller.full"
            )
        return self.kept[: self.config.rollout_batch_size]
