"""Seeded, resumable prompt order over epochs."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from megatron_dapo.checkpoint.state import CommonState, Holder
from megatron_dapo.errors import UserError

_STATE_VERSION = 1


def epoch_permutation(num_items: int, seed: int, epoch: int) -> np.ndarray:
    """Order of item indices in `epoch`: a PCG64 permutation seeded by the pair (seed, epoch).

    Seeding with the pair (not seed + epoch) keeps runs with neighbouring seeds from sharing
    epochs shifted by one.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_items)


class ResumableSampler:
    """Hands out dataset indices batch by batch, reshuffled every epoch, restorable exactly.

    With `drop_last=False` a batch that reaches the end of an epoch continues into the next one,
    so every item is used once per epoch. With `drop_last=True` the leftover items of an epoch
    (fewer than the batch) are skipped and the batch is taken from the next epoch.
    """

    checkpoint_state: ClassVar[CommonState] = CommonState(key="sampler", holder=Holder.RANK0_SHARED, drawn=True)
    """Checkpointed as extra["sampler"] (a few hundred bytes): global rank 0 draws the prompts (a placeholder
    elsewhere); a rollout draws on it before it returns, so a stop that abandons the rollout rewinds it."""

    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True, drop_last: bool = False) -> None:
        if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 1:
            raise ValueError(
                f"ResumableSampler: num_items must be an int >= 1 (dataset size), got {num_items!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"ResumableSampler: seed must be an int >= 0 (--seed), got {seed!r}")
        self.num_items, self.seed, self.shuffle, self.drop_last = (
            num_items,
            seed,
            bool(shuffle),
            bool(drop_last),
        )
        self.epoch = 0
        self.position = 0  # items of the current epoch already handed out
        self._order: np.ndarray | None = None
        self._order_epoch = -1

    def _current_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            if self.shuffle:
                self._order = epoch_permutation(self.num_items, self.seed, self.epoch)
            else:
                self._order = np.arange(self.num_items)
            self._order_epoch = self.epoch
        assert self._order is not None
        return self._order

    def _advance_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def next_batch(self, n: int) -> list[int]:
        """The next `n` item indices (ints in [0, num_items))."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"ResumableSampler.next_batch: n must be an int >= 1, got {n!r}")
        if self.drop_last:
            if n > self.num_items:
                raise ValueError(
                    f"ResumableSampler.next_batch: batch of {n} > {self.num_items} items with drop_last=True "
                    "would drop every epoch; lower the batch size or use drop_last=False"
                )
            if self.num_items - self.position < n:
                self._advance_epoch()
        batch: list[int] = []
        while len(batch) < n:
            if self.position == self.num_items:
                self._advance_epoch()
            take = min(n - len(batch), self.num_items - self.position)
            batch.extend(int(i) for i in self._current_order()[self.position : self.position + take])
            self.position += take
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue with the same batches (plain ints/bools, checkpoint-safe)."""
        return {
            "version": _STATE_VERSION,
            "num_items": self.num_items,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "position": self.position,
        }

    def check_state(self, state: dict[str, Any]) -> None:
        """UserError when `state` (a checkpoint's) was saved under another --seed: the resumed run would continue
        another prompt order (epoch_permutation of the pair (seed, epoch)) than the one it saved."""
        saved = state.get("seed")
        if saved != self.seed:
            raise UserError(f"the checkpoint under --load was saved with --seed {saved}, this run has --seed "
                            f"{self.seed}: a resumed run continues the saved prompt order; resume with --seed {saved}, "
                            f"or start a new run (another --save, without --load)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict`; the seed (`check_state`), dataset size and order settings must match this
        sampler's."""
        self.check_state(state)
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"ResumableSampler: unsupported state version {state.get('version')!r}")
        for key in ("num_items", "seed", "shuffle", "drop_last"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"ResumableSampler: checkpoint has {key}={state.get(key)!r} but this run has "
                    f"{key}={getattr(self, key)!r}; resume with the same dataset and data flags"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(position, int):
            raise ValueError(f"ResumableSampler: bad epoch/position in state: {epoch!r}/{position!r}")
        if not 0 <= position <= self.num_items:
            raise ValueError(f"ResumableSampler: position {position} outside [0, {self.num_items}]")
        self.epoch, self.position = epoch, position
