"""Router statistics of MegatronActor.train_step (actor/moe_stats.py) on a single-process tiny Qwen3-MoE,
against formulas written out here from HF transformers' router logits for the same batch:

- moe/aux_loss = mean over MoE layers of E * sum_i f_i P_i, f_i = count_i / (T * topk), P_i = mean softmax
  (megatron-core's Switch loss without its coefficient; HF's per-layer value is topk x this);
- its gradient: with zero advantages the DAPO loss has none, so the main grads are exactly those of
  coeff * sum_l aux_l * T_router / T_loss (megatron scales the aux loss by the micro-batch's router tokens and
  the per-token loss divides by the loss tokens); all zero with --moe-aux-loss-coeff 0;
- moe/tokens_per_expert_* = HF's top-k counts; moe/dropped_tokens = sum max(0, count - capacity) with a
  capacity factor.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from megatron_dapo.actor import TrainSample
from megatron_dapo.weights.mapping import canonical_mcore_name
from tests.dist.actor_common import (
    hf_to_full_mcore,
    load_hf_weights,
    mcore_shards_for_rank,
    single_process_world,
    world_actor,
)

LENGTH, PROMPT, ROWS = 16, 4, 3
ACTOR = {"use_fused_logprob": False, "clip_grad": 0.0, "max_tokens_per_micro_batch": ROWS * LENGTH}


@pytest.fixture(scope="module")
def world():
    gen = single_process_world(hf_seed=5, model_type="qwen3_moe", router_std=0.3)
    yield next(gen)
    next(gen, None)


def _samples(advantage: float = 0.0) -> list[TrainSample]:
    """Equal-length rows: one padded micro-batch without padding, so T is the same for both models."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (ROWS, LENGTH), generator=gen)
    return [TrainSample(tokens=row.tolist(), prompt_len=PROMPT, advantage=advantage) for row in ids]


def _hf_router_logits(hf, samples) -> list[torch.Tensor]:
    """Per MoE layer, [T, E] router logits of the batch (HF's own routing)."""
    out = hf(torch.tensor([s.tokens for s in samples]), output_router_logits=True)
    return list(out.router_logits)


def _switch_terms(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts [E] of the top-k, P [E] mean softmax over all experts)."""
    probs = torch.softmax(logits.float(), dim=-1)
    counts = torch.zeros(logits.shape[1]).index_add_(0, probs.topk(topk, dim=-1).indices.flatten(),
                                                     torch.ones(logits.shape[0] * topk))
    return counts, probs.mean(0)


def test_aux_loss_and_tokens_per_expert_equal_hf_formula(world):
    _, hf, arch = world
    samples = _samples(advantage=0.5)
    actor = world_actor(world, **ACTOR, moe_aux_loss_coeff=0.01)
    assert len(actor._micro_batches(samples)) == 1
    metrics = actor.train_step(samples)
    E, k, T = arch.num_experts, arch.num_experts_per_tok, ROWS * LENGTH
    with torch.no_grad():
        terms = [_switch_terms(logits, k) for logits in _hf_router_logits(hf, samples)]
    per_layer = [E * float((counts / (T * k) * p).sum()) for counts, p in terms]
    counts = torch.stack([c for c, _ in terms])
    assert len(per_layer) == len(arch.moe_layers) == 4
    assert metrics["moe/aux_loss"] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-5)
    assert metrics["moe/tokens_per_expert_max"] == float(counts.max())
    assert metrics["moe/tokens_per_expert_mean"] == pytest.approx(T * k / E)
    assert metrics["moe/tokens_per_expert_max_over_mean"] == pytest.approx(float(counts.max()) / (T * k / E))
    assert "moe/dropped_tokens" not in metrics and "moe/routing_agreement" not in metrics
    # every step starts from a cleared tracker: the same weights and batch again give the same value, not twice it
    load_hf_weights(actor, hf)
    assert actor.train_step(samples)["moe/aux_loss"] == pytest.approx(metrics["moe/aux_loss"], rel=1e-6)


def _main_grads(actor) -> dict[str, torch.Tensor]:
    return {canonical_mcore_name(n, actor.arch): p.main_grad.clone() for n, p in actor.module.named_parameters()}


@pytest.mark.parametrize("coeff", [0.0, 0.01], ids=["off", "on"])
def test_aux_loss_gradient_is_on_or_off(world, coeff):
    from megatron_dapo.distributed.parallel import padded_vocab_size

    _, hf, arch = world
    samples = _samples(advantage=0.0)  # on-policy, zero advantage: the DAPO loss has no gradient
    actor = world_actor(world, **ACTOR, moe_aux_loss_coeff=coeff)
    metrics = actor.train_step(samples)
    got = _main_grads(actor)
    if coeff == 0:
        assert "moe/aux_loss" not in metrics
        assert all(float(g.abs().max()) == 0.0 for g in got.values())
        return
    E, k, T = arch.num_experts, arch.num_experts_per_tok, ROWS * LENGTH
    loss_tokens = ROWS * (LENGTH - PROMPT)
    hf.zero_grad()
    loss = 0.0
    for logits in _hf_router_logits(hf, samples):
        counts, p = _switch_terms(logits, k)  # counts carry no gradient; P does
        loss = loss + coeff * E * (counts.detach() / (T * k) * p).sum()
    (loss * T / loss_tokens).backward()
    hf_grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in hf.named_parameters()}
    hf.zero_grad()
    want = mcore_shards_for_rank(hf_to_full_mcore(hf_grads, arch), arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                 padded_vocab=padded_vocab_size(arch.vocab_size, 1))
    router = [n for n in got if n.endswith("mlp.router.weight")]
    assert len(router) == 4 and all(float(want[n].abs().max()) > 1e-5 for n in router)
    scale = max(float(want[n].abs().max()) for n in got)
    worst = max(float((got[n] - want[n]).abs().max()) for n in got)
    assert worst < 1e-4 * scale, (worst, scale)


def test_dropped_tokens_with_a_capacity_factor(world):
    _, hf, arch = world
    samples = _samples(advantage=0.5)
    factor = 1.0
    actor = world_actor(world, **ACTOR, moe_expert_capacity_factor=factor, moe_aux_loss_coeff=0.0)
    metrics = actor.train_step(samples)
    E, k, T = arch.num_experts, arch.num_experts_per_tok, ROWS * LENGTH
    capacity = math.ceil(T * k / E * factor)  # megatron-core get_capacity
    kept: list[torch.Tensor] = []

    def capped(gate):  # each expert keeps its `capacity` highest-weight tokens; a dropped pair gets weight 0
        def forward(hidden):
            logits, weights, indices = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward(gate, hidden)
            dense = torch.zeros_like(logits).scatter(1, indices, weights)  # [T, E]
            keep = torch.zeros_like(dense, dtype=torch.bool)
            for e in range(dense.shape[1]):
                routed = (dense[:, e] > 0).nonzero().flatten()
                top = dense[routed, e].topk(min(capacity, len(routed))).indices
                keep[routed[top], e] = True
            kept.append(keep.sum(0).float())
            return logits, (dense * keep).gather(1, indices), indices
        return forward

    gates = [layer.mlp.gate for layer in hf.model.layers]
    for gate in gates:
        gate.forward = capped(gate)
    try:
        with torch.no_grad():
            hf(torch.tensor([s.tokens for s in samples]))
    finally:
        for gate in gates:
            del gate.forward
    counts = torch.stack(kept)
    dropped = T * k * len(gates) - float(counts.sum())
    assert dropped > 0, "the batch must overflow some expert (else this test shows nothing)"
    assert metrics["moe/dropped_tokens"] == dropped
    assert metrics["moe/tokens_per_expert_max"] == float(counts.max())
    assert metrics["moe/tokens_per_expert_mean"] == pytest.approx(float(counts.mean()))
