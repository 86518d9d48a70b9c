"""TP=2, PP=2 and DP=2 (torchrun, gloo) give the single-process log-probs, metrics and updated weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import (
    load_hf_state_dict,
    make_samples,
    merge_rank_shards,
    tiny_hf_model,
)
from tests.torchrun import REPO, run_torchrun

LAYOUTS = {"tp2": (2, 1, 1), "pp2": (1, 2, 1), "dp2": (1, 1, 2)}
STEPS = 2
# lr large enough that two steps move weights well beyond the fp32 reduction-order noise
CONFIG = ActorConfig(lr=1e-3, lr_warmup_steps=1, clip_grad=1.0, max_tokens_per_micro_batch=48,
                     use_fused_logprob=False)


def _single_process(data: dict) -> dict:
    arch = ModelArch(**data["arch"])
    layout = init_parallel(seed=data["seed"])
    try:
        actor = MegatronActor(arch, data["config"], layout)
        load_hf_state_dict(actor, data["hf_state_dict"])
        logps, ents = actor.compute_log_probs(data["samples"], with_entropy=True)
        metrics = [actor.train_step(data["samples"]) for _ in range(STEPS)]
        weights = merge_rank_shards({(0, 0): actor.state_dict_for_export()}, arch, tp=1, pp=1)
    finally:
        destroy_parallel()
    return {"logps": logps, "entropies": ents, "metrics": metrics, "weights": weights}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict[str, list[dict]], ModelArch]:
    tmp = tmp_path_factory.mktemp("actor_parallel")
    hf = tiny_hf_model(tie=False, seed=1)
    arch = ModelArch.from_hf(hf.config)
    data = {"arch": dataclasses.asdict(arch), "hf_state_dict": hf.state_dict(), "config": CONFIG, "seed": 7,
            "samples": make_samples(10, seed=3), "steps": STEPS, "layouts": list(LAYOUTS)}
    torch.save(data, tmp / "input.pt")
    reference = _single_process(data)
    run_torchrun(REPO / "tests/dist/actor_parallel.py", str(tmp / "input.pt"), str(tmp))
    results = {name: [torch.load(Path(tmp) / f"{name}_rank{r}.pt", weights_only=False) for r in range(2)]
               for name in LAYOUTS}
    return reference, results, arch


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_log_probs_match_single_process(runs, layout):
    reference, results, _ = runs
    for rank in results[layout]:  # every rank (each TP rank, each PP stage) holds the log-probs
        for i, logp, ent in zip(rank["indices"], rank["logps"], rank["entropies"]):
            torch.testing.assert_close(logp, reference["logps"][i], atol=2e-5, rtol=0)
            torch.testing.assert_close(ent, reference["entropies"][i], atol=2e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_train_metrics_match_single_process(runs, layout):
    reference, results, _ = runs
    for rank in results[layout]:
        for got, want in zip(rank["metrics"], reference["metrics"]):
            assert got["num_tokens"] == want["num_tokens"]
            for key in ("pg_loss", "approx_kl", "ratio", "entropy", "clipfrac_low", "clipfrac_high",
                        "grad_norm", "lr"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_updated_weights_match_single_process(runs, layout):
    reference, results, arch = runs
    tp, pp, _ = LAYOUTS[layout]
    ranks = results[layout]
    if layout == "dp2":
        for rank in ranks:  # every DP replica ends with the same weights
            merged = merge_rank_shards({(0, 0): rank["weights"]}, arch, tp=1, pp=1)
            _assert_weights_close(merged, reference["weights"])
        return
    shards = {(r["tp_rank"], r["pp_rank"]): r["weights"] for r in ranks}
    merged = merge_rank_shards(shards, arch, tp=tp, pp=pp)
    _assert_weights_close(merged, reference["weights"])


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
