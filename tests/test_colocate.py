"""Colocated mode (megatron_dapo/colocate.py): the actor's offload/onload is exact, the phase switch talks to
SGLang in the right order, the flag combinations fail with errors naming the flags."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor
from megatron_dapo.colocate import ActorOffloader, PhaseSwitcher, check_colocate_flags, engine_of_rank
from tests.dist.actor_common import load_hf_weights, make_samples, single_process_world


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=7)


def _actor(world, **overrides) -> MegatronActor:
    layout, hf, arch = world
    actor = MegatronActor(arch, ActorConfig(**{"lr": 1e-3, "max_tokens_per_micro_batch": 64, **overrides}), layout)
    load_hf_weights(actor, hf)
    return actor


def _state(actor: MegatronActor) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for c in actor.chunks for n, p in c.named_parameters()}
    for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        inner = opt.optimizer
        for i, st in enumerate(inner.state.values()):
            for k, v in st.items():
                out[f"s.{i}.{k}"] = v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def test_offload_then_onload_continues_training_bit_exactly(world):
    """Two optimizer steps with an offload/onload between them == two steps never offloaded, bit for bit
    (weights and Adam state), and while offloaded the grad buffer and Adam state hold no memory."""
    s1, s2 = make_samples(6, seed=11), make_samples(6, seed=12)
    ref = _actor(world)
    ref.train_step(s1, rollout_step=1)
    ref_metrics = ref.train_step(s2, rollout_step=2)

    actor = _actor(world)
    actor.train_step(s1, rollout_step=1)
    off = ActorOffloader(actor.chunks, actor.optimizer)
    before = _state(actor)
    metrics = off.offload()
    assert off.grad_bytes > 0 and off.state_bytes > 0
    params = sum(p.numel() for c in actor.chunks for p in c.parameters())
    assert off.state_bytes >= 2 * 4 * params  # exp_avg + exp_avg_sq in fp32 (+ step scalars)
    assert metrics["colocate/actor_offloaded_gib"] == pytest.approx((off.grad_bytes + off.state_bytes) / 2**30)
    assert all(h.tensor.untyped_storage().nbytes() == 0 for h in off._state + off._grads)
    assert all(p.untyped_storage().nbytes() > 0 for c in actor.chunks for p in c.parameters())  # weights stay
    off.onload()
    after = _state(actor)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    metrics = actor.train_step(s2, rollout_step=2)
    assert metrics["pg_loss"] == ref_metrics["pg_loss"] and metrics["grad_norm"] == ref_metrics["grad_norm"]
    got, want = _state(actor), _state(ref)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


class _Recorder:
    def __init__(self, log):
        self.log = log

    def release_memory_occupation(self, tags):
        self.log.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags):
        self.log.append(("resume", tuple(tags)))


class _FakeOffloader:
    def __init__(self, log):
        self.log = log

    def offload(self):
        self.log.append("offload")
        return {"colocate/offload_s": 0.0}

    def onload(self):
        self.log.append("onload")
        return {"colocate/onload_s": 0.0}


def test_phase_switch_order():
    """release before onload; offload, resume weights, push, then resume KV cache and CUDA graphs."""
    log: list = []
    sw = PhaseSwitcher(offloader=_FakeOffloader(log), engine=_Recorder(log), barrier=lambda: log.append("|"))
    sw.start()
    m = sw.to_training()
    assert "colocate/to_training_s" in m
    m = sw.to_generation(lambda: log.append("push") or {"sync/seconds": 1.0})
    assert m["sync/seconds"] == 1.0 and "colocate/to_generation_s" in m
    assert log == ["offload", "|", ("release", ("weights", "kv_cache", "cuda_graph")), "|", "onload", "|",
                   "offload", "|", ("resume", ("weights",)), "|", "push", ("resume", ("kv_cache", "cuda_graph")),
                   "|"]
    with pytest.raises(RuntimeError, match="from phase 'generation'"):
        sw.to_generation()


BASE = dict(colocate=True, world_size=16, gpus_per_node=8, gpus_per_engine=4, num_servers=1, server_urls=None,
            sglang_gpus=None, weight_sync_mode=None, rollout_engine="sglang", extra_args=(), mem_fraction_static=None)


@pytest.mark.parametrize("change,flag", [
    (dict(sglang_gpus="4,5"), "--sglang-gpus"),
    (dict(weight_sync_mode="distributed"), "--weight-sync-mode"),
    (dict(rollout_engine="embedded"), "--rollout-engine"),
    (dict(gpus_per_engine=3, world_size=12, gpus_per_node=8, server_urls=["u"] * 4), "--rollout-num-gpus-per-engine"),
    (dict(gpus_per_engine=16), "--rollout-num-gpus-per-engine"),
    (dict(server_urls=["http://a:1"] * 3), "--sglang-server-urls"),
    (dict(num_servers=2), "--sglang-num-servers"),
    (dict(extra_args=("--mem-fraction-static", "0.5")), "--sglang-extra-args"),
    (dict(mem_fraction_static=1.2), "--mem-fraction-static"),
])
def test_colocate_flag_errors_name_the_flag(change, flag):
    with pytest.raises(ValueError, match=flag):
        check_colocate_flags(**{**BASE, **change})


def test_colocate_flags_that_work():
    check_colocate_flags(**{**BASE, "server_urls": [f"http://n{i}:30000" for i in range(4)]})
    check_colocate_flags(**{**BASE, "world_size": 8, "gpus_per_node": None, "num_servers": 2})
    assert [engine_of_rank(r, 4) for r in (0, 3, 4, 15)] == [(0, 0), (0, 3), (1, 0), (3, 3)]


def test_sglang_colocate_is_a_deprecated_alias():
    from megatron_dapo.arguments import build_parser

    base = ["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps", "1"]
    with pytest.warns(FutureWarning, match="--colocate"):
        args = build_parser().parse_args(base + ["--sglang-colocate"])
    assert args.colocate is True
    args = build_parser().parse_args(base + ["--colocate", "--rollout-num-gpus-per-engine", "4"])
    assert args.colocate and args.sglang_tp_size == 4
    assert build_parser().parse_args(base).colocate is False
