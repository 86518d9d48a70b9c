"""Every registered --policy-loss through the real actor (Megatron forward_backward_func, several micro-batches,
padded and packed) against the same loss computed on HF transformers one response at a time; a loss's own metric
reaches the train step's metrics, and one it does not declare stops the step."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor
from megatron_dapo.algorithm.loss import POLICY_LOSSES, PolicyLossConfig
from megatron_dapo.algorithm.registry import policy_loss_config
from megatron_dapo.errors import UserError
from tests.dist.actor_common import load_hf_weights, make_samples, single_process_world
from tests.hf_reference import response_terms
from tests.losses import undeclared_metric_loss

MAX_RESPONSE = 24


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=4)


def hf_reference(hf, samples, loss_config):
    """(loss, token means of the loss's metrics, grad norm): the loss function applied to each response alone on
    HF, its numerators, denominators and metric sums summed over responses (the contract every loss keeps)."""
    hf.zero_grad()
    num, den, sums = 0.0, 0.0, {}
    for s in samples:
        logp, old, mask = response_terms(hf, s)
        out = loss_config.fn(logp[None], old[None], torch.tensor([s.advantage]), mask[None], loss_config)
        num = num + out.loss_sum
        den += float(out.denominator)
        for key, value in out.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    (num / den).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    hf.zero_grad()
    return float(num) / den, {key: value / sums["tokens"] for key, value in sums.items()}, float(norm)


def trained(world, samples, loss_config, packed=False):
    """The metrics of one actor train step on `samples` (several micro-batches, several responses each), from the
    HF weights."""
    layout, hf, arch = world
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=40,
                                            pack_sequences=packed, loss=loss_config), layout)
    load_hf_weights(actor, hf)
    groups = actor._micro_batches(samples)
    assert len(groups) > 1 and max(len(g) for g in groups) > 1  # several micro-batches, several responses each
    return actor.train_step(samples)


CASES = [(name, {}) for name in POLICY_LOSSES] + [("gspo", dict(eps_low=3e-4, eps_high=4e-4))]
"""Every registered loss (generated from the registry), and GSPO at its paper's clip range."""


@pytest.mark.parametrize("name, clip", CASES, ids=[name + ("-paper-clip" if clip else "") for name, clip in CASES])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_train_step_matches_the_hf_reference(world, name, clip, packed):
    _, hf, _ = world
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    loss_config = policy_loss_config(name, max_response_length=MAX_RESPONSE, **clip)
    _, want, want_norm = hf_reference(hf, samples, loss_config)
    metrics = trained(world, samples, loss_config, packed)
    assert metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert metrics["pg_loss"] == pytest.approx(want["pg_loss"], rel=1e-5, abs=1e-7)


def test_a_losss_own_metric_reaches_the_train_steps_metrics(world):
    """A loss that declares one more token sum ('neg_adv_tokens', tests/losses.py) gets it reduced over the
    micro-batches and logged as its token mean, equal to the one-response-at-a-time reference."""
    _, hf, _ = world
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    loss_config = policy_loss_config("tests.losses:neg_adv_loss", max_response_length=MAX_RESPONSE)
    _, want, _ = hf_reference(hf, samples, loss_config)
    assert 0 < want["neg_adv_tokens"] < 1  # both signs of advantage among the tokens
    metrics = trained(world, samples, loss_config)
    assert metrics["neg_adv_tokens"] == pytest.approx(want["neg_adv_tokens"], rel=1e-12)
    assert metrics["pg_loss"] == pytest.approx(want["pg_loss"], rel=1e-5, abs=1e-7)


def test_a_metric_the_loss_does_not_declare_stops_the_train_step(world):
    """Past the start-up trial (a config built by hand), the train step still refuses to drop a metric silently."""
    loss_config = PolicyLossConfig(name="tests.losses:undeclared_metric_loss", fn=undeclared_metric_loss)
    with pytest.raises(UserError, match=r"--policy-loss 'tests.losses:undeclared_metric_loss' returned metrics "
                                        r"\['neg_adv_tokens'\] that it does not declare"):
        trained(world, make_samples(8, seed=5, max_len=MAX_RESPONSE), loss_config)


def test_gspo_differs_from_grpo_through_the_actor(world):
    """The check above is not vacuous: the sequence-level loss gives another gradient than the token-level one."""
    layout, hf, arch = world
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    norms = [hf_reference(hf, samples, policy_loss_config(n, eps_low=3e-4, eps_high=4e-4))[2]
             for n in ("grpo", "gspo")]
    assert abs(norms[0] - norms[1]) > 1e-3 * norms[0]
