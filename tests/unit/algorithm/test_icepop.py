"""IcePop (--use-icepop; Ring-1T, arXiv 2510.18855): M(r) = r inside [alpha, beta], 0 outside, against the formula
written out; the loss it weights keeps every token in its denominator (the paper's 1/|y_i|), unlike MIS; its metric;
the flags it excludes."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm import OffPolicyConfig, PolicyLossConfig, mismatch_sums, off_policy_correction
from megatron_dapo.algorithm.grpo_loss import grpo_loss
from megatron_dapo.algorithm.mismatch import icepop_weights, reduce_mismatch
from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError
from tests.unit.algorithm.test_algorithm_mismatch import _logps

RATIOS = [[0.3, 0.51, 1.0, 4.9, 4.99, 5.2], [0.49, 2.0, 0.8, 7.0, 1.0, 1.0]]
"""Ratios near the default band's edges [0.5, 5] on both sides, none on an edge (the log-probs round)."""


def _m(r: float, low: float = 0.5, high: float = 5.0) -> float:
    return r if low <= r <= high else 0.0


def test_weights_are_the_ratio_inside_the_band_and_zero_outside():
    old, rollout = _logps(RATIOS)
    expected = torch.tensor([[_m(r) for r in row] for row in RATIOS], dtype=torch.float64)
    torch.testing.assert_close(icepop_weights(old, rollout, 0.5, 5.0), expected)
    narrow = torch.tensor([[_m(r, 0.9, 1.5) for r in row] for row in RATIOS], dtype=torch.float64)
    torch.testing.assert_close(icepop_weights(old, rollout, 0.9, 1.5), narrow)


def test_the_correction_weights_tokens_composes_with_mis_and_keeps_the_mask():
    old, rollout = _logps(RATIOS)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.float64)
    out = off_policy_correction(old, rollout, mask, OffPolicyConfig(use_icepop=True))
    assert out.loss_mask is mask  # no token leaves the denominator
    expected = [[_m(r) * m for r, m in zip(row, mrow, strict=True)] for row, mrow in zip(RATIOS, mask.tolist(),
                                                                                        strict=True)]
    torch.testing.assert_close(out.is_weights, torch.tensor(expected, dtype=torch.float64))
    both = off_policy_correction(old, rollout, mask, OffPolicyConfig(use_icepop=True, mis_mode="token",
                                                                     mis_threshold=2.5))
    assert both.loss_mask.tolist() == [[0, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 1]]  # MIS drops r outside [0.4, 2.5]
    torch.testing.assert_close(both.is_weights, out.is_weights)


def test_the_loss_is_the_papers_objective_with_every_token_in_the_denominator():
    """GRPO's loss (the paper's 1/G sum_i 1/|y_i| sum_t) with IcePop's weights: a masked token adds 0 to its
    response's sum and still counts in |y_i|."""
    old_rollout, rollout = _logps([[0.3, 1.0, 2.0], [1.0, 6.0, 1.2]], seed=2)
    mask = torch.ones(2, 3, dtype=torch.float64)
    weights = off_policy_correction(old_rollout, rollout, mask, OffPolicyConfig(use_icepop=True)).is_weights
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    r_new = torch.tensor([[1.1, 0.9, 1.5], [1.0, 1.2, 0.7]], dtype=torch.float64)
    logp = old + r_new.log()
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    out = grpo_loss(logp, old, adv, mask, PolicyLossConfig(), is_weights=weights)
    k = [[0.0, 1.0, 2.0], [1.0, 0.0, 1.2]]
    total = 0.0
    for i, a in enumerate((1.0, -1.0)):
        terms = [k[i][t] * -min(r * a, min(max(r, 0.8), 1.28) * a) for t, r in enumerate(r_new[i].tolist())]
        total += sum(terms) / 3
    assert (out.loss_sum / out.denominator).item() == pytest.approx(total / 2, rel=1e-12)


def test_the_masked_fraction_is_logged_whether_or_not_icepop_is_on():
    old, rollout = _logps(RATIOS, seed=1)
    mask = torch.ones(2, 6)
    for cfg in (OffPolicyConfig(), OffPolicyConfig(use_icepop=True)):
        got = reduce_mismatch({k: float(v) for k, v in mismatch_sums(old, rollout, mask, cfg).items()})
        assert got["mismatch/icepop_maskfrac"] == pytest.approx(4 / 12)  # 0.3, 5.2, 0.49, 7.0
    tight = OffPolicyConfig(icepop_low=0.95, icepop_high=1.05)
    got = reduce_mismatch({k: float(v) for k, v in mismatch_sums(old, rollout, mask, tight).items()})
    assert got["mismatch/icepop_maskfrac"] == pytest.approx(9 / 12)
    assert math.isclose(sum(1 for row in RATIOS for r in row if not 0.95 <= r <= 1.05) / 12, 9 / 12)


@pytest.mark.parametrize("kwargs, match", [
    (dict(icepop_low=0.0), "--icepop-low"), (dict(icepop_low=1.0), "--icepop-low"),
    (dict(icepop_high=1.0), "--icepop-high"), (dict(icepop_high=float("inf")), "--icepop-high"),
    (dict(use_icepop=True, use_tis=True), "--use-icepop .* --use-tis"),
    (dict(use_icepop=True, behaviour_weights=True), "decoupled"),
])
def test_config_errors_name_the_flag(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OffPolicyConfig(**kwargs)


def _configs(*flags: str):
    from megatron_dapo.startup import build_configs

    return build_configs(build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps",
                                                    "2", *flags]))


def test_flags_build_the_config_and_icepop_turns_the_tis_default_off():
    _, _, trainer = _configs("--use-icepop", "--icepop-low", "0.4", "--icepop-high", "3")
    assert trainer.off_policy == OffPolicyConfig(use_icepop=True, icepop_low=0.4, icepop_high=3.0)
    _, _, stale = _configs("--async-rollout", "1", "--use-icepop")  # TIS would be on by default here
    assert stale.off_policy.use_icepop and not stale.off_policy.use_tis
    _, _, fully = _configs("--max-staleness", "2", "--use-icepop", "--no-use-tis")  # a correction: accepted
    assert fully.off_policy.enabled
    with pytest.raises(UserError, match="--use-tis with --use-icepop"):
        _configs("--use-tis", "--use-icepop")
