"""The KL estimators (algorithm/kl.py) against Schulman's and GRPO's formulas written out in floats, their gradients
in closed form, the aggregation that shares the policy loss's denominator, the reward penalty's advantages
(--kl-in-reward) against GRPO's and Dr. GRPO's normalisation written out, and the flags' refusals."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.actor.reference import resolve_reference
from megatron_dapo.algorithm.advantages import dr_grpo_advantages, grpo_advantages
from megatron_dapo.algorithm.kl import (
    KLConfig,
    kl_agg_mode,
    kl_estimate,
    kl_loss_term,
    kl_penalized_advantages,
    kl_response_sum,
)
from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError

D = [-3.0, -0.5, 0.0, 0.2, 2.5]
"""log pi_theta - log pi_ref at five tokens."""


def _pair(d: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    ref = torch.tensor([-1.0, -2.0, -0.3, -4.0, -0.7], dtype=torch.float64)
    return (ref + torch.tensor(d, dtype=torch.float64)).requires_grad_(True), ref


@pytest.mark.parametrize("estimator, value, grad", [
    ("k1", lambda d: d, lambda d: 1.0),
    ("k2", lambda d: d * d / 2, lambda d: d),
    # GRPO Eq. 4: pi_ref / pi_theta - log(pi_ref / pi_theta) - 1, with pi_ref / pi_theta = exp(-d)
    ("k3", lambda d: math.exp(-d) - (-d) - 1, lambda d: 1 - math.exp(-d)),
])
def test_each_estimator_and_its_gradient_are_the_formula(estimator, value, grad):
    logp, ref = _pair(D)
    est = kl_estimate(logp, ref, estimator)
    assert est.tolist() == pytest.approx([value(d) for d in D], rel=1e-12, abs=1e-15)
    est.sum().backward()
    assert logp.grad.tolist() == pytest.approx([grad(d) for d in D], rel=1e-12, abs=1e-15)


def test_k2_and_k3_are_non_negative_and_zero_only_at_the_reference():
    logp, ref = _pair(D)
    for estimator in ("k2", "k3"):
        est = kl_estimate(logp, ref, estimator)
        assert (est >= 0).all() and est[2] == 0 and (est[[0, 1, 3, 4]] > 0).all()


def test_k1_and_k3_are_unbiased_for_the_kl_of_two_categoricals():
    """Sampled from pi_theta, E[k1] = E[k3] = KL(pi_theta || pi_ref) exactly (weights = pi_theta); k2 is biased."""
    theta = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    ref = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)
    kl = float((theta * (theta / ref).log()).sum())
    for estimator in ("k1", "k3"):
        expectation = float((theta * kl_estimate(theta.log(), ref.log(), estimator)).sum())
        assert expectation == pytest.approx(kl, rel=1e-12)
    assert float((theta * kl_estimate(theta.log(), ref.log(), "k2")).sum()) != pytest.approx(kl, rel=1e-3)


def test_the_term_shares_the_losss_denominator():
    logp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-0.5, 0.0, 1.0], [0.3, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    k1 = [[0.5, 0.0, -1.0], [-0.3, 0.0, 0.0]]
    num, den, total = kl_loss_term(logp, ref, mask, KLConfig(coef=2.0, estimator="k1"), "token-mean")
    assert den.item() == 4 and total.item() == pytest.approx(-0.8)
    assert num.item() == pytest.approx(2.0 * -0.8)
    num, den, _ = kl_loss_term(logp, ref, mask, KLConfig(coef=2.0, estimator="k1"), "seq-mean-token-mean")
    assert den.item() == 2 and num.item() == pytest.approx(2.0 * (sum(k1[0]) / 3 + k1[1][0] / 1))
    assert kl_agg_mode(True, None) == "token-mean" and kl_agg_mode(False, None) == "seq-mean-token-mean"
    assert kl_agg_mode(False, "seq-mean-token-sum") == "seq-mean-token-sum"


def test_a_log_ratio_far_out_is_clamped_not_overflowed():
    est = kl_estimate(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(est).all() and est.item() == pytest.approx(math.exp(20) - 21, rel=1e-6)


# --kl-in-reward: three responses of group 0 (one without tokens), two of group 1; per token (log pi_old, log pi_ref,
# loss mask); group 1's second response is overlong-filtered (mask 0)
REWARDS = [1.0, -1.0, 0.5, 1.0, -1.0]
GROUPS = [0, 0, 0, 1, 1]
TOKENS = [
    [(-1.0, -1.2, 1.0), (-0.3, -0.6, 1.0)],
    [],
    [(-2.0, -2.0, 1.0), (-0.5, -1.5, 1.0), (-4.0, -3.0, 1.0)],
    [(-0.7, -0.2, 1.0)],
    [(-1.0, -3.0, 0.0), (-0.2, -0.4, 0.0)],
]


def _k(d: float, estimator: str) -> float:
    return {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) + d - 1}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo"])
def test_the_reward_penalty_recomputes_the_advantages_of_the_penalised_rewards(estimator, advantage):
    """r_i' = r_i - beta sum_t m_t k(log pi_old - log pi_ref), then each group's (r' - mean) / (std + 1e-6) (unbiased
    std; dr_grpo: r' - mean), all written out in Python floats; the response without tokens keeps r and counts in
    its group, the masked one is not penalised."""
    import statistics

    beta = 0.3
    sums = []
    for tokens in TOKENS:
        sums.append(kl_response_sum(torch.tensor([o for o, _, _ in tokens]), torch.tensor([r for _, r, _ in tokens]),
                                    torch.tensor([m for _, _, m in tokens]), estimator))
        assert sums[-1] == pytest.approx(sum(m * _k(o - r, estimator) for o, r, m in tokens), rel=1e-6, abs=1e-7)
    assert sums[1] == 0.0 and sums[4] == 0.0
    penalised = [r - beta * s for r, s in zip(REWARDS, sums, strict=True)]
    expected = []
    for i, g in enumerate(GROUPS):
        group = [p for p, h in zip(penalised, GROUPS, strict=True) if h == g]
        centred = penalised[i] - statistics.fmean(group)
        expected.append(centred / (statistics.stdev(group) + 1e-6) if advantage == "grpo" else centred)
    fn = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages}[advantage]
    got = kl_penalized_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS,
                                  torch.tensor(sums, dtype=torch.float64), beta, fn)
    assert got.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    unpenalised = fn(torch.tensor(REWARDS, dtype=torch.float64), GROUPS)
    assert not torch.allclose(got, unpenalised, atol=1e-3)  # the penalty moved them
    assert kl_penalized_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUPS, torch.zeros(5), beta,
                                   fn).tolist() == unpenalised.tolist()  # no KL: the estimator's own, exactly


def test_a_response_that_moved_away_from_the_reference_loses_advantage_in_its_group():
    """Two responses with the same reward, one with a KL of 2: it gets the lower advantage (the penalty's sign)."""
    adv = kl_penalized_advantages(torch.tensor([1.0, 1.0]), [0, 0], torch.tensor([0.0, 2.0]), 0.1, dr_grpo_advantages)
    assert adv.tolist() == pytest.approx([0.1, -0.1])


def _configs(*flags: str):
    from megatron_dapo.startup import build_configs

    return build_configs(build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps",
                                                    "2", *flags]))


def test_flags_build_the_config_and_refuse_what_has_no_reference():
    actor, _, _ = _configs("--ref-load", "initial", "--kl-coef", "0.01", "--kl-estimator", "k2")
    assert actor.kl == KLConfig(coef=0.01, estimator="k2") and actor.kl_agg_mode == "token-mean"
    assert _configs("--ref-load", "initial")[0].kl == KLConfig(coef=0.0, estimator="k3")  # train/kl logged only
    assert _configs()[0].kl is None
    with pytest.raises(UserError, match="--kl-coef need a reference model: --ref-load initial"):
        _configs("--kl-coef", "0.1")
    with pytest.raises(UserError, match="--kl-estimator need a reference model"):
        _configs("--kl-estimator", "k1")
    with pytest.raises((UserError, ValueError), match="--kl-coef"):
        _configs("--ref-load", "initial", "--kl-coef", "-1")
    with pytest.raises(UserError, match="metric 'kl'"):
        from megatron_dapo.algorithm.registry import policy_loss_config

        policy_loss_config("tests.losses:kl_named_loss")


def test_kl_in_reward_moves_beta_from_the_loss_to_the_reward_and_refuses_what_it_cannot_do():
    actor, _, trainer = _configs("--ref-load", "initial", "--kl-coef", "0.5", "--kl-estimator", "k1", "--kl-in-reward")
    assert actor.kl == KLConfig(coef=0.0, estimator="k1")  # no loss term; train/kl still logged
    assert trainer.kl_reward == KLConfig(coef=0.5, estimator="k1")
    assert _configs("--ref-load", "initial", "--kl-coef", "0.5")[2].kl_reward is None
    with pytest.raises(UserError, match="--kl-in-reward need a reference model: --ref-load"):
        _configs("--kl-in-reward")
    with pytest.raises(UserError, match="--kl-coef and --kl-in-reward need a reference model"):
        _configs("--kl-in-reward", "--kl-coef", "0.5")
    # the configs' ValueErrors, which check_flags makes the run's one-line UserError
    with pytest.raises(ValueError, match="--kl-in-reward subtracts --kl-coef x each response's KL from its reward: "
                                         "--kl-coef must be > 0, got 0.0"):
        _configs("--ref-load", "initial", "--kl-in-reward")
    with pytest.raises(ValueError, match=r"--kl-coef\) must be a finite number >= 0, got -1"):
        _configs("--ref-load", "initial", "--kl-in-reward", "--kl-coef", "-1")
    with pytest.raises(ValueError, match="--kl-in-reward penalises the verifier's reward, whose advantage "
                                         "--distill-only sets to 0"):
        _configs("--ref-load", "initial", "--kl-in-reward", "--kl-coef", "0.5", "--teacher-load", "t",
                 "--distill-coef", "1", "--distill-only", "--no-dynamic-sampling")
    _configs("--ref-load", "initial", "--kl-in-reward", "--kl-coef", "0.5", "--teacher-load", "t", "--distill-coef",
             "1")  # with the verifier's advantage, distillation adds to the penalised one


def test_initial_resolves_to_the_weights_the_run_started_from(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    dist = tmp_path / "dist"
    dist.mkdir()
    assert resolve_reference(None, hf_checkpoint=str(hf), initial_checkpoint=None).kind is None
    start = resolve_reference("initial", hf_checkpoint=str(hf), initial_checkpoint=None)
    assert (start.kind, start.path) == ("hf", str(hf.resolve()))
    converted = resolve_reference("initial", hf_checkpoint=str(hf), initial_checkpoint=str(dist))
    assert (converted.kind, converted.path) == ("torch_dist", str(dist.resolve()))
    assert resolve_reference(str(dist), hf_checkpoint=str(hf), initial_checkpoint=None).kind == "torch_dist"
    with pytest.raises(UserError, match="--ref-load .*nowhere: not a directory"):
        resolve_reference(str(tmp_path / "nowhere"), hf_checkpoint=str(hf), initial_checkpoint=None)
    start.check_state(start.state_dict())  # the same source: accepted
    with pytest.raises(UserError, match=r"trained against torch_dist .*\(--ref-load initial\), this run would use "
                                        r"hf .*\(--ref-load initial\)"):
        start.check_state(converted.state_dict())
    with pytest.raises(UserError, match="this run would use no reference model"):
        resolve_reference(None, hf_checkpoint=str(hf), initial_checkpoint=None).check_state(start.state_dict())
