"""Rollout routing replay (actor/moe_replay.py) on a single-process tiny Qwen3-MoE actor, against HF
transformers' Qwen3MoeForCausalLM whose routers are forced to the same experts in the test:

(a) replayed log-probs equal HF's forced-routing log-probs for random routings (padded micro-batches and
    --pack-sequences); (b) replaying HF's own top-k changes nothing, and moe/routing_agreement is the fraction
    of (token, MoE layer) whose rollout set equals HF's own; (c) one train_step's gradients with replay equal
    those of the forced-routing HF DAPO loss, with and without --recompute-granularity full.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import pytest
import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe

from megatron_dapo.actor import ActorConfig, MegatronActor, TrainSample
from megatron_dapo.actor.moe_replay import replay_table
from megatron_dapo.algorithm.loss import policy_loss
from megatron_dapo.weights.mapping import canonical_mcore_name
from tests.dist.actor_common import (
    hf_to_full_mcore,
    load_hf_weights,
    make_samples,
    mcore_shards_for_rank,
    single_process_world,
)


@pytest.fixture(scope="module")
def world():
    gen = single_process_world(hf_seed=4, model_type="qwen3_moe", router_std=0.3)
    yield next(gen)
    next(gen, None)


def _actor(world, layout=None, **overrides) -> MegatronActor:
    base, hf, arch = world
    config = ActorConfig(**{"lr": 1e-3, "use_fused_logprob": False, "moe_routing_replay": True,
                            "moe_aux_loss_coeff": 0.0, **overrides})
    actor = MegatronActor(arch, config, layout or base)
    load_hf_weights(actor, hf)
    return actor


def _random_routing(sample: TrainSample, arch, gen: torch.Generator) -> torch.Tensor:
    """[len - 1, layers, k] distinct random experts per (token, layer) (int16, as a rollout would send)."""
    n = len(sample.tokens) - 1
    return torch.rand(n, arch.num_layers, arch.num_experts, generator=gen).argsort(-1)[..., :arch.num_experts_per_tok
                                                                                    ].to(torch.int16)


@contextmanager
def _forced_hf_routing(hf, routed: torch.Tensor | None):
    """HF routers of a [1, n] forward route token i < len(routed) of layer l to routed[i, l] with weights =
    softmax over all E logits gathered there and renormalised (norm_topk_prob); the last token keeps HF's own
    top-k. Records each layer's own top-k indices in `own` ({layer: [n, k]})."""
    own: dict[int, torch.Tensor] = {}
    gates = {i: layer.mlp.gate for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")}

    def forced(layer: int, gate):
        def forward(hidden):
            logits, scores, indices = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward(gate, hidden)
            own[layer] = indices.detach().clone()
            if routed is None:
                return logits, scores, indices
            indices = indices.clone()
            indices[:routed.shape[0]] = routed[:, layer].long()
            probs = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, indices)
            return logits, (probs / probs.sum(-1, keepdim=True)).to(logits.dtype), indices
        return forward

    for layer, gate in gates.items():
        gate.forward = forced(layer, gate)
    try:
        yield own
    finally:
        for gate in gates.values():
            del gate.forward


def _hf_response(hf, sample: TrainSample, routed: torch.Tensor | None):
    """(response log-probs, HF's own top-k per layer {l: [n, k]}) of one sample, routers forced to `routed`."""
    with _forced_hf_routing(hf, routed) as own:
        logits = hf(torch.tensor([sample.tokens])).logits[0].float()
    pos = torch.arange(sample.prompt_len - 1, len(sample.tokens) - 1)
    logp = torch.log_softmax(logits, -1)[pos, torch.tensor(sample.tokens[sample.prompt_len:])]
    return logp, own


def _with_routing(samples, routings):
    return [dataclasses.replace(s, routed_experts=r) for s, r in zip(samples, routings, strict=True)]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_replayed_log_probs_equal_hf_with_forced_routing(world, packed):
    _, hf, arch = world
    gen = torch.Generator().manual_seed(7)
    samples = make_samples(5, seed=2)
    samples = _with_routing(samples, [_random_routing(s, arch, gen) for s in samples])
    actor = _actor(world, max_tokens_per_micro_batch=40, pack_sequences=packed)  # several micro-batches
    got = actor.compute_log_probs(samples)
    natural = actor.compute_log_probs([dataclasses.replace(s, routed_experts=None) for s in samples])
    worst, moved = 0.0, 0.0
    with torch.no_grad():
        for g, n, s in zip(got, natural, samples, strict=True):
            want, _ = _hf_response(hf, s, s.routed_experts)
            worst = max(worst, (g - want).abs().max().item())
            moved = max(moved, (n - want).abs().max().item())
    assert worst < 1e-5, worst
    assert moved > 1e-2, "random routings should change the log-probs (else this test shows nothing)"


def test_replaying_own_routing_changes_nothing_and_agreement_is_exact(world):
    _, hf, arch = world
    samples = make_samples(4, seed=3)
    own_routes, rand_routes = [], []
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for s in samples:
            _, own = _hf_response(hf, s, None)
            n = len(s.tokens) - 1
            own_routes.append(torch.stack([own[layer][:n] for layer in range(arch.num_layers)], dim=1))
            rand_routes.append(_random_routing(s, arch, gen))
    actor = _actor(world, max_tokens_per_micro_batch=40)
    plain = actor.compute_log_probs(samples)
    replayed = actor.compute_log_probs(_with_routing(samples, own_routes))
    for a, b in zip(plain, replayed, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    metrics = actor.train_step(samples)  # reports the agreement of the compute_log_probs calls before it
    assert metrics["moe/routing_agreement"] == 1.0
    # random rollout routings: the agreement is the fraction of (token, layer) whose set is HF's own set
    actor.compute_log_probs(_with_routing(samples, rand_routes))
    same = total = 0
    for own, rand in zip(own_routes, rand_routes, strict=True):
        eq = (own.sort(-1).values == rand.long().sort(-1).values).all(-1)
        same, total = same + int(eq.sum()), total + eq.numel()
    assert 0 < same < total
    assert actor.train_step(samples)["moe/routing_agreement"] == pytest.approx(same / total, abs=1e-12)
    assert "moe/routing_agreement" not in actor.train_step(samples)  # nothing compared since


def _hf_grads(hf, samples, loss_config) -> dict[str, torch.Tensor]:
    """Gradients of the token-mean DAPO loss over `samples` on HF, routers forced to each sample's routing."""
    hf.zero_grad()
    sums, tokens = 0.0, 0.0
    for s in samples:
        logp, _ = _hf_response(hf, s, s.routed_experts)
        mask = torch.ones_like(logp) if s.loss_mask is None else s.loss_mask
        old = logp.detach() if s.old_log_probs is None else s.old_log_probs
        out = policy_loss(logp[None], old[None], torch.tensor([s.advantage]), mask[None], loss_config)
        sums = sums + out.loss_sum
        tokens += float(out.denominator)
    (sums / tokens).backward()
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in hf.named_parameters()}
    hf.zero_grad()
    return grads


def _actor_grads(actor) -> dict[str, torch.Tensor]:
    return {canonical_mcore_name(n, actor.arch): p.main_grad.clone() for n, p in actor.module.named_parameters()}


def _in_mcore_names(grads: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    from megatron_dapo.distributed.parallel import padded_vocab_size

    return mcore_shards_for_rank(hf_to_full_mcore(grads, arch), arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                 padded_vocab=padded_vocab_size(arch.vocab_size, 1))


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute-full"])
def test_train_step_gradients_equal_forced_routing_hf_loss(world, recompute):
    layout, hf, arch = world
    gen = torch.Generator().manual_seed(5)
    samples = make_samples(4, seed=6)
    samples = _with_routing(samples, [_random_routing(s, arch, gen) for s in samples])
    if recompute:
        layout = dataclasses.replace(layout, recompute_granularity="full", recompute_method="uniform",
                                     recompute_num_layers=1)
    # clip_grad=0: megatron clips the main grads in place, and the grad buffer is what is compared
    actor = _actor(world, layout=layout, max_tokens_per_micro_batch=40, clip_grad=0.0)  # 2+ micro-batches
    assert len(actor._micro_batches(samples)) > 1
    actor.train_step(samples)
    got = _actor_grads(actor)
    want = _in_mcore_names(_hf_grads(hf, samples, actor.config.loss), arch)
    natural = _in_mcore_names(_hf_grads(hf, [dataclasses.replace(s, routed_experts=None) for s in samples],
                                        actor.config.loss), arch)
    assert set(got) == set(want)
    worst = max((got[n] - want[n]).abs().max().item() for n in got)
    router = [n for n in got if n.endswith("mlp.router.weight")]
    assert router and all(want[n].abs().max() > 1e-4 for n in router), "the router must get a gradient"
    off = max((natural[n] - want[n]).abs().max().item() for n in got)
    assert worst < 1e-5, worst
    assert off > 1e-3, off


def test_replay_table_layout_and_errors(world):
    _, _, arch = world
    samples = make_samples(2, seed=1)
    gen = torch.Generator().manual_seed(1)
    routed = [_random_routing(s, arch, gen) for s in samples]
    samples = _with_routing(samples, [routed[0], None])
    lengths = [len(s.tokens) for s in samples]
    s = max(lengths)
    table = replay_table(samples, [0, 1], torch.zeros(2, s), cu_seqlens=None, num_layers=arch.num_layers,
                         topk=arch.num_experts_per_tok, num_experts=arch.num_experts, moe_layers=arch.moe_layers)
    table = table.view(s, 2, arch.num_layers, -1)  # s-major, as megatron's routers flatten [s, b]
    assert torch.equal(table[:lengths[0] - 1, 0], routed[0])
    assert (table[lengths[0] - 1:, 0] == -1).all() and (table[:, 1] == -1).all()
    bad = _with_routing(samples, [routed[0] + arch.num_experts, None])
    with pytest.raises(ValueError, match="outside"):
        replay_table(bad, [0, 1], torch.zeros(2, s), cu_seqlens=None, num_layers=arch.num_layers,
                     topk=arch.num_experts_per_tok, num_experts=arch.num_experts, moe_layers=arch.moe_layers)
    with pytest.raises(ValueError, match="top_k"):
        replay_table(_with_routing(samples, [routed[0][..., :1], None]), [0, 1], torch.zeros(2, s), cu_seqlens=None,
                     num_layers=arch.num_layers, topk=arch.num_experts_per_tok, num_experts=arch.num_experts,
                     moe_layers=arch.moe_layers)


@pytest.mark.slow
def test_replay_multi_rank_layouts_equal_single_process(world, tmp_path):
    """torchrun, 2 ranks (tests/dist/actor_moe_replay.py): PP=2 with --recompute-granularity full and EP=2 x DP=2
    give the single-process replayed log-probs, main grads and router statistics; TP=2 + SP (expert TP 1) and
    PP=2 x 2 virtual stages the log-probs, the router statistics and the loss metrics."""
    from tests.torchrun import REPO, run_torchrun

    _, hf, arch = world
    gen = torch.Generator().manual_seed(9)
    samples = make_samples(8, seed=8)
    samples = _with_routing(samples, [_random_routing(s, arch, gen) for s in samples])
    config = ActorConfig(lr=1e-3, use_fused_logprob=False, moe_routing_replay=True, moe_aux_loss_coeff=0.0,
                         clip_grad=0.0, max_tokens_per_micro_batch=40)
    actor = _actor(world, **{k: getattr(config, k) for k in ("clip_grad", "max_tokens_per_micro_batch")})
    ref_logps = actor.compute_log_probs(samples)
    ref_metrics = actor.train_step(samples)
    ref_grads = {canonical_mcore_name(n, arch): p.main_grad.clone() for n, p in actor.module.named_parameters()}
    torch.save({"arch": arch, "hf_state_dict": hf.state_dict(), "samples": samples, "config": config},
               tmp_path / "in.pt")
    run_torchrun(REPO / "tests/dist/actor_moe_replay.py", tmp_path / "in.pt", tmp_path, nproc=2)
    for name in ("pp2_recompute", "ep2", "tp2_sp", "pp2_vpp"):
        ranks = [torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
        if name == "pp2_recompute":
            assert ranks[0]["micro_batches"] >= 3  # 1F1B: a forward runs before the first recomputed backward
            grads = {**ranks[0]["grads"], **ranks[1]["grads"]}
            pairs = list(zip(ranks[0]["indices"], ranks[0]["logps"], strict=True))  # broadcast to every stage
        elif name == "pp2_vpp":
            grads = None
            pairs = list(zip(ranks[0]["indices"], ranks[0]["logps"], strict=True))
        elif name == "tp2_sp":
            grads = None
            pairs = list(zip(ranks[0]["indices"], ranks[0]["logps"], strict=True))  # TP ranks agree
            for a, b in zip(ranks[0]["logps"], ranks[1]["logps"], strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        else:
            grads = ranks[0]["grads"] | {n: g for n, g in ranks[1]["grads"].items() if "local_experts" in n}
            shared = [n for n in ranks[0]["grads"] if "local_experts" not in n]
            for n in shared:  # DP-reduced: both ranks hold the full gradient
                torch.testing.assert_close(ranks[0]["grads"][n], ranks[1]["grads"][n], atol=1e-6, rtol=0)
            pairs = [(i, lp) for r in ranks for i, lp in zip(r["indices"], r["logps"], strict=True)]
        assert sorted(i for i, _ in pairs) == list(range(len(samples)))
        for i, lp in pairs:
            torch.testing.assert_close(lp, ref_logps[i], atol=1e-5, rtol=0)
        if grads is not None:
            assert set(grads) == set(ref_grads), name
            worst = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
            assert worst < 1e-5, (name, worst)
        for key in ("moe/tokens_per_expert_max", "moe/tokens_per_expert_mean", "moe/routing_agreement",
                    "pg_loss", "num_tokens"):
            for r in ranks:
                assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-6, abs=1e-9), (name, key)
