"""TP1 x PP2 x VPP2 (--num-layers-per-virtual-pipeline-stage, interleaved 1F1B; torchrun, gloo) gives the
single-process log-probs, metrics and HF export; its checkpoint round-trips and loads at plain PP2."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import ParallelLayout, validate_layout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.export import iter_hf_weights
from megatron_dapo.weights.plan import stage_tensors
from tests.dist.actor_common import (
    LAYOUT_ADAM_EPS,
    load_hf_state_dict,
    make_samples,
    tiny_hf_model,
)
from tests.torchrun import REPO, run_torchrun

STEPS = 2
# Adam's eps = lr (LAYOUT_ADAM_EPS): the interleaved schedule and the single process differ in their fp32 reduction
# orders only, which then moves an updated weight by at most ~4e-7 over the two steps (at the default eps 1e-8 a
# near-zero gradient's noise moves it by up to lr); EXPORT_ATOL is that bound's margin
CONFIG = ActorConfig(lr=1e-3, lr_warmup_steps=1, clip_grad=1.0, max_tokens_per_micro_batch=48,
                     use_fused_logprob=False, adam_eps=LAYOUT_ADAM_EPS)
EXPORT_ATOL = 2e-6
"""|exported weight - single-process| after STEPS steps at CONFIG: LAYOUT_ADAM_EPS bounds the reduction-order noise's
effect by (2 + 2.42) delta <= 5.3e-7 (delta ~ 25 u max|G|, max|G| <= 0.08 under the clip to norm 1), plus a rounding
of each weight (|w| < 2: 1.2e-7): 3x under. No rtol: an element with |g| << eps moves by ~g at eps = lr, so a
layout's gradient error shows as itself on a weight of any size."""
METRICS = ("pg_loss", "approx_kl", "ratio", "entropy", "clipfrac_low", "clipfrac_high", "grad_norm", "lr")


def _single_process(data: dict) -> dict:
    arch = ModelArch(**data["arch"])
    layout = init_parallel(seed=data["seed"])
    try:
        actor = MegatronActor(arch, data["config"], layout)
        load_hf_state_dict(actor, data["hf_state_dict"])
        logps, ents = actor.compute_log_probs(data["samples"], with_entropy=True)
        metrics = [actor.train_step(data["samples"]) for _ in range(STEPS)]
        exported = {name: t.clone() for name, t in iter_hf_weights(actor.chunks, arch)}
    finally:
        destroy_parallel()
    return {"logps": logps, "entropies": ents, "metrics": metrics, "export": exported}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, list[dict]]:
    tmp = tmp_path_factory.mktemp("actor_vpp")
    hf = tiny_hf_model(tie=False, seed=1, num_hidden_layers=4)
    arch = ModelArch.from_hf(hf.config)
    hf.save_pretrained(tmp / "hf")
    data = {"arch": dataclasses.asdict(arch), "hf_state_dict": hf.state_dict(), "config": CONFIG, "seed": 7,
            "samples": make_samples(10, seed=3), "steps": STEPS, "hf_dir": str(tmp / "hf")}
    torch.save(data, tmp / "input.pt")
    reference = _single_process(data)
    run_torchrun(REPO / "tests/dist/actor_vpp.py", str(tmp / "input.pt"), str(tmp))
    return reference, [torch.load(Path(tmp) / f"vpp_rank{r}.pt", weights_only=False) for r in range(2)]


def _assert_same_export(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tol) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_vpp_matches_single_process(runs):
    reference, ranks = runs
    for pp_rank, rank in enumerate(ranks):  # both PP ranks hold the log-probs, the metrics and the full export
        for i, (logp, ent) in enumerate(zip(rank["logps"], rank["entropies"], strict=True)):
            torch.testing.assert_close(logp, reference["logps"][i], atol=2e-5, rtol=0)
            torch.testing.assert_close(ent, reference["entropies"][i], atol=2e-5, rtol=0)
        for i, logp in enumerate(rank["logps_two"]):  # 1 micro-batch split to 2 for the schedule
            torch.testing.assert_close(logp, reference["logps"][i], atol=2e-5, rtol=0)
        for got, want in zip(rank["metrics"], reference["metrics"], strict=True):
            assert got["num_tokens"] == want["num_tokens"]
            for key in METRICS:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
        _assert_same_export(rank["export"], reference["export"], atol=EXPORT_ATOL, rtol=0)
        worst = max((rank["export"][n] - w).abs().max().item() for n, w in reference["export"].items())
        print(f"PP rank {pp_rank}: max |exported weight - single-process| {worst:.2e}")


@pytest.mark.slow
def test_vpp_checkpoint_round_trip_and_plain_pp_load(runs):
    _, ranks = runs
    for rank in ranks:
        # load restores weights exactly; the optimizer/scheduler state too: the same next step again
        _assert_same_export(rank["loaded_export"], rank["export"], atol=0, rtol=0)
        for key in (*METRICS, "num_tokens"):
            assert rank["after_load"][key] == rank["after_save"][key], key
        # sharded keys carry global layer numbers: a VPP save loads into a plain PP2 actor
        _assert_same_export(rank["plain_export"], rank["export"], atol=0, rtol=0)


def test_vpp_layout_validation():
    arch = ModelArch.from_hf(tiny_hf_model(num_hidden_layers=4).config)
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage needs --pipeline-model"):
        ParallelLayout(pp=1, layers_per_virtual_stage=1)
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-size \(2\) x --num-layers-per-virtual"):
        validate_layout(arch, ParallelLayout(pp=2, layers_per_virtual_stage=3))
    assert ParallelLayout(pp=2, layers_per_virtual_stage=1).virtual_stages(arch.num_layers) == 2
    assert ParallelLayout(pp=2, layers_per_virtual_stage=2).virtual_stages(arch.num_layers) == 1


def test_virtual_stage_layers():
    """Chunk c of PP rank r holds global layers of virtual stage c * pp + r (megatron-core's
    get_transformer_layer_offset: (c * pp + r) * layers per virtual stage)."""
    arch = ModelArch.from_hf(tiny_hf_model(num_hidden_layers=8).config)
    layout = ParallelLayout(pp=2, layers_per_virtual_stage=2)
    got = {}
    for r in range(2):
        for c in range(2):
            layers = {t.global_layer for t in stage_tensors(arch, layout, r, chunk=c)}
            got[(r, c)] = sorted(layers - {None})
    assert got == {(0, 0): [0, 1], (1, 0): [2, 3], (0, 1): [4, 5], (1, 1): [6, 7]}
