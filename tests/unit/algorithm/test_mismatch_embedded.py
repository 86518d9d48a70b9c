"""Off-policy correction through the real pieces: embedded-engine rollouts vs the Megatron actor (same weights:
ratio 1, nothing clipped or masked, TIS leaves the update unchanged), and a TIS-weighted train step vs HF."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import TrainSample
from megatron_dapo.algorithm import OffPolicyConfig, PolicyLossConfig, policy_loss
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from megatron_dapo.trainer.loop import Rollout, Trainer, TrainerConfig
from tests.dist.actor_common import (
    TINY,
    make_samples,
    single_process_world,
    world_actor,
)
from tests.hf_reference import response_terms


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=4)


def _rollouts(world, engine: EmbeddedEngine) -> list[Rollout]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    requests = [RolloutRequest(prompt_ids=p, n=2, sampling=SamplingParams(max_new_tokens=10, temperature=1.0),
                               request_id=f"p{i}") for i, p in enumerate(prompts)]
    advantages = [1.0, -0.5, 0.7, -1.2, 0.3, 1.1, -0.8, 0.4]
    samples = [s for group in engine.generate(requests) for s in group]
    return [Rollout(TrainSample(tokens=list(s.prompt_ids) + list(s.response_ids), prompt_len=len(s.prompt_ids),
                                advantage=a), torch.tensor(s.logprobs, dtype=torch.float32))
            for s, a in zip(samples, advantages, strict=True)]


def test_embedded_engine_step1_ratio_is_one_and_tis_changes_nothing(world):
    _, hf, _ = world
    engine = EmbeddedEngine(dict(TINY, model_type="qwen2", tie_word_embeddings=False), state_dict=hf.state_dict(),
                            max_batch_size=8)
    off_policy = OffPolicyConfig(use_tis=True, tis_cap=2.0, mis_mode="sequence", mis_threshold=1.001)
    actor = world_actor(world, clip_grad=0.0, max_tokens_per_micro_batch=64)
    trainer = Trainer(config=TrainerConfig(num_steps=1, off_policy=off_policy), collect=None, actor=actor,
                      engine=engine, next_prompts=lambda k: [], eval_prompts=[], decode=str, reward_fn=None,
                      logger=None)
    rollouts = _rollouts(world, engine)
    old = actor.compute_log_probs([r.sample for r in rollouts])
    metrics = trainer._mismatch(rollouts, old)  # the trainer's own step-1 path (sets is_weights / loss_mask)

    assert metrics["mismatch/tokens"] == sum(r.sample.response_len for r in rollouts) > 40
    assert metrics["mismatch/logprob_abs_diff_max"] < 2e-5
    assert metrics["mismatch/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["mismatch/tis_clipfrac"] == 0.0
    assert metrics["mismatch/mis_maskfrac"] == 0.0  # even at T = 1.001
    assert 0.0 <= metrics["mismatch/kl_k3"] < 1e-9
    assert metrics["mismatch/ppl_ratio"] == pytest.approx(1.0, abs=1e-5)
    for r in rollouts:
        assert r.sample.loss_mask.tolist() == [1.0] * r.sample.response_len
        torch.testing.assert_close(r.sample.is_weights, torch.ones(r.sample.response_len), atol=2e-5, rtol=0)

    # step-1 ratio pi_theta / pi_old is 1 (no clipping), and the TIS-weighted update equals the plain one
    weighted = actor.train_step([r.sample for r in rollouts])
    plain_samples = [TrainSample(tokens=r.sample.tokens, prompt_len=r.sample.prompt_len, advantage=r.sample.advantage)
                     for r in rollouts]
    plain = world_actor(world, clip_grad=0.0, max_tokens_per_micro_batch=64).train_step(plain_samples)
    assert weighted["ratio"] == pytest.approx(1.0, abs=1e-6)
    assert weighted["clipfrac_high"] == weighted["clipfrac_low"] == 0.0
    for key in ("pg_loss", "grad_norm", "num_tokens"):
        assert weighted[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key


def test_tis_weighted_train_step_matches_hf_reference(world):
    """Weights reach the right tokens: Megatron's weighted loss and grad norm equal HF's, token by token."""
    _, hf, _ = world
    samples = make_samples(6, seed=9)
    g = torch.Generator().manual_seed(2)
    for s in samples:
        s.is_weights = 0.2 + 1.8 * torch.rand(s.response_len, generator=g)
    cfg = PolicyLossConfig()
    hf.zero_grad()
    sums, tokens = 0.0, 0.0
    for s in samples:
        logp, old, mask = response_terms(hf, s)
        out = policy_loss(logp[None], old[None], torch.tensor([s.advantage]), mask[None], cfg,
                          is_weights=s.is_weights[None])
        sums = sums + out.loss_sum
        tokens += float(out.denominator)
    (sums / tokens).backward()
    want_norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None)))
    hf.zero_grad()

    got = world_actor(world, clip_grad=0.0, max_tokens_per_micro_batch=40).train_step(samples)
    assert got["pg_loss"] == pytest.approx(float(sums.detach()) / tokens, rel=1e-5, abs=1e-7)
    assert got["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    # and the weights matter: without them the loss differs
    for s in samples:
        s.is_weights = None
    unweighted = world_actor(world, clip_grad=0.0, max_tokens_per_micro_batch=40).train_step(samples)
    assert unweighted["pg_loss"] != pytest.approx(got["pg_loss"], rel=1e-3)
