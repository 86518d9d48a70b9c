"""--policy-loss decoupled (algorithm/decoupled.py) against AReaL's decoupled PPO objective written out token by
token (Fu et al. 2025, arXiv 2505.24298): on a hand-computed 2 x 3 batch (value, gradient, cap, metrics), on random
batches in plain Python, and against --use-tis (equal below the TIS cap, different above it); the trainer's side:
the raw behaviour weights it passes, and the flags that exclude each other. The registry's contract tests
(tests/unit/algorithm/test_algorithm_losses.py) run on it by its registration."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from megatron_dapo.algorithm.decoupled import DECOUPLED_METRICS, decoupled_loss
from megatron_dapo.algorithm.loss import POLICY_LOSSES, takes_behaviour_weights
from megatron_dapo.algorithm.mismatch import OffPolicyConfig, off_policy_correction
from megatron_dapo.algorithm.registry import policy_loss_config
from megatron_dapo.errors import UserError

EPS_LOW, EPS_HIGH = 0.2, 0.28


def decoupled_objective(theta, prox, behav, adv, mask, cap=None) -> float:
    """The paper's loss (negated objective) in plain floats from per-token probabilities:
    -1/sum|o_i| * sum_i sum_t w_it * min(u_it A_i, clip(u_it, 1 - eps_low, 1 + eps_high) A_i),
    u = pi_theta / pi_prox, w = pi_prox / pi_behav (0 when above `cap`)."""
    total, tokens = 0.0, 0
    for i in range(len(theta)):
        for t in range(len(theta[i])):
            if not mask[i][t]:
                continue
            u, w, a = theta[i][t] / prox[i][t], prox[i][t] / behav[i][t], adv[i]
            if cap is not None and w > cap:
                w = 0.0
            total += w * min(u * a, min(max(u, 1 - EPS_LOW), 1 + EPS_HIGH) * a)
            tokens += 1
    return -total / tokens


# pi_theta, pi_prox (the actor before the step) and pi_behav (the rollout) of each token; row 1's last is padding
THETA = [[0.5, 0.6, 0.3], [0.2, 0.5, 0.5]]
PROX = [[0.5, 0.4, 0.4], [0.4, 0.5, 0.5]]
BEHAV = [[0.25, 0.4, 0.8], [0.1, 0.5, 0.5]]
ADV = [1.0, -1.0]
MASK = [[1, 1, 1], [1, 0, 0]]
# token by token: u = 1, 1.5, 0.75 | 0.5;  w = 2, 1, 0.5 | 4;
#   A = +1: -2 * min(1, 1) = -2;  -1 * min(1.5, 1.28) = -1.28;  -0.5 * min(0.75, 0.8) = -0.375
#   A = -1: -4 * min(-0.5, -0.8) = +3.2
# loss = (-2 - 1.28 - 0.375 + 3.2) / 4 = -0.11375;  with cap 3 the last weight is 0: -3.655 / 4 = -0.91375


def tensors():
    lg = lambda p: torch.tensor(p, dtype=torch.float64).log()  # noqa: E731
    logp = lg(THETA).requires_grad_(True)
    old, rollout = lg(PROX), lg(BEHAV)
    return logp, old, rollout, torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def weights(old, rollout, mask, **cfg):
    """What the trainer hands the loss (Trainer._mismatch -> off_policy_correction)."""
    return off_policy_correction(old, rollout, mask, OffPolicyConfig(behaviour_weights=True, **cfg)).is_weights


def test_registered_as_a_behaviour_weight_loss():
    assert POLICY_LOSSES.resolve("decoupled") is decoupled_loss
    assert takes_behaviour_weights(decoupled_loss)
    assert not any(takes_behaviour_weights(POLICY_LOSSES.resolve(n)) for n in ("dapo", "grpo", "dr_grpo", "gspo"))
    assert policy_loss_config("decoupled").metrics == DECOUPLED_METRICS


@pytest.mark.parametrize("cap, expected", [(None, -0.11375), (3.0, -0.91375)], ids=["uncapped", "cap-3"])
def test_hand_computed_batch(cap, expected):
    logp, old, rollout, adv, mask = tensors()
    assert decoupled_objective(THETA, PROX, BEHAV, ADV, MASK, cap) == pytest.approx(expected, rel=1e-12)
    cfg = policy_loss_config("decoupled", behav_weight_cap=cap)
    out = cfg.fn(logp, old, adv, mask, cfg, is_weights=weights(old, rollout, mask))
    assert (out.loss_sum / out.denominator).item() == pytest.approx(expected, rel=1e-12)
    assert out.denominator.item() == 4
    assert out.metrics["behav_weight"].item() == pytest.approx(3.5 if cap else 7.5, rel=1e-12)
    assert out.metrics["behav_capped"].item() == (1 if cap else 0)
    # d loss / d log pi_theta = -w A u / 4 where the min takes the unclipped branch, 0 where clipped
    (out.loss_sum / out.denominator).backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.5, 0.0, -0.09375, 0.0, 0.0, 0.0], abs=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [None, 1.5], ids=["uncapped", "cap-1.5"])
def test_random_batches_match_the_written_out_objective(seed, cap):
    g = torch.Generator().manual_seed(seed)
    prox = torch.rand(4, 6, generator=g, dtype=torch.float64) * 0.9 + 0.05
    theta = (prox * torch.exp(torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.3)).clamp(max=1.0)
    behav = (prox * torch.exp(torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5)).clamp(max=1.0)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = (torch.rand(4, 6, generator=g) > 0.2).double()
    mask[:, 0] = 1.0
    old = prox.log()
    cfg = policy_loss_config("decoupled", behav_weight_cap=cap)
    out = cfg.fn(theta.log(), old, adv, mask, cfg, is_weights=weights(old, behav.log(), mask))
    expected = decoupled_objective(theta.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), cap)
    assert (out.loss_sum / out.denominator).item() == pytest.approx(expected, rel=1e-10)


def test_equals_tis_below_the_tis_cap_and_differs_above_it():
    """docs/ALGORITHMS.md: dapo with --use-tis is the decoupled objective while every weight is under --tis-cap;
    above it TIS truncates to C where decoupled keeps w (or, capped, drops the token)."""
    logp, old, rollout, adv, mask = tensors()
    dec_cfg, dapo_cfg = policy_loss_config("decoupled"), policy_loss_config("dapo")
    decoupled = dec_cfg.fn(logp, old, adv, mask, dec_cfg, is_weights=weights(old, rollout, mask))
    for cap, same in ((5.0, True), (2.0, False)):  # w = 2, 1, 0.5, 4: a cap of 2 truncates the 4
        tis = off_policy_correction(old, rollout, mask, OffPolicyConfig(use_tis=True, tis_cap=cap)).is_weights
        out = dapo_cfg.fn(logp, old, adv, mask, dapo_cfg, is_weights=tis)
        assert (out.loss_sum.item() == pytest.approx(decoupled.loss_sum.item(), rel=1e-12)) is same
    # TIS C = 2 gives the last token 2 * 0.8 = 1.6 instead of 3.2: (-3.655 + 1.6) / 4
    assert (out.loss_sum / out.denominator).item() == pytest.approx(-0.51375, rel=1e-12)


def test_trainer_passes_the_raw_ratio_and_composes_with_mis():
    _, old, rollout, _, mask = tensors()
    w = weights(old, rollout, mask)
    assert w.flatten().tolist() == pytest.approx([2.0, 1.0, 0.5, 4.0, 0.0, 0.0], rel=1e-12)
    corr = off_policy_correction(old, rollout, mask, OffPolicyConfig(behaviour_weights=True, mis_mode="token",
                                                                     mis_threshold=3.0))
    assert corr.loss_mask.tolist() == [[1, 1, 1], [0, 0, 0]]  # MIS drops the w = 4 token, the weights stay raw
    assert corr.is_weights.flatten().tolist() == pytest.approx(w.flatten().tolist(), rel=1e-12)


def test_flags_that_contradict_it_are_refused():
    with pytest.raises(ValueError, match="--use-tis"):
        OffPolicyConfig(use_tis=True, behaviour_weights=True)
    with pytest.raises(UserError, match="--behav-weight-cap"):
        policy_loss_config("dapo", behav_weight_cap=2.0)
    with pytest.raises(ValueError, match="--behav-weight-cap"):
        policy_loss_config("decoupled", behav_weight_cap=1.0)
    with pytest.raises(UserError, match="--loss-agg-mode"):
        policy_loss_config("decoupled", agg_mode="seq-mean-token-mean")


@pytest.mark.parametrize("async_rollout, given, expected", [(1, None, False), (0, None, False), (1, False, False)])
def test_tis_default_is_off_with_the_decoupled_loss(async_rollout, given, expected):
    from megatron_dapo.startup import use_tis

    args = argparse.Namespace(use_tis=given, async_rollout=async_rollout, max_staleness=0, policy_loss="decoupled",
                              use_icepop=False)
    assert use_tis(args, decoupled_loss) is expected
    for depth, k in ((1, 0), (0, 2)):  # one step off, or fully async: TIS on by default with the dapo loss
        assert use_tis(argparse.Namespace(use_tis=None, async_rollout=depth, max_staleness=k, policy_loss="dapo",
                                          use_icepop=False), POLICY_LOSSES.resolve("dapo")) is True
    with pytest.raises(UserError, match="drop --use-tis"):
        use_tis(argparse.Namespace(use_tis=True, async_rollout=async_rollout, max_staleness=0,
                                   policy_loss="decoupled", use_icepop=False), decoupled_loss)


def test_without_weights_it_is_ppo_against_pi_old():
    logp, old, _, adv, mask = tensors()
    cfg, dapo = policy_loss_config("decoupled"), policy_loss_config("dapo")
    a, b = cfg.fn(logp, old, adv, mask, cfg), dapo.fn(logp, old, adv, mask, dapo)
    assert a.loss_sum.item() == pytest.approx(b.loss_sum.item(), rel=1e-12)
    assert a.metrics["behav_weight"].item() == a.metrics["tokens"].item() and not math.isnan(a.loss_sum.item())


def test_the_flags_build_it():
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.startup import build_configs

    base = ["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps", "2", "--async-rollout", "1"]
    actor, _, trainer = build_configs(build_parser().parse_args(
        [*base, "--policy-loss", "decoupled", "--behav-weight-cap", "5"]))
    assert actor.loss.fn is decoupled_loss and actor.loss.behav_weight_cap == 5.0
    assert trainer.off_policy == OffPolicyConfig(use_tis=False, behaviour_weights=True)
    _, _, dapo = build_configs(build_parser().parse_args(base))
    assert dapo.off_policy == OffPolicyConfig(use_tis=True)  # --async-rollout 1's default TIS, unchanged
    with pytest.raises(UserError, match="drop --use-tis"):
        build_configs(build_parser().parse_args([*base, "--policy-loss", "decoupled", "--use-tis"]))
    with pytest.raises(UserError, match="--behav-weight-cap"):
        build_configs(build_parser().parse_args([*base, "--behav-weight-cap", "5"]))
