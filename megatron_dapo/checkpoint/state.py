"""What a checkpointed component declares about its own state (style rule 17).

Each component of a run that has state says, in its own class, where that state goes in a checkpoint, who holds it
and whether a rollout draws on it: a class attribute `checkpoint_state`, one of the two declarations below. The
checkpointer (checkpointer.py) is handed the components by name (`Checkpointer(states={...})`, train.py) and reads
only these declarations, so a new component's state is a change in that component's class plus the line that hands
it over; nothing in checkpoint/ names a component.

- `CommonState`: a picklable dict (plain types and tensors: the common state is read back with `weights_only`) that
  the component returns from `state_dict()` and takes back in `load_state_dict(state)`; it sits in the checkpoint's
  common `extra` dict (common.pt, written by global rank 0) at `extra[key]`.
- `ShardedState`: the component's state is the checkpoint's distributed part, dist_checkpointing's torch_dist
  tensors and objects that every rank writes its shard of. checkpoint/training.py writes and reads it from the
  component (`CheckpointSaver.save`, `load_checkpoint`): the actor's model chunks, optimizer, LR scheduler and each
  rank's RNG (MegatronActor, its `modules`, `optimizer`, `scheduler`, `arch`, `layout`, `config`, `steps`). A
  checkpoint has one.

This module imports nothing, so a component anywhere in the package declares its state without depending on the
checkpoint code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class Holder(enum.Enum):
    """Which ranks hold a common state, and so which write it."""

    EVERY_RANK = "every rank"
    """Every rank holds the same state (the trainer's step) and writes it; megatron checks the copies are equal."""
    RANK0_SHARED = "rank 0, shared"
    """Only global rank 0 holds it (the other ranks hold placeholders built from the same flags): built and restored
    on rank 0 alone, and broadcast from rank 0 before a save, so every rank writes the same common state."""
    RANK0_ONLY = "rank 0 only"
    """Only global rank 0 holds it and only its copy is written: too large to broadcast (the --async-rollout batch,
    up to ~0.7 GB at 32B), so it is kept out of megatron's cross-rank check of the common state."""


@dataclass(frozen=True, kw_only=True)
class CommonState:
    """A component's state in the checkpoint's common `extra` dict."""

    key: str
    """extra[key] holds the state. Existing checkpoints hold their states at their keys: never rename one."""
    holder: Holder = Holder.EVERY_RANK
    flat: bool = False
    """The state is one value, `state_dict()[key]`, stored as extra[key] itself (the trainer's "step")."""
    optional: bool = False
    """A checkpoint may lack it (written without the flag that makes it, or with nothing to save: `state_dict()`
    returned {}): the component then stays as built. Otherwise a checkpoint without it is refused on load."""
    drawn: bool = False
    """A rollout changes it before the rollout returns (the sampler's draws): `Checkpointer.mark` copies it before
    each rollout and `rewind` puts it back when a stop signal abandons the rollout."""

    @property
    def rank0(self) -> bool:
        """Only global rank 0 holds it."""
        return self.holder is not Holder.EVERY_RANK


@dataclass(frozen=True)
class ShardedState:
    """A component's state is the checkpoint's distributed part, written through dist_checkpointing by
    checkpoint/training.py (see the module docstring)."""


class Stateful(Protocol):
    """A component with common state: its declaration and its state's two directions. It may also have
    `check_state(state)`, called on every rank before any component is restored (the sampler's --seed check)."""

    checkpoint_state: ClassVar[CommonState]

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
