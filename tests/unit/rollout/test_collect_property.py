"""Property test of collect_batch's round arithmetic and token accounting, on the simulated engine of
tests/sim_engine.py with the real data sampler (ResumableSampler rejects a request for 0 prompts, as train.py's
does): hundreds of seeded cases over keep rate, carried-in groups (none, fewer than the first round, exactly it,
more), over-sample factor, batch size, G, response length, round budget and staleness cap, each chained over a
few steps. Every step completes, and every token and every group has exactly one fate."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence

from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig
from megatron_dapo.data.sampler import ResumableSampler
from megatron_dapo.rollout.collect import CollectConfig, CollectResult, Prompt, collect_batch
from megatron_dapo.rollout.partial_rollout import CarriedGroup, staleness_of
from megatron_dapo.rollout.types import Sample, SamplingParams
from tests import sim_engine as sim

CASES = 300
POOL = 40
"""Dataset size: small, so the sampler wraps epochs within a case (a step can draw a prompt twice)."""


class Counted(sim.LengthLatencyEngine):
    """The simulated engine, counting the response tokens its stream hands out (the independent reference for
    rollout/generated_tokens) and refusing a call with no requests (an engine round trip for nothing)."""

    streamed: int = 0

    def stream(self, requests):
        assert requests, "collect_batch called the engine with no requests"
        for group in super().stream(requests):
            self.streamed += sum(len(s.response_ids) for s in group)
            yield group


def carried_groups(rng: random.Random, count: int, g: int, length: int, version: int,
                   lags: Sequence[int] = (1, 1, 2), informative: float = 0.5) -> list[CarriedGroup]:
    """`count` groups as a previous step would have cut them: per sample finished ('stop' shorter than `length`,
    'length' at it) or aborted with a prefix of 0..length-1 tokens; each group's tokens from a version `lags`
    behind `version` (2 is over a cap of 1); with probability `informative` its samples start with a random
    verdict token, else all with the same one."""
    groups = []
    for j in range(count):
        prompt = Prompt(prompt_ids=[3, 4 + j % 200], ground_truth="1", index=10_000 + j)
        old = version - rng.choice(lags)
        mixed, verdict = rng.random() < informative, rng.choice([0, 1])
        samples = []
        for i in range(g):
            kind = rng.choice(["stop", "length", "abort", "abort"])
            n = {"stop": rng.randint(1, length - 1) if length > 1 else 0, "length": length,
                 "abort": rng.randint(0, length - 1)}[kind]
            kind = "abort" if kind == "stop" and n == 0 else kind
            ids = ([rng.choice([0, 1]) if mixed else verdict] + [2] * (n - 1)) if n else []
            samples.append(Sample(request_id=f"old-{j}", index=i, prompt_ids=prompt.prompt_ids, response_ids=ids,
                                  logprobs=[-0.5] * n, finish_reason=kind, weight_version=old))
        groups.append(CarriedGroup(prompt=prompt, samples=samples, seed=rng.randrange(2**31), first_step=0))
    return groups


def recording(sampler: ResumableSampler, items: Sequence[Prompt]) -> tuple[Callable[[int], list[Prompt]], list[int]]:
    """next_prompts over the real sampler, and the list of the dataset indices it handed out."""
    handed_out: list[int] = []

    def next_prompts(k: int) -> list[Prompt]:
        idx = sampler.next_batch(k)
        handed_out.extend(idx)
        return [items[i] for i in idx]

    return next_prompts, handed_out


def tokens(samples: Sequence[Sample]) -> int:
    return sum(len(s.response_ids) for s in samples)


def check_step(case: str, result: CollectResult, config: CollectConfig, carried_in: list[CarriedGroup],
               streamed: int, handed_out: list[int], version: int) -> None:
    """The step's accounting: token fates and group fates add up exactly, each term against its own reference."""
    m, batch = result.metrics, config.dynamic_sampling.rollout_batch_size
    budget = config.dynamic_sampling.max_num_gen_batches
    assert len(result.groups) == batch or (len(result.groups) < batch and m["dynamic_sampling/rounds"] == budget), \
        f"{case}: {len(result.groups)} groups kept of {batch} after {m['dynamic_sampling/rounds']} rounds"
    stale = [g for g in carried_in if g.prompt.index in set(result.stale_dropped)]
    kept_tokens = tokens([s for g in result.groups for s in g.samples])
    carried_tokens = tokens([s for g in result.carried for s in g.samples])
    assert m["rollout/generated_tokens"] == streamed, case
    assert m["rollout/resumed_tokens"] == sum(g.tokens for g in carried_in), case
    assert m["rollout/kept_tokens"] == kept_tokens, case
    assert m["rollout/carried_tokens"] == carried_tokens, case
    if config.partial_rollout:
        assert m["rollout/discarded_tokens"] == sum(g.tokens for g in stale), case
    assert m["rollout/resumed_tokens"] + m["rollout/generated_tokens"] == m["rollout/kept_tokens"] + \
        m["rollout/filtered_tokens"] + m["rollout/carried_tokens"] + m["rollout/discarded_tokens"], f"{case}: {m}"
    assert min(m[k] for k in m if k.endswith("_tokens")) >= 0, case

    requested = int(m["dynamic_sampling/requested_groups"])
    assert result.requested == handed_out and requested == len(handed_out), case
    seen = int(m["dynamic_sampling/seen_groups"])
    assert m["dynamic_sampling/kept_groups"] == len(result.groups), case
    if config.partial_rollout:
        assert len(result.resumed) + len(result.stale_dropped) == len(carried_in), case
        assert (m["rollout/resumed_groups"], m["rollout/carried_groups"], m["rollout/stale_dropped_groups"]) == \
            (len(result.resumed), len(result.carried), len(stale)), case
        assert seen + len(result.carried) == len(result.resumed) + requested, f"{case}: {m}"
        cap = config.partial_rollout_max_staleness
        if cap is not None:
            assert all(staleness_of(g, version) > cap for g in stale), case
            assert m["rollout/max_staleness"] <= cap, case
    else:
        assert not result.carried and not carried_in, case
        surplus, aborted = m["dynamic_sampling/surplus_groups"], m["rollout/aborted_groups"]
        assert seen + surplus + aborted == requested, f"{case}: {m}"
    out = Counter([g.prompt.index for g in result.groups] + [g.prompt.index for g in result.carried])
    assert not out - Counter(result.resumed + result.requested), f"{case}: a group kept or carried twice"


def run_case(seed: int) -> None:
    """One seeded configuration, 1-3 chained steps (weights version + 1 after each)."""
    rng = random.Random(seed)
    batch, g, length = rng.randint(1, 12), rng.randint(2, 6), rng.randint(2, 10)
    factor = rng.choice([1.0, 1.1, 1.3, 1.5, 2.0, round(rng.uniform(1.0, 3.0), 2)])
    keep = rng.choice([0.0, 0.05, 0.2, 0.5, 0.9, 1.0, round(rng.random(), 2)])
    partial = rng.random() < 0.8
    budget = rng.choice([1, 2] if keep < 0.2 else [1, 2, 3, 8])  # keep rate ~0: rounds of 20 x factor x B
    cap = rng.choice([1, 2, None]) if partial else None
    config = CollectConfig(
        n_samples_per_prompt=g, sampling=SamplingParams(max_new_tokens=length),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=batch, enabled=rng.random() < 0.9,
                                               max_num_gen_batches=budget, on_exhausted="partial"),
        overlong=OverlongConfig(max_response_length=length, buffer_length=length // 2),
        over_sample_factor=factor, seed=seed, partial_rollout=partial, partial_rollout_max_staleness=cap)
    engine = Counted(keep_rate=keep, truncate_prob=rng.choice([0.0, 0.1, 0.5]), seed=seed, partial_progress=True,
                     group_size=g)
    engine.version = rng.randint(2, 4)
    first_round = math.ceil(factor * batch)
    count = rng.choice([0, rng.randint(1, max(1, first_round - 1)), first_round, rng.randint(first_round,
                                                                                              3 * first_round)])
    carried = carried_groups(rng, count, g, length, engine.version) if partial else []
    sampler, items = ResumableSampler(POOL, seed=seed), sim.prompts(POOL)
    for step in range(1, rng.randint(1, 3) + 1):
        case = f"seed {seed} step {step} (B={batch} G={g} L={length} factor={factor} keep={keep} " \
               f"carried={len(carried)} rounds<={budget} partial={partial} cap={cap})"
        next_prompts, handed_out = recording(sampler, items)
        before = engine.streamed
        result = collect_batch(engine, next_prompts, sim.decode, sim.reward, config, step=step, carried=carried)
        check_step(case, result, config, carried, engine.streamed - before, handed_out, engine.version)
        carried = result.carried
        engine.update_weights([], version=engine.version + 1)


def test_every_step_completes_and_every_token_has_one_fate():
    for seed in range(CASES):
        run_case(seed)


def test_demo_shape_carried_groups_at_least_the_first_round():
    """examples/run_embedded_demo.sh's shape (B = 16, G = 8, --over-sample-factor 1.5, L = 40, 16 rounds, partial
    exhaustion) with --partial-rollout, entering a step with 30 carried groups >= the first round's 24 (the
    demo died at step 19 asking the sampler for 0 prompts): round 1 is the carried groups only, new prompts come
    from round 2, and the tokens add up."""
    batch, g, length = 16, 8, 40
    config = CollectConfig(
        n_samples_per_prompt=g, sampling=SamplingParams(max_new_tokens=length),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=batch, max_num_gen_batches=16,
                                               on_exhausted="partial"),
        overlong=OverlongConfig(max_response_length=length, buffer_length=8), over_sample_factor=1.5, seed=1234,
        partial_rollout=True, partial_rollout_max_staleness=1)
    engine = Counted(keep_rate=0.4, truncate_prob=0.1, seed=3, partial_progress=True, group_size=g)
    engine.version = 18
    carried = carried_groups(random.Random(0), 30, g, length, engine.version, lags=(1,), informative=0.3)
    next_prompts, handed_out = recording(ResumableSampler(200, seed=1234), sim.prompts(200))
    result = collect_batch(engine, next_prompts, sim.decode, sim.reward, config, step=19, carried=carried)
    check_step("demo shape", result, config, carried, engine.streamed, handed_out, engine.version)
    assert len(result.resumed) == len(carried) and not result.stale_dropped
    assert handed_out and not any("-r1-" in rid for rid in engine.records), "round 1 drew new prompts"
    assert result.metrics["dynamic_sampling/rounds"] >= 2
