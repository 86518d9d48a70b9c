"""ResumableSampler: epochs are permutations, seeded, and a restored sampler continues exactly."""

from __future__ import annotations

import json

import pytest

from megatron_dapo.data import ResumableSampler
from megatron_dapo.data.sampler import epoch_permutation
from megatron_dapo.errors import UserError


def _epochs(sampler: ResumableSampler, num_items: int, epochs: int) -> list[list[int]]:
    return [sampler.next_batch(num_items) for _ in range(epochs)]


def test_each_epoch_is_a_fresh_permutation():
    sampler = ResumableSampler(50, seed=3)
    first, second, third = _epochs(sampler, 50, 3)
    for epoch in (first, second, third):
        assert sorted(epoch) == list(range(50))
    assert first != second != third
    assert first == epoch_permutation(50, 3, 0).tolist() and second == epoch_permutation(50, 3, 1).tolist()


def test_same_seed_same_order_other_seed_differs():
    a, b, c = ResumableSampler(40, seed=7), ResumableSampler(40, seed=7), ResumableSampler(40, seed=8)
    batches_a = [a.next_batch(6) for _ in range(20)]
    assert batches_a == [b.next_batch(6) for _ in range(20)]
    assert batches_a != [c.next_batch(6) for _ in range(20)]


def test_no_shuffle_is_sequential_and_wraps():
    sampler = ResumableSampler(5, seed=0, shuffle=False)
    assert [sampler.next_batch(3) for _ in range(4)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3], [4, 0, 1]]
    assert sampler.epoch == 2


def test_batches_span_epochs_without_drop_last():
    sampler = ResumableSampler(10, seed=1)
    stream = sum((sampler.next_batch(4) for _ in range(5)), [])  # 20 items = exactly two epochs
    assert stream == epoch_permutation(10, 1, 0).tolist() + epoch_permutation(10, 1, 1).tolist()


def test_drop_last_skips_epoch_remainder():
    sampler = ResumableSampler(10, seed=1, drop_last=True)
    batches = [sampler.next_batch(4) for _ in range(3)]
    e0, e1 = epoch_permutation(10, 1, 0).tolist(), epoch_permutation(10, 1, 1).tolist()
    assert batches == [e0[0:4], e0[4:8], e1[0:4]]  # e0[8:10] dropped
    with pytest.raises(ValueError, match="drop_last=True"):
        sampler.next_batch(11)


def test_batch_larger_than_dataset_cycles():
    sampler = ResumableSampler(3, seed=0, shuffle=False)
    assert sampler.next_batch(7) == [0, 1, 2, 0, 1, 2, 0]


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("stop_after", [0, 3, 7, 12])
def test_resume_sees_exactly_the_same_prompts(drop_last, stop_after):
    reference = ResumableSampler(23, seed=11, drop_last=drop_last)
    expected = [reference.next_batch(5) for _ in range(20)]

    first = ResumableSampler(23, seed=11, drop_last=drop_last)
    seen = [first.next_batch(5) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints store plain data
    resumed = ResumableSampler(23, seed=11, drop_last=drop_last)
    resumed.load_state_dict(state)
    seen += [resumed.next_batch(5) for _ in range(20 - stop_after)]
    assert seen == expected


@pytest.mark.parametrize(
    "kwargs, field",
    [
        pytest.param({"num_items": 24}, "num_items", id="dataset-size"),
        pytest.param({"shuffle": False}, "shuffle", id="shuffle"),
        pytest.param({"drop_last": True}, "drop_last", id="drop-last"),
    ],
)
def test_resume_with_different_settings_names_the_field(kwargs, field):
    state = ResumableSampler(23, seed=11).state_dict()
    settings = {"num_items": 23, "seed": 11, **kwargs}
    other = ResumableSampler(settings.pop("num_items"), **settings)
    with pytest.raises(ValueError, match=f"checkpoint has {field}="):
        other.load_state_dict(state)


def test_resume_with_another_seed_is_a_user_error_naming_both_seeds_and_the_flag():
    """Before (issue 38 item 12) a ValueError, printed by the trainer as a traceback from inside the resume."""
    state = ResumableSampler(23, seed=11).state_dict()
    for check in (ResumableSampler(23, seed=12).check_state, ResumableSampler(23, seed=12).load_state_dict):
        with pytest.raises(UserError) as err:
            check(state)
        assert str(err.value).startswith("the checkpoint under --load was saved with --seed 11, this run has --seed "
                                         "12: ") and "resume with --seed 11" in str(err.value)
    ResumableSampler(23, seed=11).check_state(state)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_items must be an int >= 1"):
        ResumableSampler(0, seed=0)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        ResumableSampler(3, seed=-1)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        ResumableSampler(3, seed=0).next_batch(0)
    bad = ResumableSampler(3, seed=0).state_dict() | {"position": 9}
    with pytest.raises(ValueError, match="position 9 outside"):
        ResumableSampler(3, seed=0).load_state_dict(bad)


def test_neighbouring_seeds_do_not_share_epochs_shifted_by_one():
    """The permutation is seeded by the pair (seed, epoch), not seed + epoch: seed 5's second epoch is not seed 6's
    first."""
    assert epoch_permutation(50, 5, 1).tolist() != epoch_permutation(50, 6, 0).tolist()
    assert epoch_permutation(50, 5, 1).tolist() == epoch_permutation(50, 5, 1).tolist()


def test_drop_last_keeps_a_batch_that_exactly_fills_the_epoch():
    """drop_last drops only a remainder shorter than the batch: 10 items in batches of 5 use every item."""
    sampler = ResumableSampler(10, seed=2, drop_last=True)
    e0, e1 = epoch_permutation(10, 2, 0).tolist(), epoch_permutation(10, 2, 1).tolist()
    assert [sampler.next_batch(5) for _ in range(3)] == [e0[:5], e0[5:], e1[:5]]


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
def test_resume_from_the_exact_end_of_an_epoch(drop_last):
    """A checkpoint taken when a batch ended exactly at the end of an epoch (position == num_items, the next epoch not
    yet begun) resumes into the next epoch's order."""
    first = ResumableSampler(12, seed=4, drop_last=drop_last)
    first.next_batch(6)
    first.next_batch(6)
    state = first.state_dict()
    assert (state["epoch"], state["position"]) == (0, 12)
    resumed = ResumableSampler(12, seed=4, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert resumed.next_batch(6) == first.next_batch(6) == epoch_permutation(12, 4, 1).tolist()[:6]
