"""One step's rollout batch: generate G responses per prompt -> verify -> shape -> dynamic sampling.

The loop (DAPO Sec. 3.2, "keep sampling until the batch is full") asks each round for
`BatchFiller.round_size` prompts (over_sample_factor x groups still needed / keep rate measured so far),
scores each group as the engine finishes it, and decides on groups in *submission* order: a group that
finishes early waits until every group submitted before it is decided. Once the batch is full the
requests still in flight (all submitted after the cut) are aborted.

Why submission order: deciding in completion order keeps the fastest groups, and the slowest are the
long and truncated responses that carry the overlong penalty, so it keeps too few truncated groups; in
submission order the kept groups are the first informative ones of a random prompt order, an unbiased sample
(tools/bench_dynamic_sampling.py simulates both: docs/BENCHMARKS.md, "Dynamic sampling"). It also
makes a seeded step's kept set independent of timing (resume determinism).
The cost is waiting for the slow groups ahead of the cut: a round ends when the group that fills the
batch and every group submitted before it have finished, in practice the round's slowest response (at
production scale a 20480-token response). Completion order waits for it too whenever the cut falls among the
truncated groups. Groups that finished behind the cut are generated and discarded.

With --partial-rollout nothing is discarded: the groups behind the cut, finished or still generating, are
carried to the next step and submitted there first, filling part of its first round (all of it when they are at
least round_size: then no new prompt is drawn before round 2; megatron_dapo/rollout/partial_rollout.py), unless by
then they are staler than --partial-rollout-max-staleness (then dropped, in discarded). Every response token's fate is
counted: rollout/resumed_tokens + rollout/generated_tokens == kept + filtered + carried + discarded.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_dapo.algorithm import BatchFiller, DynamicSamplingConfig, OverlongConfig, overlong_penalty
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.partial_rollout import (
    CarriedGroup,
    continuation_request,
    drop_stale,
    extend,
    fresh_prompt_count,
    settle,
    staleness_metrics,
)
from megatron_dapo.rollout.types import Prompt, RolloutRequest, Sample, SamplingParams

RewardFn = Callable[[str, str], Any]
"""(response text, ground truth) -> object with `score` (float) and `acc` (bool), e.g. math_dapo."""


@dataclass
class ScoredGroup:
    """The G responses of one prompt with their verifier results and shaped rewards."""

    prompt: Prompt
    samples: list[Sample]
    accs: list[bool]
    rewards: list[float]
    """Verifier score plus overlong penalty, per response."""


@dataclass(frozen=True, kw_only=True)
class CollectConfig:
    n_samples_per_prompt: int
    """G, responses per prompt (--n-samples-per-prompt)."""
    sampling: SamplingParams
    dynamic_sampling: DynamicSamplingConfig
    overlong: OverlongConfig
    over_sample_factor: float = 1.0
    """Prompts asked for per round = ceil(factor * groups still needed / keep rate measured so far in the
    step), keep rate 1 in the first round (--over-sample-factor)."""
    seed: int | None = None
    """Base of the per-request sampling seeds (--seed): with it, a step's rollouts depend only on the
    weights, the step and the prompts, so a resumed run regenerates exactly what it lost."""
    partial_rollout: bool = False
    """Carry the groups cut when the batch is full to the next step instead of dropping them
    (--partial-rollout; megatron_dapo/rollout/partial_rollout.py)."""
    partial_rollout_max_staleness: int | None = None
    """Carried groups whose oldest token is more than this many weight versions behind the engine at the step
    that would resume them are dropped instead (--partial-rollout-max-staleness); None: no cap (the command
    line always sets one with --partial-rollout, train.max_staleness)."""

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.dynamic_sampling.enabled and self.n_samples_per_prompt < 2:
            raise ValueError("dynamic sampling needs --n-samples-per-prompt >= 2 (a group of one is never "
                             "informative); pass --no-dynamic-sampling or raise G")
        if self.over_sample_factor < 1.0:
            raise ValueError(f"--over-sample-factor must be >= 1, got {self.over_sample_factor}")
        if self.partial_rollout_max_staleness is not None:
            if not self.partial_rollout:
                raise ValueError(f"--partial-rollout-max-staleness {self.partial_rollout_max_staleness} is given "
                                 "without --partial-rollout: nothing is carried, so nothing can go stale; pass "
                                 "--partial-rollout or drop --partial-rollout-max-staleness")
            if self.partial_rollout_max_staleness < 1:
                raise ValueError(f"--partial-rollout-max-staleness must be >= 1 (weight versions a carried prefix "
                                 f"may lag the engine), got {self.partial_rollout_max_staleness}; 0 would drop "
                                 "every carried prefix: use --no-partial-rollout for that")
        if self.overlong.max_response_length != self.sampling.max_new_tokens:
            raise ValueError(
                f"overlong max length ({self.overlong.max_response_length}) must equal the rollout "
                f"max_new_tokens ({self.sampling.max_new_tokens}); both come from --max-response-length"
            )


@dataclass
class CollectResult:
    groups: list[ScoredGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    requested: list[int] = field(default_factory=list)
    """Dataset indices of every new prompt sent to the engine this step, in order (kept or not)."""
    carried: list[CarriedGroup] = field(default_factory=list)
    """--partial-rollout: the groups cut at the end of this step, in submission order, for the next step."""
    resumed: list[int] = field(default_factory=list)
    """Dataset indices of the carried groups this step resumed (drawn at an earlier step)."""
    stale_dropped: list[int] = field(default_factory=list)
    """Dataset indices of the carried groups this step dropped as staler than --partial-rollout-max-staleness."""


def request_seed(base: int, request_id: str) -> int:
    """A stable 31-bit sampling seed for one request of a seeded run."""
    return zlib.crc32(f"{base}:{request_id}".encode()) & 0x7FFFFFFF


def score_group(prompt: Prompt, samples: Sequence[Sample], decode: Callable[[list[int]], str],
                reward_fn: RewardFn, overlong: OverlongConfig) -> ScoredGroup:
    """Verifier score (+1/-1) plus the Eq. 13 overlong penalty for each response of one prompt."""
    accs, rewards = [], []
    for s in samples:
        result = reward_fn(decode(s.response_ids), prompt.ground_truth)
        accs.append(bool(result.acc))
        rewards.append(float(result.score) + overlong_penalty(len(s.response_ids), overlong))
    return ScoredGroup(prompt=prompt, samples=list(samples), accs=accs, rewards=rewards)


@dataclass
class _Slot:
    """One group of a round, in submission order: a fresh prompt (one request of n = G) or a carried group
    (one continuation request per unfinished sample)."""

    prompt: Prompt
    samples: list[Sample | None]
    """By sample index: None while the fresh request runs; a carried sample's prefix until it comes back."""
    seed: int | None
    first_step: int
    waiting: int = 0
    """Requests of this slot still in flight."""

    def done(self) -> list[Sample]:
        return [s for s in self.samples if s is not None]

    @property
    def tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.done())


@dataclass
class _Tally:
    """Response tokens by fate over one step: resumed + generated == kept + filtered + carried + discarded."""

    resumed: int = 0
    generated: int = 0
    kept: int = 0
    filtered: int = 0
    carried: int = 0
    discarded: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {f"rollout/{k}_tokens": float(v) for k, v in dataclasses.asdict(self).items()}


@dataclass
class _Step:
    """One step's rounds, a method per job: the carried groups sent first (`take_carried`, `resume`), the fresh
    prompts (`add_fresh`), the engine's stream with the abort at the cut (`stream`), the decisions in submission
    order (`complete`, `cut`) and the step's metrics (`report`)."""

    config: CollectConfig
    score: Callable[[_Slot], ScoredGroup]
    filler: BatchFiller[ScoredGroup]
    decided: list[ScoredGroup] = field(default_factory=list)
    carried: list[CarriedGroup] = field(default_factory=list)
    tally: _Tally = field(default_factory=_Tally)
    aborted: int = 0
    requested: list[int] = field(default_factory=list)
    """Dataset indices of the fresh prompts sent this step, in order."""
    slots: list[_Slot] = field(default_factory=list)
    """The current round's groups, in submission order."""
    requests: list[RolloutRequest] = field(default_factory=list)
    """The current round's requests, in submission order."""
    slot_of: dict[str, int] = field(default_factory=dict)
    """Request id -> position of its slot in the round."""
    finished: dict[int, _Slot | None] = field(default_factory=dict)
    """Position -> slot with every sample back (None: aborted), not yet decided."""
    next_position: int = 0

    def new_round(self) -> None:
        self.slots, self.requests, self.slot_of, self.finished, self.next_position = [], [], {}, {}, 0

    def take_carried(self, carried: Sequence[CarriedGroup], engine: RolloutEngine
                     ) -> tuple[list[CarriedGroup], list[CarriedGroup]]:
        """(to resume, stale): the previous step's cut groups, those staler than --partial-rollout-max-staleness
        on the engine's current weights dropped unsent (their tokens: resumed, then discarded)."""
        self.tally.resumed = sum(g.tokens for g in carried)
        to_resume, stale = drop_stale(carried, engine.weight_version if carried else 0,
                                      self.config.partial_rollout_max_staleness)
        self.tally.discarded += sum(g.tokens for g in stale)
        return to_resume, stale

    def _send(self, request: RolloutRequest) -> None:
        """`request` joins the round, for the slot appended next."""
        self.requests.append(request)
        self.slot_of[request.request_id] = len(self.slots)

    def resume(self, groups: Sequence[CarriedGroup], tag: str) -> None:
        """The carried groups, first in the round: a slot each, a continuation request per unfinished sample. A
        group that finished behind the previous step's cut is decided without generating; when those alone fill
        the batch, the unfinished ones are carried a step more."""
        for j, group in enumerate(groups):
            slot = _Slot(prompt=group.prompt, samples=list(group.samples), seed=group.seed,
                         first_step=group.first_step)
            for i in group.unfinished:
                self._send(continuation_request(group.prompt.prompt_ids, group.samples[i], self.config.sampling,
                                                group.seed, f"{tag}-c{j}-p{group.prompt.index}-s{i}"))
                slot.waiting += 1
            self.slots.append(slot)
        for position, slot in enumerate(self.slots):
            if slot.waiting == 0:
                self.complete(position)
        if self.filler.full:
            for slot in self.slots:
                if slot.waiting:
                    self.cut(slot, surplus=False)

    def add_fresh(self, next_prompts: Callable[[int], list[Prompt]], want: int, tag: str, step: int) -> None:
        """New prompts after the carried groups, up to `want` groups in the round: one request of n = G each,
        seeded by its request id."""
        count = fresh_prompt_count(want, len(self.slots))
        fresh = next_prompts(count) if count else []
        self.requested += [p.index for p in fresh]
        self.filler.stats.requested_groups += len(fresh)
        g = self.config.n_samples_per_prompt
        for i, p in enumerate(fresh):
            rid = f"{tag}-{i}-p{p.index}"
            sampling = seeded(self.config.sampling, self.config.seed, rid)
            self._send(RolloutRequest(prompt_ids=p.prompt_ids, n=g, sampling=sampling, request_id=rid))
            self.slots.append(_Slot(prompt=p, samples=[None] * g, seed=sampling.seed, first_step=step, waiting=1))

    def stream(self, engine: RolloutEngine) -> None:
        """The round's requests through the engine: each response extends its slot's sample, a slot with every
        sample back is decided (`complete`); once the batch is full, one abort for what is still in flight."""
        cut_sent = False
        # no requests: the round was carried groups only, every one finished behind the previous step's cut
        for received, samples in enumerate(engine.stream(self.requests) if self.requests else (), start=1):
            position = self.slot_of[samples[0].request_id]
            slot = self.slots[position]
            self.tally.generated += sum(len(s.response_ids) for s in samples)
            for s in samples:
                slot.samples[s.index] = extend(slot.samples[s.index], s, slot.prompt.prompt_ids)
            slot.waiting -= 1
            if slot.waiting == 0:
                self.complete(position)
            if self.filler.full and not cut_sent and received < len(self.requests):
                engine.abort()  # the aborted requests still come out of the stream
                cut_sent = True

    def cut(self, slot: _Slot, *, surplus: bool) -> None:
        """A group the batch has no place for: carried to the next step, or generated and never trained on."""
        if self.config.partial_rollout:
            samples = [settle(s, self.config.sampling) for s in slot.done()]
            self.carried.append(CarriedGroup(prompt=slot.prompt, samples=samples, seed=slot.seed,
                                             first_step=slot.first_step))
            self.tally.carried += slot.tokens
            return
        if surplus:
            self.filler.note_surplus()
        self.tally.discarded += slot.tokens

    def complete(self, position: int) -> None:
        """Slot `position` has every sample back: decide what is decidable, in submission order."""
        slot = self.slots[position]
        if any(s.finish_reason == "abort" for s in slot.done()):
            self.aborted += 1  # ours after the cut, or the engine's: a hole in the submission order
            self.cut(slot, surplus=False)
            if not self.filler.full:
                self.finished[position] = None
            return
        if self.filler.full:  # finished behind the cut
            self.cut(slot, surplus=True)
            return
        self.finished[position] = slot
        while self.next_position in self.finished and not self.filler.full:
            ready = self.finished.pop(self.next_position)
            self.next_position += 1
            if ready is not None:
                group = self.score(ready)
                self.decided.append(group)
                if self.filler.offer(group, group.accs):
                    self.tally.kept += ready.tokens
                else:
                    self.tally.filtered += ready.tokens
        if self.filler.full:  # the cut: what finished early behind it is surplus (or carried)
            for later in filter(None, self.finished.values()):
                self.cut(later, surplus=True)
            self.finished.clear()


    def report(self, engine: RolloutEngine, *, resumed: int, stale: int) -> tuple[list[ScoredGroup], dict[str, float]]:
        """(the kept groups, the step's metrics): dynamic sampling's counts, the decided groups' rollout
        statistics, where every response token went; with --partial-rollout the kept samples' staleness and the
        carried / resumed / stale-dropped group counts."""
        metrics = self.filler.stats.as_metrics()
        metrics.update(rollout_stats(self.decided, self.config.sampling.max_new_tokens))
        if engine.tool_use:  # the conversations' share of calls, and the engine's multi_turn/* counters
            metrics.update(tool_stats([s for g in self.decided for s in g.samples], "rollout"))
            metrics.update(engine.take_metrics())
        metrics["rollout/aborted_groups"] = float(self.aborted)
        metrics.update(self.tally.as_metrics())
        batch = self.filler.batch()
        if self.config.partial_rollout:
            metrics.update(staleness_metrics([s for g in batch for s in g.samples], engine.weight_version))
            metrics["rollout/carried_groups"] = float(len(self.carried))
            metrics["rollout/resumed_groups"] = float(resumed)
            metrics["rollout/stale_dropped_groups"] = float(stale)
        return batch, metrics


def collect_batch(
    engine: RolloutEngine,
    next_prompts: Callable[[int], list[Prompt]],
    decode: Callable[[list[int]], str],
    reward_fn: RewardFn,
    config: CollectConfig,
    *,
    step: int,
    carried: Sequence[CarriedGroup] = (),
) -> CollectResult:
    """Generate rounds until `rollout_batch_size` informative groups are kept (or the budget ends).

    `next_prompts(k)` hands out the next k prompts of the data sampler. Groups are decided in the order
    their prompts were submitted, so the kept groups are the first informative ones of the prompt order
    whatever the engine's timing. Returns the kept groups in that order; rollout metrics are over every
    decided group (kept or dropped, an unbiased sample of the policy's responses), dynamic-sampling
    metrics count rounds and requested / generated / kept groups, `rollout/*_tokens` where every response
    token went.

    With config.partial_rollout, `carried` (the previous step's CollectResult.carried) are submitted first,
    ahead of the first round's new prompts, and the groups cut at the end of this step come back in
    CollectResult.carried instead of being thrown away (megatron_dapo/rollout/partial_rollout.py). Carried groups staler
    than config.partial_rollout_max_staleness on the engine's current weights are dropped first, unsent (their
    tokens: resumed, then discarded).
    """
    if carried and not config.partial_rollout:
        raise ValueError("carried groups given to collect_batch without --partial-rollout")
    state = _Step(config=config, filler=BatchFiller(config.dynamic_sampling),
                  score=lambda slot: score_group(slot.prompt, slot.done(), decode, reward_fn, config.overlong))
    filler = state.filler
    to_resume, stale = state.take_carried(carried, engine)
    resumed = [g.prompt.index for g in to_resume]
    t0 = time.perf_counter()
    while not filler.full and filler.start_round():
        want = filler.round_size(config.over_sample_factor)
        tag = f"s{step}-r{filler.stats.rounds}"
        state.new_round()
        state.resume(to_resume, tag)  # first round only: the previous step's cut groups go first
        to_resume = []
        if filler.full:  # those alone filled the batch: the unfinished carried groups wait a step more
            break
        state.add_fresh(next_prompts, want, tag, step)
        state.stream(engine)
    batch, metrics = state.report(engine, resumed=len(resumed), stale=len(stale))
    metrics["time/rollout_s"] = time.perf_counter() - t0
    return CollectResult(groups=batch, metrics=metrics, requested=state.requested, carried=state.carried,
                         resumed=resumed, stale_dropped=[g.prompt.index for g in stale])


def seeded(sampling: SamplingParams, base_seed: int | None, request_id: str) -> SamplingParams:
    """`sampling` with the request's own seed (unchanged when the run is unseeded)."""
    if base_seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=request_seed(base_seed, request_id))


def tool_stats(samples: Sequence[Sample], prefix: str) -> dict[str, float]:
    """Multi-turn rollouts (rollout/multi_turn.py): <prefix>/tool_call_rate (share of responses with a call run),
    tool_calls_mean (calls per response), tool_token_share (tool-output tokens / response tokens) and
    generated_len_mean (the policy's own tokens per response). {} for no samples."""
    if not samples:
        return {}
    tokens = sum(len(s.response_ids) for s in samples)
    generated = sum(sum(s.generated()) for s in samples)
    return {
        f"{prefix}/tool_call_rate": sum(s.tool_calls > 0 for s in samples) / len(samples),
        f"{prefix}/tool_calls_mean": sum(s.tool_calls for s in samples) / len(samples),
        f"{prefix}/tool_token_share": (tokens - generated) / tokens if tokens else 0.0,
        f"{prefix}/generated_len_mean": generated / len(samples),
    }


def rollout_stats(groups: Sequence[ScoredGroup], max_len: int) -> dict[str, float]:
    """Reward, accuracy and length statistics over the responses of the decided groups (kept or not)."""
    lengths = [len(s.response_ids) for g in groups for s in g.samples]
    rewards = [r for g in groups for r in g.rewards]
    accs = [a for g in groups for a in g.accs]
    if not lengths:
        return {}
    truncated = [s.truncated for g in groups for s in g.samples]
    return {
        "rollout/reward": sum(rewards) / len(rewards),
        "rollout/accuracy": sum(accs) / len(accs),
        "rollout/response_len_mean": sum(lengths) / len(lengths),
        "rollout/response_len_max": float(max(lengths)),
        "rollout/clip_ratio": sum(truncated) / len(truncated),
        "rollout/responses": float(len(lengths)),
        "rollout/max_len": float(max_len),
    }
