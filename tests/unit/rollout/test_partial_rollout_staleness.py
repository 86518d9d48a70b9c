"""--partial-rollout-max-staleness on the embedded engine (tests/unit/rollout/test_partial_rollout.py's tiny random
Qwen2): with dynamic sampling and a batch of 3 groups, carried groups fill the batch and are carried again, reaching
staleness 3 in 6 steps without a cap. References: the engine's own token stream (Counting), the staleness of each
carried group written out from its per-token versions, the uncapped run, and an uninterrupted run for the resume."""

from __future__ import annotations

import copy

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.rollout.collect import CollectConfig, Prompt, collect_batch
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.partial_rollout import from_state, state
from megatron_dapo.startup import build_configs
from tests.rewards import length_parity
from tests.unit.rollout.test_partial_rollout import Counting, _config, _decode, _model, _prompts, _tokens

STEPS = 6
BATCH = 3


def _steps(max_staleness: int | None, *, resume_at: int | None = None):
    """STEPS steps of collect_batch with dynamic sampling, weights version = step after each. With `resume_at` k:
    after step k the carried groups go through the checkpoint state and a fresh engine on version k continues
    (the trainer's resume). Returns per step (result, tokens streamed, carried groups in, engine version)."""
    models = [_model(0)] + [_model(0, std=0.15 + 0.01 * s) for s in range(1, STEPS + 1)]
    engine = Counting(EmbeddedEngine(copy.deepcopy(models[0]), max_batch_size=64))
    prompts, cursor = _prompts(200), {"i": 0}

    def next_prompts(k: int) -> list[Prompt]:
        cursor["i"] += k
        return prompts[cursor["i"] - k: cursor["i"]]

    config = _config(partial=True, dynamic=True, batch=BATCH, max_staleness=max_staleness)
    carried, out = [], []
    for step in range(1, STEPS + 1):
        before, version = engine.tokens, engine.weight_version
        result = collect_batch(engine, next_prompts, _decode, length_parity, config, step=step, carried=carried)
        out.append((result, engine.tokens - before, carried, version))
        carried = result.carried
        if step == resume_at:  # a new process: the carried groups from the checkpoint, an engine on the initial weights
            carried = from_state(state(carried))
            engine = Counting(EmbeddedEngine(copy.deepcopy(models[0]), max_batch_size=64))
        engine.update_weights(models[step].state_dict().items(), version=step)
    return out


def _staleness(group, version: int) -> int:
    versions = [v for s in group.samples for v in s.versions()]
    return version - min(versions) if versions else 0


def _fingerprint(result) -> tuple:
    """Everything a step hands the trainer and the next step, bit for bit (metrics but the wall time)."""
    def samples(groups):
        return [(g.prompt.index, [(s.response_ids, s.logprobs, s.versions(), s.finish_reason) for s in g.samples])
                for g in groups]
    metrics = {k: v for k, v in result.metrics.items() if not k.startswith("time/")}
    return (samples(result.groups), [g.rewards for g in result.groups], samples(result.carried), result.requested,
            result.resumed, result.stale_dropped, metrics)


@pytest.fixture(scope="module")
def uncapped():
    return _steps(None)


def test_the_uncapped_run_carries_groups_more_than_once(uncapped):
    worst = max(r.metrics["rollout/max_staleness"] for r, *_ in uncapped)
    assert worst >= 3, f"no group reached staleness 3 (worst {worst}): the cap-2 test would exercise nothing"
    assert all(r.metrics["rollout/stale_dropped_groups"] == 0 and not r.stale_dropped for r, *_ in uncapped)


@pytest.mark.parametrize("cap", [1, 2])
def test_cap_bounds_staleness_and_dropped_tokens_are_discarded(uncapped, cap):
    assert max(r.metrics["rollout/max_staleness"] for r, *_ in uncapped) > cap, "the cap would bound nothing"
    dropped_total = 0
    dropped_prompts: set[int] = set()
    for result, streamed, carried_in, version in _steps(cap):
        m = result.metrics
        # reference: each carried-in group's staleness written out from its per-token versions
        stale = [g for g in carried_in if _staleness(g, version) > cap]
        assert result.stale_dropped == [g.prompt.index for g in stale]
        assert result.resumed == [g.prompt.index for g in carried_in if _staleness(g, version) <= cap]
        assert m["rollout/stale_dropped_groups"] == len(stale)
        assert m["rollout/resumed_groups"] == len(carried_in) - len(stale)
        # no kept group, nor any group carried on, is older than the cap would allow
        assert m["rollout/max_staleness"] <= cap
        assert all(_staleness(g, version) <= cap for g in result.groups)
        # the dropped groups' tokens, and only they, are discarded; the token identity holds
        resumed = sum(g.tokens for g in carried_in)
        kept = _tokens(s for g in result.groups for s in g.samples)
        assert m["rollout/discarded_tokens"] == sum(g.tokens for g in stale)
        assert (m["rollout/generated_tokens"], m["rollout/resumed_tokens"], m["rollout/kept_tokens"]) == \
            (streamed, resumed, kept)
        assert streamed + resumed == kept + m["rollout/filtered_tokens"] + m["rollout/carried_tokens"] + \
            m["rollout/discarded_tokens"]
        # a dropped prompt is not drawn again
        seen = set(result.requested) | {g.prompt.index for g in (*result.groups, *result.carried)}
        assert seen.isdisjoint(dropped_prompts)
        dropped_prompts |= set(result.stale_dropped)
        dropped_total += len(stale)
    assert dropped_total > 0, f"cap {cap} dropped nothing: the test exercises nothing"


def test_a_cap_never_reached_changes_nothing(uncapped):
    capped = _steps(STEPS + 1)
    for (a, *_), (b, *_) in zip(uncapped, capped, strict=True):
        assert _fingerprint(a) == _fingerprint(b)


def test_the_cap_is_applied_the_same_after_a_resume():
    reference = _steps(1)
    assert sum(len(r.stale_dropped) for r, *_ in reference[3:]) > 0, "no drop after the resume point"
    resumed = _steps(1, resume_at=3)
    for step, ((a, *_), (b, *_)) in enumerate(zip(reference, resumed, strict=True), start=1):
        assert _fingerprint(a) == _fingerprint(b), f"step {step}"


FLAGS = ["--hf-checkpoint", "x", "--prompt-data", "x", "--num-steps", "1"]


def test_flag_defaults_and_errors():
    collect = build_configs(build_parser().parse_args([*FLAGS, "--partial-rollout"]))[1]
    assert collect.partial_rollout_max_staleness == 1
    collect = build_configs(build_parser().parse_args([*FLAGS, "--partial-rollout",
                                                       "--partial-rollout-max-staleness", "3"]))[1]
    assert collect.partial_rollout_max_staleness == 3
    assert build_configs(build_parser().parse_args(FLAGS))[1].partial_rollout_max_staleness is None
    for bad in ("0", "-2"):
        with pytest.raises(ValueError, match=rf"--partial-rollout-max-staleness must be >= 1.*got {bad}"):
            build_configs(build_parser().parse_args([*FLAGS, "--partial-rollout",
                                                     "--partial-rollout-max-staleness", bad]))
    with pytest.raises(ValueError, match=r"--partial-rollout-max-staleness 2 is given without --partial-rollout"):
        build_configs(build_parser().parse_args([*FLAGS, "--partial-rollout-max-staleness", "2"]))
    with pytest.raises(ValueError, match=r"without --partial-rollout"):
        CollectConfig(**{**_config(partial=False, dynamic=True).__dict__, "partial_rollout_max_staleness": 1})
