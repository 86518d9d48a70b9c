"""Sequence parallelism (TP=2 + SP, and TP=2 + SP + full recompute, torchrun on gloo, local spec) gives
the log-probs, metrics and updated weights of TP=2 without SP: one launch, several checks.

Families: the first registered one, and every family with a per-head q/k norm (Qwen3): under SP its
q_layernorm / k_layernorm are SequenceParallelRMSNorm (models/spec.py) and each TP rank holds the gradient
of its own heads only, so the updated weights equal TP-only's only if finalize_model_grads sums them over TP.
The others add no layer SP treats differently."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo import planner
from megatron_dapo.actor import ActorConfig
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families
from tests.dist.actor_common import FAMILIES, make_samples, tiny_hf_model
from tests.dist.actor_sp import LAYOUTS
from tests.torchrun import REPO, run_torchrun

VARIANTS = ("tp2_sp", "tp2_sp_recompute")
SP_FAMILIES = tuple(f for f in FAMILIES if f == FAMILIES[0] or families()[f].arch_defaults.get("qk_layernorm"))


@pytest.fixture(scope="module")
def all_runs(tmp_path_factory) -> dict[str, dict[str, list[dict]]]:
    """model_type -> {layout: per-rank results, "arch": ModelArch}."""
    tmp = tmp_path_factory.mktemp("actor_sp")
    hfs = {f: tiny_hf_model(f, tie=False, seed=2, num_hidden_layers=2) for f in SP_FAMILIES}
    samples = make_samples(7, seed=9)
    assert any(len(s.tokens) % 2 for s in samples)  # odd lengths: SP must pad s to a multiple of TP
    data = {"families": {f: {"arch": dataclasses.asdict(ModelArch.from_hf(hf.config)),
                             "hf_state_dict": hf.state_dict()} for f, hf in hfs.items()},
            "config": ActorConfig(lr=1e-3, clip_grad=1.0, max_tokens_per_micro_batch=48, use_fused_logprob=False),
            "seed": 5, "samples": samples, "steps": 2}
    torch.save(data, tmp / "input.pt")
    run_torchrun(REPO / "tests/dist/actor_sp.py", str(tmp / "input.pt"), str(tmp))
    return {f: {name: [torch.load(Path(tmp) / f"{f}_{name}_rank{r}.pt", weights_only=False) for r in range(2)]
                for name in ("tp2", *VARIANTS)} | {"arch": ModelArch.from_hf(hf.config)} for f, hf in hfs.items()}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_type", SP_FAMILIES)
def test_sequence_parallel_matches_tp_only(all_runs, model_type, variant):
    runs = all_runs[model_type]
    for rank in range(2):
        want, got = runs["tp2"][rank], runs[variant][rank]
        for key in ("logps", "entropies"):
            for g, w in zip(got[key], want[key]):
                torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        for g, w in zip(got["metrics"], want["metrics"]):
            for key in ("pg_loss", "entropy", "approx_kl", "grad_norm", "num_tokens"):
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), key
        for name, w in want["weights"].items():
            # norm weights see partial gradients per TP rank under SP: equal only if summed over TP
            torch.testing.assert_close(got["weights"][name], w, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("model_type", SP_FAMILIES)
def test_sequence_parallel_tags_every_norm_weight(all_runs, model_type):
    runs = all_runs[model_type]
    tagged = runs["tp2_sp"][0]["norm_tagged"]
    assert tagged and all("layernorm" in n for n in tagged)
    names = runs["tp2_sp"][0]["weights"]
    assert sorted(n for n in names if "layernorm" in n) == tagged
    assert runs["tp2"][0]["norm_tagged"] == []


@pytest.mark.parametrize("name", ["tp2", *VARIANTS])
@pytest.mark.parametrize("model_type", SP_FAMILIES)
def test_planner_matches_saved_tensors_at_tp2(all_runs, model_type, name):
    """The planner's TP / SP division (and its q/k-norm term) against the bytes megatron-core saves per rank:
    exact."""
    runs = all_runs[model_type]
    arch, layout = runs["arch"], LAYOUTS[name]
    spec = planner.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    inputs = planner.PlanInputs(tokens_per_micro_batch=48, max_seq_len=24, params_dtype="float32")
    (plan,) = planner.plan_stages(arch, layout, inputs, spec)
    for rank in range(2):
        measured = runs[name][rank]["saved_bytes"]
        assert measured == plan.lines["  activations per micro-batch"], (name, rank, measured)
