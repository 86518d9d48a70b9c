"""One checkpointer: saves and restores the run's stateful components by name (style rule 17).

Each component declares its own state in its class (`checkpoint_state`, checkpoint/state.py): where the state sits
in a checkpoint, who holds it, whether a rollout draws on it. The checkpointer is handed the components by name
(`states`, train.py) and reads only those declarations: it names no component, so a new component's state is a
change in that component plus the line that hands it over. It writes them all through
megatron_dapo/checkpoint/training.py (`CheckpointSaver`, `load_checkpoint`): the component that declares a
`ShardedState` (the actor: model, optimizer, scheduler, each rank's RNG) as sharded tensors and objects of
dist_checkpointing's torch_dist format; every `CommonState` as a picklable dict in the checkpoint's common `extra`
dict, at the key it declares. The keys are those every checkpoint written so far has, so all of them load:

    extra = {"step": 7,                     # "trainer"   (Trainer: the last completed step)
             "sampler": {...},              # "sampler"   (ResumableSampler; a few hundred bytes)
             "carried": {...},              # "carried"   (CarriedGroups, --partial-rollout; 12 B per carried token)
             "async_batch": {...},          # "ahead"     (BatchAhead, --async-rollout 1; up to ~0.7 GB at 32B)
             "stream": {...},               # "stream"    (StreamingRollout, --max-staleness; rollout/streaming.py)
             "metrics": {...}}              # "record"    (SavedRecord: the saved step's metrics record so far)

A component with nothing to save returns {} and nothing is written for it. Who holds what (`Holder`): only global
rank 0 draws prompts, generates and logs, so "sampler", "carried", "ahead", "stream" and "record" are rank 0's; the
other ranks hold placeholders. On a save rank 0 builds them inside the trainer's `section` (a failure there reaches
every rank), then the small shared ones ("sampler", "carried": RANK0_SHARED) are broadcast on the wait group (gloo,
--rollout-timeout) so every rank writes the identical common state megatron checks across ranks; "ahead", "stream"
and "record" (RANK0_ONLY) stay on rank 0 (its size; the saver keeps it out of that check). On a load every rank
reads the checkpoint, then the rank-0 components are restored on rank 0 alone, again inside a `section`.

A stop signal can abandon a step's rollout on rank 0 (trainer/stop.py); the save that follows must be the one the
last finished step would have written. A rollout changes no actor state, and the carried groups and the batch ahead
only once it returns, but the sampler's position as it draws (declared `drawn`), and the RNG if anything in it
draws: `mark` copies those (rank 0, before each rollout) and `rewind` puts them back.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist

from megatron_dapo.checkpoint import training
from megatron_dapo.checkpoint.state import CommonState, Holder, ShardedState, Stateful
from megatron_dapo.checkpoint.training import CheckpointSaver, rng_state, set_rng_state
from megatron_dapo.distributed import comm
from megatron_dapo.errors import UserError


class MissingStateError(ValueError):
    """A checkpoint lacks the state of a component this run needs; the message names the component."""


def declared_states(states: Mapping[str, Any]) -> tuple[dict[str, CommonState], str | None]:
    """Each component's `checkpoint_state`: the common ones by name, and the name of the one with the sharded state
    (None: none). ValueError for a component that declares none, two components at one `extra` key, or two with a
    sharded state: a checkpoint has one place for each."""
    undeclared = sorted(name for name, c in states.items()
                        if not isinstance(getattr(c, "checkpoint_state", None), (CommonState, ShardedState)))
    if undeclared:
        raise ValueError(f"Checkpointer: no slot for component(s) {undeclared}: their class declares no "
                         f"`checkpoint_state` (a CommonState or ShardedState, megatron_dapo/checkpoint/state.py)")
    common = {name: c.checkpoint_state for name, c in states.items() if isinstance(c.checkpoint_state, CommonState)}
    sharded = [name for name, c in states.items() if isinstance(c.checkpoint_state, ShardedState)]
    if len(sharded) > 1:
        raise ValueError(f"Checkpointer: components {sharded} each declare the checkpoint's sharded state; a "
                         f"checkpoint has one")
    by_key: dict[str, list[str]] = {}
    for name, slot in common.items():
        by_key.setdefault(slot.key, []).append(name)
    clashes = {key: names for key, names in by_key.items() if len(names) > 1}
    if clashes:
        raise ValueError("Checkpointer: components declare the same checkpoint key: " + "; ".join(
            f"{names} at extra[{key!r}]" for key, names in sorted(clashes.items())))
    return common, sharded[0] if sharded else None


class Checkpointer:
    """Saves and restores the named components (`states`) on every rank, each as its class declares
    (`checkpoint_state`, checkpoint/state.py).

    `section(what)`: Trainer.section, the status barrier that makes a failure in rank 0's part reach the others;
    `group`: the wait group the shared rank-0 state is broadcast on (None in a world of one). `save_dir` (--save)
    and `load_dir` (--load) may be None: no saves, nothing to resume. `save` and `load` need a component with the
    sharded state (the actor)."""

    def __init__(self, states: Mapping[str, Any], *, save_dir: str | None, load_dir: str | None,
                 fully_parallel: bool = False, async_save: bool = False,
                 section: Callable[[str], AbstractContextManager[None]] = lambda what: nullcontext(),
                 group=None) -> None:
        self.slots, sharded = declared_states(states)
        self.states: dict[str, Stateful] = {name: states[name] for name in self.slots}
        self.sharded = states[sharded] if sharded is not None else None
        self.load_dir, self.section, self.group = load_dir, section, group
        rank0_only = tuple(slot.key for slot in self.slots.values() if slot.holder is Holder.RANK0_ONLY)
        self.saver = CheckpointSaver(save_dir, fully_parallel=fully_parallel, async_save=async_save,
                                     rank0_extra=rank0_only) if save_dir else None
        self._marked: tuple[dict[str, Any], dict[str, dict[str, Any]]] | None = None

    def _is_rank0(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def _holds(self, slot: CommonState) -> bool:
        return not slot.rank0 or self._is_rank0()

    def _sharded_component(self, what: str):
        if self.sharded is None:
            raise ValueError(f"Checkpointer.{what}: no component declares the checkpoint's sharded state (the "
                             f"actor's ShardedState)")
        return self.sharded

    def extra(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's (shared, rank-0-only) parts of `extra`: the common states at their declared keys."""
        shared: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for name, component in self.states.items():
            slot = self.slots[name]
            if not self._holds(slot):
                continue
            state = component.state_dict()
            if not state:
                continue
            (own if slot.holder is Holder.RANK0_ONLY else shared)[slot.key] = state[slot.key] if slot.flat else state
        return shared, own

    def save(self, step: int) -> None:
        """Write step `step` (every rank calls this). Rank 0's component states are built inside a section, so a
        failure there reaches the other ranks; the shared ones then travel on the wait group (a few hundred bytes
        plus 12 B per carried token), and the sharded state goes through dist_checkpointing (training.py)."""
        if self.saver is None:
            raise ValueError("Checkpointer.save without a save directory (--save)")
        sharded = self._sharded_component("save")
        with self.section("while preparing the checkpoint's sampler state"):
            shared, own = self.extra()
        if self.group is not None:  # identical common state on every rank; gloo, rank 0 may be late
            shared = comm.broadcast_object(shared, 0, group=self.group)
        self.saver.save(step, sharded, extra=shared | own)

    def mark(self) -> None:
        """Rank 0, before a step's rollout: copy the RNG states and the states of the `drawn` components (the
        sampler: 7 ints), ~10 KB in all, for `rewind`. No-op on the other ranks (they draw nothing meanwhile)."""
        if self._is_rank0():
            self._marked = (rng_state(), {name: copy.deepcopy(component.state_dict())
                                          for name, component in self.states.items() if self.slots[name].drawn})

    def rewind(self) -> None:
        """Rank 0, after a stop signal abandoned the rollout: put back what `mark` copied, so a save now writes
        the state the end of the last finished step had (Trainer._stop)."""
        if self._is_rank0() and self._marked is not None:
            rng, states = self._marked
            set_rng_state(rng)
            for name, state in states.items():
                self.states[name].load_state_dict(state)

    def load(self) -> int | None:
        """Restore the newest usable checkpoint under `load_dir` into the sharded component and every other; return
        its step (None: no load_dir, or nothing in it). A checkpoint without a required component's state raises
        MissingStateError naming the component."""
        if not self.load_dir:
            return None
        extra = training.load_checkpoint(self.load_dir, self._sharded_component("load"))
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
        for name, component in self.states.items():
            slot, check = self.slots[name], getattr(component, "check_state", None)
            if check is None or slot.key not in extra:
                continue
            try:
                check({slot.key: extra[slot.key]} if slot.flat else extra[slot.key])
            except UserError as err:
                err.echo = self._is_rank0()
                raise

    def load_extra(self, extra: Mapping[str, Any]) -> None:
        """Give each component (that this rank holds) its state from a checkpoint's `extra`, in `states` order."""
        for name, component in self.states.items():
            slot = self.slots[name]
            if not self._holds(slot):
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
