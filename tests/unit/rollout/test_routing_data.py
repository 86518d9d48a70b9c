"""The routing data path of --moe-routing-replay, rollout side: what the engines return as Sample.routed_experts
(SGLang's wire format, decoded; the embedded engine's router hooks, against a teacher-forced HF forward), partial
rollouts, and the trip into TrainSample.routed_experts through rank 0's data plane. The real SGLang server's routes
are checked against HF in tests/sglang/test_sglang_families.py (qwen3_moe case)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_dapo.actor import TrainSample
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.partial_rollout import continuation_request, extend
from megatron_dapo.rollout.sglang.protocol import generate_payload, parse_generate_response, to_sample
from megatron_dapo.rollout.sglang.server import ServerConfig
from megatron_dapo.rollout.types import RolloutRequest, RoutingShape, Sample, SamplingParams, routing_dtype, routing_of
from megatron_dapo.trainer.dataplane import pack, unpack
from tests.dist.actor_common import tiny_config
from tests.hf_reference import hf_routes

EOS = 1
QWEN3_30B_A3B = RoutingShape(num_layers=48, top_k=8, num_experts=128)


def _moe_model(seed: int, **overrides) -> torch.nn.Module:
    """A tiny qwen3_moe (8 experts, top-2) with routers x10: decisive top-k choices, no fp32 near-ties."""
    fields = dict(tiny_config("qwen3_moe", vocab_size=96, num_hidden_layers=3), model_type="qwen3_moe",
                  tie_word_embeddings=False, eos_token_id=EOS, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.15)
            if name.endswith("mlp.gate.weight"):
                p.mul_(10.0)
    return model


def _requests(n_prompts: int, sampling: SamplingParams) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(2)
    return [RolloutRequest(prompt_ids=torch.randint(2, 96, (int(torch.randint(3, 11, (1,), generator=g)),),
                                                    generator=g).tolist(),
                           n=2, sampling=sampling, request_id=f"r{i}") for i in range(n_prompts)]


def test_routing_dtype_and_30b_a3b_bytes():
    assert routing_dtype(8) == routing_dtype(128) == routing_dtype(256) == torch.uint8
    assert routing_dtype(257) == torch.int32  # gloo carries no int16
    row = QWEN3_30B_A3B.num_layers * QWEN3_30B_A3B.top_k
    assert row * torch.tensor([], dtype=QWEN3_30B_A3B.dtype).element_size() == 384  # B a token, as uint8
    assert row * 4 == 1536 and len(base64.b64encode(bytes(row * 4))) == 2048  # int32 on SGLang's wire, base64
    arch = ModelArch.from_hf(dict(tiny_config("qwen3_moe"), model_type="qwen3_moe"))
    assert routing_of(arch, False) is None
    assert routing_of(arch, True) == RoutingShape(arch.num_layers, arch.num_experts_per_tok, arch.num_experts)
    with pytest.raises(ValueError, match="--moe-routing-replay needs a mixture-of-experts model"):
        routing_of(ModelArch.from_hf(dict(tiny_config("qwen3"), model_type="qwen3")), True)


def test_sglang_wire_format_decodes_into_the_sample():
    """meta_info.routed_experts is base64 of int32 [seqlen - 1, L, K] (SGLang 0.5.23, tokenizer_manager.py:2602)."""
    shape = RoutingShape(num_layers=3, top_k=2, num_experts=8)
    req = RolloutRequest(prompt_ids=[5, 6, 7], n=1, sampling=SamplingParams(max_new_tokens=4), request_id="a")
    assert "return_routed_experts" not in generate_payload(req, 0)
    assert generate_payload(req, 0, routed_experts=True)["return_routed_experts"] is True
    ids = np.random.default_rng(0).integers(0, 8, size=(3 + 2 - 1, 3, 2)).astype(np.int32)
    body = {"output_ids": [9, 10], "meta_info": {
        "output_token_logprobs": [[-0.5, 9, None], [-0.25, 10, None]], "finish_reason": {"type": "length"},
        "routed_experts": base64.b64encode(ids.tobytes()).decode()}}
    sample = to_sample(req, 0, parse_generate_response(body, routing=shape), 0)
    assert sample.routed_experts.dtype == torch.uint8
    assert torch.equal(sample.routed_experts.long(), torch.from_numpy(ids).long())
    assert parse_generate_response(body).routed_experts is None  # not asked: not decoded
    with pytest.raises(ValueError, match="--enable-return-routed-experts"):
        parse_generate_response({**body, "meta_info": {k: v for k, v in body["meta_info"].items()
                                                       if k != "routed_experts"}}, routing=shape)
    with pytest.raises(ValueError, match="not a multiple of the model's 3 layers x top-2"):
        parse_generate_response({**body, "meta_info": {**body["meta_info"], "routed_experts": base64.b64encode(
            ids.tobytes()[:-4]).decode()}}, routing=shape)
    with pytest.raises(ValueError, match="routed_experts has shape"):  # rows must be prompt + response - 1
        Sample(request_id="a", index=0, prompt_ids=[5, 6, 7], response_ids=[9], logprobs=[-0.5],
               finish_reason="stop", weight_version=0, routed_experts=torch.zeros(4, 3, 2, dtype=torch.uint8))
    cmd = ServerConfig(model_path="/m", device="cpu", return_routed_experts=True).server_command(0)
    assert "--enable-return-routed-experts" in cmd
    assert "--enable-return-routed-experts" not in ServerConfig(model_path="/m", device="cpu").server_command(0)


@pytest.mark.parametrize("overrides", [{}, dict(mlp_only_layers=[1])], ids=["all-moe", "dense-layer-1"])
def test_embedded_engine_routes_equal_teacher_forced_hf(overrides):
    """Batched, left-padded, sampled generation: every fed-in token's experts equal HF's top-k (order included) on
    the whole sequence; a continuation of a cut sample (partial rollout) re-routes prompt + prefix, so the joined
    sample's rows are the whole sequence's."""
    model = _moe_model(3, **overrides)
    engine = EmbeddedEngine(model, max_batch_size=3, record_routing=True)
    assert engine.routing == RoutingShape(3, 2, 8)
    groups = engine.generate(_requests(3, SamplingParams(max_new_tokens=7, seed=11)))
    samples = [s for g in groups for s in g]
    rows = 0
    for s in samples:
        ids = s.prompt_ids + s.response_ids
        assert s.routed_experts.dtype == torch.uint8 and s.routed_experts.shape == (len(ids) - 1, 3, 2)
        assert torch.equal(s.routed_experts.long(), hf_routes(model, ids)[:-1]), s.request_id
        rows += len(ids) - 1
    assert rows > 40
    if overrides:
        assert not s.routed_experts[:, 1].any()  # the dense layer's column: zeros, as SGLang's
    # partial rollout: sample 0 cut after 3 tokens, continued, joined
    first = samples[0]
    cut = len(first.prompt_ids) + 3 - 1
    prefix = Sample(request_id=first.request_id, index=first.index, prompt_ids=first.prompt_ids,
                    response_ids=first.response_ids[:3], logprobs=first.logprobs[:3], finish_reason="abort",
                    weight_version=0, routed_experts=first.routed_experts[:cut])
    req = continuation_request(first.prompt_ids, prefix, SamplingParams(max_new_tokens=7), 5, "cont")
    (cont,), = engine.generate([req])
    joined = extend(prefix, cont, first.prompt_ids)
    assert joined.routed_experts.shape[0] == len(joined.prompt_ids) + len(joined.response_ids) - 1
    assert torch.equal(joined.routed_experts.long(), hf_routes(model, joined.prompt_ids + joined.response_ids)[:-1])
    # off: nothing recorded
    plain = EmbeddedEngine(model, max_batch_size=3)
    assert all(s.routed_experts is None for g in plain.generate(_requests(1, SamplingParams(max_new_tokens=3)))
               for s in g)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        EmbeddedEngine(dict(tiny_config("qwen3", vocab_size=96), model_type="qwen3"), record_routing=True)


def _rollout_cls():
    """The trainer's Rollout (what the data plane packs and unpacks)."""
    from megatron_dapo.trainer.loop import Rollout

    return Rollout


def test_dataplane_carries_routes_only_when_replay_is_on():
    shape = RoutingShape(num_layers=3, top_k=2, num_experts=8)
    g = torch.Generator().manual_seed(0)

    _Rollout = _rollout_cls()

    def row(p: int, r: int):
        routes = torch.randint(0, 8, (p + r - 1, 3, 2), generator=g).to(torch.uint8)
        sample = TrainSample(tokens=list(range(p + r)), prompt_len=p, advantage=0.5, routed_experts=routes)
        return _Rollout(sample, torch.randn(r, generator=g))

    minibatches = [[row(4, 3), row(2, 5)], [row(6, 1)]]
    share = pack(minibatches, shape)
    tokens = 7 + 7 + 7
    assert share.routes.dtype == torch.uint8 and share.routes.numel() == (tokens - 3) * 3 * 2
    assert share.nbytes == pack(minibatches).nbytes + (tokens - 3) * 6  # 6 B a fed-in token: L x K uint8
    back = unpack(share, _Rollout, shape)
    for mb_sent, mb_back in zip(minibatches, back, strict=True):
        for a, b in zip(mb_sent, mb_back, strict=True):
            assert torch.equal(a.sample.routed_experts, b.sample.routed_experts)
            assert b.sample.tokens == a.sample.tokens
    off = unpack(pack(minibatches), _Rollout)
    assert pack(minibatches).routes is None
    assert all(r.sample.routed_experts is None for mb in off for r in mb)
    missing = [[_Rollout(TrainSample(tokens=[1, 2, 3], prompt_len=2, advantage=0.0), torch.zeros(1))]]
    with pytest.raises(ValueError, match="--moe-routing-replay: a row's routed experts are None"):
        pack(missing, shape)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "off"])
def test_trainer_carries_sample_routes_into_train_samples_only_with_replay(monkeypatch, replay):
    """Trainer.build_samples (rank 0): Sample.routed_experts becomes TrainSample.routed_experts with
    --moe-routing-replay, and nothing is carried without it."""
    from types import SimpleNamespace

    from megatron_dapo.algorithm import grpo_advantages
    from megatron_dapo.rollout.collect import Prompt, ScoredGroup
    from megatron_dapo.trainer import loop

    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_world_size", lambda: 1)
    arch = ModelArch.from_hf(dict(tiny_config("qwen3_moe"), model_type="qwen3_moe"))
    shape = routing_of(arch, True)
    actor = SimpleNamespace(arch=arch, config=SimpleNamespace(moe_routing_replay=replay))
    g = torch.Generator().manual_seed(0)
    samples = [Sample(request_id="p", index=i, prompt_ids=[3, 4, 5], response_ids=[6] * (i + 1),
                      logprobs=[-1.0] * (i + 1), finish_reason="stop", weight_version=0,
                      routed_experts=torch.randint(0, 8, (3 + i, shape.num_layers, shape.top_k),
                                                   generator=g).to(shape.dtype)) for i in range(2)]
    group = ScoredGroup(prompt=Prompt(prompt_ids=[3, 4, 5], ground_truth="", index=0), samples=samples,
                        accs=[True, False], rewards=[1.0, -1.0])
    trainer = SimpleNamespace(actor=actor, config=SimpleNamespace(advantage_estimator=grpo_advantages,
                                                                  global_batch_size=None, kl_reward=None),
                              collect=SimpleNamespace(overlong=SimpleNamespace(filter_truncated=False)),
                              dp_split=lambda mb, dp: [list(range(len(mb)))])
    trainer.routing = loop.Trainer.routing.func(trainer)
    assert trainer.routing == (shape if replay else None)
    shares, _ = loop.Trainer.build_samples(trainer, [group])
    rows = [r.sample for r in shares[0][0]]
    assert len(rows) == 2
    for sample, row in zip(samples, rows, strict=True):
        if replay:
            assert torch.equal(row.routed_experts, sample.routed_experts)
        else:
            assert row.routed_experts is None


def test_checkpointed_samples_keep_their_routes():
    """A checkpoint keeps the routes of the samples it holds: --partial-rollout's carried groups (a finished sample of
    a cut group is trained after the resume as it is) and --async-rollout's batch ahead; through torch.save and a
    weights_only load."""
    import io

    from megatron_dapo.rollout.async_rollout import AheadBatch, batch_from_state, batch_state
    from megatron_dapo.rollout.collect import Prompt, ScoredGroup
    from megatron_dapo.rollout.partial_rollout import CarriedGroup, from_state, state

    g = torch.Generator().manual_seed(1)
    prompt = Prompt(prompt_ids=[3, 4, 5], ground_truth="1", index=7)
    samples = [Sample(request_id="p", index=0, prompt_ids=[3, 4, 5], response_ids=[6, 7], logprobs=[-1.0, -0.5],
                      finish_reason="stop", weight_version=2,
                      routed_experts=torch.randint(0, 8, (4, 3, 2), generator=g).to(torch.uint8)),
               Sample(request_id="p", index=1, prompt_ids=[3, 4, 5], response_ids=[], logprobs=[],
                      finish_reason="abort", weight_version=2)]

    def through_disk(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    carried = from_state(through_disk(state([CarriedGroup(prompt=prompt, samples=samples, seed=3, first_step=1)])))
    ahead = batch_from_state(through_disk(batch_state(AheadBatch.from_checkpoint(
        2, 1, [ScoredGroup(prompt=prompt, samples=samples, accs=[True, False], rewards=[1.0, -1.0])], {}))))
    for back in (carried[0].samples, ahead.result()[0][0].samples):
        assert torch.equal(back[0].routed_experts, samples[0].routed_experts)
        assert back[0].routed_experts.dtype == torch.uint8 and back[1].routed_experts is None
