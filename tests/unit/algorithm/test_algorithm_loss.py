"""DAPO policy loss against the paper's formula written out token by token in plain Python."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm import PolicyLossConfig, aggregate, policy_loss, reduce_metrics


def reference_token_loss(logp: float, old: float, adv: float, eps_low: float, eps_high: float,
                         dual_c: float | None = None) -> float:
    """-min(r A, clip(r, 1-eps_low, 1+eps_high) A), then the dual-clip cap for A < 0 (plain floats)."""
    r = math.exp(max(-20.0, min(20.0, logp - old)))
    clipped_r = min(max(r, 1 - eps_low), 1 + eps_high)
    loss = -min(r * adv, clipped_r * adv)
    if dual_c is not None and adv < 0:
        loss = min(loss, -dual_c * adv)
    return loss


def random_batch(seed: int, b: int = 5, s: int = 7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None, :] < lengths[:, None]).double()
    return logp.requires_grad_(True), old, adv, mask


@pytest.mark.parametrize("dual_c", [None, 3.0], ids=["no-dual-clip", "dual-clip-3"])
def test_token_mean_matches_written_out_formula(dual_c):
    logp, old, adv, mask = random_batch(0)
    cfg = PolicyLossConfig(dual_clip_c=dual_c)
    out = policy_loss(logp, old, adv, mask, cfg)
    total, count = 0.0, 0
    for b in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            if mask[b, t]:
                total += reference_token_loss(logp[b, t].item(), old[b, t].item(), adv[b].item(), 0.2, 0.28,
                                              dual_c)
                count += 1
    assert out.denominator.item() == count
    assert out.loss_sum.item() == pytest.approx(total, rel=1e-6, abs=1e-9)


def test_clip_higher_is_asymmetric():
    # A > 0: ratio 1.25 is inside [0.8, 1.28] -> unclipped, gradient flows; ratio 1.35 -> clipped at 1.28.
    # A < 0: ratio 0.85 inside -> unclipped; ratio 0.7 -> clipped at 0.8 (no gradient).
    ratios = torch.tensor([[1.25, 1.35, 0.85, 0.7]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    old = torch.zeros_like(ratios)
    logp = ratios.log().requires_grad_(True)
    out = policy_loss(logp, old, adv, torch.ones_like(ratios), PolicyLossConfig())
    per_token = [-1.25, -1.28, 0.85, 0.8]
    assert out.loss_sum.item() == pytest.approx(sum(per_token))
    out.loss_sum.backward()
    # d(-A r)/d logp = -A r where unclipped, 0 where clipped
    expected_grad = torch.tensor([[-1.25, 0.0, 0.85, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(logp.grad, expected_grad)
    assert out.metrics["clipfrac_high"].item() == 1
    assert out.metrics["clipfrac_low"].item() == 1


def test_symmetric_clip_is_ppo():
    # eps_high = eps_low = 0.2 is vanilla PPO: ratio 1.25 with A > 0 is clipped at 1.2.
    logp = torch.tensor([[math.log(1.25)]])
    out = policy_loss(logp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1),
                      PolicyLossConfig(eps_low=0.2, eps_high=0.2))
    assert out.loss_sum.item() == pytest.approx(-1.2)


def test_dual_clip_caps_negative_advantage_loss():
    logp = torch.tensor([[math.log(10.0)]])
    adv = torch.tensor([-1.0])
    plain = policy_loss(logp, torch.zeros(1, 1), adv, torch.ones(1, 1), PolicyLossConfig())
    dual = policy_loss(logp, torch.zeros(1, 1), adv, torch.ones(1, 1), PolicyLossConfig(dual_clip_c=3.0))
    assert plain.loss_sum.item() == pytest.approx(10.0)
    assert dual.loss_sum.item() == pytest.approx(3.0)
    assert dual.metrics["clipfrac_dual"].item() == 1


def test_log_ratio_is_clamped():
    out = policy_loss(torch.tensor([[100.0]]), torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1),
                      PolicyLossConfig())
    assert math.isfinite(out.loss_sum.item())
    assert out.loss_sum.item() == pytest.approx(math.exp(20.0), rel=1e-5)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_aggregation_modes_match_formulas(mode):
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [7.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # last row: no tokens
    num, den = aggregate(x, mask, mode)
    expected = {
        "token-mean": (1 + 2 + 3 + 4 + 5) / 5,
        "seq-mean-token-mean": ((1 + 2 + 3) / 3 + (4 + 5) / 2) / 2,
        "seq-mean-token-sum": ((1 + 2 + 3) + (4 + 5)) / 2,
    }[mode]
    assert (num / den).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("splits", [[1, 4], [2, 2, 1], [1, 1, 1, 1, 1]], ids=["1+4", "2+2+1", "5x1"])
def test_any_micro_batch_split_gives_the_same_loss_and_gradient(mode, splits):
    logp, old, adv, mask = random_batch(1)
    cfg = PolicyLossConfig(agg_mode=mode)
    full = policy_loss(logp, old, adv, mask, cfg)
    (full.loss_sum / full.denominator).backward()
    grad_full = logp.grad.clone()
    logp.grad = None

    parts, start = [], 0
    for n in splits:
        sl = slice(start, start + n)
        parts.append(policy_loss(logp[sl], old[sl], adv[sl], mask[sl], cfg))
        start += n
    num = sum(p.loss_sum for p in parts)
    den = sum(p.denominator for p in parts)
    (num / den).backward()
    assert (num / den).item() == pytest.approx((full.loss_sum / full.denominator).item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, grad_full, rtol=1e-12, atol=1e-14)


def test_token_mean_weights_tokens_not_sequences():
    # One long and one short sequence with opposite per-token losses: token-mean is dominated by the
    # long one (DAPO's point), seq-mean-token-mean averages the two sequence means equally.
    x = torch.tensor([[1.0] * 9 + [0.0], [-1.0] + [0.0] * 9])
    mask = torch.tensor([[1.0] * 9 + [0.0], [1.0] + [0.0] * 9])
    tn, td = aggregate(x, mask, "token-mean")
    sn, sd = aggregate(x, mask, "seq-mean-token-mean")
    assert (tn / td).item() == pytest.approx(0.8)
    assert (sn / sd).item() == pytest.approx(0.0)


def test_metrics_are_token_sums_that_reduce_exactly():
    logp, old, adv, mask = random_batch(2)
    ent = torch.rand_like(old)
    a = policy_loss(logp[:2], old[:2], adv[:2], mask[:2], PolicyLossConfig(), entropy=ent[:2])
    b = policy_loss(logp[2:], old[2:], adv[2:], mask[2:], PolicyLossConfig(), entropy=ent[2:])
    merged = reduce_metrics([a.metrics, b.metrics])
    assert merged["tokens"] == mask.sum().item()
    assert merged["entropy"] == pytest.approx(((ent * mask).sum() / mask.sum()).item())
    assert merged["approx_kl"] == pytest.approx((((old - logp) * mask).sum() / mask.sum()).item())


def test_bad_shapes_and_config_are_rejected():
    with pytest.raises(ValueError, match="same"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3),
                    PolicyLossConfig())
    with pytest.raises(ValueError, match="--clip-ratio-c"):
        PolicyLossConfig(dual_clip_c=0.5)
    with pytest.raises(ValueError, match="--loss-agg-mode"):
        PolicyLossConfig(agg_mode="mean")


def _ratio_grid() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log pi_theta, log pi_old [2, 9] and advantages [2]: one row with A = +0.7, one with A = -1.3, each over
    ratios on both sides of 1 - eps_high, 1 - eps_low, 1, 1 + eps_low, 1 + eps_high (0.2 / 0.28) and past the
    dual-clip cap c = 3 (fp64, exact ratios up to rounding)."""
    ratios = torch.tensor([0.5, 0.71, 0.75, 0.85, 1.0, 1.1, 1.25, 1.3, 4.0], dtype=torch.float64)
    old = torch.full((2, ratios.numel()), -1.5, dtype=torch.float64)
    logp = (old + ratios.log()).requires_grad_(True)
    return logp, old, torch.tensor([0.7, -1.3], dtype=torch.float64)


@pytest.mark.parametrize("dual_c", [None, 3.0], ids=["no-dual-clip", "dual-clip-3"])
def test_both_advantage_signs_match_the_formula_token_by_token(dual_c):
    """Eq. 10 with the dual clip for A < 0 only, per token, on a row of each advantage sign; the formula tests above
    draw advantages at random, and seed 0 happens to draw only negative ones, so a dual clip applied to A > 0 (or
    A > 0 handled like A < 0) went unseen. Also the gradient: -A r where the token's term is unclipped, 0 where
    clipped or capped."""
    logp, old, adv = _ratio_grid()
    out = policy_loss(logp, old, adv, torch.ones_like(old), PolicyLossConfig(dual_clip_c=dual_c))
    out.loss_sum.backward()
    for b in range(2):
        for t in range(logp.shape[1]):
            lp, o, a = logp[b, t].item(), old[b, t].item(), adv[b].item()
            want = reference_token_loss(lp, o, a, 0.2, 0.28, dual_c)
            single = policy_loss(logp[b:b + 1, t:t + 1].detach(), old[b:b + 1, t:t + 1], adv[b:b + 1],
                                 torch.ones(1, 1, dtype=torch.float64), PolicyLossConfig(dual_clip_c=dual_c))
            assert single.loss_sum.item() == pytest.approx(want, rel=1e-12), (b, t)
            r = math.exp(lp - o)
            live = want == pytest.approx(-a * r, rel=1e-12) and (1 - 0.2 < r < 1 + 0.28 or (a > 0) == (r < 1))
            assert logp.grad[b, t].item() == pytest.approx(-a * r if live else 0.0, abs=1e-12), (b, t)


def test_clip_fractions_count_each_side_at_its_own_eps():
    """clipfrac_high counts A > 0 tokens with r > 1 + eps_high, clipfrac_low A < 0 tokens with r < 1 - eps_low:
    r = 0.75 (between 1 - eps_high and 1 - eps_low) is clipped low, r = 1.25 (between 1 + eps_low and 1 + eps_high)
    is not clipped high."""
    logp, old, adv = _ratio_grid()
    out = policy_loss(logp, old, adv, torch.ones_like(old), PolicyLossConfig())
    assert out.metrics["clipfrac_high"].item() == 2  # A > 0 row: 1.3, 4.0
    assert out.metrics["clipfrac_low"].item() == 3  # A < 0 row: 0.5, 0.71, 0.75


def test_bf16_log_probs_are_computed_in_fp32():
    """bf16 log-probs (a bf16 model's) enter the ratio in fp32: the loss equals the formula on the same bf16 values
    in fp64 to fp32 precision (rel 1e-6 against bf16's 2^-8 = 3.9e-3 ratio steps), and comes back fp32."""
    g = torch.Generator().manual_seed(1)
    old = (-torch.rand(4, 6, generator=g) * 3).bfloat16()
    logp = (old.float() + torch.randn(4, 6, generator=g) * 0.05).bfloat16()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = policy_loss(logp, old, adv, torch.ones(4, 6), PolicyLossConfig())
    assert out.loss_sum.dtype == torch.float32
    want = sum(reference_token_loss(logp[b, t].item(), old[b, t].item(), adv[b].item(), 0.2, 0.28)
               for b in range(4) for t in range(6))
    assert out.loss_sum.item() == pytest.approx(want, rel=1e-6)


def test_old_log_probs_and_advantages_get_no_gradient():
    """pi_old and A are constants of the objective (the docstring's 'no gradient'): a caller's tensors that require
    grad still get none from the loss."""
    logp, old, adv = _ratio_grid()
    old.requires_grad_(True)
    adv.requires_grad_(True)
    policy_loss(logp, old, adv, torch.ones_like(old), PolicyLossConfig()).loss_sum.backward()
    assert old.grad is None and adv.grad is None and logp.grad is not None


@pytest.mark.parametrize("eps_low", [1.01, -0.01])
def test_eps_low_outside_0_1_is_refused(eps_low):
    """A lower clip 1 - eps_low must not go below 0 (--clip-ratio-low in [0, 1]; 1 is no lower clip, CISPO's
    paper)."""
    with pytest.raises(ValueError, match=r"--clip-ratio-low\) must be in \[0, 1\]"):
        PolicyLossConfig(eps_low=eps_low)
    assert PolicyLossConfig(eps_low=1.0).eps_low == 1.0
