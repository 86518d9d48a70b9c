"""The policy losses (--policy-loss) against their papers' formulas written out in plain Python (values,
closed-form gradients), and the contract every registered loss keeps, parametrized over the registry so a new
loss gets it by registering: gradient against finite differences, split invariance of (numerator, denominator)
over micro-batches, the metrics it declares (token sums), TIS weights on each token's term."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_dapo.algorithm import dr_grpo_loss, grpo_loss, gspo_loss, policy_loss
from megatron_dapo.algorithm.loss import POLICY_LOSSES, TOKEN_METRICS
from megatron_dapo.algorithm.registry import policy_loss_config

L_MAX = 9
LOSSES = ["dapo", "grpo", "dr_grpo", "gspo"]
"""The losses whose formulas this file writes out (a new loss's formula goes in its own test file)."""
REGISTERED = list(POLICY_LOSSES)
"""Every registered loss: the contract tests run on each."""


def config(name: str, **fields):
    return policy_loss_config(name, max_response_length=L_MAX, **fields)


def random_batch(seed: int, b: int = 5, s: int = 7, token_adv: bool = False):
    """float64 [b, s] log-probs (requires grad), old log-probs, advantages, and a right-padded mask with one
    hole, every row at least one token."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, s, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, s, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(b, s, generator=g, dtype=torch.float64) if token_adv else torch.randn(b, generator=g,
                                                                                              dtype=torch.float64)
    lengths = torch.randint(1, s + 1, (b,), generator=g)
    mask = (torch.arange(s)[None, :] < lengths[:, None]).double()
    mask[0, 0] = 0.0 if lengths[0] > 1 else 1.0  # a masked-out token inside a response
    return logp.requires_grad_(True), old, adv, mask


def rows(mask):
    """Per row, the positions of its loss tokens (plain Python)."""
    return [[t for t in range(mask.shape[1]) if mask[b, t] > 0] for b in range(mask.shape[0])]


def token_term(logp: float, old: float, adv: float, eps_low: float = 0.2, eps_high: float = 0.28) -> float:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = exp(logp - old)."""
    r = math.exp(logp - old)
    return -min(r * adv, min(max(r, 1 - eps_low), 1 + eps_high) * adv)


def written_out(name: str, logp, old, adv, mask) -> float:
    """Each loss's objective (negated), token by token in floats."""
    lp, od, m = logp.tolist(), old.tolist(), rows(mask)
    a = [[x] * logp.shape[1] for x in adv.tolist()] if adv.dim() == 1 else adv.tolist()
    seqs = [i for i in range(len(m)) if m[i]]
    G = len(seqs)
    if name == "dapo":  # DAPO Eq. 8: 1 / sum_i |o_i| * sum_i sum_t
        total = sum(token_term(lp[i][t], od[i][t], a[i][t]) for i in seqs for t in m[i])
        return total / sum(len(m[i]) for i in seqs)
    if name == "grpo":  # GRPO: 1/G sum_i 1/|o_i| sum_t
        return sum(sum(token_term(lp[i][t], od[i][t], a[i][t]) for t in m[i]) / len(m[i]) for i in seqs) / G
    if name == "dr_grpo":  # Dr. GRPO: 1/G sum_i sum_t ... / L_max
        return sum(sum(token_term(lp[i][t], od[i][t], a[i][t]) for t in m[i]) / L_MAX for i in seqs) / G
    if name == "gspo":  # GSPO: 1/G sum_i -min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r_it)
        total = 0.0
        for i in seqs:
            s_i = math.exp(sum(lp[i][t] - od[i][t] for t in m[i]) / len(m[i]))
            total += -min(s_i * a[i][m[i][0]], min(max(s_i, 0.8), 1.28) * a[i][m[i][0]])
        return total / G
    raise AssertionError(name)


def closed_form_grad(name: str, logp, old, adv, mask, eps_low: float = 0.2, eps_high: float = 0.28) -> torch.Tensor:
    """d loss / d logp_it of each objective, differentiated by hand: the token term's derivative is
    -A r where the min picks the unclipped branch (0 where clipped), times the aggregation weight."""
    lp, od, m = logp.tolist(), old.tolist(), rows(mask)
    a = [[x] * logp.shape[1] for x in adv.tolist()] if adv.dim() == 1 else adv.tolist()
    seqs = [i for i in range(len(m)) if m[i]]
    G, N = len(seqs), sum(len(m[i]) for i in seqs)
    grad = torch.zeros_like(logp)
    for i in seqs:
        if name == "gspo":  # d s_i / d logp_it = s_i / |y_i|, the same for every token of the response
            s_i = math.exp(sum(lp[i][t] - od[i][t] for t in m[i]) / len(m[i]))
            A = a[i][m[i][0]]
            clipped = (A > 0 and s_i > 1 + eps_high) or (A < 0 and s_i < 1 - eps_low)
            for t in m[i]:
                grad[i, t] = 0.0 if clipped else -A * s_i / len(m[i]) / G
            continue
        weight = {"dapo": 1 / N, "grpo": 1 / (G * len(m[i])), "dr_grpo": 1 / (G * L_MAX)}[name]
        for t in m[i]:
            r, A = math.exp(lp[i][t] - od[i][t]), a[i][t]
            clipped = (A > 0 and r > 1 + eps_high) or (A < 0 and r < 1 - eps_low)
            grad[i, t] = 0.0 if clipped else -A * r * weight
    return grad


def run(name: str, logp, old, adv, mask, **fields):
    cfg = config(name, **fields)
    return cfg.fn(logp, old, adv, mask, cfg)


def test_the_registry_maps_names_to_the_functions():
    assert [config(n).fn for n in LOSSES] == [policy_loss, grpo_loss, dr_grpo_loss, gspo_loss]
    assert [n for n in REGISTERED if n in LOSSES] == LOSSES  # registered where they are defined, in this order


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_matches_the_papers_formula(name, seed):
    logp, old, adv, mask = random_batch(seed)
    out = run(name, logp, old, adv, mask)
    assert (out.loss_sum / out.denominator).item() == pytest.approx(written_out(name, logp, old, adv, mask),
                                                                    rel=1e-10, abs=1e-12)
    counts = {"dapo": mask.sum().item(), "grpo": 5, "dr_grpo": 5, "gspo": 5}  # tokens, or responses
    assert out.denominator.item() == counts[name]


def test_small_explicit_batch_in_closed_form():
    # two responses: [r = 1.1, 1.5] with A = +1 and [r = 0.5] with A = -2 (L_max = 9)
    logp = torch.tensor([[math.log(1.1), math.log(1.5)], [math.log(0.5), 0.0]], dtype=torch.float64)
    old, adv = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([1.0, -2.0], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    t = [-1.1, -1.28, 2 * 0.8]  # per-token terms: unclipped, clipped at 1.28, clipped at 0.8 (A < 0)
    s1 = math.sqrt(1.1 * 1.5)  # GSPO: geometric mean 1.2845 > 1.28 -> clipped; s2 = 0.5 -> clipped at 0.8
    expected = {
        "dapo": sum(t) / 3,
        "grpo": ((t[0] + t[1]) / 2 + t[2]) / 2,
        "dr_grpo": ((t[0] + t[1]) / 9 + t[2] / 9) / 2,
        "gspo": (-min(s1, 1.28) + 2 * 0.8) / 2,
    }
    for name, want in expected.items():
        out = run(name, logp, old, adv, mask)
        assert (out.loss_sum / out.denominator).item() == pytest.approx(want, rel=1e-12), name


@pytest.mark.parametrize("name, token_adv", [(n, False) for n in LOSSES] + [(n, True) for n in LOSSES[:3]],
                         ids=[f"{n}-seq-adv" for n in LOSSES] + [f"{n}-token-adv" for n in LOSSES[:3]])
def test_gradient_matches_the_formulas_derivative(name, token_adv):
    """(GSPO's sequence-level formula has one advantage per response; GSPO-token's per-token case is below.)"""
    logp, old, adv, mask = random_batch(3, token_adv=token_adv)
    out = run(name, logp, old, adv, mask)
    (out.loss_sum / out.denominator).backward()
    torch.testing.assert_close(logp.grad, closed_form_grad(name, logp.detach(), old, adv, mask), rtol=1e-10,
                               atol=1e-12)


# ---- the contract of every registered loss -------------------------------------------------------------------
@pytest.mark.parametrize("name", REGISTERED)
def test_gradient_matches_finite_differences(name):
    """(CISPO keeps the gradient of a token whose weight it clipped, where its value is flat: by design not the
    value's derivative there, so it is checked here with a range nothing leaves, and clipped in test_cispo_loss.)"""
    logp, old, adv, mask = random_batch(4, b=3, s=4)
    cfg = config(name, **({"eps_low": 1.0, "eps_high": 100.0} if name == "cispo" else {}))

    def f(x):
        out = cfg.fn(x, old, adv, mask, cfg)
        return out.loss_sum / out.denominator

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-7)


def test_gspo_token_equals_sequence_level_gspo_in_value_and_gradient():
    """GSPO Sec. 4.3: with one advantage per response, GSPO-token has GSPO's value and gradient. The reference
    differentiates the sequence-level objective itself (s_i from the whole response's likelihood ratio)."""
    for eps in [(0.2, 0.28), (3e-4, 4e-4)]:  # the DAPO defaults, and the GSPO paper's (clips most responses)
        logp, old, adv, mask = random_batch(5, b=6, s=9)
        out = run("gspo", logp, old, adv, mask, eps_low=eps[0], eps_high=eps[1])
        (out.loss_sum / out.denominator).backward()
        grad, logp.grad = logp.grad.clone(), None
        lengths = mask.sum(-1)
        s = torch.exp(((logp - old) * mask).sum(-1) / lengths)  # (pi_theta(y) / pi_old(y)) ^ (1 / |y|)
        ref = -torch.minimum(s * adv, torch.clamp(s, 1 - eps[0], 1 + eps[1]) * adv).mean()
        ref.backward()
        assert (out.loss_sum / out.denominator).item() == pytest.approx(ref.item(), rel=1e-12)
        torch.testing.assert_close(grad, logp.grad, rtol=1e-12, atol=1e-14)


def test_gspo_token_takes_per_token_advantages():
    """GSPO-token (Sec. 4.3): s_it has the value s_i, and token t's term is weighted by its own A_it."""
    logp, old, adv, mask = random_batch(6, token_adv=True)
    out = run("gspo", logp, old, adv, mask)
    (out.loss_sum / out.denominator).backward()
    m, lp, od, a = rows(mask), logp.tolist(), old.tolist(), adv.tolist()
    value, grad = 0.0, torch.zeros_like(logp)
    for i in range(len(m)):
        s_i = math.exp(sum(lp[i][t] - od[i][t] for t in m[i]) / len(m[i]))
        for t in m[i]:
            value += -min(s_i * a[i][t], min(max(s_i, 0.8), 1.28) * a[i][t]) / len(m[i]) / len(m)
            clipped = (a[i][t] > 0 and s_i > 1.28) or (a[i][t] < 0 and s_i < 0.8)
            grad[i, t] = 0.0 if clipped else -a[i][t] * s_i / len(m[i]) / len(m)
    assert (out.loss_sum / out.denominator).item() == pytest.approx(value, rel=1e-12)
    torch.testing.assert_close(logp.grad, grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", REGISTERED)
@pytest.mark.parametrize("splits", [[1, 4], [2, 2, 1], [1, 1, 1, 1, 1]], ids=["1+4", "2+2+1", "5x1"])
def test_micro_batch_split_gives_the_single_batch_loss_and_gradient(name, splits):
    """Sum of numerators / sum of denominators over micro-batches (or DP ranks) = the one-batch loss."""
    logp, old, adv, mask = random_batch(7)
    cfg = config(name)
    full = cfg.fn(logp, old, adv, mask, cfg)
    (full.loss_sum / full.denominator).backward()
    grad_full, logp.grad = logp.grad.clone(), None
    parts, start = [], 0
    for n in splits:
        sl = slice(start, start + n)
        parts.append(cfg.fn(logp[sl], old[sl], adv[sl], mask[sl], cfg))
        start += n
    num, den = sum(p.loss_sum for p in parts), sum(p.denominator for p in parts)
    (num / den).backward()
    assert den.item() == full.denominator.item() and den.item() == round(den.item())  # an integer count
    assert (num / den).item() == pytest.approx((full.loss_sum / full.denominator).item(), rel=1e-12)
    torch.testing.assert_close(logp.grad, grad_full, rtol=1e-12, atol=1e-14)


def test_gspo_ratio_is_per_sequence_even_with_padding_and_in_any_row_order():
    """Each row's s_i depends on that row only: a row alone, or padded wider among others, gets the same."""
    logp, old, adv, mask = random_batch(8)
    together = run("gspo", logp, old, adv, mask)
    alone = []
    for i in range(logp.shape[0]):
        n = int(mask[i].nonzero().max()) + 1  # the row without its padding
        alone.append(run("gspo", logp[i:i + 1, :n], old[i:i + 1, :n], adv[i:i + 1], mask[i:i + 1, :n]))
    assert together.loss_sum.item() == pytest.approx(sum(o.loss_sum.item() for o in alone), rel=1e-12)
    assert together.metrics["ratio"].item() == pytest.approx(sum(o.metrics["ratio"].item() for o in alone), rel=1e-12)


@pytest.mark.parametrize("name", REGISTERED)
def test_metrics_of_every_loss_are_the_declared_token_sums(name):
    """Exactly the metrics it declares (what the actor reduces and logs), as token sums: the shared ones checked
    against their definitions, and each summing over a split of the rows."""
    logp, old, adv, mask = random_batch(9)
    ent = torch.rand_like(old)
    cfg = config(name)
    out = cfg.fn(logp, old, adv, mask, cfg, entropy=ent)
    assert set(out.metrics) == set(cfg.metrics), "reports exactly what it declares"
    assert out.metrics["tokens"].item() == mask.sum().item()
    if "entropy" in out.metrics:
        assert out.metrics["entropy"].item() == pytest.approx((ent * mask).sum().item())
    if "approx_kl" in out.metrics:
        assert out.metrics["approx_kl"].item() == pytest.approx(((old - logp) * mask).sum().item())
    parts = [cfg.fn(logp[sl], old[sl], adv[sl], mask[sl], cfg, entropy=ent[sl]) for sl in (slice(0, 2), slice(2, 5))]
    for key, value in out.metrics.items():
        assert sum(p.metrics[key].item() for p in parts) == pytest.approx(value.item(), rel=1e-12, abs=1e-12), key


def test_the_shared_metrics_are_what_token_metrics_reports():
    logp, old, adv, mask = random_batch(9)
    out = policy_loss(logp, old, adv, mask, config("dapo"), entropy=torch.rand_like(old))
    assert set(out.metrics) == set(TOKEN_METRICS) and len(TOKEN_METRICS) == 8
    assert all(config(name).metrics == TOKEN_METRICS for name in LOSSES)


@pytest.mark.parametrize("name", REGISTERED)
def test_tis_weights_scale_each_tokens_term(name):
    logp, old, adv, mask = random_batch(10)
    w = torch.rand_like(old) + 0.5
    cfg = config(name)
    weighted = cfg.fn(logp, old, adv, mask, cfg, is_weights=w)
    # the same loss with the weights folded into per-token advantages (every term is linear in A at fixed clip
    # decision, and w > 0 keeps the sign of A, hence the min's branch)
    folded = cfg.fn(logp, old, adv[:, None] * w, mask, cfg)
    assert weighted.loss_sum.item() == pytest.approx(folded.loss_sum.item(), rel=1e-12)
    assert weighted.denominator.item() == folded.denominator.item()
