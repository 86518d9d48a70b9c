"""Rollout batch collection (dynamic sampling loop) and avg@k / pass@k, with a scripted engine."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from math import comb

import pytest
import torch

from megatron_dapo.algorithm import (
    KEEP_RATE_FLOOR,
    BatchFiller,
    DynamicSamplingConfig,
    GenerationBudgetExhausted,
    OverlongConfig,
)
from megatron_dapo.reward import get_reward_fn
from megatron_dapo.rollout.collect import CollectConfig, Prompt, collect_batch, request_seed
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.evaluation import evaluate, pass_at_k
from megatron_dapo.rollout.types import RolloutRequest, Sample, SamplingParams
from tests import sim_engine as sim
from tests.sim_engine import LengthLatencyEngine, cycling


def encode(text: str) -> list[int]:
    """Token ids are code points: a response is the text of its ids."""
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(map(chr, ids))


reward = get_reward_fn("math_dapo")


class ScriptedEngine(RolloutEngine):
    """Answers prompt p with `script[p]` (a list of n response strings); records calls and aborts.

    Streams groups one at a time, so an abort issued mid-stream stops the rest of the call, whose
    groups come back with finish_reason 'abort' (the RolloutEngine contract)."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = script
        self.calls: list[list[RolloutRequest]] = []
        self.aborted: list[str] = []
        self._pending: list[str] = []

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        self.calls.append(list(requests))
        self._pending = [r.request_id for r in requests]
        for req in requests:
            reason = "abort" if req.request_id in self.aborted else None
            self._pending.remove(req.request_id)
            texts = self.script[decode(req.prompt_ids)]
            full = [encode(t) for t in texts[: req.n]]
            yield [Sample(request_id=req.request_id, index=i, prompt_ids=req.prompt_ids,
                          response_ids=ids if reason is None else [],
                          logprobs=[-0.5] * (len(ids) if reason is None else 0),
                          finish_reason=reason or ("length" if len(ids) >= req.sampling.max_new_tokens
                                                   else "stop"),
                          weight_version=0) for i, ids in enumerate(full)]

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        stopped = list(self._pending) if request_ids is None else list(request_ids)
        self.aborted += stopped
        return stopped

    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def update_weights(self, named_tensors, *, version: int) -> None: ...
    def health(self) -> bool: return True
    def shutdown(self) -> None: ...
    @property
    def weight_version(self) -> int: return 0


RIGHT, WRONG = "Answer: 4", "Answer: 5"
PROMPTS = [Prompt(prompt_ids=encode(f"q{i}"), ground_truth="4", index=i) for i in range(6)]
SCRIPT = {
    "q0": [RIGHT, RIGHT],   # all correct -> dropped
    "q1": [RIGHT, WRONG],   # kept
    "q2": [WRONG, WRONG],   # all wrong -> dropped
    "q3": [WRONG, RIGHT],   # kept
    "q4": [RIGHT, WRONG],   # kept
    "q5": [WRONG, RIGHT],
}


def make_config(batch: int, **kw) -> CollectConfig:
    return CollectConfig(
        n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=16),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=batch, **kw.pop("ds", {})),
        overlong=OverlongConfig(max_response_length=16, buffer_length=8), **kw)


def cycling_prompts():
    it = itertools.cycle(PROMPTS)
    return lambda k: [next(it) for _ in range(k)]


def test_collect_keeps_informative_groups_across_rounds_and_aborts_the_rest():
    engine = ScriptedEngine(SCRIPT)
    result = collect_batch(engine, cycling_prompts(), decode, reward, make_config(2), step=1)
    assert [g.prompt.index for g in result.groups] == [1, 3]
    # round 1 asks for 2: q0 (dropped), q1 (kept); keep rate 1/2, so round 2 asks 1 needed / 0.5 = 2: q2, q3
    assert [len(c) for c in engine.calls] == [2, 2]
    assert result.requested == [0, 1, 2, 3]
    assert result.metrics["dynamic_sampling/rounds"] == 2
    assert result.metrics["dynamic_sampling/generated_per_kept"] == 2.0
    assert result.metrics["dynamic_sampling/all_correct"] == 1
    assert result.metrics["dynamic_sampling/all_wrong"] == 1
    g = result.groups[0]
    assert g.accs == [True, False]
    # 9 tokens: below L_max - L_cache = 8? no: 9 > 8 -> penalty (8 - 9) / 8 added to +1 / -1
    assert g.rewards == pytest.approx([1.0 - 1 / 8, -1.0 - 1 / 8])
    assert result.metrics["rollout/accuracy"] == pytest.approx(4 / 8)


def test_over_sampling_aborts_surplus_requests_once_full():
    engine = ScriptedEngine(SCRIPT)
    result = collect_batch(engine, cycling_prompts(), decode, reward, make_config(1, over_sample_factor=4.0),
                           step=3)
    assert [g.prompt.index for g in result.groups] == [1]
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 4
    assert len(engine.aborted) == 2  # q2 and q3 were still pending when q1 filled the batch
    assert result.metrics["rollout/aborted_groups"] == 2
    assert result.requested == [0, 1, 2, 3]  # every prompt handed out is accounted for


def test_generation_budget():
    always_uniform = {f"q{i}": [RIGHT, RIGHT] for i in range(6)}
    with pytest.raises(GenerationBudgetExhausted, match="--max-num-gen-batches"):
        collect_batch(ScriptedEngine(always_uniform), cycling_prompts(), decode, reward,
                      make_config(2, ds={"max_num_gen_batches": 3}), step=1)
    partial = collect_batch(ScriptedEngine(SCRIPT), cycling_prompts(), decode, reward,
                            make_config(5, ds={"max_num_gen_batches": 1, "on_exhausted": "partial"}), step=1)
    assert [g.prompt.index for g in partial.groups] == [1, 3, 4]


def test_seeded_requests_get_stable_distinct_seeds():
    engine = ScriptedEngine(SCRIPT)
    collect_batch(engine, cycling_prompts(), decode, reward, make_config(2, seed=7), step=1)
    seeds = [r.sampling.seed for call in engine.calls for r in call]
    assert len(set(seeds)) == len(seeds)
    assert seeds[0] == request_seed(7, engine.calls[0][0].request_id)
    engine2 = ScriptedEngine(SCRIPT)
    collect_batch(engine2, cycling_prompts(), decode, reward, make_config(2, seed=7), step=1)
    assert seeds == [r.sampling.seed for call in engine2.calls for r in call]


def test_config_validation():
    with pytest.raises(ValueError, match="--n-samples-per-prompt >= 2"):
        CollectConfig(n_samples_per_prompt=1, sampling=SamplingParams(max_new_tokens=4),
                      dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=1),
                      overlong=OverlongConfig(max_response_length=4))
    with pytest.raises(ValueError, match="--max-response-length"):
        CollectConfig(n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=4),
                      dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=1),
                      overlong=OverlongConfig(max_response_length=8))


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that contain a correct one."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (6, 2, 3), (8, 5, 8), (5, 5, 2)])
def test_pass_at_k_matches_enumeration(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k))
    assert comb(n, k) > 0


def test_evaluate_avg_and_pass():
    script = {"q0": [RIGHT, WRONG, WRONG, WRONG], "q1": [RIGHT, RIGHT, RIGHT, WRONG]}
    out = evaluate(ScriptedEngine(script), PROMPTS[:2], decode, reward, n_samples=4,
                   sampling=SamplingParams(max_new_tokens=16), pass_ks=(1, 2))
    assert out["eval/avg@4"] == pytest.approx((0.25 + 0.75) / 2)
    assert out["eval/pass@1"] == pytest.approx(0.5)
    assert out["eval/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 3, 2)) / 2)
    assert torch.isclose(torch.tensor(out["eval/response_len_mean"]), torch.tensor(9.0))


# ---- dynamic sampling on a simulated engine whose latency grows with response length (tests/sim_engine.py)

def sim_config(batch: int, *, n: int = 8, factor: float = 1.3, **ds) -> CollectConfig:
    return CollectConfig(n_samples_per_prompt=n, sampling=SamplingParams(max_new_tokens=32), seed=1,
                         dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=batch, **ds),
                         overlong=OverlongConfig(max_response_length=32, buffer_length=8), over_sample_factor=factor)


def test_kept_groups_do_not_depend_on_generation_time():
    """Truncated groups finish last; the kept ones must still be the first informative groups in submission
    order, so the truncated share among kept equals that among all eligible (informative) groups."""
    engine = LengthLatencyEngine(keep_rate=0.9, truncate_prob=0.04)
    next_prompts = cycling(sim.prompts(5000))
    kept: list[str] = []
    for step in range(1, 31):
        before = len(engine.records)
        result = collect_batch(engine, next_prompts, sim.decode, sim.reward, sim_config(64), step=step)
        ids = [g.samples[0].request_id for g in result.groups]
        submitted = list(engine.records.values())[before:]
        assert ids == [r.request_id for r in submitted if r.informative][:64]  # exact, whatever the timing
        kept += ids
    eligible = [r for r in engine.records.values() if r.informative]
    p_eligible = sum(r.truncated for r in eligible) / len(eligible)
    p_kept = sum(engine.records[i].truncated for i in kept) / len(kept)
    assert 0.2 < p_eligible < 0.35  # 1 - 0.96^8 = 0.28 of groups hold a truncated response
    sampling_error = (p_eligible * (1 - p_eligible) / len(kept)) ** 0.5  # ~0.01 for 1920 kept groups
    assert abs(p_kept - p_eligible) < 3 * sampling_error
    # completion order (the old loop) would keep ~0.15 here: the truncated groups finish last and are cut


@pytest.mark.parametrize("keep_rate", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_rounds_sized_by_keep_rate_fill_within_max_num_gen_batches(keep_rate):
    engine = LengthLatencyEngine(keep_rate=keep_rate, truncate_prob=0.02)
    next_prompts = cycling(sim.prompts(5000))
    config = sim_config(128, n=2, max_num_gen_batches=10)  # on_exhausted='error': any shortfall raises
    rounds = []
    for step in range(1, 11):
        result = collect_batch(engine, next_prompts, sim.decode, sim.reward, config, step=step)
        assert len(result.groups) == 128
        m = result.metrics
        rounds.append(m["dynamic_sampling/rounds"])
        assert m["dynamic_sampling/requested_groups"] >= m["dynamic_sampling/generated_groups"] >= 128
        assert m["dynamic_sampling/generated_per_kept"] == m["dynamic_sampling/generated_groups"] / 128
    assert max(rounds) <= 3, rounds  # ceil(1.3 x needed) per round needed all 10 at keep rate 0.3


def test_on_gen_exhausted_unchanged_on_the_simulated_engine():
    with pytest.raises(GenerationBudgetExhausted, match="--max-num-gen-batches=10"):
        collect_batch(LengthLatencyEngine(keep_rate=0.0, truncate_prob=0.0), cycling(sim.prompts(100)),
                      sim.decode, sim.reward, sim_config(8, max_num_gen_batches=10), step=1)
    engine = LengthLatencyEngine(keep_rate=0.01, truncate_prob=0.0)
    result = collect_batch(engine, cycling(sim.prompts(100)), sim.decode, sim.reward,
                           sim_config(64, max_num_gen_batches=2, on_exhausted="partial"), step=1)
    assert result.metrics["dynamic_sampling/rounds"] == 2
    assert 0 < len(result.groups) < 64
    assert [g.samples[0].request_id for g in result.groups] == [
        r.request_id for r in engine.records.values() if r.informative]


def test_round_size_divides_by_the_measured_keep_rate():
    filler: BatchFiller[int] = BatchFiller(DynamicSamplingConfig(rollout_batch_size=512))
    assert filler.round_size(1.3) == 666  # ceil(1.3 x 512): nothing measured yet
    for i in range(666):
        filler.offer(i, [True, False] if i < 200 else [True, True])
    assert filler.round_size(1.3) == math.ceil(1.3 * 312 * 666 / 200)  # 1351
    empty: BatchFiller[int] = BatchFiller(DynamicSamplingConfig(rollout_batch_size=512))
    for i in range(10):
        empty.offer(i, [False, False])
    assert empty.round_size(1.3) == math.ceil(1.3 * 512 / KEEP_RATE_FLOOR)  # 13312 at the 0.05 floor
