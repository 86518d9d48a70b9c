"""Sequence parallelism (TP=2 + SP, and TP=2 + SP + full recompute, torchrun on gloo, local spec) gives
the log-probs, metrics and updated weights of TP=2 without SP: one launch, several checks.

Families: the first registered one, and every family with a per-head q/k norm (Qwen3): under SP its
q_layernorm / k_layernorm are SequenceParallelRMSNorm (models/spec.py) and each TP rank holds the gradient
of its own heads only, so the updated weights equal TP-only's only if finalize_model_grads sums them over TP.
The others add no layer SP treats differently. A mixture-of-experts family (megatron-core refuses its TP > 1
without SP) compares both SP variants with the single-process run instead: its router sees each TP rank's
sequence slice (its weight's gradient is partial per rank, summed over TP like the norms'); its experts are split
over expert-TP = TP. The load-balancing loss is off (MOE_CONFIG): the actor passes megatron no padding mask, so the
loss counts the padded positions, and SP pads each sequence to a multiple of TP: with it on (0.001) the second
step's pg_loss differs from the single-process run's by 1.1e-4 relative."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families
from megatron_dapo.planner import activations, stages
from tests.dist.actor_common import (
    FAMILIES,
    LAYOUT_ADAM_EPS,
    make_samples,
    merge_rank_shards,
    sharpen_router,
    single_process_run,
    tiny_config,
    tiny_hf_model,
)
from tests.dist.actor_sp import LAYOUTS, layouts
from tests.torchrun import REPO, run_torchrun

VARIANTS = ("tp2_sp", "tp2_sp_recompute")
SP_FAMILIES = tuple(f for f in FAMILIES if f == FAMILIES[0] or families()[f].arch_defaults.get("qk_layernorm"))
# Adam's eps = lr: the updated weights' sensitivity to the layouts' fp32 reduction order is bounded for every
# element (LAYOUT_ADAM_EPS: the argument for atol 1e-5)
CONFIG = ActorConfig(lr=1e-3, clip_grad=1.0, max_tokens_per_micro_batch=48, use_fused_logprob=False,
                     adam_eps=LAYOUT_ADAM_EPS)
MOE_CONFIG = dataclasses.replace(CONFIG, moe_aux_loss_coeff=0.0)
"""An MoE family's (the actor refuses the MoE flags on a dense model)."""


def _is_moe(model_type: str) -> bool:
    return ModelArch.from_hf(families()[model_type].hf_config(**tiny_config(model_type))).is_moe


def _tiny(model_type: str):
    hf = tiny_hf_model(model_type, tie=False, seed=2, num_hidden_layers=2)
    return sharpen_router(hf) if ModelArch.from_hf(hf.config).is_moe else hf


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """model_type -> {layout: per-rank results, "arch": ModelArch}."""
    tmp = tmp_path_factory.mktemp("actor_sp")
    hfs = {f: _tiny(f) for f in SP_FAMILIES}
    samples = make_samples(7, seed=9)
    assert any(len(s.tokens) % 2 for s in samples)  # odd lengths: SP must pad s to a multiple of TP
    data = {"families": {f: {"arch": dataclasses.asdict(ModelArch.from_hf(hf.config)),
                             "hf_state_dict": hf.state_dict(),
                             "config": MOE_CONFIG if ModelArch.from_hf(hf.config).is_moe else CONFIG}
                         for f, hf in hfs.items()},
            "seed": 5, "samples": samples, "steps": 2}
    torch.save(data, tmp / "input.pt")
    run_torchrun(REPO / "tests/dist/actor_sp.py", str(tmp / "input.pt"), str(tmp))
    out = {}
    for f, hf in hfs.items():
        arch = ModelArch.from_hf(hf.config)
        out[f] = {name: [torch.load(Path(tmp) / f"{f}_{name}_rank{r}.pt", weights_only=False) for r in range(2)]
                  for name in layouts(arch)} | {"arch": arch}
        if arch.is_moe:  # no TP-only run: the reference is the single-process one
            out[f]["single"] = single_process_run(arch, hf.state_dict(), MOE_CONFIG, data["samples"],
                                                  seed=data["seed"], steps=data["steps"])
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_type", SP_FAMILIES)
def test_sequence_parallel_matches_tp_only(all_runs, model_type, variant):
    runs = all_runs[model_type]
    if runs["arch"].is_moe:
        _assert_matches_single_process(runs, variant)
        return
    for rank in range(2):
        want, got = runs["tp2"][rank], runs[variant][rank]
        for key in ("logps", "entropies"):
            for g, w in zip(got[key], want[key], strict=True):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        for g, w in zip(got["metrics"], want["metrics"], strict=True):
            for key in ("pg_loss", "entropy", "approx_kl", "grad_norm", "num_tokens"):
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
        for name, w in want["weights"].items():
            # norm weights see partial gradients per TP rank under SP: equal only if summed over TP
            torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=1e-4, msg=name)
        worst = max((got["weights"][n] - w).abs().max().item() for n, w in want["weights"].items())
        print(f"{model_type} {variant} rank {rank}: max |updated weight - TP-only| {worst:.2e}")


def _assert_matches_single_process(runs: dict, variant: str) -> None:
    """Both TP ranks' log-probs, entropies and metrics, and the TP-merged updated weights, equal the TP=1 run's."""
    want = runs["single"]
    for rank in runs[variant]:
        for key in ("logps", "entropies"):
            for g, w in zip(rank[key], want[key], strict=True):
                torch.testing.assert_close(g, w, atol=2e-5, rtol=0)
        for g, w in zip(rank["metrics"], want["metrics"], strict=True):
            for key in ("pg_loss", "entropy", "approx_kl", "grad_norm", "num_tokens"):
                assert g[key] == pytest.approx(w[key], rel=1e-4, abs=1e-6), key
    got = merge_rank_shards({(r, 0): runs[variant][r]["weights"] for r in range(2)}, runs["arch"], tp=2, pp=1)
    assert sorted(got) == sorted(want["weights"])
    for name, w in want["weights"].items():  # the experts' fc1 / fc2 are split over expert-TP = TP as dense ones
        torch.testing.assert_close(got[name], w, atol=1e-5, rtol=1e-4, msg=name)
    worst = max((got[n] - w).abs().max().item() for n, w in want["weights"].items())
    print(f"{runs['arch'].model_type} {variant}: max |updated weight - single-process| {worst:.2e}")


@pytest.mark.parametrize("model_type", SP_FAMILIES)
def test_sequence_parallel_tags_every_norm_weight(all_runs, model_type):
    runs = all_runs[model_type]
    tagged = runs["tp2_sp"][0]["norm_tagged"]
    names = runs["tp2_sp"][0]["weights"]
    # and an MoE model's routers: each TP rank routes its own sequence slice, so its router gradient is partial too;
    # and multi-head latent attention's latent norms (fused into the up projections) and its duplicated down
    # projections, which see this rank's sequence slice too
    partial = ("mlp.router.weight", "layer_norm_weight", "down_proj.weight")
    assert tagged and tagged == sorted(n for n in names if "layernorm" in n or n.endswith(partial))
    assert any("layernorm" in n for n in tagged)
    if "tp2" in runs:
        assert runs["tp2"][0]["norm_tagged"] == []


@pytest.mark.parametrize("name", ["tp2", *VARIANTS])
@pytest.mark.parametrize("model_type", [f for f in SP_FAMILIES if not _is_moe(f)])
def test_planner_matches_saved_tensors_at_tp2(all_runs, model_type, name):
    """The planner's TP / SP division (and its q/k-norm term) against the bytes megatron-core saves per rank:
    exact."""
    runs = all_runs[model_type]
    arch, layout = runs["arch"], LAYOUTS[name]
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    inputs = stages.PlanInputs(tokens_per_micro_batch=48, max_seq_len=24, params_dtype="float32")
    (plan,) = stages.plan_stages(arch, layout, inputs, spec)
    for rank in range(2):
        measured = runs[name][rank]["saved_bytes"]
        assert measured == plan.lines["  activations per micro-batch"], (name, rank, measured)
