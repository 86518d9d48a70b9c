"""Single-process actor: log-probs vs HF, micro-batch invariance, loss/grad vs an HF reference, LR warmup."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, TrainSample
from megatron_dapo.actor.batching import plan_micro_batches
from megatron_dapo.actor.logprob import fused_available
from megatron_dapo.algorithm.loss import PolicyLossConfig, policy_loss
from tests.dist.actor_common import (
    LAYOUT_ADAM_EPS,
    hf_response_log_probs,
    make_samples,
    merge_rank_shards,
    single_process_world,
    world_actor,
)
from tests.hf_reference import response_terms


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=4)


@pytest.mark.parametrize("fused", [False, pytest.param(True, marks=pytest.mark.skipif(
    not fused_available(), reason="megatron_dapo.ops not importable"))], ids=["megatron", "fused"])
def test_log_probs_and_entropy_match_hf(world, fused):
    samples = make_samples(5, seed=1)
    logps, ents = world_actor(world, use_fused_logprob=fused, max_tokens_per_micro_batch=40).compute_log_probs(
        samples, with_entropy=True)
    ref_logps, ref_ents = hf_response_log_probs(world[1], samples)
    for got, want, s in zip(logps, ref_logps, samples, strict=True):
        assert got.shape == (s.response_len,) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for got, want in zip(ents, ref_ents, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _hf_loss_and_grad_norm(hf, samples, loss_config):
    """The DAPO token-mean loss over the whole batch and its grad norm, computed on HF directly."""
    hf.zero_grad()
    sums, tokens = 0.0, 0.0
    for s in samples:
        logp, old, mask = response_terms(hf, s)
        out = policy_loss(logp[None], old[None], torch.tensor([s.advantage]), mask[None], loss_config)
        sums = sums + out.loss_sum
        tokens += float(out.denominator)
    (sums / tokens).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    hf.zero_grad()
    return float(sums) / tokens, float(norm)


def test_train_step_loss_and_grad_norm_match_hf_reference(world):
    samples = make_samples(8, seed=5)
    loss_config = PolicyLossConfig()
    want_loss, want_norm = _hf_loss_and_grad_norm(world[1], samples, loss_config)
    metrics = world_actor(world, max_tokens_per_micro_batch=40, clip_grad=0.0).train_step(samples)
    assert metrics["pg_loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    tokens = sum(float(s.loss_mask.sum()) if s.loss_mask is not None else s.response_len for s in samples)
    assert metrics["num_tokens"] == tokens


def test_token_mean_loss_is_invariant_to_micro_batch_split(world):
    """Same loss, metrics and updated weights whether the batch is 1 micro-batch or many. Adam at eps = lr
    (LAYOUT_ADAM_EPS): the splits sum the same per-token gradients in other fp32 orders, and at the default eps 1e-8
    that noise on a near-zero gradient moves a weight by up to lr (measured 2e-6 here)."""
    samples = make_samples(9, seed=6)
    arch = world[2]
    results = []
    for split in (dict(max_tokens_per_micro_batch=10_000), dict(max_tokens_per_micro_batch=30),
                  dict(micro_batch_size=1)):
        actor = world_actor(world, adam_eps=LAYOUT_ADAM_EPS, **split)
        n_micro = len(actor._micro_batches(samples))
        metrics = actor.train_step(samples)
        weights = merge_rank_shards({(0, 0): actor.state_dict_for_export()}, arch, tp=1, pp=1)
        results.append((n_micro, metrics, weights))
    assert results[0][0] == 1 and results[1][0] > 2 and results[2][0] == len(samples)
    for _, metrics, weights in results[1:]:
        for key in ("pg_loss", "approx_kl", "clipfrac_low", "clipfrac_high", "entropy", "grad_norm",
                    "num_tokens"):
            assert metrics[key] == pytest.approx(results[0][1][key], rel=1e-5, abs=1e-7), key
        for name, w in weights.items():
            # one step at eps = lr: a gradient noise delta moves the update by <= 2 delta (LAYOUT_ADAM_EPS, k = 1),
            # delta ~ 25 u max|G| (max|G| 0.08 after the clip to norm 1): <= 2.4e-7, plus one rounding of |w| < 1.25
            # (1.2e-7); 5x under atol. No rtol: at eps = lr an element with |g| << eps moves by ~g, so a split's
            # gradient error shows as itself on a weight of any size
            torch.testing.assert_close(w, results[0][2][name], atol=2e-6, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_lr_warmup_then_constant(world):
    actor = world_actor(world, lr=1e-3, lr_warmup_steps=2, max_tokens_per_micro_batch=10_000)
    samples = make_samples(2, seed=7)
    lrs = [actor.train_step(samples)["lr"] for _ in range(3)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3])


def test_plan_micro_batches_respects_budget():
    lengths = [5, 17, 3, 9, 12, 8, 2]
    groups = plan_micro_batches(lengths, max_tokens=20, micro_batch_size=1)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[i] for i in g) <= 20 for g in groups)
    assert plan_micro_batches(lengths, max_tokens=None, micro_batch_size=3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="--max-tokens-per-micro-batch"):
        plan_micro_batches(lengths, max_tokens=16, micro_batch_size=1)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(lr=0.0), "--lr"), (dict(min_lr=1.0, lr=0.1), "--min-lr"),
    (dict(lr_decay_style="step"), "--lr-decay-style"), (dict(lr_decay_style="cosine"), "--lr-decay-steps"),
    (dict(clip_grad=-1.0), "--clip-grad"), (dict(adam_beta2=1.0), "--adam-beta2"),
    (dict(max_tokens_per_micro_batch=0), "--max-tokens-per-micro-batch"),
    (dict(params_dtype="fp8"), "--params-dtype"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_actor_config_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ActorConfig(**kwargs)


def test_train_sample_validation():
    with pytest.raises(ValueError, match="prompt_len"):
        TrainSample(tokens=[1, 2], prompt_len=2)
    with pytest.raises(ValueError, match="old_log_probs"):
        TrainSample(tokens=[1, 2, 3], prompt_len=1, old_log_probs=torch.zeros(3))
