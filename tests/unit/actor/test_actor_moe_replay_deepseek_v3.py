"""Rollout routing replay (actor/moe_replay.py) on DeepSeek-V3's router: sigmoid scores, the correction bias added
for the choice only, group-limited top-k, weights = the chosen unbiased scores renormalised x routed_scaling_factor.
megatron-core's `topk_routing_with_score_function` asks the replay hook for the top-k of the *biased* scores and
then gathers the unbiased ones at what it returns; the replayed log-probs must equal HF's DeepseekV3ForCausalLM
with its routers forced to the same experts (weights computed the HF way), for random routings that ignore the
groups (a rollout engine's choice is taken as it is)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, TrainSample
from tests.dist.actor_common import load_hf_weights, make_samples, single_process_world


@pytest.fixture(scope="module")
def world():
    gen = single_process_world(hf_seed=4, model_type="deepseek_v3", router_std=0.3)
    yield next(gen)
    next(gen, None)


@contextmanager
def _forced_routing(hf, routed: torch.Tensor):
    """HF's DeepSeek-V3 routers route token i < len(routed) of MoE layer l to routed[i, l], weighted as HF weights
    its own choice (sigmoid scores at the experts, renormalised, x routed_scaling_factor); the last token keeps its
    own top-k."""
    gates = {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")}
    originals = {i: gate.forward for i, gate in gates.items()}

    def forced(layer: int, gate, own_forward):
        def forward(hidden):
            logits, _, indices = own_forward(hidden)
            indices = indices.clone()
            indices[:routed.shape[0]] = routed[:, layer].long()
            weights = logits.sigmoid().gather(1, indices)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
            return logits, weights, indices
        return forward

    for layer, gate in gates.items():
        gate.forward = forced(layer, gate, originals[layer])
    try:
        yield
    finally:
        for gate in gates.values():
            del gate.forward


def test_replayed_log_probs_equal_hf_forced_to_the_same_experts(world):
    _, hf, arch = world
    gen = torch.Generator().manual_seed(7)
    samples = make_samples(4, seed=2)

    def routing(sample: TrainSample) -> torch.Tensor:
        n = len(sample.tokens) - 1
        return torch.rand(n, arch.num_layers, arch.num_experts, generator=gen).argsort(-1)[
            ..., :arch.num_experts_per_tok].to(torch.int16)

    samples = [dataclasses.replace(s, routed_experts=routing(s)) for s in samples]
    config = ActorConfig(lr=1e-3, use_fused_logprob=False, moe_routing_replay=True, moe_aux_loss_coeff=0.0,
                         max_tokens_per_micro_batch=40)
    actor = MegatronActor(arch, config, world[0])
    load_hf_weights(actor, hf)
    got = actor.compute_log_probs(samples)
    natural = actor.compute_log_probs([dataclasses.replace(s, routed_experts=None) for s in samples])
    worst = moved = 0.0
    with torch.no_grad():
        for g, n, s in zip(got, natural, samples, strict=True):
            with _forced_routing(hf, s.routed_experts):
                logits = hf(torch.tensor([s.tokens])).logits[0].float()
            pos = torch.arange(s.prompt_len - 1, len(s.tokens) - 1)
            want = torch.log_softmax(logits, -1)[pos, torch.tensor(s.tokens[s.prompt_len:])]
            worst, moved = max(worst, (g - want).abs().max().item()), max(moved, (n - want).abs().max().item())
    print(f"replayed vs HF forced: {worst:.2e}; own routing vs HF forced: {moved:.2e}")
    assert worst < 1e-5, worst
    assert moved > 1e-2, "random routings should change the log-probs (else this test shows nothing)"
