"""The fully async rollout's rules (rollout/stream.py) against a reference written out from them: one pass over
the groups in submission order, independent of when each finished."""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_dapo.rollout.stream import StreamConfig, StreamScheduler, check_spans, oldest, spans_of


def _config(**kw) -> StreamConfig:
    base = dict(batch_groups=4, max_staleness=2, n_samples=2)
    return StreamConfig(**(base | kw))


MIXED, ALL_RIGHT = [True, False], [True, True]


def test_in_flight_target_is_k_batches_of_kept_groups_over_the_keep_rate():
    s = StreamScheduler(_config(batch_groups=4, max_staleness=2, over_sample_factor=1.5))
    assert s.want() == math.ceil(1.5 * 2 * 4 / 1.0)  # no decision yet: rate 1
    seqs = [s.submit(key=i, version=0) for i in range(12)]
    assert s.want() == 0 and s.in_flight == 12
    for seq, accs in zip(seqs[:4], [MIXED, ALL_RIGHT, MIXED, ALL_RIGHT], strict=True):
        s.complete(seq, [((0, 3),), ((0, 5),)], accs)
    # 2 kept of 4 decided: ready 2, rate 0.5, target ceil(1.5 * (8 - 2) / 0.5) = 18, 8 still in flight
    assert (s.ready, s.keep_rate, s.in_flight) == (2, 0.5, 8)
    assert s.want() == 18 - 8


def test_in_flight_cap_bounds_the_target_and_refills_as_groups_finish():
    s = StreamScheduler(_config(batch_groups=4, max_staleness=2, max_in_flight=3))
    seqs = [s.submit(i, 0) for i in range(s.want())]
    assert len(seqs) == 3 and s.want() == 0  # the uncapped target would be 8
    s.complete(seqs[0], [((0, 1),)] * 2, MIXED)
    assert s.want() == 1
    with pytest.raises(ValueError, match="max_in_flight must be >= 1"):
        _config(max_in_flight=0)


def test_keep_rate_zero_is_floored_not_infinite():
    s = StreamScheduler(_config(batch_groups=1, max_staleness=1))
    s.complete(s.submit(0, 0), [((0, 1),)] * 2, ALL_RIGHT)
    assert s.keep_rate == 0.0 and s.want() == 1 / 0.05  # KEEP_RATE_FLOOR bounds the submission rate


def _reference(rng: random.Random, count: int, config: StreamConfig):
    """Random groups, and the batches (keys) and dropped keys the rules give: one pass in submission order, the
    train version of the batch being built being the count of batches handed before it. Each group's tokens are
    generated at versions up to that train version (the engine never runs ahead of the actor), its first token
    lagging by 0 to K + 2 versions (a long-running group), versions non-decreasing along each response."""
    groups, batches, building, dropped, outcomes = [], [], [], [], {}
    for key in range(count):
        train_version = config.first_train_version + len(batches)
        start = max(0, train_version - rng.choice([0, 0, 1, config.max_staleness, config.max_staleness + 2]))
        samples = []
        for _ in range(config.n_samples):
            v, spans = start, []
            for _ in range(rng.randint(0, 3)):
                spans.append((v, rng.randint(0, 7)))
                v = min(train_version, v + rng.randint(0, 1))
            samples.append(tuple(spans))
        accs = [rng.random() < 0.5 for _ in range(config.n_samples)]
        groups.append((key, samples, accs))
        if any(oldest(s) is not None and train_version - oldest(s) > config.max_staleness for s in samples):
            dropped.append(key)
            outcomes[key] = "dropped"
            continue
        if config.dynamic_sampling and all(accs) == any(accs):
            outcomes[key] = "filtered"
            continue
        outcomes[key] = "kept"
        building.append(key)
        if len(building) == config.batch_groups:
            batches.append(building)
            building = []
    return groups, batches, dropped, outcomes


@pytest.mark.parametrize("seed", range(6))
def test_batches_do_not_depend_on_completion_order_and_match_the_reference(seed):
    rng = random.Random(seed)
    config = _config(batch_groups=3, max_staleness=1 + seed % 3, n_samples=3)
    groups, expected, dropped, outcomes = _reference(rng, 60, config)
    assert expected and dropped, "the case needs full batches and stale groups"
    for order_seed in range(3):
        s = StreamScheduler(config)
        seqs = [s.submit(key, version=0) for key, _, _ in groups]
        order = list(range(len(groups)))
        random.Random(order_seed).shuffle(order)
        handed = []
        for i in order:
            s.complete(seqs[i], groups[i][1], groups[i][2])
            while (batch := s.pop_batch()) is not None:
                handed.append(batch)
        assert [b.keys for b in handed] == expected
        assert [b.train_version for b in handed] == list(range(len(expected)))
        assert s.take_counts()["rollout/stale_dropped_groups"] == len(dropped)
        assert dict(s.take_decisions()) == outcomes  # every group decided once, as the reference decides it
        for b in handed:  # every trained token within the bound
            assert max(b.staleness_tokens) <= config.max_staleness


def test_staleness_histogram_counts_tokens_by_version_gap():
    s = StreamScheduler(_config(batch_groups=1, max_staleness=3, first_train_version=2))
    s.complete(s.submit("a", 1), [((1, 5), (2, 3)), ((0, 2), (1, 0), (2, 4))], MIXED)
    batch = s.pop_batch()
    assert batch.train_version == 2 and batch.staleness_tokens == {1: 5, 0: 7, 2: 2}
    m = batch.metrics()
    assert m["rollout/staleness/0"] == pytest.approx(7 / 14) and m["rollout/staleness/2"] == pytest.approx(2 / 14)
    assert m["rollout/max_staleness"] == 2.0


def test_a_group_staler_than_k_is_dropped_at_k_and_kept_at_k_plus_one():
    spans = [((0, 4),), ((1, 4),)]
    for k, kept in ((2, False), (3, True)):
        s = StreamScheduler(_config(batch_groups=1, max_staleness=k, first_train_version=3))
        s.complete(s.submit("old", 0), spans, MIXED)
        counts = s.take_counts()
        assert (s.pop_batch() is not None) == kept
        assert counts["rollout/stale_dropped_groups"] == (0 if kept else 1)
        assert counts["rollout/discarded_tokens"] == (0 if kept else 8)


def test_regenerate_resubmits_only_the_stale_samples_at_the_end_of_the_order():
    s = StreamScheduler(_config(batch_groups=2, max_staleness=1, first_train_version=2, stale_policy="regenerate"))
    old = s.submit("old", 0)
    fresh = s.submit("fresh", 2)
    s.complete(fresh, [((2, 3),), ((2, 1),)], MIXED)
    s.complete(old, [((0, 6), (1, 2)), ((1, 4),)], MIXED)  # sample 0 starts at version 0 < 2 - 1
    (regen,) = s.take_regenerations()
    assert regen.key == "old" and regen.samples == (0,) and regen.seq > fresh
    counts = s.take_counts()
    assert counts["rollout/regenerated_tokens"] == 8 and counts["rollout/regenerated_groups"] == 1
    assert s.in_flight == 1 and s.pop_batch() is None  # 'fresh' is kept, 'old' waits for its new sample
    s.complete(regen.seq, [((2, 5),), ((1, 4),)], MIXED)
    batch = s.pop_batch()
    assert batch.keys == ["fresh", "old"] and batch.staleness_tokens == {0: 9, 1: 4}
    assert s.take_counts()["stream/generated_tokens"] == 5  # the new sample only; the kept one was counted


def test_state_round_trip_continues_identically():
    rng = random.Random(7)
    config = _config(batch_groups=3, max_staleness=2, n_samples=3, stale_policy="regenerate")
    groups, _, _, _ = _reference(rng, 40, config)

    def run(restore_at: int | None):
        s = StreamScheduler(config)
        seqs = [s.submit(key, 0) for key, _, _ in groups]
        order = list(range(len(groups)))
        random.Random(1).shuffle(order)
        handed, regens, decisions = [], [], []
        for step, i in enumerate(order):
            if step == restore_at:
                state = torch.load(_save(s.state_dict()), weights_only=True)  # plain types: no pickled class
                s = StreamScheduler(config)
                s.load_state_dict(state)
            s.complete(seqs[i], groups[i][1], groups[i][2])
            regens += s.take_regenerations()
            decisions.append(s.take_decisions())
            while (b := s.pop_batch()) is not None:
                handed.append((b.keys, b.train_version, b.staleness_tokens))
        return handed, regens, decisions

    baseline = run(None)
    assert baseline[0] and baseline[1]
    assert run(17) == baseline


def _save(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="max_staleness must be >= 1"):
        _config(max_staleness=0)
    with pytest.raises(ValueError, match="stale_policy must be one of"):
        _config(stale_policy="truncate")
    with pytest.raises(ValueError, match="dynamic sampling needs --n-samples-per-prompt >= 2"):
        _config(n_samples=1)
    s = StreamScheduler(_config())
    seq = s.submit("a", 0)
    with pytest.raises(ValueError, match="expected G = 2"):
        s.complete(seq, [((0, 1),)], [True])
    with pytest.raises(ValueError, match="versions decrease along the response"):
        s.complete(seq, [((1, 1), (0, 1)), ((0, 1),)], MIXED)
    with pytest.raises(ValueError, match="group 99 is not in flight"):
        s.complete(99, [((0, 1),)] * 2, MIXED)


def test_spans_helpers():
    assert spans_of([3, 3, 4, 4, 4, 6]) == ((3, 2), (4, 3), (6, 1)) and spans_of([]) == ()
    assert oldest(((2, 0), (3, 1))) == 3 and oldest(((2, 0),)) is None
    assert check_spans([[1, 2], [1, 3]], "x") == ((1, 2), (1, 3))
