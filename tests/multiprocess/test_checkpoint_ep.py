"""Training checkpoints under expert parallelism (4 gloo ranks, one torchrun launch; tests/dist/checkpoint_ep.py).

A tiny Qwen3-MoE saved at EP=2 (DP=4: expert-DP=2) resumes exactly at EP=2 with the regular and the distributed
optimizer: the third step's metrics and every updated weight equal the uninterrupted run's bit for bit. What
megatron-core 0.16.1 reshards (training.check_optimizer_layout): the regular optimizer at EP=4 (the experts' state
has a global expert axis: equal up to reduction order, RESUMED_UPDATE_ATOL at Adam's eps = lr); not the distributed
optimizer at another EP, and no optimizer between EP > 1 and EP = 1: those loads fail with a CheckpointLayoutError
naming the flags.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_dapo.actor import ActorConfig
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import (
    LAYOUT_ADAM_EPS,
    RESUMED_UPDATE_ATOL,
    make_samples,
    sharpen_router,
    tiny_hf_model,
)
from tests.dist.checkpoint_ep import NPROC
from tests.dist.checkpoint_ep import runs as resumed_runs
from tests.torchrun import REPO, run_torchrun

pytestmark = pytest.mark.slow
OPTIMIZERS = ("regular", "distopt")
METRICS = ("pg_loss", "approx_kl", "ratio", "entropy", "grad_norm", "lr", "num_tokens")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, ModelArch]:
    """({(optimizer, run): [per-rank result]} with run "straight" or "resumed_<layout>"), arch."""
    tmp = tmp_path_factory.mktemp("checkpoint_ep")
    hf = sharpen_router(tiny_hf_model("qwen3_moe", seed=4, num_hidden_layers=2))
    arch = ModelArch.from_hf(hf.config)
    data = {"arch": dataclasses.asdict(arch), "hf_state_dict": hf.state_dict(), "seed": 3,
            # Adam's eps = lr: the EP=4 resume's third update differs from the EP=2 one by the experts' fp32
            # reduction order only, within RESUMED_UPDATE_ATOL for every element (at eps 1e-8 a near-zero
            # gradient's noise moves one by up to lr)
            "config": ActorConfig(lr=1e-3, lr_warmup_steps=1, clip_grad=1.0, max_tokens_per_micro_batch=48,
                                  use_fused_logprob=False, adam_eps=LAYOUT_ADAM_EPS),
            "samples": [make_samples(6, seed=20 + k) for k in range(3)]}
    torch.save(data, tmp / "input.pt")
    run_torchrun(REPO / "tests/dist/checkpoint_ep.py", str(tmp / "input.pt"), str(tmp), nproc=NPROC)
    return {(opt, run): [torch.load(Path(tmp) / f"{opt}_{run}_rank{r}.pt", weights_only=False) for r in range(NPROC)]
            for opt in OPTIMIZERS for run in ["straight", *resumed_runs(opt)]}, arch


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_at_the_same_expert_layout_is_exact(runs, optimizer):
    results, _ = runs
    for want, got in zip(results[(optimizer, "straight")], results[(optimizer, "resumed_ep2")], strict=True):
        assert got["extra"]["step"] == 2
        assert got["metrics"] == want["metrics"]
        assert sorted(got["weights"]) == sorted(want["weights"])
        for name, w in want["weights"].items():
            assert torch.equal(got["weights"][name], w), name


def test_regular_optimizer_reshards_experts_to_ep4(runs):
    results, arch = runs
    straight = {k: v for r in results[("regular", "straight")] for k, v in r["weights"].items()}
    experts = {k for k in straight if ".local_experts." in k}
    assert len(experts) == arch.num_experts * len(arch.moe_layers) * 2  # fc1 and fc2 of every (layer, expert)
    seen = set()
    for want, got in zip(results[("regular", "straight")], results[("regular", "resumed_ep4")], strict=True):
        for key in METRICS:
            assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-6, abs=1e-9), key
        assert len([k for k in got["weights"] if ".local_experts." in k]) == len(experts) // 4  # E / 4 experts
        for name, w in got["weights"].items():
            torch.testing.assert_close(w, straight[name], atol=RESUMED_UPDATE_ATOL, rtol=0,
                                       msg=lambda m, n=name: f"{n}: {m}")
            seen.add(name)
    assert seen == set(straight)
    worst = max((w - straight[n]).abs().max().item() for r in results[("regular", "resumed_ep4")]
                for n, w in r["weights"].items())
    print(f"EP4 resume: max |updated weight - EP2| {worst:.2e}")


@pytest.mark.parametrize(("optimizer", "layout", "reason"), [
    ("distopt", "resumed_ep4", "cannot be resharded"),
    ("regular", "resumed_ep1", "chained optimizer only when EP > 1")])
def test_unsupported_expert_reshard_names_the_flags(runs, optimizer, layout, reason):
    results, _ = runs
    for got in results[(optimizer, layout)]:
        assert got["error"].startswith("CheckpointLayoutError: "), got["error"]
        assert "saved at --expert-model-parallel-size 2 --expert-tensor-parallel-size 1" in got["error"]
        assert reason in got["error"], got["error"]
