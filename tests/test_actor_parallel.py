"""TP=2, PP=2, TP=2 x PP=2 and DP (torchrun, 4 gloo ranks) give the single-process log-probs, entropies,
metrics and updated weights, for every registered model family: one launch runs every family and layout.

On 4 ranks TP=2 and PP=2 run with DP=2 (the distributed optimizer on, half the samples per replica); pure
DP (DP=4) runs for the first family only (it does not depend on the family's layers).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import (
    FAMILIES,
    load_hf_state_dict,
    make_samples,
    merge_rank_shards,
    tiny_hf_model,
)
from tests.dist.actor_parallel import LAYOUTS, NPROC
from tests.torchrun import REPO, run_torchrun

FAMILY_LAYOUTS = ("tp2", "pp2", "tp2pp2")
CASES = [(f, lay) for f in FAMILIES for lay in FAMILY_LAYOUTS] + [(FAMILIES[0], "dp4")]
IDS = [f"{f}-{lay}" for f, lay in CASES]
STEPS = 2
# lr large enough that two steps move weights well beyond the fp32 reduction-order noise
CONFIG = ActorConfig(lr=1e-3, lr_warmup_steps=1, clip_grad=1.0, max_tokens_per_micro_batch=48,
                     use_fused_logprob=False)


def _single_process(data: dict, family: dict) -> dict:
    arch = ModelArch(**family["arch"])
    layout = init_parallel(seed=data["seed"])
    try:
        actor = MegatronActor(arch, data["config"], layout)
        load_hf_state_dict(actor, family["hf_state_dict"])
        logps, ents = actor.compute_log_probs(data["samples"], with_entropy=True)
        metrics = [actor.train_step(data["samples"]) for _ in range(STEPS)]
        weights = merge_rank_shards({(0, 0): actor.state_dict_for_export()}, arch, tp=1, pp=1)
    finally:
        destroy_parallel()
    return {"logps": logps, "entropies": ents, "metrics": metrics, "weights": weights}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict[str, list[dict]], ModelArch]]:
    """model_type -> (single-process reference, {layout: per-rank results}, arch)."""
    tmp = tmp_path_factory.mktemp("actor_parallel")
    families = {}
    for i, model_type in enumerate(FAMILIES):
        # untied and tied alternate over the families: PP=2 with a tied model keeps an embedding copy on the
        # last stage whose gradient megatron-core must all-reduce with the first stage's
        # (seed 1 + i: with llama's seed 1 one fc1 weight's two Adam updates nearly cancel, and its 3e-4 net move
        # differs by 1.3e-5 between TP and single-process reduction orders: conditioning, not a layout error)
        hf = tiny_hf_model(model_type, tie=i % 2 == 1, seed=1 + i, num_hidden_layers=2)
        families[model_type] = {"arch": dataclasses.asdict(ModelArch.from_hf(hf.config)),
                                "hf_state_dict": hf.state_dict(),
                                "layouts": [lay for f, lay in CASES if f == model_type]}
    data = {"families": families, "config": CONFIG, "seed": 7, "samples": make_samples(10, seed=3),
            "steps": STEPS}
    torch.save(data, tmp / "input.pt")
    run_torchrun(REPO / "tests/dist/actor_parallel.py", str(tmp / "input.pt"), str(tmp), nproc=NPROC)
    out = {}
    for model_type, family in families.items():
        results = {name: [torch.load(Path(tmp) / f"{model_type}_{name}_rank{r}.pt", weights_only=False)
                          for r in range(NPROC)] for name in family["layouts"]}
        out[model_type] = (_single_process(data, family), results, ModelArch(**family["arch"]))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("model_type", "layout"), CASES, ids=IDS)
def test_log_probs_match_single_process(runs, model_type, layout):
    reference, results, _ = runs[model_type]
    for rank in results[layout]:  # every rank (each TP rank, each PP stage) holds its DP slice's log-probs
        for i, logp, ent in zip(rank["indices"], rank["logps"], rank["entropies"], strict=True):
            torch.testing.assert_close(logp, reference["logps"][i], atol=2e-5, rtol=0)
            torch.testing.assert_close(ent, reference["entropies"][i], atol=2e-5, rtol=0)


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
    reference, results, arch = runs[model_type]
    lay = LAYOUTS[layout]
    ranks = results[layout]
    for dp_rank in range(lay.dp):  # every DP replica ends with the single-process weights
        shards = {(r["tp_rank"], r["pp_rank"]): r["weights"] for r in ranks if r["dp_rank"] == dp_rank}
        assert len(shards) == lay.tp * lay.pp
        _assert_weights_close(merge_rank_shards(shards, arch, tp=lay.tp, pp=lay.pp), reference["weights"])


def _assert_weights_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m, n=name: f"{n}: {m}")
