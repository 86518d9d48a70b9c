"""Every registered --policy-loss through the real actor (Megatron forward_backward_func, several micro-batches,
padded and packed) against the same loss computed on HF transformers one response at a time."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor
from megatron_dapo.algorithm.registry import policy_loss_config
from tests.dist.actor_common import load_hf_weights, make_samples, single_process_world
from tests.hf_reference import response_terms

MAX_RESPONSE = 24


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=4)


def hf_reference(hf, samples, loss_config):
    """(loss, token-mean pg_loss, grad norm): the loss function applied to each response alone on HF, its
    numerators and denominators summed over responses (the contract every loss keeps)."""
    hf.zero_grad()
    num, den, pg, tokens = 0.0, 0.0, 0.0, 0.0
    for s in samples:
        logp, old, mask = response_terms(hf, s)
        out = loss_config.fn(logp[None], old[None], torch.tensor([s.advantage]), mask[None], loss_config)
        num = num + out.loss_sum
        den += float(out.denominator)
        pg += float(out.metrics["pg_loss"])
        tokens += float(out.metrics["tokens"])
    (num / den).backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in hf.parameters() if p.grad is not None))
    hf.zero_grad()
    return float(num) / den, pg / tokens, float(norm)


@pytest.mark.parametrize("name, clip", [
    ("grpo", {}), ("dr_grpo", {}), ("gspo", {}), ("gspo", dict(eps_low=3e-4, eps_high=4e-4)),
], ids=["grpo", "dr_grpo", "gspo", "gspo-paper-clip"])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_train_step_matches_the_hf_reference(world, name, clip, packed):
    layout, hf, arch = world
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    loss_config = policy_loss_config(name, max_response_length=MAX_RESPONSE, **clip)
    _, want_pg, want_norm = hf_reference(hf, samples, loss_config)
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=40,
                                            pack_sequences=packed, loss=loss_config), layout)
    load_hf_weights(actor, hf)
    groups = actor._micro_batches(samples)
    assert len(groups) > 1 and max(len(g) for g in groups) > 1  # several micro-batches, several responses each
    metrics = actor.train_step(samples)
    assert metrics["grad_norm"] == pytest.approx(want_norm, rel=1e-4)
    assert metrics["pg_loss"] == pytest.approx(want_pg, rel=1e-5, abs=1e-7)


def test_gspo_differs_from_grpo_through_the_actor(world):
    """The check above is not vacuous: the sequence-level loss gives another gradient than the token-level one."""
    layout, hf, arch = world
    samples = make_samples(8, seed=5, max_len=MAX_RESPONSE)
    norms = [hf_reference(hf, samples, policy_loss_config(n, eps_low=3e-4, eps_high=4e-4))[2]
             for n in ("grpo", "gspo")]
    assert abs(norms[0] - norms[1]) > 1e-3 * norms[0]
