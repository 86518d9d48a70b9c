"""One checkpointer: saves and restores the run's stateful components by name (style rule 17).

Each component owns its state through `state_dict()` / `load_state_dict()`; the checkpointer knows where each
one's state sits in a checkpoint and who holds it (`LAYOUT`), and writes them all, with the actor, through
megatron_dapo/checkpoint/training.py (`CheckpointSaver`, `load_checkpoint`). The actor's state (model, optimizer,
scheduler, each rank's RNG) is sharded tensors and objects of dist_checkpointing's torch_dist format; every other
component's state is a picklable dict in the checkpoint's common `extra` dict, at the same keys as before the
checkpointer existed, so every checkpoint written so far loads:

    extra = {"step": 7,                     # "trainer"   (Trainer: the last completed step)
             "sampler": {...},              # "sampler"   (ResumableSampler; a few hundred bytes)
             "carried": {...},              # "carried"   (CarriedGroups, --partial-rollout; 12 B per carried token)
             "async_batch": {...}}          # "ahead"     (BatchAhead, --async-rollout 1; up to ~0.7 GB at 32B)

A component with nothing to save returns {} and nothing is written for it. Who holds what: only global rank 0
draws prompts and generates, so "sampler", "carried" and "ahead" are rank 0's; the other ranks hold
placeholders. On a save rank 0 builds them inside the trainer's `section` (a failure there reaches every rank),
then the small shared ones ("sampler", "carried") are broadcast on the wait group (gloo, --rollout-timeout) so
every rank writes the identical common state megatron checks across ranks; "ahead" stays on rank 0 (its size;
training.RANK0_EXTRA keeps it out of that check). On a load every rank reads the checkpoint, then the rank-0
components are restored on rank 0 alone, again inside a `section`.

A stop signal can abandon a step's rollout on rank 0 (trainer/stop.py); the save that follows must be the one the
last finished step would have written. A rollout changes no actor state, and the carried groups and the batch ahead
only once it returns, but the sampler's position as it draws, and the RNG if anything in it draws: `mark` copies
those (rank 0, before each rollout) and `rewind` puts them back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from megatron_dapo.checkpoint import training
from megatron_dapo.checkpoint.training import RANK0_EXTRA, CheckpointSaver, rng_state, set_rng_state
from megatron_dapo.distributed import comm
from megatron_dapo.errors import UserError


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Slot:
    """Where a component's state sits in the checkpoint's `extra` dict and who holds it."""

    key: str
    """extra[key] holds the state."""
    flat: bool = False
    """The state is one value, `state_dict()[key]`, stored as extra[key] itself (the trainer's "step")."""
    rank0: bool = False
    """Only global rank 0 holds it: built and restored on rank 0 alone."""
    shared: bool = True
    """A rank-0 state every rank writes: broadcast from rank 0 before the save (False: rank 0's copy alone)."""
    optional: bool = False
    """A checkpoint may lack it (written without the flag that makes it): the component then stays as built."""
    drawn: bool = False
    """A rollout changes it before the rollout returns (the sampler's draws): `Checkpointer.mark` copies it."""


LAYOUT: dict[str, Slot] = {
    "trainer": Slot("step", flat=True),
    "sampler": Slot("sampler", rank0=True, drawn=True),
    "carried": Slot("carried", rank0=True, optional=True),  # absent: written without --partial-rollout
    "ahead": Slot("async_batch", rank0=True, shared=False, optional=True),  # absent: nothing finished ahead
}
"""Component name -> its slot. The keys are those of every checkpoint written so far (do not rename them)."""
assert {s.key for s in LAYOUT.values() if s.rank0 and not s.shared} == set(RANK0_EXTRA)


class MissingStateError(ValueError):
    """A checkpoint lacks the state of a component this run needs; the message names the component."""


class Checkpointer:
    """Saves and restores the actor and the named components (`states`, names from LAYOUT) on every rank.

    `section(what)`: Trainer.section, the status barrier that makes a failure in rank 0's part reach the others;
    `group`: the wait group the shared rank-0 state is broadcast on (None in a world of one). `save_dir` (--save)
    and `load_dir` (--load) may be None: no saves, nothing to resume."""

    def __init__(self, states: Mapping[str, Stateful], *, actor, save_dir: str | None, load_dir: str | None,
                 fully_parallel: bool = False, async_save: bool = False,
                 section: Callable[[str], AbstractContextManager[None]] = lambda what: nullcontext(),
                 group=None) -> None:
        unknown = sorted(set(states) - set(LAYOUT))
        if unknown:
            raise ValueError(f"Checkpointer: no slot for component(s) {unknown}; known: {sorted(LAYOUT)}")
        self.states, self.actor, self.load_dir = dict(states), actor, load_dir
        self.section, self.group = section, group
        self.saver = CheckpointSaver(save_dir, fully_parallel=fully_parallel, async_save=async_save) \
            if save_dir else None
        self._marked: tuple[dict[str, Any], dict[str, dict[str, Any]]] | None = None

    def _is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _holds(self, slot: Slot) -> bool:
        return not slot.rank0 or self._is_rank0()

    def extra(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's (shared, rank-0-only) parts of `extra`: the components' states at their slots."""
        shared: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for name, component in self.states.items():
            slot = LAYOUT[name]
            if not self._holds(slot):
                continue
            state = component.state_dict()
            if not state:
                continue
            (shared if slot.shared else own)[slot.key] = state[slot.key] if slot.flat else state
        return shared, own

    def save(self, step: int) -> None:
        """Write step `step` (every rank calls this). Rank 0's component states are built inside a section, so a
        failure there reaches the other ranks; the shared ones then travel on the wait group (a few hundred bytes
        plus 12 B per carried token), and the actor's tensors go through dist_checkpointing (training.py)."""
        if self.saver is None:
            raise ValueError("Checkpointer.save without a save directory (--save)")
        with self.section("while preparing the checkpoint's sampler state"):
            shared, own = self.extra()
        if self.group is not None:  # identical common state on every rank; gloo, rank 0 may be late
            shared = comm.broadcast_object(shared, 0, group=self.group)
        self.saver.save(step, self.actor, extra=shared | own)

    def mark(self) -> None:
        """Rank 0, before a step's rollout: copy the RNG states and the states of the `drawn` components (the
        sampler: 7 ints), ~10 KB in all, for `rewind`. No-op on the other ranks (they draw nothing meanwhile)."""
        if self._is_rank0():
            self._marked = (rng_state(), {name: copy.deepcopy(component.state_dict())
                                          for name, component in self.states.items() if LAYOUT[name].drawn})

    def rewind(self) -> None:
        """Rank 0, after a stop signal abandoned the rollout: put back what `mark` copied, so a save now writes
        the state the end of the last finished step had (Trainer._stop)."""
        if self._is_rank0() and self._marked is not None:
            rng, states = self._marked
            set_rng_state(rng)
            for name, state in states.items():
                self.states[name].load_state_dict(state)

    def load(self) -> int | None:
        """Restore the newest usable checkpoint under `load_dir` into the actor and every component; return its
        step (None: no load_dir, or nothing in it). A checkpoint without a required component's state raises
        MissingStateError naming the component."""
        if not self.load_dir:
            return None
        extra = training.load_checkpoint(self.load_dir, self.actor)
        if extra is None:
            return None
        self.check_extra(extra)
        with self.section("while restoring the sampler state from the checkpoint"):  # the others wait in the sync
            self.load_extra(extra)
        if self._is_rank0():
            print(f"[megatron-dapo] resumed from {self.load_dir} at step {int(extra['step'])}")
        return int(extra["step"])

    def check_extra(self, extra: Mapping[str, Any]) -> None:
        """Every rank, before any component is restored: each component with a `check_state(state)` (the sampler:
        the run's --seed against the saved one) checks the checkpoint's state against the flags it was built from.
        Every rank holds every component (placeholders off rank 0, built from the same flags) and reads the same
        shared state, so all reach the same verdict; a UserError is printed by global rank 0 alone."""
        for name, slot in LAYOUT.items():
            check = getattr(self.states.get(name), "check_state", None)
            if check is None or slot.key not in extra:
                continue
            try:
                check({slot.key: extra[slot.key]} if slot.flat else extra[slot.key])
            except UserError as err:
                err.echo = self._is_rank0()
                raise

    def load_extra(self, extra: Mapping[str, Any]) -> None:
        """Give each component (that this rank holds) its state from a checkpoint's `extra`, in LAYOUT order."""
        for name, slot in LAYOUT.items():
            component = self.states.get(name)
            if component is None or not self._holds(slot):
                continue
            if slot.key not in extra:
                if slot.optional:
                    continue
                raise MissingStateError(f"the checkpoint under --load {self.load_dir} has no state for {name!r} "
                                        f"(extra[{slot.key!r}]); it was not written by this trainer's --save")
            state = extra[slot.key]
            component.load_state_dict({slot.key: state} if slot.flat else state)

    def close(self) -> None:
        """Finish an --async-save in flight (renamed here) and stop its writer."""
        if self.saver is not None:
            self.saver.close()
