"""Dynamic sampling (DAPO, arXiv 2503.14476 Sec. 3.2, Eq. 11 constraint 0 < |{o_i correct}| < G).

A prompt group whose G responses are all correct or all wrong has zero advantage for every token, so
it adds no gradient but still dilutes the token-level mean. DAPO drops such groups and keeps
generating until the batch holds `train_batch_size` informative groups.

The filter looks at *accuracy* (did the verifier accept the answer), not at the shaped reward: with
overlong shaping two correct answers of different lengths have different rewards, and a group that
is all correct is still uninformative about correctness (paper's definition; verl filters on the
metric chosen by `filter_groups.metric`, "acc" in its DAPO recipe).

Deviation: when `max_num_gen_batches` rounds are spent without filling the batch, the paper does not
say what happens; verl raises. Here `on_exhausted` chooses: "error" (default, names the flag) or
"partial" (train on the groups kept so far; the token-level mean needs no fixed batch size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

G = TypeVar("G")


def group_is_informative(accuracies: Sequence[bool | float]) -> bool:
    """True when the group's accuracies are neither all correct nor all wrong (needs >= 2 samples)."""
    values = [bool(a) for a in accuracies]
    return len(values) >= 2 and any(values) and not all(values)


@dataclass(frozen=True, kw_only=True)
class DynamicSamplingConfig:
    train_batch_size: int
    """Prompt groups per training step (--rollout-batch-size)."""
    enabled: bool = True
    """Drop uninformative groups (--dynamic-sampling / --no-dynamic-sampling)."""
    max_num_gen_batches: int = 0
    """Generation rounds allowed per step before giving up (--max-num-gen-batches); 0 = unlimited."""
    on_exhausted: Literal["error", "partial"] = "error"
    """What to do when the rounds run out (--on-gen-exhausted)."""

    def __post_init__(self) -> None:
        if self.train_batch_size <= 0:
            raise ValueError(
                f"train_batch_size (--rollout-batch-size) must be > 0, got {self.train_batch_size}"
            )
        if self.max_num_gen_batches < 0:
            raise ValueError(f"max_num_gen_batches (--max-num-gen-batches) must be >= 0, got "
                             f"{self.max_num_gen_batches}")
        if self.on_exhausted not in ("error", "partial"):
            raise ValueError(f"on_exhausted (--on-gen-exhausted) must be 'error' or 'partial', got "
                             f"{self.on_exhausted!r}")


class GenerationBudgetExhausted(RuntimeError):
    """Raised when dynamic sampling used every allowed generation round without filling the batch."""


@dataclass
class FillStats:
    rounds: int = 0
    seen_groups: int = 0
    kept_groups: int = 0
    all_correct: int = 0
    all_wrong: int = 0
    surplus_groups: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/seen_groups": float(self.seen_groups),
            "dynamic_sampling/kept_groups": float(self.kept_groups),
            "dynamic_sampling/all_correct": float(self.all_correct),
            "dynamic_sampling/all_wrong": float(self.all_wrong),
            "dynamic_sampling/keep_ratio": self.kept_groups / self.seen_groups if self.seen_groups else 0.0,
        }


@dataclass
class BatchFiller(Generic[G]):
    """Accumulates kept groups across generation rounds until the training batch is full.

    Usage per training step: `start_round()` before each generation round, `offer(group, accs)` for
    every finished group, stop generating once `full`; then `batch()`. Groups offered after the batch
    is full are counted as surplus and not trained on (they came from the same policy, but keeping
    them for the next step would make that step off-policy).
    """

    config: DynamicSamplingConfig
    kept: list[G] = field(default_factory=list)
    stats: FillStats = field(default_factory=FillStats)

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.config.train_batch_size

    @property
    def needed(self) -> int:
        return max(0, self.config.train_batch_size - len(self.kept))

    def start_round(self) -> bool:
        """Count a new generation round and return True, or return False when the budget is spent
        under on_exhausted='partial'; raise GenerationBudgetExhausted under 'error'."""
        if self.exhausted:
            if self.config.on_exhausted == "partial":
                return False
            raise GenerationBudgetExhausted(
                f"dynamic sampling kept {len(self.kept)}/{self.config.train_batch_size} groups after "
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
        self.stats.seen_groups += 1
        if self.full:
            self.stats.surplus_groups += 1
            return False
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

    def batch(self) -> list[G]:
        """The kept groups, at most train_batch_size; fewer only after a 'partial' exhaustion."""
        if not self.full and not (self.exhausted and self.config.on_exhausted == "partial"):
            raise RuntimeError(
                f"batch requested with {len(self.kept)}/{self.config.train_batch_size} groups kept and "
                f"generation budget left; keep generating until BatchFiller.full"
            )
        return self.kept[: self.config.train_batch_size]
