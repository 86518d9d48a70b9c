"""Group advantages, dynamic sampling and overlong shaping against hand-computed values."""

from __future__ import annotations

import statistics

import pytest
import torch

from megatron_dapo.algorithm import (
    BatchFiller,
    DynamicSamplingConfig,
    GenerationBudgetExhausted,
    OverlongConfig,
    broadcast_to_tokens,
    group_advantages,
    group_is_informative,
    overlong_keep_mask,
    overlong_penalties,
    overlong_penalty,
)


def test_group_advantages_match_mean_and_unbiased_std_per_group():
    rewards = [1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.5]
    groups = ["a", "b", "a", "a", "b", "a", "b"]  # interleaved, unequal sizes (4 and 3)
    adv = group_advantages(rewards, groups)
    for g in ("a", "b"):
        members = [i for i, k in enumerate(groups) if k == g]
        values = [rewards[i] for i in members]
        mu, sd = statistics.fmean(values), statistics.stdev(values)  # stdev: divides by n - 1, as verl
        for i in members:
            assert adv[i].item() == pytest.approx((rewards[i] - mu) / (sd + 1e-6), rel=1e-6)


def test_group_advantage_of_one_correct_in_sixteen_is_the_verl_number():
    """G = 16, one +1 and fifteen -1: mean -0.875, squared deviations 1.875^2 + 15 * 0.125^2 = 3.75.
    verl (unbiased std): sqrt(3.75 / 15) = 0.5, so A = 1.875 / 0.5 = 3.75 and -0.125 / 0.5 = -0.25.
    The population std sqrt(3.75 / 16) would give 3.873 and -0.258 (sqrt(16/15) = 1.033x larger)."""
    rewards = [1.0] + [-1.0] * 15
    adv = group_advantages(rewards, [0] * 16)
    assert adv[0].item() == pytest.approx(1.875 / (0.5 + 1e-6), rel=1e-7)
    assert adv[1:].tolist() == pytest.approx([-0.125 / (0.5 + 1e-6)] * 15, rel=1e-7)
    population = group_advantages(rewards, [0] * 16, unbiased=False)
    assert population[0].item() == pytest.approx(1.875 / (3.75 / 16) ** 0.5, rel=1e-5)
    assert (population[0] / adv[0]).item() == pytest.approx((16 / 15) ** 0.5, rel=1e-5)


def test_group_advantages_variants():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0])
    ids = [0, 0, 0, 0]
    population = group_advantages(rewards, ids, unbiased=False)
    assert population[0].item() == pytest.approx(1.5 / (statistics.pstdev([1, -1, -1, -1]) + 1e-6), rel=1e-6)
    centred = group_advantages(rewards, ids, normalize_std=False)
    torch.testing.assert_close(centred, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    # a uniform group has zero advantage, a singleton too
    assert group_advantages([1.0, 1.0, 3.0], [7, 7, 8]).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="pair up"):
        group_advantages([1.0, 2.0], [0])


def test_broadcast_to_tokens():
    out = broadcast_to_tokens(torch.tensor([0.5, -2.0]), [3, 1])
    assert [t.tolist() for t in out] == [[0.5, 0.5, 0.5], [-2.0]]


def test_group_is_informative():
    assert group_is_informative([True, False, False])
    assert not group_is_informative([True, True])
    assert not group_is_informative([0.0, 0.0, 0.0])
    assert not group_is_informative([True])


def test_batch_filler_accumulates_across_rounds_and_counts_surplus():
    filler: BatchFiller[str] = BatchFiller(DynamicSamplingConfig(rollout_batch_size=3))
    rounds = [
        [("g0", [1, 1]), ("g1", [1, 0]), ("g2", [0, 0])],
        [("g3", [0, 1]), ("g4", [1, 1])],
        [("g5", [1, 0]), ("g6", [0, 1]), ("g7", [1, 0])],
    ]
    for groups in rounds:
        assert filler.start_round()
        for name, accs in groups:
            filler.offer(name, accs)
        if filler.full:
            break
    assert filler.batch() == ["g1", "g3", "g5"]
    s = filler.stats
    # g6, g7 come after the batch is full: surplus, not decided on
    assert (s.rounds, s.seen_groups, s.kept_groups, s.all_correct, s.all_wrong, s.surplus_groups) == (
        3, 6, 3, 2, 1, 2)
    metrics = filler.stats.as_metrics()
    assert metrics["dynamic_sampling/keep_ratio"] == pytest.approx(3 / 6)
    assert metrics["dynamic_sampling/generated_per_kept"] == pytest.approx(8 / 3)


def test_batch_filler_budget_error_names_the_flag_and_partial_mode():
    filler: BatchFiller[int] = BatchFiller(DynamicSamplingConfig(rollout_batch_size=2, max_num_gen_batches=2))
    for _ in range(2):
        filler.start_round()
        filler.offer(1, [1, 1])
    with pytest.raises(GenerationBudgetExhausted, match="--max-num-gen-batches"):
        filler.start_round()
    with pytest.raises(RuntimeError, match="keep generating"):
        BatchFiller(DynamicSamplingConfig(rollout_batch_size=2)).batch()

    partial: BatchFiller[int] = BatchFiller(
        DynamicSamplingConfig(rollout_batch_size=2, max_num_gen_batches=1, on_exhausted="partial"))
    assert partial.start_round()
    partial.offer(5, [1, 0])
    assert not partial.start_round()
    assert partial.batch() == [5]


def test_batch_filler_without_filtering_keeps_everything():
    filler: BatchFiller[int] = BatchFiller(DynamicSamplingConfig(rollout_batch_size=2, enabled=False))
    filler.start_round()
    filler.offer(0, [1, 1])
    filler.offer(1, [0, 0])
    assert filler.batch() == [0, 1]


@pytest.mark.parametrize(
    "length,expected",
    [(0, 0.0), (16, 0.0), (17, -1 / 4), (18, -2 / 4), (20, -1.0), (21, -1.0), (1000, -1.0)],
)
def test_overlong_penalty_eq13(length, expected):
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, linear to -1 at 20, -1 beyond.
    cfg = OverlongConfig(max_response_length=20, buffer_length=4)
    assert overlong_penalty(length, cfg) == pytest.approx(expected)


def test_overlong_batch_factor_and_filter():
    cfg = OverlongConfig(max_response_length=20, buffer_length=4, penalty_factor=0.5, filter_truncated=True)
    torch.testing.assert_close(overlong_penalties([10, 18, 20], cfg), torch.tensor([0.0, -0.25, -0.5]))
    torch.testing.assert_close(overlong_keep_mask([False, True], cfg), torch.tensor([1.0, 0.0]))
    assert overlong_penalty(25, OverlongConfig(max_response_length=20)) == 0.0  # buffer 0: off
    with pytest.raises(ValueError, match="--overlong-buffer-length"):
        OverlongConfig(max_response_length=8, buffer_length=9)


@pytest.mark.parametrize("factor", [1.0, 0.5, 2.0])
def test_overlong_penalty_is_eq13_times_the_factor_in_all_three_cases(factor):
    """R_length of Eq. 13 (L_max = 20, L_cache = 4) written out, times --overlong-penalty-factor in every case,
    including |y| > L_max (the other tests take factor 1 there)."""
    def eq13(n: int) -> float:
        if n <= 20 - 4:
            return 0.0
        return (20 - 4 - n) / 4 if n <= 20 else -1.0

    cfg = OverlongConfig(max_response_length=20, buffer_length=4, penalty_factor=factor)
    for n in (0, 15, 16, 17, 19, 20, 21, 40):
        assert overlong_penalty(n, cfg) == pytest.approx(factor * eq13(n)), n


def test_a_buffer_as_long_as_l_max_is_allowed_and_grades_every_length():
    """L_cache = L_max is in range (--overlong-buffer-length <= --max-response-length): the penalty then grows from
    the first token, -|y| / L_max."""
    cfg = OverlongConfig(max_response_length=8, buffer_length=8)
    assert [overlong_penalty(n, cfg) for n in (0, 2, 8)] == [0.0, -0.25, -1.0]


def test_truncated_samples_stay_in_the_loss_without_overlong_filter():
    """Overlong filtering is opt-in (--overlong-filter): without it a truncated sample keeps its loss mask."""
    on = OverlongConfig(max_response_length=20, filter_truncated=True)
    off = OverlongConfig(max_response_length=20)
    torch.testing.assert_close(overlong_keep_mask([True, False, True], on), torch.tensor([0.0, 1.0, 0.0]))
    torch.testing.assert_close(overlong_keep_mask([True, False, True], off), torch.tensor([1.0, 1.0, 1.0]))
