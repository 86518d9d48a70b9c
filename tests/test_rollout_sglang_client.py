"""SGLangEngine client against fake SGLang servers on 127.0.0.1 (tests/sglang/fake_server.py):
request building, response parsing, bucketing, retries on a dead server, abort, weight updates, restart."""

import os
import stat
import sys
from pathlib import Path

import httpx
import pytest
import torch

from megatron_dapo.rollout.buckets import iter_buckets
from megatron_dapo.rollout.sglang_engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.sglang_protocol import generate_payload, parse_generate_response, sample_rid
from megatron_dapo.rollout.sglang_server import ServerConfig
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.sglang.fake_server import fake_logprob, fake_token, serve

REPO = Path(__file__).resolve().parents[1]


def _reqs(count, n=2, max_new=5, **kw):
    sp = SamplingParams(max_new_tokens=max_new, **kw)
    return [RolloutRequest(prompt_ids=[3, 4, i + 1], n=n, sampling=sp, request_id=f"p{i}")
            for i in range(count)]


@pytest.fixture
def fakes():
    servers = [serve() for _ in range(2)]
    yield servers
    for server, _ in servers:
        server.shutdown()
        server.server_close()


def _url(server):
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_payload_and_parsing():
    req = _reqs(1, max_new=7, temperature=0.6, top_p=0.9, top_k=5, stop_token_ids=(2,), seed=11)[0]
    body = generate_payload(req, 1)
    assert body["rid"] == sample_rid("p0", 1) and body["input_ids"] == [3, 4, 1]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["temperature"], sp["top_p"], sp["top_k"], sp["stop_token_ids"]) == \
        (7, 0.6, 0.9, 5, [2])
    assert sp["sampling_seed"] != generate_payload(req, 0)["sampling_params"]["sampling_seed"]
    for kind in ("length", "stop", "abort"):
        out = parse_generate_response({"output_ids": [5, 6], "meta_info": {
            "finish_reason": {"type": kind}, "weight_version": "3",
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]]}})
        assert (out.response_ids, out.logprobs, out.finish_reason, out.weight_version) == \
            ([5, 6], [-0.5, -1.5], kind, 3)
    with pytest.raises(ValueError, match="finish_reason"):
        parse_generate_response({"meta_info": {"finish_reason": {"type": "eos"}}})
    with pytest.raises(ValueError, match="disagree"):
        parse_generate_response({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"},
                                                                  "output_token_logprobs": []}})


def test_buckets_bound_size_split_dtype_and_roundtrip():
    torch.manual_seed(0)
    named = [(f"w{i}", torch.randn(10, 10)) for i in range(5)] + [("big", torch.randn(300))] + \
            [("half", torch.randn(4).half()), ("f", torch.randn(3))]
    buckets = list(iter_buckets(iter(named), bucket_bytes=1000))  # 400 B per 10x10 fp32
    assert [[m.name for m in b.metas] for b in buckets] == \
        [["w0", "w1"], ["w2", "w3"], ["w4"], ["big"], ["half"], ["f"]]
    assert all(b.nbytes <= 1000 or len(b.metas) == 1 for b in buckets)
    back = dict(kv for b in buckets for kv in b.named_tensors())
    for name, t in named:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_generate_order_parsing_and_spread(fakes):
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], client=ClientConfig(max_concurrency=4))
    reqs = _reqs(6, n=3, max_new=4, seed=5)
    groups = engine.generate(reqs)
    assert [g[0].request_id for g in groups] == [r.request_id for r in reqs]
    for req, group in zip(reqs, groups):
        for s in group:
            seed = generate_payload(req, s.index)["sampling_params"]["sampling_seed"]
            expected = [fake_token(req.prompt_ids, seed, k) for k in range(4)]
            assert s.response_ids == expected and s.logprobs == [fake_logprob(t) for t in expected]
            assert s.finish_reason == "length"
    counts = [len(st.rids) for _, st in fakes]
    assert sum(counts) == 18 and min(counts) > 0
    engine.shutdown()


def test_dead_server_requests_are_retried_not_lost(fakes):
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], client=ClientConfig(max_retries=2))
    fakes[0][0].shutdown()
    fakes[0][0].server_close()  # connection refused from now on
    groups = engine.generate(_reqs(8, n=2))
    assert sorted(g[0].request_id for g in groups) == [f"p{i}" for i in range(8)]
    assert all(s.finish_reason == "length" and len(s.response_ids) == 5 for g in groups for s in g)
    assert len(fakes[1][1].rids) == 16
    assert not engine.health()
    engine.shutdown()


def test_abort_mid_stream_returns_all_groups():
    server, state = serve(token_delay_s=0.01)
    engine = SGLangEngine(server_urls=[_url(server)], client=ClientConfig(max_concurrency=4))
    reqs = _reqs(10, n=2, max_new=30)
    seen, aborted = [], []
    for group in engine.stream(reqs):
        seen.append(group)
        if len(seen) == 1:
            aborted = engine.abort()
    assert sorted(g[0].request_id for g in seen) == sorted(r.request_id for r in reqs)
    assert all(len(g) == 2 for g in seen) and len(aborted) >= 5
    late = [s for g in seen if g[0].request_id in aborted for s in g]
    # A sample may still finish in the instant before its abort lands; nothing else may happen to it.
    assert all(s.finish_reason == "abort" or len(s.response_ids) == 30 for s in late)
    assert sum(s.finish_reason == "abort" for s in late) >= 8
    assert set(state.aborted) <= {sample_rid(i, k) for i in aborted for k in range(2)}
    assert state.aborted  # in-flight ones got /abort_request by rid
    engine.shutdown()
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("mode", ["tensor", "disk"])
def test_weight_update_buckets_reach_server(fakes, mode, tmp_path):
    urls = [_url(s) for s, _ in fakes]
    engine = SGLangEngine(server_urls=urls, client=ClientConfig(update_mode=mode, bucket_bytes=256,
                                                                disk_dir=str(tmp_path)))
    named = [(f"model.layers.{i}.w", torch.randn(8, 8)) for i in range(3)]
    named.append(("lm_head.weight", torch.randn(5)))
    engine.update_weights(iter(named), version=4)
    assert engine.weight_version == 4
    for _, state in fakes:
        for name, t in named:
            torch.testing.assert_close(torch.tensor(state.weights[name]), t)
        calls = state.calls
        if mode == "tensor":
            assert calls["/update_weights_from_tensor"] == 4  # 256 B buckets: one tensor each
            assert calls["/begin_weight_update"] == calls["/end_weight_update"] == 1
        else:
            assert calls["/update_weights_from_disk"] == 1
    sample = engine.generate(_reqs(1, n=1))[0][0]
    assert sample.weight_version == 4
    engine.shutdown()


def test_pause_resume_reach_every_server(fakes):
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes])
    engine.pause()
    assert all(st.paused.is_set() for _, st in fakes)
    engine.resume()
    assert not any(st.paused.is_set() for _, st in fakes)
    engine.shutdown()


def test_launch_restart_and_resync(tmp_path):
    """A launched server that dies is restarted, re-synced from the last disk weights, and its
    requests are retried: every group comes back complete."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO}/tests/sglang/fake_server.py "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    cfg = ServerConfig(model_path=str(tmp_path), num_servers=1, base_port=_free_port(), device="cpu",
                       python=str(wrapper), startup_timeout_s=30, log_dir=str(tmp_path / "logs"),
                       env={"FAKE_SGLANG_LIFETIME": "60"})
    engine = SGLangEngine(cfg, client=ClientConfig(update_mode="disk", disk_dir=str(tmp_path / "w")))
    try:
        assert engine.health()
        engine.update_weights([("w", torch.ones(3))], version=2)
        engine.group.servers[0].proc.kill()
        engine.group.servers[0].proc.wait()
        groups = engine.generate(_reqs(3, n=2))
        assert len(groups) == 3 and all(s.finish_reason == "length" for g in groups for s in g)
        assert engine.restarts == 1
        stats = httpx.get(f"{cfg.server_url(0)}/stats").json()
        assert stats["version"] == "2" and stats["weights"]["w"] == [1.0, 1.0, 1.0]
    finally:
        engine.shutdown()
    assert not engine.group.servers[0].alive()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return port if port < 60000 else 30123


def test_config_validation():
    with pytest.raises(ValueError, match="num_servers"):
        ServerConfig(model_path="m", num_servers=0)
    with pytest.raises(ValueError, match="--weight-sync-mode"):
        ClientConfig(update_mode="nfs")
    with pytest.raises(ValueError, match="exactly one"):
        SGLangEngine()
    assert ServerConfig(model_path="m", num_servers=2).router is True
    cmd = ServerConfig(model_path="m", device="cpu", base_port=31000).server_command(0)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "127.0.0.1" in cmd and "31000" in cmd
    assert os.path.basename(cmd[0]).startswith("python")
