"""The KL term to a frozen reference model (--ref-load, --kl-coef, --kl-estimator) through the real actor: the frozen
model's log-probs equal HF's for its own weights, and a train step with the KL term has the loss, train/kl and
gradient of the same objective computed on HF transformers one response at a time (autograd through the HF policy,
the HF reference as a constant), for each estimator and for a token-counting and a response-counting loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor
from megatron_dapo.algorithm.kl import KLConfig, kl_estimate
from megatron_dapo.algorithm.registry import policy_loss_config
from tests.dist.actor_common import (
    hf_response_log_probs,
    load_hf_weights,
    make_samples,
    single_process_world,
    tiny_hf_model,
)
from tests.hf_reference import response_terms

MAX_RESPONSE = 24
BETA = 2.0


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=4)


@pytest.fixture(scope="module")
def ref_hf():
    """The reference policy: the same architecture, other weights (so the KL is far from 0)."""
    return tiny_hf_model("qwen2", seed=11)


def _frozen(world, hf, config: ActorConfig) -> MegatronActor:
    layout, _, arch = world
    model = MegatronActor(arch, config, layout, frozen=True)
    load_hf_weights(model, hf)
    return model


def test_the_frozen_model_computes_hfs_log_probs_and_holds_no_training_state(world, ref_hf):
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    ref = _frozen(world, ref_hf, ActorConfig(lr=1e-3, max_tokens_per_micro_batch=40))
    got = ref.compute_log_probs(samples)
    want, _ = hf_response_log_probs(ref_hf, samples)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w.float(), rtol=0, atol=2e-5)
    assert ref.optimizer is None and ref.scheduler is None
    assert not any(p.requires_grad for m in ref.modules for p in m.parameters())
    with pytest.raises(RuntimeError, match="frozen model"):
        ref.train_step(samples)


def hf_objective(hf, ref_hf, samples, loss_config, kl: KLConfig, agg_mode: str):
    """(loss, train/kl token mean, grad norm) of policy loss + beta x the KL estimate aggregated by `agg_mode`, each
    response alone on HF, numerators and denominators summed over responses."""
    hf.zero_grad()
    num, den, kl_tokens, tokens = 0.0, 0.0, 0.0, 0.0
    ref_logps, _ = hf_response_log_probs(ref_hf, samples)
    for s, ref in zip(samples, ref_logps, strict=True):
        logp, old, mask = response_terms(hf, s)
        out = loss_config.fn(logp[None], old[None], torch.tensor([s.advantage]), mask[None], loss_config)
        est = kl_estimate(logp, ref.float(), kl.estimator)
        if agg_mode == "token-mean":
            kl_num = (est * mask).sum()
        else:  # seq-mean-token-mean: one response here
            kl_num = (est * mask).sum() / mask.sum() if mask.sum() > 0 else est.sum() * 0
        num = num + out.loss_sum + kl.coef * kl_num
        den += float(out.denominator)
        kl_tokens += float((est.detach() * mask).sum())
        tokens += float(mask.sum())
    (num / den).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    hf.zero_grad()
    return float(num) / den, kl_tokens / tokens, float(norm)


@pytest.mark.parametrize("loss", ["dapo", "grpo"])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_train_step_with_the_kl_term_matches_the_hf_objective(world, ref_hf, loss, estimator):
    layout, hf, arch = world
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    kl = KLConfig(coef=BETA, estimator=estimator)
    config = ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=40, kl=kl,
                         loss=policy_loss_config(loss, max_response_length=MAX_RESPONSE))
    assert config.kl_agg_mode == {"dapo": "token-mean", "grpo": "seq-mean-token-mean"}[loss]
    ref = _frozen(world, ref_hf, config)
    for s, lp in zip(samples, ref.compute_log_probs(samples), strict=True):
        s.ref_log_probs = lp
    _, want_kl, want_norm = hf_objective(hf, ref_hf, samples, config.loss, kl, config.kl_agg_mode)
    _, _, plain_norm = hf_objective(hf, ref_hf, samples, config.loss, dataclasses.replace(kl, coef=0.0),
                                    config.kl_agg_mode)
    assert abs(want_norm - plain_norm) > 1e-3 * plain_norm  # the KL term moves the gradient
    actor = MegatronActor(arch, config, layout)
    load_hf_weights(actor, hf)
    metrics = actor.train_step(samples)
    assert metrics["kl"] == pytest.approx(want_kl, rel=1e-4)
    assert metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    if estimator != "k1":
        assert want_kl > 0  # k2, k3 >= 0, and the reference's weights differ


def test_a_sample_without_reference_log_probs_stops_the_step(world):
    layout, hf, arch = world
    samples = make_samples(4, seed=5, max_len=MAX_RESPONSE)
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, kl=KLConfig(coef=0.1), max_tokens_per_micro_batch=400), layout)
    load_hf_weights(actor, hf)
    with pytest.raises(ValueError, match="needs each sample's ref_log_probs"):
        actor.train_step(samples)
    assert len(actor._micro_batches(samples)) == 1
    samples[0].ref_log_probs = torch.zeros(samples[0].response_len)
    with pytest.raises(ValueError, match="3 of 4 samples of a micro-batch lack ref_log_probs"):
        actor.train_step(samples)


@pytest.mark.parametrize("loss", ["dapo", "grpo", "gspo"])
def test_per_token_advantages_reach_the_loss_as_on_hf(world, loss):
    """A sample's token_advantages (the distillation teacher's) are added to its advantage token by token, in padded
    and packed micro-batches: the train step's gradient equals HF's with the [1, L] advantages of each response."""
    layout, hf, arch = world
    samples = make_samples(8, seed=7, max_len=MAX_RESPONSE)
    gen = torch.Generator().manual_seed(3)
    for s in samples[::2]:  # half the rows carry token advantages, the others their advantage alone
        s.token_advantages = torch.randn(s.response_len, generator=gen)
    config = policy_loss_config(loss, max_response_length=MAX_RESPONSE)
    hf.zero_grad()
    num, den = 0.0, 0.0
    for s in samples:
        logp, old, mask = response_terms(hf, s)
        adv = torch.full((s.response_len,), s.advantage)
        if s.token_advantages is not None:
            adv = adv + s.token_advantages
        out = config.fn(logp[None], old[None], adv[None], mask[None], config)
        num, den = num + out.loss_sum, den + float(out.denominator)
    (num / den).backward()
    want = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))
    hf.zero_grad()
    for packed in (False, True):
        actor = MegatronActor(arch, ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=40, loss=config,
                                                pack_sequences=packed), layout)
        load_hf_weights(actor, hf)
        assert actor.train_step(samples)["grad_norm"] == pytest.approx(want, rel=1e-4), packed
    for s in samples:
        s.token_advantages = None
    plain = MegatronActor(arch, ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=40, loss=config),
                          layout)
    load_hf_weights(plain, hf)
    assert plain.train_step(samples)["grad_norm"] != pytest.approx(want, rel=1e-3)  # they changed the gradient
