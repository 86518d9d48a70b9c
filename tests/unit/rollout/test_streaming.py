"""The fully async rollout's thread (rollout/streaming.py) against a token-level simulated engine: the per-token
staleness bound, decisions in submission order, responses cut at a push and continued equal to their uninterrupted
draw, and a resume from a state saved in a push window that repeats the uninterrupted run exactly."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig
from megatron_dapo.algorithm.dynamic_sampling import group_is_informative
from megatron_dapo.rollout.collect import CollectConfig, ScoredGroup, request_seed
from megatron_dapo.rollout.stream import StreamScheduler
from megatron_dapo.rollout.streaming import StreamingConfig, StreamingRollout, in_flight_cap, lead
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests import sim_engine as sim
from tests.sim_engine import LengthLatencyEngine

B, G, L, SEED = 4, 4, 32, 7


class Sampler:
    """The next k prompts of a long list, with its position as state (the run's ResumableSampler, reduced)."""

    def __init__(self, pos: int = 0) -> None:
        self.items, self.pos = sim.prompts(10_000), pos

    def __call__(self, k: int):
        out = self.items[self.pos:self.pos + k]
        self.pos += k
        return out


def collect_config(**kw) -> CollectConfig:
    return CollectConfig(n_samples_per_prompt=G, sampling=SamplingParams(max_new_tokens=L), seed=SEED,
                         dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=B),
                         overlong=OverlongConfig(max_response_length=L, buffer_length=8), **kw)


def make(k: int, steps: int, *, policy: str = "drop", sampler: Sampler | None = None, engine=None, **collect_kw):
    engine = engine or LengthLatencyEngine(keep_rate=0.6, truncate_prob=0.15, seed=3, partial_progress=True,
                                           group_size=G)
    manager = StreamingRollout(StreamingConfig(max_staleness=k, num_steps=steps, stale_policy=policy),
                               collect_config(**collect_kw), engine=engine, next_prompts=sampler or Sampler(),
                               decode=sim.decode, reward_fn=sim.reward)
    return manager, engine


def drive(manager: StreamingRollout, engine, first: int, last: int,
          in_window: Callable[[int], None] | None = None) -> dict[int, tuple[list[ScoredGroup], dict]]:
    """The trainer's side, as Trainer.run calls it: take the step's batch, train (nothing here), then push the new
    version (and save, `in_window`) inside the window."""
    out = {}
    try:
        for step in range(first, last + 1):
            groups, metrics, _ = manager.take(step)
            out[step] = (groups, metrics)
            with manager.window(step):
                engine.update_weights([], version=step)
                if in_window is not None:
                    in_window(step)
    finally:
        manager.close()
    return out


def uninterrupted_draw(engine: LengthLatencyEngine, group: ScoredGroup) -> list[list[int]]:
    """The group's G responses as one uncut request would have generated them (the engine draws per seed)."""
    gid = group.samples[0].request_id.split("-")[0]
    seed = request_seed(SEED, gid)
    req = RolloutRequest(prompt_ids=group.prompt.prompt_ids, n=G, request_id="ref",
                         sampling=SamplingParams(max_new_tokens=L, seed=seed))
    return engine._draw_group(req, G, L, record=False)[0]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_trained_token_is_within_k_versions_and_batches_keep_submission_order(k: int):
    steps = 8
    manager, engine = make(k, steps)
    ahead: dict[int, tuple[int, int, int]] = {}

    def look(step: int) -> None:
        state = manager.state_dict()
        ahead[step] = (state["scheduler"]["handed"], len(state["scheduler"]["batches"]), len(state["ready"]))

    batches = drive(manager, engine, 1, steps, in_window=look)
    for v, (handed, in_scheduler, ready) in ahead.items():
        # at the push of version v the rollout is parked with the batch of step v + D handed over (D = max(1, K - 1))
        assert handed >= min(v + lead(k), steps), ahead
        # and counts as taken only the batches of steps <= v (the trainer has them): the others still count as
        # ready ahead of the trainer in StreamScheduler.want, whatever the trainer's thread has done
        if handed < steps:
            assert (in_scheduler, ready) == (handed - v, 0), ahead
    kept_order = []
    dropped = 0.0
    for step, (groups, metrics) in batches.items():
        assert len(groups) == B
        train_version = step - 1
        hist: dict[int, int] = {}
        for g in groups:
            assert group_is_informative(g.accs)
            kept_order.append(g.prompt.index)
            # cut at a push and continued, or not: the response is the uncut draw of its seed
            assert [s.response_ids for s in g.samples] == uninterrupted_draw(engine, g)
            assert all(s.finish_reason in ("stop", "length") for s in g.samples)
            for s in g.samples:
                for v in s.versions():
                    hist[train_version - v] = hist.get(train_version - v, 0) + 1
        assert max(hist) <= k and min(hist) >= 0
        total = sum(hist.values())
        for d in range(k + 1):
            assert metrics.get(f"rollout/staleness/{d}", 0.0) == pytest.approx(hist.get(d, 0) / total)
        assert metrics["async/train_version"] == train_version
        dropped += metrics["rollout/stale_dropped_groups"]
    # decided in submission order: the kept prompts of all batches, in order, are increasing (drop policy)
    assert kept_order == sorted(kept_order) and len(set(kept_order)) == len(kept_order)
    # a batch K steps ahead exists before the push it waits for: versions < train version - 1 do occur
    assert any(batches[s][1].get(f"rollout/staleness/{k}", 0) > 0 for s in range(k + 1, steps + 1))
    if k == 1:
        assert dropped > 0  # groups spanning two pushes exceed K = 1 (the simulation's finding at 32B)


def test_mixed_version_responses_carry_both_versions_across_a_push():
    # K = 3 (lead 2): a group cut at a push lives long enough to be trained (at K = 2 this engine's waves, all
    # requests starting together, decide most cut groups a batch too late)
    manager, engine = make(3, 10)
    batches = drive(manager, engine, 1, 10)
    mixed = [s for groups, _ in batches.values() for g in groups for s in g.samples if len(set(s.versions())) > 1]
    assert mixed, "no response spanned a push"
    for s in mixed:
        versions = s.versions()
        assert versions == sorted(versions)  # the prefix from the older weights, then the newer


def test_the_regenerate_policy_keeps_the_bound_without_dropping_a_group():
    steps = 8
    manager, engine = make(1, steps, policy="regenerate")
    batches = drive(manager, engine, 1, steps)
    regenerated = sum(m["rollout/regenerated_tokens"] for _, m in batches.values())
    assert regenerated > 0
    for step, (groups, metrics) in batches.items():
        assert metrics["rollout/stale_dropped_groups"] == 0
        assert max(step - 1 - v for g in groups for s in g.samples for v in s.versions()) <= 1


@pytest.mark.parametrize("k,cut_at,prefixes", [(1, 3, False), (2, 3, False), (3, 2, True), (3, 4, True)])
def test_a_resume_from_a_window_save_repeats_the_uninterrupted_run(k: int, cut_at: int, prefixes: bool):
    """`prefixes`: the state saved holds responses cut mid-generation. At K <= 2 this engine's waves (every request
    of a call starts together) end by the time a batch is handed over, so those saves hold the batches handed over
    and at most groups that finished behind the cut; K = 3 runs further ahead and its saves hold cut prefixes."""
    steps = 7
    reference_manager, reference_engine = make(k, steps)
    reference = drive(reference_manager, reference_engine, 1, steps)

    saved: dict = {}
    sampler = Sampler()
    first, engine = make(k, steps, sampler=sampler)

    def save(step: int) -> None:
        if step == cut_at:
            saved.update(state=first.state_dict(), pos=sampler.pos)

    drive(first, engine, 1, cut_at, in_window=save)
    cut = [len(s["response_ids"]) for g in saved["state"]["carried"]["groups"] for s in g["samples"]
           if s["finish_reason"] == "abort"]
    assert any(cut) is prefixes, cut
    resumed_engine = LengthLatencyEngine(keep_rate=0.6, truncate_prob=0.15, seed=3, partial_progress=True,
                                         group_size=G)
    resumed_engine.update_weights([], version=cut_at)  # train.py pushes the checkpoint's weights
    second, _ = make(k, steps, sampler=Sampler(saved["pos"]), engine=resumed_engine)
    second.load_state_dict(saved["state"])
    resumed = drive(second, resumed_engine, cut_at + 1, steps)
    for step in range(cut_at + 1, steps + 1):
        ref_groups, ref_metrics = reference[step]
        groups, metrics = resumed[step]
        assert [(g.prompt.index, g.rewards, [(s.response_ids, s.versions()) for s in g.samples]) for g in groups] == \
            [(g.prompt.index, g.rewards, [(s.response_ids, s.versions()) for s in g.samples]) for g in ref_groups]
        assert {k: v for k, v in metrics.items() if not k.startswith("time/")} == \
            {k: v for k, v in ref_metrics.items() if not k.startswith("time/")}


def test_a_save_outside_a_window_holds_the_rollout_at_a_cut():
    manager, engine = make(2, 6)
    manager.take(1)
    state = manager.state_dict()  # the trainer is "training" step 1: the rollout cuts and holds
    assert state["scheduler"]["handed"] >= 1
    # the groups the scheduler counts in flight are exactly the cut ones, each with all G samples so far (finished
    # or a prefix): nothing is mid-request, so nothing generated is missing from the state
    in_flight = [g["key"] for g in state["scheduler"]["groups"] if g["samples"] is None]
    assert in_flight and sorted(in_flight) == sorted(state["carried_gids"]) == sorted(state["carry"])
    assert all(len(g["samples"]) == G for g in state["carried"]["groups"])
    manager.close()


def test_an_engine_failure_reaches_the_trainer():
    class Failing(LengthLatencyEngine):
        def open_stream(self, requests):
            raise OSError("server gone")

    manager, _ = make(2, 3, engine=Failing(keep_rate=0.5, truncate_prob=0.0, group_size=G))
    with pytest.raises(RuntimeError, match="fully async rollout failed: OSError: server gone"):
        manager.take(1)
    manager.close()


def test_the_engine_must_serve_the_version_before_the_first_step():
    manager, engine = make(2, 3)
    engine.update_weights([], version=2)
    with pytest.raises(RuntimeError, match="must serve weight version 0; it serves 2"):
        manager.take(1)


def test_config_is_validated():
    with pytest.raises(ValueError, match="--max-staleness must be >= 1"):
        StreamingConfig(max_staleness=0, num_steps=3)
    with pytest.raises(ValueError, match="--stale-policy must be one of"):
        StreamingConfig(max_staleness=1, num_steps=3, stale_policy="keep")


def test_groups_in_flight_are_capped_near_what_the_engine_runs_at_once(monkeypatch):
    """--max-in-flight-groups 0: ceil(1.25 x capacity / G) groups; an engine that does not say is not capped, and the
    cap holds in the stream: never more groups submitted and undecided than it."""
    assert in_flight_cap(128, 8) == 20 and in_flight_cap(256, 16) == 20 and in_flight_cap(3, 8) == 1
    assert in_flight_cap(None, 8) is None

    peak = []
    real_submit = StreamScheduler.submit

    def submit(self, key, version):
        seq = real_submit(self, key, version)
        peak.append(self.in_flight)
        return seq

    monkeypatch.setattr(StreamScheduler, "submit", submit)
    for cap, most in ((5, 5), (None, 40)):  # uncapped: ceil(1.5 x K x B / keep rate) at the floor's rate
        peak.clear()
        engine = LengthLatencyEngine(keep_rate=0.6, truncate_prob=0.15, seed=3, partial_progress=True, group_size=G)
        manager = StreamingRollout(StreamingConfig(max_staleness=2, num_steps=4, max_in_flight=cap),
                                   collect_config(over_sample_factor=1.5), engine=engine, next_prompts=Sampler(),
                                   decode=sim.decode, reward_fn=sim.reward)
        drive(manager, engine, 1, 4)
        assert max(peak) <= most and max(peak) == cap if cap else max(peak) > 5, (cap, max(peak))


def test_each_group_back_tops_the_stream_up_to_the_cap():
    """Continuous submission: between two cuts, a group that comes back is followed by an `add` of new groups that
    brings the groups in flight back to what the scheduler wants (the cap, or less once batches wait), in the same
    stream (no wave ends first)."""
    after_add = []

    class Recording(LengthLatencyEngine):
        def open_stream(self, requests):
            stream = super().open_stream(requests)
            add = stream._add

            def recorded(more):
                add(more)
                after_add.append((manager._sched.in_flight, manager._sched.want()))
            stream._add = recorded
            return stream

    engine = Recording(keep_rate=0.6, truncate_prob=0.15, seed=3, partial_progress=True, group_size=G)
    manager = StreamingRollout(StreamingConfig(max_staleness=2, num_steps=6, max_in_flight=5), collect_config(),
                               engine=engine, next_prompts=Sampler(), decode=sim.decode, reward_fn=sim.reward)
    drive(manager, engine, 1, 6)
    assert len(after_add) >= 6 and {want for _, want in after_add} == {0}, after_add
    assert max(in_flight for in_flight, _ in after_add) == 5


def test_no_thread_is_left_behind():
    before = {t.name for t in threading.enumerate()}
    manager, engine = make(2, 3)
    drive(manager, engine, 1, 3)
    assert "stream-rollout" not in {t.name for t in threading.enumerate()} - before


@pytest.mark.parametrize("extra, says", [
    (("--max-staleness", "2", "--no-use-tis"), "--max-staleness 2 trains tokens up to 2 weight versions old with no "
                                              "off-policy correction"),
    (("--max-staleness", "2", "--partial-rollout"), "--max-staleness 2 and --partial-rollout exclude each other"),
    (("--max-staleness", "1", "--async-rollout", "1"), "--max-staleness 1 and --async-rollout 1 exclude each other"),
    (("--max-staleness", "2", "--max-num-gen-batches", "3"), "the fully async rollout .* has no rounds"),
    (("--allow-uncorrected-staleness",), "--allow-uncorrected-staleness is given without --max-staleness"),
    (("--max-staleness", "-1"), "--max-staleness must be >= 0"),
    (("--max-in-flight-groups", "4"), "--max-in-flight-groups 4 caps the fully async rollout: it needs"),
    (("--max-staleness", "2", "--max-in-flight-groups", "-1"), "--max-in-flight-groups must be >= 0"),
])
def test_modes_that_cannot_mix_are_refused_by_name(extra, says):
    from megatron_dapo.startup import build_configs
    from tests.unit.rollout.test_async_rollout import _flags

    with pytest.raises(ValueError, match=says):
        build_configs(_flags(*extra))


@pytest.mark.parametrize("extra, tis", [
    (("--max-staleness", "2"), True),  # TIS on by default, as with --async-rollout 1
    (("--max-staleness", "1", "--no-use-tis"), False),  # K = 1: allowed uncorrected (one step, as one-step-off)
    (("--max-staleness", "2", "--no-use-tis", "--mis-mode", "token"), False),
    (("--max-staleness", "3", "--no-use-tis", "--allow-uncorrected-staleness"), False),
    (("--max-staleness", "2", "--policy-loss", "decoupled"), False),  # the loss weights by the ratio itself
])
def test_the_flags_build_the_fully_async_trainer(extra, tis):
    from megatron_dapo.startup import build_configs
    from tests.unit.rollout.test_async_rollout import _flags

    _, _, trainer = build_configs(_flags(*extra))
    assert trainer.max_staleness == int(extra[1]) and trainer.off_policy.use_tis is tis
