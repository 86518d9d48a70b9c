"""TIS / MIS / mismatch metrics against formulas written out, and the TIS-weighted loss's gradient."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.actor import TrainSample
from megatron_dapo.actor.batching import build_micro_batch
from megatron_dapo.algorithm import (
    OffPolicyConfig,
    PolicyLossConfig,
    mis_keep_mask,
    mismatch_sums,
    off_policy_correction,
    policy_loss,
    reduce_mismatch,
    tis_weights,
)
from megatron_dapo.algorithm.mismatch import MAX_KEYS, SUM_KEYS
from megatron_dapo.arguments import build_parser


def _logps(ratios: list[list[float]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, rollout) log-probs with pi_old / pi_rollout = ratios exactly (rollout probs random in (0, 0.3))."""
    g = torch.Generator().manual_seed(seed)
    r = torch.tensor(ratios, dtype=torch.float64)
    p_rollout = 0.3 * torch.rand(r.shape, generator=g, dtype=torch.float64) + 1e-3
    return (p_rollout * r).log(), p_rollout.log()


def test_tis_weights_are_ratios_truncated_at_the_cap():
    ratios = [[3.0, 0.5, 1.0, 2.5], [0.1, 1.9, 7.0, 1.2]]
    old, rollout = _logps(ratios)
    expected = [[min(x, 2.0) for x in row] for row in ratios]
    torch.testing.assert_close(tis_weights(old, rollout, 2.0), torch.tensor(expected, dtype=torch.float64))


def test_mis_token_and_sequence_masks():
    ratios = [[3.0, 0.4, 1.5, 0.6], [4.0, 0.5, 1.0, 1.0], [4.0, 1.9, 1.0, 9.0]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.float32)
    old, rollout = _logps(ratios)
    token = mis_keep_mask(old, rollout, mask, "token", 2.0)
    assert token.tolist() == [[False, False, True, True], [False, True, True, False], [False, True, True, False]]
    # geometric means over masked tokens: (3*.4*1.5*.6)^(1/4)=0.95, (4*.5*1)^(1/3)=1.26, (4*1.9*1)^(1/3)=1.97
    gm = [math.prod(r[:k]) ** (1 / k) for r, k in zip(ratios, (4, 3, 3), strict=True)]
    assert gm[0] < 1.9 and gm[1] < 1.9 < gm[2] < 2.1
    seq = mis_keep_mask(old, rollout, mask, "sequence", 1.9)
    assert seq.tolist() == [[True] * 4, [True, True, True, False], [False] * 4]
    # the 9.0 outside the mask does not count: at T = 2.1 row 3 (gm 1.97) is kept
    assert mis_keep_mask(old, rollout, mask, "sequence", 2.1)[2].tolist() == [True, True, True, False]


def test_correction_composes_tis_weights_and_mis_mask():
    ratios = [[3.0, 0.4, 1.5, 1.0]]
    old, rollout = _logps(ratios)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = off_policy_correction(old, rollout, mask, OffPolicyConfig(use_tis=True, tis_cap=2.0, mis_mode="token",
                                                                    mis_threshold=2.0))
    assert out.loss_mask.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    torch.testing.assert_close(out.is_weights, torch.tensor([[2.0, 0.4, 1.5, 0.0]], dtype=torch.float64))
    off = off_policy_correction(old, rollout, mask, OffPolicyConfig())
    assert off.is_weights is None and off.loss_mask is mask


def test_metrics_match_formulas_written_out():
    ratios = [[3.0, 0.4, 1.5, 0.6], [4.0, 0.5, 1.0, 1.0]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.float32)
    old, rollout = _logps(ratios, seed=3)
    cfg = OffPolicyConfig(tis_cap=2.0, mis_mode="sequence", mis_threshold=1.5)
    # two "DP ranks" (one row each), reduced as the trainer does: sums add, maxima take the max
    parts = [mismatch_sums(old[i:i + 1], rollout[i:i + 1], mask[i:i + 1], cfg) for i in range(2)]
    reduced = {k: sum(float(p[k]) for p in parts) for k in SUM_KEYS} | {k: max(float(p[k]) for p in parts)
                                                                        for k in MAX_KEYS}
    got = reduce_mismatch(reduced)

    toks = [(ratios[b][t], float(old[b, t]), float(rollout[b, t])) for b in range(2) for t in range(4) if mask[b, t]]
    n = len(toks)
    assert got["mismatch/tokens"] == n == 6
    assert got["mismatch/logprob_abs_diff_mean"] == pytest.approx(sum(abs(math.log(r)) for r, _, _ in toks) / n)
    assert got["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(4.0))
    assert got["mismatch/is_ratio_mean"] == pytest.approx(sum(r for r, _, _ in toks) / n)
    assert got["mismatch/is_ratio_max"] == pytest.approx(4.0)
    assert got["mismatch/tis_weight_mean"] == pytest.approx(sum(min(r, 2.0) for r, _, _ in toks) / n)
    assert got["mismatch/tis_clipfrac"] == pytest.approx(2 / 6)  # 3.0 and 4.0
    # sequence MIS at T=1.5: row 0 gm (0.972) kept, row 1 gm sqrt(2) = 1.414 kept -> nothing masked
    assert got["mismatch/mis_maskfrac"] == 0.0
    assert got["mismatch/kl_k3"] == pytest.approx(sum(r - 1 - math.log(r) for r, _, _ in toks) / n)
    ppl_old = math.exp(-sum(lo for _, lo, _ in toks) / n)
    ppl_rollout = math.exp(-sum(lr for _, _, lr in toks) / n)
    assert got["mismatch/ppl_ratio"] == pytest.approx(ppl_old / ppl_rollout)
    tighter = reduce_mismatch({k: float(v) for k, v in mismatch_sums(
        old, rollout, mask, OffPolicyConfig(mis_mode="sequence", mis_threshold=1.2)).items()})
    assert tighter["mismatch/mis_maskfrac"] == pytest.approx(2 / 6)  # row 1 (gm 1.414) dropped


def test_identical_log_probs_give_unit_ratios_and_zero_fractions():
    logp = torch.log(torch.rand(3, 7) * 0.9 + 0.05)
    got = reduce_mismatch({k: float(v) for k, v in mismatch_sums(logp, logp.clone(), torch.ones(3, 7),
                                                                  OffPolicyConfig(mis_mode="token")).items()})
    assert got["mismatch/is_ratio_mean"] == 1.0 and got["mismatch/tis_weight_mean"] == 1.0
    assert got["mismatch/tis_clipfrac"] == 0.0 and got["mismatch/mis_maskfrac"] == 0.0
    assert got["mismatch/kl_k3"] == 0.0 and got["mismatch/ppl_ratio"] == 1.0


def test_weighted_policy_loss_and_gradient():
    """loss = sum_t w_t m_t max(-A r_t, -A clip(r_t)) / sum_t m_t; d/dlogp_t = -w_t m_t A r_t / N unclipped, else 0."""
    cfg = PolicyLossConfig(eps_low=0.2, eps_high=0.28)
    ratio = torch.tensor([[1.0, 1.5, 0.7, 1.1], [0.9, 1.2, 0.5, 1.0]], dtype=torch.float64)
    old = torch.full_like(ratio, -2.0)
    logp = (old + ratio.log()).requires_grad_(True)
    adv = torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float64)
    w = torch.tensor([[2.0, 0.5, 1.0, 1.3], [0.25, 1.0, 1.7, 9.0]], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp, old, adv, mask, cfg, is_weights=w)
    out.loss_sum.backward()

    expected_loss, expected_grad = 0.0, torch.zeros_like(ratio)
    for b in range(2):
        a = float(adv[b])
        for t in range(4):
            if not mask[b, t]:
                continue
            r = float(ratio[b, t])
            unclipped, clipped = -a * r, -a * min(max(r, 0.8), 1.28)
            expected_loss += float(w[b, t].detach()) * max(unclipped, clipped)
            if unclipped >= clipped:  # the unclipped branch is the max: it carries the gradient
                expected_grad[b, t] = float(w[b, t].detach()) * -a * r
    assert float(out.denominator) == 7
    assert float(out.loss_sum) == pytest.approx(expected_loss)
    torch.testing.assert_close(logp.grad, expected_grad)
    assert w.grad is None  # the weights are constants of the loss
    # weights of 1 change nothing
    plain = policy_loss(logp, old, adv, mask, cfg)
    ones = policy_loss(logp, old, adv, mask, cfg, is_weights=torch.ones_like(ratio))
    assert float(plain.loss_sum) == float(ones.loss_sum)
    with pytest.raises(ValueError, match="is_weights"):
        policy_loss(logp, old, adv, mask, cfg, is_weights=torch.ones(2, 3))


def test_train_sample_and_micro_batch_carry_weights():
    a = TrainSample(tokens=[5, 6, 7, 8, 9], prompt_len=2, is_weights=torch.tensor([0.5, 2.0, 1.5]))
    b = TrainSample(tokens=[5, 6, 7], prompt_len=1)
    mb = build_micro_batch([a, b], [0, 1])
    # position t predicts token t+1: the response of a (tokens 2..4) is predicted at positions 1..3
    torch.testing.assert_close(mb.is_weights, torch.tensor([[1.0, 0.5, 2.0, 1.5, 1.0], [1.0] * 5]))
    assert build_micro_batch([b], [0]).is_weights is None
    with pytest.raises(ValueError, match="is_weights"):
        TrainSample(tokens=[5, 6, 7], prompt_len=1, is_weights=torch.ones(3))
    with pytest.raises(ValueError, match="is_weights"):
        TrainSample(tokens=[5, 6, 7], prompt_len=1, is_weights=torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("kwargs, flag", [
    (dict(tis_cap=0.9), "--tis-cap"), (dict(tis_cap=float("inf")), "--tis-cap"),
    (dict(mis_mode="geometric"), "--mis-mode"), (dict(mis_threshold=1.0), "--mis-threshold"),
])
def test_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        OffPolicyConfig(**kwargs)


def test_flags_build_the_config():
    from megatron_dapo.startup import build_configs

    args = build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps", "2",
                                      "--use-tis", "--tis-cap", "3", "--mis-mode", "sequence",
                                      "--mis-threshold", "1.5"])
    _, _, trainer = build_configs(args)
    assert trainer.off_policy == OffPolicyConfig(use_tis=True, tis_cap=3.0, mis_mode="sequence", mis_threshold=1.5)
    _, _, default = build_configs(build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "y",
                                                             "--num-steps", "2"]))
    assert not default.off_policy.enabled


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_mis_keeps_a_ratio_on_the_threshold(mode):
    """MIS drops ratios outside the closed interval [1/T, T]: with T = e, a log-ratio of exactly +-1 (r = e, 1/e) is
    kept, one of 1 + 2^-20 is not."""
    old = torch.tensor([[1.0, -1.0, 1.0 + 2**-20]], dtype=torch.float64)
    rollout = torch.zeros_like(old)
    if mode == "token":
        keep = mis_keep_mask(old, rollout, torch.ones_like(old), "token", math.e)
        assert keep.tolist() == [[True, True, False]]
    else:  # one row per ratio: the row's geometric mean is its only token's ratio
        keep = mis_keep_mask(old.t(), rollout.t(), torch.ones_like(old.t()), "sequence", math.e)
        assert keep.tolist() == [[True], [True], [False]]
