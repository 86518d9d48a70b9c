"""One step's rollout batch: generate G responses per prompt -> verify -> shape -> dynamic sampling.

The loop (DAPO Sec. 3.2, "keep sampling until the batch is full") asks each round for
`BatchFiller.round_size` prompts (over_sample_factor x groups still needed / keep rate measured so far),
scores each group as the engine finishes it, and decides on groups in *submission* order: a group that
finishes early waits until every group submitted before it is decided. Once the batch is full the
requests still in flight (all submitted after the cut) are aborted.

Why submission order: deciding in completion order keeps the fastest groups, and the slowest are the
long and truncated responses that carry the overlong penalty. tools/bench_dynamic_sampling.py (keep rate
0.9, over-sample 1.3, batch 512, G = 16, 40 simulated steps): 27.7% of requested groups hold a truncated
response; completion order keeps 15.5% such groups, submission order 27.8% (the eligible share is 27.9%):
the kept groups are the first informative ones of a random prompt order, an unbiased sample. It also
makes a seeded step's kept set independent of timing (resume determinism).
The cost is waiting for the slow groups ahead of the cut: a round ends when the group that fills the
batch and every group submitted before it have finished, in practice the round's slowest response (at
production scale a 20480-token response, ~14 min at ~25 tokens/s per sequence on a busy Qwen2.5-32B
SGLang server). Completion order waits for it too whenever the cut falls among the truncated groups;
in the simulation the step time is 1.03 vs 1.01 max-length responses at keep rate 0.9. Groups that
finished behind the cut are generated and discarded (finished/kept 1.30 vs 1.12 at keep rate 0.9).
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
from megatron_dapo.rollout.types import RolloutRequest, Sample, SamplingParams

RewardFn = Callable[[str, str], Any]
"""(response text, ground truth) -> object with `score` (float) and `acc` (bool), e.g. math_dapo."""


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """A prompt ready for the engine: token ids plus what the verifier needs."""

    prompt_ids: list[int]
    ground_truth: str
    index: int
    """Position in the dataset (stable across resumes)."""


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

    def __post_init__(self) -> None:
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt must be >= 1, got {self.n_samples_per_prompt}")
        if self.dynamic_sampling.enabled and self.n_samples_per_prompt < 2:
            raise ValueError("dynamic sampling needs --n-samples-per-prompt >= 2 (a group of one is never "
                             "informative); pass --no-dynamic-sampling or raise G")
        if self.over_sample_factor < 1.0:
            raise ValueError(f"--over-sample-factor must be >= 1, got {self.over_sample_factor}")
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
    """Dataset indices of every prompt sent to the engine this step, in order (kept or not)."""


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


def collect_batch(
    engine: RolloutEngine,
    next_prompts: Callable[[int], list[Prompt]],
    decode: Callable[[list[int]], str],
    reward_fn: RewardFn,
    config: CollectConfig,
    *,
    step: int,
) -> CollectResult:
    """Generate rounds until `rollout_batch_size` informative groups are kept (or the budget ends).

    `next_prompts(k)` hands out the next k prompts of the data sampler. Groups are decided in the order
    their prompts were submitted, so the kept groups are the first informative ones of the prompt order
    whatever the engine's timing. Returns the kept groups in that order; rollout metrics are over every
    decided group (kept or dropped, an unbiased sample of the policy's responses), dynamic-sampling
    metrics count rounds and requested / generated / kept groups.
    """
    filler: BatchFiller[ScoredGroup] = BatchFiller(config.dynamic_sampling)
    decided: list[ScoredGroup] = []
    aborted = 0
    requested: list[int] = []
    t0 = time.perf_counter()
    while not filler.full and filler.start_round():
        want = filler.round_size(config.over_sample_factor)
        tag = f"s{step}-r{filler.stats.rounds}"
        prompts = {f"{tag}-{i}-p{p.index}": p for i, p in enumerate(next_prompts(want))}
        requested += [p.index for p in prompts.values()]
        filler.stats.requested_groups += len(prompts)
        position = {rid: i for i, rid in enumerate(prompts)}
        requests = [RolloutRequest(prompt_ids=p.prompt_ids, n=config.n_samples_per_prompt,
                                   sampling=seeded(config.sampling, config.seed, rid), request_id=rid)
                    for rid, p in prompts.items()]
        finished: dict[int, ScoredGroup | None] = {}  # position -> group (None: aborted), not yet decided
        next_position = received = 0
        for samples in engine.stream(requests):
            rid = samples[0].request_id
            received += 1
            if any(s.finish_reason == "abort" for s in samples):
                aborted += 1  # ours after the cut, or the engine's: a hole in the submission order
                group = None
            elif filler.full:
                filler.note_surplus()  # finished after the cut: generated, not trained on
                continue
            else:
                group = score_group(prompts[rid], samples, decode, reward_fn, config.overlong)
            if filler.full:
                continue
            finished[position[rid]] = group
            while next_position in finished and not filler.full:
                group = finished.pop(next_position)
                next_position += 1
                if group is not None:
                    decided.append(group)
                    filler.offer(group, group.accs)
            if filler.full:  # the cut: what finished early behind it is surplus, the rest is aborted
                for _ in filter(None, finished.values()):
                    filler.note_surplus()
                finished.clear()
                if received < len(requests):
                    engine.abort()  # the aborted groups still come out of the stream, counted above
    metrics = filler.stats.as_metrics()
    metrics.update(_rollout_metrics(decided, config.sampling.max_new_tokens))
    metrics["rollout/aborted_groups"] = float(aborted)
    metrics["time/rollout_s"] = time.perf_counter() - t0
    return CollectResult(groups=filler.batch(), metrics=metrics, requested=requested)


def seeded(sampling: SamplingParams, base_seed: int | None, request_id: str) -> SamplingParams:
    """`sampling` with the request's own seed (unchanged when the run is unseeded)."""
    if base_seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=request_seed(base_seed, request_id))


def _rollout_metrics(groups: Sequence[ScoredGroup], max_len: int) -> dict[str, float]:
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
