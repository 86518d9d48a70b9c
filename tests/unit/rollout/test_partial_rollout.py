"""Partial rollout (--partial-rollout) on the embedded engine with a tiny random Qwen2: nothing generated is
dropped, prefixes come back as the start of the next step's responses with the versions and log-probs of the
weights that produced them, a continuation equals one uninterrupted generation, and the checkpoint state
round-trips. References: token counts taken from the engine's stream, teacher-forced HF forwards."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig
from megatron_dapo.rollout.collect import CollectConfig, Prompt, collect_batch
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.partial_rollout import CarriedGroup, continuation_request, extend, from_state, settle, state
from megatron_dapo.rollout.sampling import row_seed
from megatron_dapo.rollout.sglang.protocol import generate_payload
from megatron_dapo.rollout.types import RolloutRequest, Sample, SamplingParams
from tests.rewards import length_parity

CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1,
           rope_theta=10000.0)
EOS = 1
MAX_NEW = 24
STOPS = tuple(range(1, 11))
"""Ten stop tokens of 96: responses end after ~10 tokens on average, so groups finish at different steps and the
cut finds rows mid-generation."""


def _model(seed: int, std: float = 0.15) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**CFG, attn_implementation="eager")).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, std)
    return model


def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    lp = logits.log_softmax(-1)[len(prompt) - 1: -1]
    return lp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


def _prompts(count: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(11)
    return [Prompt(prompt_ids=torch.randint(2, 96, (int(torch.randint(3, 9, (1,), generator=g)),),
                                            generator=g).tolist(), ground_truth="", index=i) for i in range(count)]


def _decode(ids: list[int]) -> str:
    return "a" * len(ids)  # length_parity rewards an even number of response tokens


class Counting:
    """The engine, counting every response token its stream hands out (the independent reference)."""

    def __init__(self, engine: EmbeddedEngine):
        self.engine, self.tokens = engine, 0

    def stream(self, requests):
        for group in self.engine.stream(requests):
            self.tokens += sum(len(s.response_ids) for s in group)
            yield group

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _config(*, partial: bool, dynamic: bool, batch: int = 3, max_staleness: int | None = None) -> CollectConfig:
    return CollectConfig(
        n_samples_per_prompt=4, sampling=SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=STOPS),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=batch, enabled=dynamic),
        overlong=OverlongConfig(max_response_length=MAX_NEW, buffer_length=8), over_sample_factor=2.5, seed=5,
        partial_rollout=partial, partial_rollout_max_staleness=max_staleness)


def _run(partial: bool, dynamic: bool, steps: int = 4, *, batch: int = 3, max_staleness: int | None = None):
    """`steps` steps of collect_batch, new weights (version = step) after each. Returns per step (result, tokens
    streamed, carried groups in), and the model of each weight version."""
    models = [_model(0)] + [_model(0, std=0.15 + 0.01 * s) for s in range(1, steps + 1)]
    engine = Counting(EmbeddedEngine(copy.deepcopy(models[0]), max_batch_size=64))  # it loads updates in place
    prompts = _prompts(200)
    cursor = {"i": 0}

    def next_prompts(k: int) -> list[Prompt]:
        out = prompts[cursor["i"]: cursor["i"] + k]
        cursor["i"] += k
        return out

    carried, out = [], []
    config = _config(partial=partial, dynamic=dynamic, batch=batch, max_staleness=max_staleness)
    for step in range(1, steps + 1):
        before = engine.tokens
        result = collect_batch(engine, next_prompts, _decode, length_parity, config, step=step, carried=carried)
        out.append((result, engine.tokens - before, carried))
        carried = result.carried
        engine.update_weights(models[step].state_dict().items(), version=step)
    return out, models


@pytest.fixture(scope="module", params=[pytest.param(True, id="dynamic"), pytest.param(False, id="no_dynamic")])
def partial_run(request):
    return request.param, _run(partial=True, dynamic=request.param)


def _tokens(samples) -> int:
    return sum(len(s.response_ids) for s in samples)


def test_nothing_generated_is_dropped(partial_run):
    dynamic, (steps, _) = partial_run
    carried_any = 0
    for result, streamed, carried_in in steps:
        m = result.metrics
        resumed = sum(g.tokens for g in carried_in)
        kept = _tokens(s for g in result.groups for s in g.samples)
        carried = sum(g.tokens for g in result.carried)
        assert m["rollout/generated_tokens"] == streamed
        assert (m["rollout/resumed_tokens"], m["rollout/kept_tokens"], m["rollout/carried_tokens"]) == \
            (resumed, kept, carried)
        assert m["rollout/discarded_tokens"] == 0
        if not dynamic:
            assert m["rollout/filtered_tokens"] == 0
        assert streamed + resumed == kept + m["rollout/filtered_tokens"] + carried
        assert m["rollout/carried_groups"] == len(result.carried)
        assert m["rollout/resumed_groups"] == len(carried_in)
        carried_any += sum(1 for g in result.carried for s in g.samples
                           if s.finish_reason == "abort" and s.response_ids)
    assert carried_any > 0, "no group was cut mid-generation: the test exercises nothing"


def test_prefixes_reappear_with_their_versions_and_logprobs(partial_run):
    _, (steps, models) = partial_run
    checked = 0
    for version in range(1, len(steps)):  # steps[version] ran on weight version `version`
        (result, _, carried_in), (prev, _, _) = steps[version], steps[version - 1]
        assert set(result.requested).isdisjoint(result.resumed)  # a carried prompt is not drawn again
        prefixes = {g.prompt.index: g for g in carried_in}
        assert list(prefixes) == [g.prompt.index for g in prev.carried] == result.resumed
        oldest = version
        for group in result.groups:
            if group.prompt.index not in prefixes:
                assert {v for s in group.samples for v in s.versions()} == {version}
                continue
            for old, new in zip(prefixes[group.prompt.index].samples, group.samples, strict=True):
                k = len(old.response_ids)
                assert new.response_ids[:k] == old.response_ids and new.logprobs[:k] == old.logprobs
                oldest = min([oldest, *old.versions()])
                if old.finish_reason != "abort":
                    assert new.response_ids == old.response_ids and new.finish_reason == old.finish_reason
                    continue
                assert new.versions() == old.versions() + [version] * (len(new.response_ids) - k)
                # every token's rollout log-prob is that of the weights that generated it
                prompt = group.prompt.prompt_ids
                for v in set(new.versions()):
                    at = torch.tensor([u == v for u in new.versions()])
                    torch.testing.assert_close(torch.tensor(new.logprobs)[at],
                                               _teacher_forced(models[v], prompt, new.response_ids)[at])
                checked += k > 0
        assert result.metrics["rollout/max_staleness"] == version - oldest
    assert checked > 0, "no kept group resumed a non-empty prefix"


def test_without_partial_rollout_cut_tokens_are_discarded():
    for result, streamed, carried_in in _run(partial=False, dynamic=True, steps=2)[0]:
        m = result.metrics
        assert carried_in == [] and result.carried == [] and m["rollout/resumed_tokens"] == 0
        kept = _tokens(s for g in result.groups for s in g.samples)
        assert m["rollout/discarded_tokens"] > 0
        assert streamed == kept + m["rollout/filtered_tokens"] + m["rollout/discarded_tokens"]
        assert "rollout/max_staleness" not in m


@pytest.mark.parametrize("sampling", [
    pytest.param(SamplingParams(max_new_tokens=MAX_NEW, seed=3), id="t1"),
    pytest.param(SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=30, seed=3), id="filtered"),
    pytest.param(SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, seed=3), id="greedy"),
])
def test_continuation_equals_one_uninterrupted_generation(sampling):
    """Same weights: a group cut after 5 decode steps and continued from its prefixes equals the group generated
    in one go (the continuation keeps each sample's random stream: RolloutRequest.first_index/resumed_tokens)."""
    model = _model(0)
    engine = EmbeddedEngine(model, max_batch_size=64)
    prompt = [5, 9, 14, 3]
    whole = engine.generate([RolloutRequest(prompt_ids=prompt, n=4, sampling=sampling, request_id="whole")])[0]
    short = RolloutRequest(prompt_ids=[7, 7], n=1, request_id="short",
                           sampling=dataclasses.replace(sampling, max_new_tokens=5))
    cut = {}
    for group in engine.stream([short, RolloutRequest(prompt_ids=prompt, n=4, sampling=sampling, request_id="g")]):
        if group[0].request_id == "short":
            engine.abort()
        else:
            cut = {s.index: s for s in group}
    assert any(s.finish_reason == "abort" and len(s.response_ids) == 5 for s in cut.values())
    requests = [continuation_request(prompt, s, sampling, sampling.seed, f"c{i}")
                for i, s in cut.items() if s.finish_reason == "abort"]
    assert all(r.first_index == int(r.request_id[1:]) and r.resumed_tokens == 5 for r in requests)
    for (cont,) in engine.generate(requests):
        cut[cont.index] = extend(cut[cont.index], cont, prompt)
    for ref in whole:
        got = cut[ref.index]
        assert (got.response_ids, got.finish_reason, got.prompt_ids) == (ref.response_ids, ref.finish_reason, prompt)
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-5)


def test_sglang_continuation_payload_keeps_the_sample_seed():
    sampling = SamplingParams(max_new_tokens=MAX_NEW, seed=42)
    prefix = Sample(request_id="r", index=3, prompt_ids=[5, 6], response_ids=[8, 9, 10], logprobs=[-1.0] * 3,
                    finish_reason="abort", weight_version=0)
    req = continuation_request([5, 6], prefix, sampling, 42, "r-c")
    body = generate_payload(req, 0)
    assert body["input_ids"] == [5, 6, 8, 9, 10]
    assert body["sampling_params"]["sampling_seed"] == row_seed(42, 3)
    assert body["sampling_params"]["max_new_tokens"] == MAX_NEW - 3
    whole = generate_payload(RolloutRequest(prompt_ids=[5, 6], n=4, sampling=sampling, request_id="r"), 3)
    assert whole["sampling_params"]["sampling_seed"] == body["sampling_params"]["sampling_seed"]


def test_settle_and_request_validation():
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=(EOS,))
    base = dict(request_id="r", index=0, prompt_ids=[5], weight_version=0, finish_reason="abort")
    assert settle(Sample(**base, response_ids=[3, EOS], logprobs=[0.0] * 2), sampling).finish_reason == "stop"
    assert settle(Sample(**base, response_ids=[3] * 4, logprobs=[0.0] * 4), sampling).finish_reason == "length"
    assert settle(Sample(**base, response_ids=[3] * 3, logprobs=[0.0] * 3), sampling).finish_reason == "abort"
    with pytest.raises(ValueError, match="n must be 1"):
        RolloutRequest(prompt_ids=[5, 6], n=2, sampling=sampling, request_id="x", resumed_tokens=1)
    with pytest.raises(ValueError, match="resumed_tokens"):
        RolloutRequest(prompt_ids=[5, 6], n=1, sampling=sampling, request_id="x", resumed_tokens=2)
    with pytest.raises(ValueError, match="token_versions"):
        Sample(**base, response_ids=[3], logprobs=[0.0], token_versions=[0, 1])
    with pytest.raises(ValueError, match="--partial-rollout"):
        collect_batch(None, lambda k: [], _decode, length_parity, _config(partial=False, dynamic=True), step=1,
                      carried=[CarriedGroup(prompt=_prompts(1)[0], samples=[Sample(**base, response_ids=[3],
                                                                                     logprobs=[0.0])],
                                            seed=None, first_step=1)])
    with pytest.raises(ValueError, match="ordered by index"):
        CarriedGroup(prompt=_prompts(1)[0], samples=[], seed=None, first_step=1)


def test_checkpoint_state_round_trips(partial_run):
    groups = [g for result, *_ in partial_run[1][0] for g in result.carried]
    assert groups
    back = from_state(state(groups))
    assert len(back) == len(groups)
    for a, b in zip(groups, back, strict=True):
        assert (a.prompt, a.seed, a.first_step) == (b.prompt, b.seed, b.first_step)
        for x, y in zip(a.samples, b.samples, strict=True):
            assert (x.response_ids, x.finish_reason, x.weight_version, x.versions(), x.index) == \
                (y.response_ids, y.finish_reason, y.weight_version, y.versions(), y.index)
            assert torch.equal(torch.tensor(x.logprobs, dtype=torch.float32), torch.tensor(y.logprobs))
    assert from_state(None) == []
    with pytest.raises(ValueError, match="layout version"):
        from_state({"version": 99, "groups": []})


def test_a_carried_conversation_keeps_its_tool_tokens_and_calls():
    """A multi-turn conversation carried in a checkpoint (rollout/multi_turn.py): its tool-token mask (1 B a token) and
    calls come back, and a version-1 checkpoint (before conversations) still reads, its samples without them."""
    prompt = _prompts(1)[0]
    conv = Sample(request_id="r", index=0, prompt_ids=prompt.prompt_ids, response_ids=[5, 6, 7, 8, 9],
                  logprobs=[-0.5, -0.25, 0.0, 0.0, -1.0], finish_reason="abort", weight_version=2,
                  loss_mask=[1, 1, 0, 0, 1], tool_calls=1)
    plain = Sample(request_id="r", index=1, prompt_ids=prompt.prompt_ids, response_ids=[5], logprobs=[-0.5],
                   finish_reason="stop", weight_version=2)
    data = state([CarriedGroup(prompt=prompt, samples=[conv, plain], seed=3, first_step=1)])
    (back,) = from_state(data)
    assert (back.samples[0].loss_mask, back.samples[0].tool_calls) == ([1, 1, 0, 0, 1], 1)
    assert (back.samples[1].loss_mask, back.samples[1].tool_calls) == ([], 0)
    old = {"version": 1, "groups": [{**data["groups"][0], "samples": [
        {k: v for k, v in s.items() if k not in ("loss_mask", "tool_calls")} for s in data["groups"][0]["samples"]]}]}
    assert [s.loss_mask for s in from_state(old)[0].samples] == [[], []]


def test_simulated_engine_partial_progress_and_the_bench_shape():
    """tests/sim_engine.py with partial_progress (what tools/bench_partial_rollout.py runs at 32B shape): the
    token accounting closes and every carried prefix comes back as the start of a kept or re-carried response."""
    from tests import sim_engine as sim

    engine = sim.LengthLatencyEngine(keep_rate=0.8, truncate_prob=0.05, seed=2, partial_progress=True, group_size=4)
    config = CollectConfig(n_samples_per_prompt=4, sampling=SamplingParams(max_new_tokens=32),
                           dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=8),
                           overlong=OverlongConfig(max_response_length=32, buffer_length=8), over_sample_factor=1.5,
                           seed=3, partial_rollout=True)
    next_prompts, carried, prefixes = sim.cycling(sim.prompts(1000)), [], 0
    for step in range(1, 6):
        result = collect_batch(engine, next_prompts, sim.decode, sim.reward, config, step=step, carried=carried)
        m = result.metrics
        assert m["rollout/resumed_tokens"] + m["rollout/generated_tokens"] == \
            m["rollout/kept_tokens"] + m["rollout/filtered_tokens"] + m["rollout/carried_tokens"]
        later = {g.prompt.index: g.samples for g in (*result.groups, *result.carried)}
        for group in carried:
            if group.prompt.index in later:
                for old, new in zip(group.samples, later[group.prompt.index], strict=True):
                    assert new.response_ids[:len(old.response_ids)] == old.response_ids
                    prefixes += old.finish_reason == "abort" and len(old.response_ids) > 0
        carried = result.carried
        engine.update_weights([], version=step)
    assert prefixes > 0
