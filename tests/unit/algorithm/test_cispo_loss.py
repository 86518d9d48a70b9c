"""--policy-loss cispo against MiniMax-M1's Eq. 4-5 (arXiv 2506.13585) written out in plain Python: the value, the
gradient (every token keeps sg(r^) A d log pi, clipped or not; PPO's is 0 where clipped), the paper's own form
-sg(r^) A log pi having the same gradient, no lower bound at --clip-ratio-low 1, and the flags it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm.registry import policy_loss_config
from megatron_dapo.errors import UserError
from tests.unit.algorithm.test_algorithm_losses import random_batch, rows


def clipped_weight(r: float, eps_low: float, eps_high: float) -> float:
    return min(max(r, 1 - eps_low), 1 + eps_high)


def run(logp, old, adv, mask, **fields):
    cfg = policy_loss_config("cispo", **fields)
    return cfg.fn(logp, old, adv, mask, cfg)


@pytest.mark.parametrize("eps", [(0.2, 0.28), (1.0, 0.28), (0.5, 2.0)], ids=["dapo-range", "no-lower", "wide"])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_and_gradient_are_the_papers(eps, seed):
    """Value: 1/N sum -r^_it A_it; gradient w.r.t. log pi_it: -r^_it A_it / N on every loss token."""
    eps_low, eps_high = eps
    logp, old, adv, mask = random_batch(seed)
    out = run(logp, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    (out.loss_sum / out.denominator).backward()
    lp, od, m, a = logp.tolist(), old.tolist(), rows(mask), adv.tolist()
    n = sum(len(t) for t in m)
    value, grad, clipped = 0.0, torch.zeros_like(logp), 0
    for i, tokens in enumerate(m):
        for t in tokens:
            r = math.exp(lp[i][t] - od[i][t])
            w = clipped_weight(r, eps_low, eps_high)
            clipped += w != r
            value += -w * a[i] / n
            grad[i, t] = -w * a[i] / n
    assert clipped > 0 or eps == (0.5, 2.0), "the batch must exercise the clip"
    assert out.denominator.item() == n
    assert (out.loss_sum / out.denominator).item() == pytest.approx(value, rel=1e-12)
    torch.testing.assert_close(logp.grad, grad, rtol=1e-12, atol=1e-14)


def test_the_papers_form_has_the_same_gradient_and_clipped_tokens_keep_theirs():
    """-sg(r^) A log pi (Eq. 4 as written) gives the same gradient; DAPO's loss gives 0 to the clipped tokens that
    CISPO keeps."""
    logp, old, adv, mask = random_batch(3)
    out = run(logp, old, adv, mask)
    (out.loss_sum / out.denominator).backward()
    ours, logp.grad = logp.grad.clone(), None
    r = torch.exp(logp.detach() - old)
    weight = torch.clamp(r, 0.8, 1.28)
    paper = (-(weight * adv[:, None]) * logp * mask).sum() / mask.sum()
    paper.backward()
    torch.testing.assert_close(ours, logp.grad, rtol=1e-12, atol=1e-14)
    cfg = policy_loss_config("dapo")
    logp.grad = None
    dapo = cfg.fn(logp, old, adv, mask, cfg)
    (dapo.loss_sum / dapo.denominator).backward()
    clipped = ((r > 1.28) & (adv[:, None] > 0) | (r < 0.8) & (adv[:, None] < 0)) & (mask > 0)
    assert clipped.any()
    assert torch.all(logp.grad[clipped] == 0) and torch.all(ours[clipped] != 0)


def test_clip_fractions_count_weights_clipped_whatever_the_advantage():
    logp = torch.log(torch.tensor([[0.5, 1.0, 1.5, 2.0]], dtype=torch.float64)).requires_grad_(True)
    old, mask = torch.zeros(1, 4, dtype=torch.float64), torch.ones(1, 4, dtype=torch.float64)
    for adv in (1.0, -1.0):
        out = run(logp, old, torch.tensor([adv], dtype=torch.float64), mask)
        assert out.metrics["clipfrac_high"].item() == 2  # 1.5 and 2.0 above 1.28
        assert out.metrics["clipfrac_low"].item() == 1  # 0.5 below 0.8
        assert out.metrics["clipfrac_dual"].item() == 0
        assert out.metrics["pg_loss"].item() == pytest.approx(-adv * (0.8 + 1.0 + 1.28 + 1.28), rel=1e-12)
    out = run(logp, old, torch.tensor([1.0], dtype=torch.float64), mask, eps_low=1.0)  # the paper: no lower bound
    assert out.metrics["clipfrac_low"].item() == 0
    assert out.metrics["pg_loss"].item() == pytest.approx(-(0.5 + 1.0 + 1.28 + 1.28), rel=1e-12)


def test_the_dual_clip_is_refused_and_the_aggregation_follows_the_flag():
    with pytest.raises(UserError, match=r"--clip-ratio-c 3.0 does not apply to --policy-loss cispo"):
        policy_loss_config("cispo", dual_clip_c=3.0)
    logp, old, adv, mask = random_batch(5)
    seq = run(logp, old, adv, mask, agg_mode="seq-mean-token-mean")
    assert seq.denominator.item() == 5  # responses
