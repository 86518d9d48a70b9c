"""build_weight_sync picks the implementation once, from (colocate, engine, transport, PP); the trainer calls it.

The table below is written out from the flags' meaning (docs/ARCHITECTURE.md, weight_sync/base.py), not from
sync_kind's code: colocated engines take each GPU's own buckets; the embedded and process engines load in
process; SGLang servers get the whole model from rank 0, except in distributed mode at PP > 1, where each
pipeline stage sends its own.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.rollout.collect import CollectConfig
from megatron_dapo.weight_sync.build import build_weight_sync, engine_kind, sync_kind

CASES = [  # (colocate, engine, mode, pp) -> implementation
    (True, "sglang", "tensor", 1, "colocated"),
    (True, "sglang", "tensor", 2, "colocated"),
    (False, "embedded", None, 1, "engine_load"),
    (False, "embedded", None, 2, "engine_load"),
    (False, "sglang", "tensor", 1, "server"),
    (False, "sglang", "tensor", 2, "server"),
    (False, "sglang", "disk", 1, "server"),
    (False, "sglang", "disk", 2, "server"),
    (False, "sglang", "distributed", 1, "server"),
    (False, "sglang", "distributed", 2, "stage"),
    (False, "sglang", "distributed", 4, "stage"),
]


@pytest.mark.parametrize("colocate, engine, mode, pp, want", [
    pytest.param(*c, id=f"{'colocate-' if c[0] else ''}{c[1]}-{c[2]}-pp{c[3]}") for c in CASES])
def test_each_combination_gets_its_implementation(colocate, engine, mode, pp, want):
    assert sync_kind(engine=engine, mode=mode, pp=pp, colocate=colocate) == want


def test_an_unknown_engine_names_the_flag():
    with pytest.raises(ValueError, match="--rollout-engine"):
        sync_kind(engine="vllm", mode=None, pp=1, colocate=False)
    with pytest.raises(ValueError, match="needs its transport"):
        sync_kind(engine="sglang", mode=None, pp=1, colocate=False)


def test_rank0_facts_and_the_objects_built_in_a_world_of_one():
    """World of one (no process group): the facts come from the engine object and the transport given, nothing is
    exchanged; an SGLang engine gets its transport's ServerPush, which attaches to it (its recover/close), any other
    engine an EngineLoad."""
    from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
    from megatron_dapo.weight_sync.engine_load import EngineLoad
    from megatron_dapo.weight_sync.transports.disk import DiskPush
    from tests.sglang.fake_server import serve

    class Loads:
        def __init__(self):
            self.got: list[tuple[int, list[str]]] = []

        def update_weights(self, named, *, version):
            self.got.append((version, [n for n, _ in named]))

        def take_metrics(self):
            return {"engine/x": 1.0}

    loads = Loads()
    assert engine_kind(loads) == "embedded"
    sync = build_weight_sync(loads, wait_group=None)
    assert type(sync) is EngineLoad

    server, _ = serve(tp_size=1)
    engine = SGLangEngine(server_urls=[f"http://127.0.0.1:{server.server_address[1]}"],
                          client=ClientConfig())
    try:
        assert engine_kind(engine) == "sglang"
        sync = build_weight_sync(engine, transport="disk", wait_group=None)
        assert type(sync) is DiskPush and engine.weight_sync is sync
        with pytest.raises(RuntimeError, match="already has weight sync DiskPush"):
            DiskPush(engine)  # one sync per engine: it owns the host copy
    finally:
        engine.shutdown()
        server.shutdown()
        server.server_close()


def test_the_trainer_calls_the_sync_it_was_built_with(monkeypatch):
    """Trainer.sync_weights is one call to weight_sync.push(actor, version), which adds time/sync_s; the embedded
    path hands rank 0's engine the whole export (every tensor, in order) and returns its metrics."""
    from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig
    from megatron_dapo.rollout.types import SamplingParams
    from megatron_dapo.trainer.loop import Trainer, TrainerConfig
    from megatron_dapo.weight_sync.engine_load import EngineLoad
    from megatron_dapo.weights import export

    monkeypatch.setattr(export, "iter_hf_weights",
                        lambda chunks, arch: ((f"w{i}", torch.full((2,), float(i))) for i in range(3)))

    class Loads:
        version = 0

        def update_weights(self, named, *, version):
            self.names = [n for n, _ in named]
            self.version = version

        def take_metrics(self):
            return {"engine/x": 1.0}

    engine = Loads()
    collect = CollectConfig(n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=3),
                            dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=1, enabled=False),
                            overlong=OverlongConfig(max_response_length=3))
    trainer = Trainer(config=TrainerConfig(num_steps=1), collect=collect, actor=SimpleNamespace(chunks=[], arch=None),
                      engine=engine, next_prompts=lambda k: [], eval_prompts=[], decode=str, reward_fn=None,
                      logger=None)
    assert type(trainer.weight_sync) is EngineLoad
    metrics = trainer.sync_weights(4)
    assert engine.names == ["w0", "w1", "w2"] and engine.version == 4
    assert metrics["engine/x"] == 1.0 and metrics["time/sync_s"] >= 0


def test_requests_per_sync_follow_bytes_not_tensors_at_30b_a3b():
    """A sync is as many requests per server as buckets. plan_buckets (the sizing) packs as iter_buckets (the push)
    does, checked on real tensors; at Qwen3-30B-A3B's 18,867 tensors (18,432 experts) the count stays within
    2 x ceil(bytes / bucket), and splitting every tensor into 8 pieces (8x the tensors, same bytes) barely moves it."""
    import math

    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.weight_sync.buckets import iter_buckets, plan_buckets
    from megatron_dapo.weights.plan import hf_tensor_specs
    from tools.bench_weight_sync import SIZING_MODELS

    g = torch.Generator().manual_seed(0)
    named = [(f"t{i}", torch.zeros(int(torch.randint(1, 400, (1,), generator=g)),
                                   dtype=torch.bfloat16 if i % 17 else torch.float32)) for i in range(300)]
    made = list(iter_buckets(named, 1000))
    plan = plan_buckets(((t.numel() * t.element_size(), t.dtype) for _, t in named), 1000)
    assert plan.buckets == len(made) and plan.tensors == 300
    assert plan.nbytes == sum(b.nbytes for b in made) and plan.largest_bucket == max(b.nbytes for b in made)

    arch = ModelArch.from_hf(SIZING_MODELS["qwen3-30B-A3B"])
    specs = hf_tensor_specs(arch, torch.bfloat16)
    assert len(specs) == 18_867 and sum(".experts." in t.name for t in specs) == 48 * 128 * 3
    bucket = 512 << 20
    plan = plan_buckets(((t.nbytes, t.dtype) for t in specs), bucket)
    assert plan.nbytes == 2 * arch.num_parameters()  # bf16: every parameter once
    assert plan.buckets <= 2 * math.ceil(plan.nbytes / bucket)
    assert plan.buckets == 114  # measured; ceil(61.06 GB / 512 MiB) = 114: the expert tensors pack tightly
    finer = plan_buckets(((t.nbytes // 8, t.dtype) for t in specs for _ in range(8)), bucket)
    assert finer.tensors == 8 * plan.tensors and abs(finer.buckets - plan.buckets) <= 1
