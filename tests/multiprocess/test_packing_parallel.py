"""Packing and the fused linear head under TP=2, TP=2 + SP and PP=2 (one torchrun launch, gloo, local
spec): log-probs, entropies, loss metrics and gradients equal the padded logits path of the same layout
to 1e-6 (that path itself equals the single-process run: tests/multiprocess/test_actor_parallel.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import make_samples, tiny_hf_model
from tests.dist.packing_parallel import WORLDS
from tests.torchrun import REPO, run_torchrun

ATOL = 1e-6
VARIANTS = {name: base for variants in WORLDS.values() for name, (_, _, base) in variants.items() if base}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    tmp = tmp_path_factory.mktemp("packing_parallel")
    hf = tiny_hf_model(tie=False, seed=3)
    samples = make_samples(9, seed=12)
    assert any(len(s.tokens) % 2 for s in samples)  # SP pads packed rows to a multiple of TP
    data = {"arch": dataclasses.asdict(ModelArch.from_hf(hf.config)), "hf_state_dict": hf.state_dict(),
            "config": ActorConfig(lr=1e-3, clip_grad=0.0, max_tokens_per_micro_batch=48), "seed": 5,
            "samples": samples}
    torch.save(data, tmp / "input.pt")
    run_torchrun(REPO / "tests/dist/packing_parallel.py", str(tmp / "input.pt"), str(tmp))
    names = [n for variants in WORLDS.values() for n in variants]
    return {n: [torch.load(Path(tmp) / f"{n}_rank{r}.pt", weights_only=False) for r in range(2)] for n in names}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_padded_logits_path(runs, variant):
    base = VARIANTS[variant]
    for rank in range(2):
        got, want = runs[variant][rank], runs[base][rank]
        for key in ("logps", "entropies"):
            for g, w in zip(got[key], want[key], strict=True):
                torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        for key in ("pg_loss", "clipfrac_high", "clipfrac_low", "approx_kl", "ratio", "entropy", "grad_norm",
                    "num_tokens"):
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-6, abs=ATOL), key
        assert got["grads"].keys() == want["grads"].keys()
        for name, w in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], w, atol=ATOL, rtol=1e-5, msg=f"{variant} {name}")
