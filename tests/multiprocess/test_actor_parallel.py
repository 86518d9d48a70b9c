"""TP=2, PP=2, TP=2 x PP=2 and DP (torchrun, 4 gloo ranks) give the single-process log-probs, entropies,
metrics and updated weights, for every registered model family (and a frozen copy, the reference model of
--ref-load, the actor's log-probs bit for bit); a mixture-of-experts family runs its
expert-parallel layouts instead: one launch runs every family and layout.

Uneven pipelines (UNEVEN_LAYOUTS, --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers): a
4-layer model of the first family at PP=2 x DP=2 split 1/3 and 3/1, with the same checks, plus the weight plan's HF
load of each rank against the independent copy (bit for bit) and the HF export after the steps against the
single-process weights.

On 4 ranks TP=2 and PP=2 run with DP=2 (the distributed optimizer on, half the samples per replica); pure
DP (DP=4) runs for the first family only (it does not depend on the family's layers).

MoE (MOE_LAYOUTS): EP=2 over DP=4 (each expert on 2 expert-DP replicas: megatron's expert-DP gradient
all-reduce), EP=4 (one expert-DP replica), TP=2 x EP=2 + SP with expert-TP 1 and 2 (the alltoall dispatcher's
expert-TP all-gather / reduce-scatter of uneven splits), PP=2 x EP=2 on a mixed dense / MoE model
(mlp_only_layers=[1]: stage 0 holds an MoE and a dense layer). Their log-probs are also checked against HF
transformers' Qwen3MoeForCausalLM; the router weights are scaled up so routing is decided by clear margins (a
top-k tie broken by reduction-order noise would change the output, not show a layout error).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families
from tests.dist.actor_common import (
    FAMILIES,
    LAYOUT_ADAM_EPS,
    hf_response_log_probs,
    hf_to_full_mcore,
    make_samples,
    mcore_shards_for_rank,
    merge_layout_shards,
    merge_rank_shards,
    sharpen_router,
    single_process_run,
    tiny_config,
    tiny_hf_model,
)
from tests.dist.actor_parallel import LAYOUTS, NPROC, STAGE_LAYERS
from tests.torchrun import REPO, run_torchrun


def _is_moe(model_type: str) -> bool:
    return ModelArch.from_hf(families()[model_type].hf_config(**tiny_config(model_type))).is_moe


FAMILY_LAYOUTS = ("tp2", "pp2", "tp2pp2")
MOE_LAYOUTS = ("ep2", "ep4", "tp2ep2", "tp2ep2etp2")
MIXED_LAYOUTS = ("pp2ep2",)
"""Layouts of the mixed dense / MoE variant of each MoE family (model key `<model_type>_mixed`)."""
UNEVEN_LAYOUTS = tuple(STAGE_LAYERS)
UNEVEN_MODEL = f"{FAMILIES[0]}_4layers"
"""The model key of the uneven layouts: the first family with 4 layers (2 layers split only 1/1)."""
MOE_FAMILIES = tuple(f for f in FAMILIES if _is_moe(f))
CASES = ([(f, lay) for f in FAMILIES if f not in MOE_FAMILIES for lay in FAMILY_LAYOUTS]
         + [(FAMILIES[0], "dp4")]
         + [(UNEVEN_MODEL, lay) for lay in UNEVEN_LAYOUTS]
         + [(f, lay) for f in MOE_FAMILIES for lay in MOE_LAYOUTS]
         + [(f"{f}_mixed", lay) for f in MOE_FAMILIES for lay in MIXED_LAYOUTS])
IDS = [f"{f}-{lay}" for f, lay in CASES]
MOE_CASES = [(m, lay) for m, lay in CASES if lay in MOE_LAYOUTS + MIXED_LAYOUTS]
STEPS = 2
# lr large enough that two steps move weights well beyond the fp32 reduction-order noise; Adam's eps = lr bounds
# what that noise does to the updated weights for every element (LAYOUT_ADAM_EPS: the argument for atol 1e-5)
CONFIG = ActorConfig(lr=1e-3, lr_warmup_steps=1, clip_grad=1.0, max_tokens_per_micro_batch=48,
                     use_fused_logprob=False, adam_eps=LAYOUT_ADAM_EPS)
MOE_CONFIG = dataclasses.replace(CONFIG, moe_aux_loss_coeff=0.0)
"""The load-balancing loss off: megatron computes it per micro-batch over that micro-batch's local tokens (a
product of per-expert token fractions and mean probabilities, not a sum over tokens), so it depends on how the
samples are split over DP ranks and micro-batches and cannot equal the single-process run's. The router still
trains through the top-k weights of the policy loss."""


def _tiny_moe(model_type: str, seed: int, **overrides):
    """A tiny untied MoE HF model with clear top-k margins (`sharpen_router`)."""
    return sharpen_router(tiny_hf_model(model_type, tie=False, seed=seed, **overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict[str, list[dict]], ModelArch]]:
    """model key -> (single-process reference, {layout: per-rank results}, arch); MoE references also hold HF's
    log-probs and entropies ("hf_logps", "hf_entropies"), UNEVEN_MODEL's its HF state dict ("hf_state_dict")."""
    tmp = tmp_path_factory.mktemp("actor_parallel")
    models, hfs = {}, {}
    for i, model_type in enumerate(FAMILIES):
        # one seed for every family (the seeds were once picked per family to dodge an element near Adam's eps;
        # LAYOUT_ADAM_EPS makes the weight comparison well-conditioned for any)
        if model_type in MOE_FAMILIES:
            hfs[model_type] = _tiny_moe(model_type, seed=1, num_hidden_layers=2)
            hfs[f"{model_type}_mixed"] = _tiny_moe(model_type, seed=1, num_hidden_layers=4, mlp_only_layers=[1])
            continue
        # untied and tied alternate over the families: PP=2 with a tied model keeps an embedding copy on the
        # last stage whose gradient megatron-core must all-reduce with the first stage's
        hfs[model_type] = tiny_hf_model(model_type, tie=i % 2 == 1, seed=1, num_hidden_layers=2)
    hfs[UNEVEN_MODEL] = tiny_hf_model(FAMILIES[0], tie=False, seed=1, num_hidden_layers=4)
    for key, hf in hfs.items():
        arch = ModelArch.from_hf(hf.config)
        models[key] = {"arch": dataclasses.asdict(arch), "hf_state_dict": hf.state_dict(),
                       "layouts": [lay for m, lay in CASES if m == key],
                       "config": MOE_CONFIG if arch.is_moe else CONFIG}
    data = {"families": models, "config": CONFIG, "seed": 7, "samples": make_samples(10, seed=3),
            "steps": STEPS}
    torch.save(data, tmp / "input.pt")
    run_torchrun(REPO / "tests/dist/actor_parallel.py", str(tmp / "input.pt"), str(tmp), nproc=NPROC)
    out = {}
    for key, model in models.items():
        results = {name: [torch.load(Path(tmp) / f"{key}_{name}_rank{r}.pt", weights_only=False)
                          for r in range(NPROC)] for name in model["layouts"]}
        reference = single_process_run(ModelArch(**model["arch"]), model["hf_state_dict"], model["config"],
                                       data["samples"], seed=data["seed"], steps=STEPS)
        if ModelArch(**model["arch"]).is_moe:
            reference["hf_logps"], reference["hf_entropies"] = hf_response_log_probs(hfs[key], data["samples"])
        if key == UNEVEN_MODEL:  # the weight plan's load is checked against it
            reference["hf_state_dict"] = model["hf_state_dict"]
        out[key] = (reference, results, ModelArch(**model["arch"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), CASES, ids=IDS)
def test_log_probs_match_single_process(runs, model_type, layout):
    reference, results, _ = runs[model_type]
    for rank in results[layout]:  # every rank (each TP rank, each PP stage) holds its DP slice's log-probs
        for i, logp, ent in zip(rank["indices"], rank["logps"], rank["entropies"], strict=True):
            torch.testing.assert_close(logp, reference["logps"][i], atol=2e-5, rtol=0)
            torch.testing.assert_close(ent, reference["entropies"][i], atol=2e-5, rtol=0)
        # the frozen reference model on the same layout and weights runs the very same forward: bit for bit
        for logp, frozen in zip(rank["logps"], rank["frozen_logps"], strict=True):
            assert torch.equal(logp, frozen)


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), MOE_CASES, ids=[f"{m}-{lay}" for m, lay in MOE_CASES])
def test_moe_log_probs_match_hf(runs, model_type, layout):
    """Expert-parallel log-probs and entropies against HF's Qwen3MoeForCausalLM (and the single-process run's)."""
    reference, results, _ = runs[model_type]
    worst = {"logp": 0.0, "entropy": 0.0}
    for i in range(len(reference["logps"])):
        torch.testing.assert_close(reference["logps"][i], reference["hf_logps"][i], atol=2e-5, rtol=0)
    for rank in results[layout]:
        for i, logp, ent in zip(rank["indices"], rank["logps"], rank["entropies"], strict=True):
            torch.testing.assert_close(logp, reference["hf_logps"][i], atol=2e-5, rtol=0)
            torch.testing.assert_close(ent, reference["hf_entropies"][i], atol=2e-5, rtol=0)
            worst["logp"] = max(worst["logp"], (logp - reference["hf_logps"][i]).abs().max().item())
            worst["entropy"] = max(worst["entropy"], (ent - reference["hf_entropies"][i]).abs().max().item())
        for logp, frozen in zip(rank["logps"], rank["frozen_logps"], strict=True):  # the reference model's
            assert torch.equal(logp, frozen)
    print(f"{model_type} {layout}: max |logp - HF| {worst['logp']:.2e}, max |entropy - HF| {worst['entropy']:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), CASES, ids=IDS)
def test_train_metrics_match_single_process(runs, model_type, layout):
    reference, results, _ = runs[model_type]
    for rank in results[layout]:
        for got, want in zip(rank["metrics"], reference["metrics"], strict=True):
            assert got["num_tokens"] == want["num_tokens"]
            for key in ("pg_loss", "approx_kl", "ratio", "entropy", "clipfrac_low", "clipfrac_high",
                        "grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), CASES, ids=IDS)
def test_updated_weights_match_single_process(runs, model_type, layout):
    """Every DP replica ends with the single-process weights; under EP every expert-DP replica holds every expert
    (gathered over its EP and expert-TP ranks) with the single-process values."""
    reference, results, arch = runs[model_type]
    lay = LAYOUTS[layout]
    dense, experts = merge_layout_shards(results[layout], arch, tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=lay.ep,
                                         etp=lay.expert_tp, edp=lay.expert_dp, stage_layers=STAGE_LAYERS.get(layout))
    want_experts = {k: v for k, v in reference["weights"].items() if ".local_experts." in k}
    for got in dense:
        _assert_weights_close(got, {k: v for k, v in reference["weights"].items() if k not in want_experts})
    assert len(experts) == (lay.expert_dp if arch.is_moe else 0)
    for got in experts:
        _assert_weights_close(got, want_experts)
    worst = max((g[k] - reference["weights"][k]).abs().max().item() for g in dense + experts for k in g)
    print(f"{model_type} {layout}: max |updated weight - single-process| {worst:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", UNEVEN_LAYOUTS)
def test_uneven_pipeline_weight_plan_loads_and_exports(runs, layout):
    """The weights plan under an uneven split: each rank's HF -> megatron shards (weights.plan.iter_rank_shards, the
    --hf-checkpoint load) equal the independent copy placed by STAGE_LAYERS, bit for bit; and the HF export after the
    steps (weights.export.iter_hf_weights, every rank the whole model), mapped back through the independent copy,
    equals the single-process weights."""
    reference, results, arch = runs[UNEVEN_MODEL]
    assert len({r["pp_rank"] for r in results[layout]}) == 2
    full = hf_to_full_mcore(reference["hf_state_dict"], arch)
    for rank in results[layout]:
        want = mcore_shards_for_rank(full, arch, tp=1, tp_rank=0, pp=2, pp_rank=rank["pp_rank"],
                                     padded_vocab=padded_vocab_size(arch.vocab_size, 1),
                                     stage_layers=STAGE_LAYERS[layout])
        got = rank["plan_shards"]
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
        exported = hf_to_full_mcore(rank["hf_export"], arch)
        shards = mcore_shards_for_rank(exported, arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                       padded_vocab=padded_vocab_size(arch.vocab_size, 1))
        _assert_weights_close(merge_rank_shards({(0, 0): shards}, arch, tp=1, pp=1), reference["weights"])


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same names, every element within atol 1e-5 + rtol 1e-4: the layouts differ only by fp32 reduction order,
    which moves a weight by at most ~4e-7 over the two steps at CONFIG's Adam eps (LAYOUT_ADAM_EPS), and a layout
    error by its gradient error (an element with |g| << eps moves by ~g)."""
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _adamw_two_steps(grads: list[torch.Tensor], eps: float, lr: float = 1e-3) -> list[torch.Tensor]:
    """Weights after each of len(grads) steps of torch's AdamW (megatron-core's Adam on CPU) from w = 0.5, with the
    actor's betas (0.9, 0.999) and weight decay 0.1; float64, so only the optimizer's arithmetic shows."""
    w = torch.nn.Parameter(torch.full_like(grads[0], 0.5))
    opt = torch.optim.AdamW([w], lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.1)
    out = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        out.append(w.detach().clone())
    return out


def test_layout_adam_eps_bounds_what_reduction_noise_does_to_the_weights():
    """LAYOUT_ADAM_EPS's argument, on torch's AdamW over two steps at lr 1e-3: each step moves a weight by at most
    R_k lr past its weight decay (R_1 = 1, R_2 = 1.0014), and a gradient noise δ of 25 u x 0.06 (the largest
    tensor max measured) moves it by at most lr (2 + 2.42) δ / eps: under the tests' atol at eps = lr, above it at
    the default eps = 1e-8 for an element whose gradient is near 0; and a gradient twice too large shows in the
    weights at eps = lr, where at 1e-8 Adam's scale invariance hides it."""
    gen = torch.Generator().manual_seed(0)
    n = 20_000  # |g| log-uniform over 1e-12 .. 1e-1 at each step, random signs: near-zero and large elements
    grads = [torch.randn(n, generator=gen, dtype=torch.float64).sign()
             * 10 ** (-12 + 11 * torch.rand(n, generator=gen, dtype=torch.float64)) for _ in range(2)]
    delta = 25 * 2.0 ** -24 * 0.06
    noisy = [g + delta * torch.randn(n, generator=gen, dtype=torch.float64).sign() for g in grads]
    r2 = (0.09 ** 2 / 0.000999 + 0.1 ** 2 / 0.001) ** 0.5 * 0.001999 ** 0.5 / 0.19
    assert r2 == pytest.approx(1.0014, abs=1e-4)
    lr, decay = 1e-3, 1 - 1e-3 * 0.1
    w = _adamw_two_steps(grads, LAYOUT_ADAM_EPS)
    assert (w[0] - 0.5 * decay).abs().max() <= lr * (1 + 1e-12)
    assert (w[1] - w[0] * decay).abs().max() <= r2 * lr * (1 + 1e-12)
    assert (w[1] - w[0] * decay).abs().max() > lr * 0.9  # |g| >> eps: near the bound (not vacuous)
    bound = lr * (2 + (1 + r2 * 2 ** 0.5)) * delta / LAYOUT_ADAM_EPS
    worst = (_adamw_two_steps(noisy, LAYOUT_ADAM_EPS)[1] - w[1]).abs().max().item()
    assert worst <= bound < 1e-5 / 10, (worst, bound)
    assert worst > bound / 10  # the noise reaches some element at this size
    default = (_adamw_two_steps(noisy, 1e-8)[1] - _adamw_two_steps(grads, 1e-8)[1]).abs().max().item()
    assert default > 1e-5, default  # what the layout comparisons saw at the default eps
    # a layout error that doubles a gradient (a reduction summed twice): seen at eps = lr, hidden at eps = 1e-8
    doubled = [2 * g for g in grads]
    assert (_adamw_two_steps(doubled, LAYOUT_ADAM_EPS)[1] - w[1]).abs().max() > 1e-4
    large = (grads[0].abs() > 1e-3) & (grads[1].abs() > 1e-3)  # |g| >> eps: Adam is scale-invariant there
    assert (_adamw_two_steps(doubled, 1e-8)[1] - _adamw_two_steps(grads, 1e-8)[1])[large].abs().max() < 1e-7
