"""Fully asynchronous rollout (--max-staleness K >= 1): rank 0's thread that never waits for a step.

`StreamingRollout` drives the pure rules of `rollout/stream.py: StreamScheduler` with a real engine (embedded, its
process, or SGLang servers: the RolloutEngine interface) on one daemon thread of global rank 0:

- **Continuous submission.** Each wave is one `engine.open_stream` call, from one cut to the next: it opens with
  the groups cut at the last push (each unfinished sample continued from its prefix,
  `partial_rollout.continuation_request`; a sample the regenerate policy sent back is continued from an empty
  prefix on its own seed) and `StreamScheduler.want()` new prompts, and every time a group comes back it is topped
  up with want() new ones (`OpenStream.add`), which the engine starts in the slots that group freed (over-sampling
  is that submission rate: no rounds). Groups are scored the moment their last response is back and decided in
  submission order; a batch of B kept groups is handed over as soon as it exists.
- **The push lands at a cut, at a point fixed by the schedule, not by timing.** Batches are numbered by the step
  that trains them: step s trains at actor version s - 1 and its push sets version s. When the batch of step s is
  handed over and s - K > the version the engine serves, the rollout needs version s - K before it may generate
  further (a token generated now is trained at step s + 1 or later, at version >= s, so it must be at least
  version s - K). It then *cuts*: aborts the requests in flight (`engine.abort()`; the embedded engine stops them
  at the decode step in progress, SGLang as /abort_request lands), takes every sample so far (finished, or a
  prefix with its log-probs and per-token versions), and *parks*. The trainer pushes version s - K while it is
  parked (`window`), evaluates and saves, then releases it; the cut groups resume first in the next wave, their
  continuations re-prefilled under the new weights, so a response that spans the push carries both versions, each
  token labelled with the weights whose forward pass produced it (`Sample.token_versions`). That is SGLang's
  retract semantics reached through the abort path (docs/ASYNC.md, section 1), the same for every engine; no
  request runs while weights load, and a push, an evaluation or a save never shares the engine with generation.
- **What the trainer sees.** `take(step)` hands the trainer the batch of `step` (waiting only while it does not
  exist yet: time/rollout_wait_s); `window(step)` waits for the park that version `step` is due at (the rollout
  K batches ahead, or finished: time/push_wait_s). With K = 1 the rollout generates step s+1 while step s trains
  and the push waits for it, as --async-rollout 1, but the groups still generating when a batch is handed over
  keep going instead of being thrown away or waiting for the next step; with K = 2 it runs a batch further ahead.
- **Staleness.** A group with a token older than (its batch's train version - K) is dropped or regenerated at its
  decision (StreamScheduler, --stale-policy); every trained token therefore has staleness <= K
  (`rollout/staleness/<d>`, the share of the batch's tokens at staleness d).

Determinism and exact resume: decisions are in submission order, the embedded engine's samples depend only on
seeds, weights and which rows share its batch (a function of the requests and of where they were added: after
which group, never when), and both the cut points and the batches the rollout counts as taken are
functions of the schedule (`_release`, `_pop_due`), never of the trainer's timing. A checkpoint is written while
the rollout is parked (the periodic save of step s happens in the window of version s); it holds the scheduler,
every group not yet trained (cut groups with their prefixes, finished groups with their rewards, batches handed
over) and the sampler moved with them; a resumed run carries on from the same cut, so it makes the same waves, the
same batches and the same updates as the uninterrupted run. A save forced by a stop signal outside a window
(trainer/stop.py) cuts at the next group the engine returns: a valid state to resume from, but that cut point is
timing-dependent. With SGLang the abort point is timing-dependent anyway (partial_rollout.py says why).

Memory (rank 0, host): the in-flight groups' samples as Python lists plus the K batches ahead; at the production
setting the planner's row (planner: fully async in-flight state) gives the bytes.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

from megatron_dapo.checkpoint.state import CommonState, Holder
from megatron_dapo.rollout import partial_rollout
from megatron_dapo.rollout.async_rollout import groups_from_state, groups_state
from megatron_dapo.rollout.collect import CollectConfig, RewardFn, ScoredGroup, rollout_stats, score_group, seeded
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.partial_rollout import CarriedGroup, continuation_request, extend, settle
from megatron_dapo.rollout.stream import STALE_POLICIES, StreamConfig, StreamScheduler, spans_of
from megatron_dapo.rollout.types import Prompt, RolloutRequest, Sample

STATE_VERSION = 1
"""Layout version of `StreamingRollout.state_dict()`."""
CLOSE_TIMEOUT_S = 60.0
"""How long `close` waits for the rollout thread to finish its cut (an abort and the drain of what comes back)."""


IN_FLIGHT_SLACK = 1.25
"""--max-in-flight-groups 0: groups in flight capped at this x the engine's capacity in groups. The production
simulation (tools/sim_async.py, docs/BENCHMARKS.md) found 1.25 as fast as no cap with no stale group dropped."""


def in_flight_cap(capacity: int | None, n_samples: int, slack: float = IN_FLIGHT_SLACK) -> int | None:
    """ceil(slack x capacity / n_samples) groups for an engine generating `capacity` samples at once; None (no cap)
    when the engine does not say."""
    if capacity is None:
        return None
    return max(1, math.ceil(slack * capacity / n_samples))


def lead(max_staleness: int) -> int:
    """D = max(1, K - 1): the rollout parks for version s - D when the batch of step s is handed over, so it runs D
    batches ahead of training. Tokens generated between the hand-overs of steps s - 1 and s have version s - 1 - D
    and may be trained up to step s + K - D: with D = K - 1 a group in flight at a push lives two batches (K >= 2);
    D = K would leave it one (every group spanning a push would be over the bound), D < K - 1 less overlap."""
    return max(1, max_staleness - 1)


@dataclass(frozen=True, kw_only=True)
class StreamingConfig:
    max_staleness: int
    """K (--max-staleness): the most weight versions a trained token may lag the actor that trains it; >= 1."""
    num_steps: int
    """The run's last step (--num-steps): the rollout stops once that step's batch is handed over."""
    stale_policy: str = "drop"
    """--stale-policy: what happens to a group with a token staler than K (stream.STALE_POLICIES)."""
    max_in_flight: int | None = None
    """At most this many groups in flight (None: the scheduler's target alone, ceil(factor x K x B / keep rate))."""

    def __post_init__(self) -> None:
        if self.max_staleness < 1:
            raise ValueError(f"--max-staleness must be >= 1 for the fully async rollout, got {self.max_staleness}")
        if self.num_steps < 1:
            raise ValueError(f"--num-steps must be >= 1, got {self.num_steps}")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"--stale-policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1 group (or None), got {self.max_in_flight}")


@dataclass
class _Slot:
    """One group of the stream: its prompt, its G samples so far (None while a request for it runs), the seed its
    requests draw from, and its rewards once every sample finished."""

    gid: int
    prompt: Prompt
    seed: int | None
    submit_version: int
    """The engine's weight version when the group was first submitted."""
    samples: list[Sample | None]
    waiting: int = 0
    """Requests of this slot in the current wave."""
    scored: ScoredGroup | None = None

    def unfinished(self) -> list[int]:
        return [i for i, s in enumerate(self.samples) if s is None or s.finish_reason == "abort"]


@dataclass
class _Batch:
    """A batch the rollout counts as taken by the trainer (`_pop_due`), waiting for `take`."""

    step: int
    groups: list[ScoredGroup]
    metrics: dict[str, float]
    requested: list[int]
    """Dataset indices of the prompts submitted since the previous batch was counted as taken."""


@dataclass
class _Sync:
    """The rendezvous between the rollout thread and the trainer, under `StreamingRollout._cv`."""

    applied: int = -1
    """The weight version the engine serves as the rollout counts it (set by `start` and each release)."""
    parked_for: int | None = None
    """The version the parked rollout waits for; None while it generates."""
    released: int = -1
    """The newest version whose window the trainer has left."""
    hold: bool = False
    """A save outside a window asked the rollout to cut and stay parked."""
    held: bool = False
    closing: bool = False
    done: bool = False
    error: BaseException | None = None
    ready: deque[_Batch] = field(default_factory=deque)


class StreamingRollout:
    """Rank 0's fully async rollout (module docstring); a checkpointed component (name "stream",
    extra["stream"], rank 0's alone)."""

    checkpoint_state: ClassVar[CommonState] = CommonState(key="stream", holder=Holder.RANK0_ONLY, optional=True)
    """extra["stream"]: absent from a checkpoint written without --max-staleness."""

    def __init__(self, config: StreamingConfig | None, collect: CollectConfig, *, engine: RolloutEngine | None,
                 next_prompts: Callable[[int], list[Prompt]] | None, decode: Callable[[list[int]], str],
                 reward_fn: RewardFn) -> None:
        """`config` None: this run is not fully async; the component then only refuses a checkpoint that is."""
        self.config, self.collect = config, collect
        self.engine, self.next_prompts, self.decode, self.reward_fn = engine, next_prompts, decode, reward_fn
        self._cv = threading.Condition()
        self._sync = _Sync()
        self._sched: StreamScheduler | None = None
        self._slots: dict[int, _Slot] = {}
        self._seq: dict[int, int] = {}
        """gid -> the scheduler's sequence number of its current submission."""
        self._carry: list[int] = []
        """gids whose requests were cut (or regenerate samples): continued first in the next wave."""
        self._next_gid = 0
        self._wave = 0
        self._popped = 0
        """Batches the rollout counts as taken (`_pop_due`)."""
        self._requested: list[int] = []
        """Dataset indices of the prompts submitted since the last batch was taken, for the prompts record."""
        self._thread: threading.Thread | None = None
        self._parked_s = 0.0
        """Seconds the rollout waited parked for a push since the last batch counted as taken (the engine idle)."""

    # ---- the trainer's side ------------------------------------------------------------------------------------

    def start(self, step: int) -> None:
        """Start the rollout thread before step `step` (the first step this process trains); the engine serves
        version step - 1. Idempotent."""
        if self._thread is not None:
            return
        cfg = self.config
        assert cfg is not None and self.engine is not None and self.next_prompts is not None
        version = self.engine.weight_version
        if version != step - 1:
            raise RuntimeError(f"the fully async rollout starts at step {step}, so the engine must serve weight "
                               f"version {step - 1}; it serves {version}")
        if self._sched is None:
            self._sched = StreamScheduler(self._stream_config(first_train_version=step - 1))
        elif self._sched.config.first_train_version + self._sched.handed < step - 1:
            raise RuntimeError(f"the checkpoint's stream handed over batches up to step "
                               f"{self._sched.config.first_train_version + self._sched.handed}, the run resumes at "
                               f"step {step}")
        self._sync.applied = self._sync.released = step - 1
        self._thread = threading.Thread(target=self._main, name="stream-rollout", daemon=True)
        self._thread.start()

    def take(self, step: int) -> tuple[list[ScoredGroup], dict[str, float], list[int]]:
        """The kept groups of `step`'s batch, its metrics (with time/rollout_wait_s) and the dataset indices of
        the prompts submitted since the previous batch; blocks until the batch exists."""
        self.start(step)
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._sync.ready or self._sync.error is not None or self._sync.done)
            self._raise_if_failed()
            if not self._sync.ready:
                raise RuntimeError(f"the fully async rollout ended before handing over the batch of step {step}")
            batch = self._sync.ready.popleft()
        if batch.step != step:
            raise RuntimeError(f"the fully async rollout handed over the batch of step {batch.step}, the trainer is "
                               f"at step {step}")
        return batch.groups, batch.metrics | {"time/rollout_wait_s": time.perf_counter() - t0}, batch.requested

    @contextmanager
    def window(self, step: int) -> Iterator[dict[str, float]]:
        """Around step `step`'s push (version `step`), evaluation and save: waits until the rollout is parked for
        that version (or finished), yields a dict that gets time/push_wait_s, releases the rollout on exit."""
        metrics: dict[str, float] = {}
        t0 = time.perf_counter()
        with self._cv:
            self._cv.wait_for(lambda: self._sync.parked_for == step or self._sync.done
                              or self._sync.error is not None)
            self._raise_if_failed()
            if self._sync.parked_for is not None and self._sync.parked_for != step:
                raise RuntimeError(f"the fully async rollout waits for version {self._sync.parked_for}, the trainer "
                                   f"pushes {step}")
        metrics["time/push_wait_s"] = time.perf_counter() - t0
        try:
            yield metrics
        finally:
            with self._cv:
                self._sync.released = max(self._sync.released, step)
                self._cv.notify_all()

    def close(self) -> None:
        """Stop the rollout thread: it aborts what is in flight and exits (waits up to CLOSE_TIMEOUT_S)."""
        with self._cv:
            self._sync.closing = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_TIMEOUT_S)

    def _raise_if_failed(self) -> None:
        if self._sync.error is not None:
            raise RuntimeError(f"the fully async rollout failed: {type(self._sync.error).__name__}: "
                               f"{self._sync.error}") from self._sync.error

    # ---- the rollout thread --------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while True:
                self._settle()
                with self._cv:
                    if self._finished():
                        self._pop_due(everything=True)
                    if self._sync.closing or self._finished():
                        return
                if self._complete_finished_carried():
                    continue
                requests = self._next_wave()
                if not requests:
                    raise RuntimeError("the fully async rollout has nothing to submit and nothing in flight before "
                                       "the batch it needs (scheduler: want() is 0)")
                stream = self.engine.open_stream(requests)
                for samples in stream:
                    self._receive(samples, cutting=False)
                    if self._interrupt():
                        self._cut(stream)
                        break
                    if stream.accepts_additions and (fresh := self._fresh()):  # refill the freed slots now
                        stream.add(fresh)
        except BaseException as err:  # delivered to the trainer's thread by take / window
            with self._cv:
                self._sync.error = err
        finally:
            with self._cv:
                self._sync.done = True
                self._cv.notify_all()

    def _finished(self) -> bool:
        """Every batch up to --num-steps was handed over."""
        sched = self._sched
        return sched.config.first_train_version + sched.handed >= self.config.num_steps

    def _due(self) -> int | None:
        """The version the rollout must wait for before generating on, None when none is due: version s - lead
        once the batch of step s = first + handed is handed over (`lead`)."""
        sched = self._sched
        needed = sched.config.first_train_version + sched.handed - lead(self.config.max_staleness)
        return self._sync.applied + 1 if needed > self._sync.applied else None

    def _interrupt(self) -> bool:
        with self._cv:
            return self._due() is not None or self._sync.hold or self._sync.closing or self._finished()

    def _settle(self) -> None:
        """Pop the batches the trainer now counts as taking, park for every version due, hold if a save asked."""
        with self._cv:
            self._pop_due()
            while (version := self._due()) is not None and not self._sync.closing:
                self._sync.parked_for = version
                self._cv.notify_all()
                t0 = time.perf_counter()
                self._cv.wait_for(lambda v=version: self._sync.released >= v or self._sync.closing)
                self._parked_s += time.perf_counter() - t0
                if self._sync.closing:
                    return
                if self.engine.weight_version != version:
                    raise RuntimeError(f"the trainer left the window of version {version}, the engine serves "
                                       f"{self.engine.weight_version}")
                self._sync.applied, self._sync.parked_for = version, None
                self._pop_due()
            if self._sync.hold:
                self._sync.held = True
                self._cv.notify_all()
                self._cv.wait_for(lambda: self._sync.closing)

    def _pop_due(self, everything: bool = False) -> None:
        """The trainer trains step s once version s - 1 is pushed, so the batches the rollout counts as taken
        (those not in `ready` for StreamScheduler.want) are those of steps <= applied + 1: a function of the
        schedule, never of when the trainer's thread gets there. `everything`: the rollout ended, all of them."""
        sched = self._sched
        due = sched.handed if everything else min(sched.handed,
                                                   self._sync.applied - sched.config.first_train_version + 1)
        while self._popped < due:
            handed = sched.pop_batch()
            self._popped += 1
            groups = [self._slots.pop(gid).scored for gid in handed.keys]
            for gid in handed.keys:
                del self._seq[gid]
            metrics = handed.metrics() | sched.take_counts() | rollout_stats(groups, self.collect.sampling
                                                                               .max_new_tokens)
            metrics |= {"async/staleness": metrics["rollout/max_staleness"],
                        "async/train_version": float(handed.train_version),
                        "stream/in_flight_groups": float(sched.in_flight), "stream/keep_rate": sched.keep_rate,
                        "time/rollout_parked_s": self._parked_s}
            self._parked_s = 0.0
            self._sync.ready.append(_Batch(step=handed.train_version + 1, groups=groups, metrics=metrics,
                                           requested=self._requested))
            self._requested = []
            self._cv.notify_all()

    def _complete_finished_carried(self) -> bool:
        """Cut groups whose every sample had finished: decided now, in submission order, without a request.
        True when there were any (the caller settles again: a batch may have been handed over)."""
        finished = [gid for gid in self._carry if not self._slots[gid].unfinished()]
        self._complete_carried(finished)
        return bool(finished)

    def _complete_carried(self, gids: list[int]) -> None:
        """Take `gids` out of the carried groups and hand each to the scheduler as it is, in submission order."""
        taken = set(gids)
        self._carry = [gid for gid in self._carry if gid not in taken]
        for gid in sorted(gids, key=self._seq.__getitem__):
            self._complete(self._slots[gid])

    def _next_wave(self) -> list[RolloutRequest]:
        """The cut groups' continuations (in submission order), then want() new groups."""
        self._wave += 1
        sampling, requests = self.collect.sampling, []
        for gid in sorted(self._carry, key=self._seq.__getitem__):
            slot = self._slots[gid]
            for i in slot.unfinished():
                prefix = slot.samples[i]
                assert prefix is not None
                requests.append(continuation_request(slot.prompt.prompt_ids, prefix, sampling, slot.seed,
                                                     f"g{gid}-s{i}-w{self._wave}"))
                slot.waiting += 1
        self._carry = []
        return requests + self._fresh()

    def _fresh(self) -> list[RolloutRequest]:
        """want() new groups (none when the scheduler's target or cap is reached), submitted at the engine's
        version."""
        with self._cv:
            want = self._sched.want()
        fresh = self.next_prompts(want) if want else []
        sampling, g, requests = self.collect.sampling, self.collect.n_samples_per_prompt, []
        for prompt in fresh:
            gid, self._next_gid = self._next_gid, self._next_gid + 1
            group_sampling = seeded(sampling, self.collect.seed, f"g{gid}")
            slot = _Slot(gid=gid, prompt=prompt, seed=group_sampling.seed, submit_version=self._sync.applied,
                         samples=[None] * g, waiting=1)
            self._slots[gid] = slot
            with self._cv:
                self._seq[gid] = self._sched.submit(gid, self._sync.applied)
            self._requested.append(prompt.index)
            requests.append(RolloutRequest(prompt_ids=prompt.prompt_ids, n=g, sampling=group_sampling,
                                           request_id=f"g{gid}-w{self._wave}"))
        return requests

    def _slot_of(self, request_id: str) -> _Slot:
        return self._slots[int(request_id.split("-", 1)[0][1:])]

    def _receive(self, samples: list[Sample], *, cutting: bool) -> None:
        """A request's samples are back: extend its slot; a slot with every sample finished is decided, unless this
        is the drain of a cut (then it is carried like the others and decided first in the next wave)."""
        slot = self._slot_of(samples[0].request_id)
        for s in samples:
            slot.samples[s.index] = settle(extend(slot.samples[s.index], s, slot.prompt.prompt_ids),
                                           self.collect.sampling)
        slot.waiting -= 1
        if slot.waiting:
            return
        if cutting or slot.unfinished():  # aborted by us, or by the engine (a server lost): continued next wave
            self._carry.append(slot.gid)
            return
        self._complete(slot)

    def _complete(self, slot: _Slot) -> None:
        """Score the finished group and hand it to the scheduler; free what it filters or drops; queue what it
        regenerates (its stale samples continue from an empty prefix, on their own seeds)."""
        samples = [s for s in slot.samples if s is not None]
        slot.scored = score_group(slot.prompt, samples, self.decode, self.reward_fn, self.collect.overlong)
        with self._cv:
            self._sched.complete(self._seq[slot.gid], [spans_of(s.versions()) for s in samples], slot.scored.accs)
            decisions = self._sched.take_decisions()
            regenerations = self._sched.take_regenerations()
        for gid, outcome in decisions:
            if outcome in ("filtered", "dropped"):
                del self._slots[gid]
                del self._seq[gid]
        for regen in regenerations:
            again = self._slots[regen.key]
            self._seq[regen.key] = regen.seq
            again.scored = None
            for i in regen.samples:
                old = again.samples[i]
                again.samples[i] = Sample(request_id=old.request_id, index=i, prompt_ids=old.prompt_ids,
                                          response_ids=[], logprobs=[], finish_reason="abort",
                                          weight_version=self._sync.applied)
            self._carry.append(regen.key)

    def _cut(self, stream: Iterator[list[Sample]]) -> None:
        """Abort what is in flight and drain the stream: every group of the wave not decided yet keeps its samples
        so far and is continued first in the next wave."""
        self.engine.abort()
        for samples in stream:
            self._receive(samples, cutting=True)
        self._retire_hopeless()

    def _retire_hopeless(self) -> None:
        """Cut groups with a token older than (the train version of the batch being built - K) can never be trained
        (versions only grow): handed to the scheduler now as they are, to be dropped or regenerated at their turn,
        instead of generating on."""
        sched = self._sched
        bound = sched.config.first_train_version + sched.handed - self.config.max_staleness
        hopeless = [gid for gid in self._carry
                    if min((v for s in self._slots[gid].samples if s is not None for v in s.versions()),
                           default=bound) < bound]
        self._complete_carried(hopeless)

    # ---- checkpoint ---------------------------------------------------------------------------------------------

    def _quiesce(self) -> None:
        """Rank 0, before a snapshot: the rollout thread must be parked (a window), held, or finished; a save
        outside a window asks it to cut at the next group back and hold."""
        if self._thread is None:
            return
        with self._cv:
            if self._sync.parked_for is not None or self._sync.done:
                return
            self._sync.hold = True
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._sync.held or self._sync.done or self._sync.parked_for is not None)
            self._raise_if_failed()

    def state_dict(self) -> dict[str, Any]:
        """{} when not fully async or nothing started; else the scheduler, every group not trained yet (cut groups
        with their prefixes, finished ones with their rewards), the batches handed over, and the counters: 12 B per
        carried token, the finished groups as async_rollout.groups_state (~16 B per token)."""
        if self.config is None or self._sched is None:
            return {}
        self._quiesce()
        with self._cv:
            slots = sorted(self._slots.values(), key=lambda s: s.gid)
            partial = [s for s in slots if s.scored is None]
            scored = [s for s in slots if s.scored is not None]
            return {
                "version": STATE_VERSION, "scheduler": self._sched.state_dict(),
                "carried": partial_rollout.state([CarriedGroup(prompt=s.prompt, samples=list(s.samples), seed=s.seed,
                                                               first_step=s.submit_version) for s in partial]),
                "carried_gids": [s.gid for s in partial],
                "scored": groups_state([s.scored for s in scored]),
                "scored_gids": [s.gid for s in scored],
                "scored_seeds": [s.seed for s in scored], "scored_versions": [s.submit_version for s in scored],
                "seq": {str(gid): seq for gid, seq in self._seq.items()},
                "carry": list(self._carry) + [s.gid for s in partial if s.gid not in self._carry],
                "ready": [{"step": b.step, "groups": groups_state(b.groups), "metrics": b.metrics,
                           "requested": b.requested} for b in self._sync.ready],
                "first_train_version": self._sched.config.first_train_version,
                "next_gid": self._next_gid, "wave": self._wave, "popped": self._popped,
                "requested": list(self._requested),
            }

    def load_state_dict(self, data: dict[str, Any]) -> None:
        if self.config is None:
            raise ValueError("the checkpoint was written by a fully async run (--max-staleness K): its groups in "
                             "flight would be lost; resume with --max-staleness")
        if data.get("version") != STATE_VERSION:
            raise ValueError(f"checkpoint's stream state has layout version {data.get('version')!r}, this code reads "
                             f"{STATE_VERSION}")
        saved = data["scheduler"]
        sched = StreamScheduler(self._stream_config(first_train_version=int(data["first_train_version"])))
        sched.load_state_dict(saved)
        self._sched = sched
        self._slots = {}
        for gid, group in zip(data["carried_gids"], partial_rollout.from_state(data["carried"]), strict=True):
            self._slots[int(gid)] = _Slot(gid=int(gid), prompt=group.prompt, seed=group.seed,
                                          submit_version=group.first_step, samples=list(group.samples))
        for gid, seed, version, group in zip(data["scored_gids"], data["scored_seeds"], data["scored_versions"],
                                             groups_from_state(data["scored"]), strict=True):
            self._slots[int(gid)] = _Slot(gid=int(gid), prompt=group.prompt, seed=seed, submit_version=int(version),
                                          samples=list(group.samples), scored=group)
        self._seq = {int(gid): int(seq) for gid, seq in data["seq"].items()}
        self._carry = [int(gid) for gid in data["carry"]]
        self._sync.ready = deque(_Batch(step=int(b["step"]), groups=groups_from_state(b["groups"]),
                                        metrics=dict(b["metrics"]), requested=[int(i) for i in b["requested"]])
                                 for b in data["ready"])
        self._next_gid, self._wave, self._popped = int(data["next_gid"]), int(data["wave"]), int(data["popped"])
        self._requested = [int(i) for i in data["requested"]]

    def _stream_config(self, *, first_train_version: int) -> StreamConfig:
        cfg, collect = self.config, self.collect
        return StreamConfig(batch_groups=collect.dynamic_sampling.rollout_batch_size,
                            max_staleness=cfg.max_staleness, n_samples=collect.n_samples_per_prompt,
                            dynamic_sampling=collect.dynamic_sampling.enabled,
                            over_sample_factor=collect.over_sample_factor, stale_policy=cfg.stale_policy,
                            first_train_version=first_train_version, max_in_flight=cfg.max_in_flight)
