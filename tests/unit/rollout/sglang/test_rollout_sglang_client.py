"""SGLangEngine client against fake SGLang servers on 127.0.0.1 (tests/sglang/fake_server.py):
request building, response parsing, bucketing, retries on a dead server, abort, weight updates, restart,
attached servers that die and come back, API keys, and launched servers dying with the trainer."""

import json
import os
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.sglang.protocol import generate_payload, parse_generate_response, sample_rid, to_sample
from megatron_dapo.rollout.sglang.server import ServerConfig
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from megatron_dapo.weight_sync.buckets import iter_buckets
from tests.ports import free_port_block
from tests.procs import running
from tests.sglang import full_push
from tests.sglang.fake_server import fake_logprob, fake_token, kill, serve
from tests.torchrun import REPO


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


def _spanned(spans, served, n=4):
    """A /generate response of `n` tokens with meta_info.weight_versions `spans` and meta_info.weight_version
    `served`."""
    ids = list(range(10, 10 + n))
    return {"output_ids": ids, "meta_info": {
        "finish_reason": {"type": "length"}, "weight_version": served, "weight_versions": spans,
        "output_token_logprobs": [[-0.5, t, None] for t in ids]}}


def _span(version, start, end):
    return {"version": version, "start": start, "end": end}


def test_weight_versions_become_token_versions():
    """meta_info.weight_versions (SGLang 0.5.23, half-open output-token spans): one version leaves token_versions
    empty as without the field; a change mid-response labels each token and the sample with its first version."""
    req = _reqs(1)[0]
    one = parse_generate_response(_spanned([_span("3", 0, 4)], "3"))
    assert (one.weight_version, one.token_versions) == (3, [])
    default = parse_generate_response(_spanned([_span("default", 0, 4)], "default"))
    assert (default.weight_version, default.token_versions) == (None, [])  # as without the field: the fallback
    assert to_sample(req, 0, default, 7).versions() == [7] * 4
    empty = parse_generate_response(_spanned([_span("5", 0, 0)], "5", n=0))
    assert (empty.weight_version, empty.token_versions, empty.response_ids) == (5, [], [])
    mid = parse_generate_response(_spanned([_span("3", 0, 1), _span("4", 1, 3), _span("6", 3, 4)], "6"))
    assert (mid.weight_version, mid.token_versions, mid.served_version) == (3, [3, 4, 4, 6], "6")
    sample = to_sample(req, 1, mid, 9)
    assert (sample.weight_version, sample.token_versions, sample.versions()) == (3, [3, 4, 4, 6], [3, 4, 4, 6])


@pytest.mark.parametrize(("spans", "served", "match"), [
    ([_span("3", 0, 3)], "3", r"covers 3 tokens, but the response has 4"),
    ([_span("3", 0, 5)], "3", r"covers 5 tokens, but the response has 4"),
    ([_span("3", 1, 4)], "3", r"weight_versions\[0\] covers \[1, 4\)"),
    ([_span("3", 0, 2), _span("4", 1, 4)], "4", r"weight_versions\[1\] covers \[1, 4\)"),
    ([_span("3", 0, 2), _span("4", 3, 4)], "4", r"weight_versions\[1\] covers \[3, 4\)"),
    ([_span("3", 0, 2), _span("4", 2, 2), _span("5", 2, 4)], "5", r"weight_versions\[1\] covers \[2, 2\)"),
    ([_span("4", 0, 2), _span("3", 2, 4)], "3", r"decreasing"),
    ([_span("default", 0, 2), _span("1", 2, 4)], "1", r"not an integer"),
    ([_span("3", 0, 2), _span("4", 2, 4)], "3", r"ends with version '4' but meta_info.weight_version is '3'"),
    ([_span("3", "0", 4)], "3", r"weight_versions\[0\].start is '0'"),
    ([{"start": 0, "end": 4}], None, r"weight_versions\[0\] has no version"),
    ([], "3", r"expected a non-empty list"),
    ({"version": "3", "start": 0, "end": 4}, "3", r"expected a non-empty list"),
])
def test_malformed_weight_versions_are_refused(spans, served, match):
    """Spans that do not cover exactly the response tokens in order, or whose versions cannot be ordered or
    decrease, raise naming meta_info.weight_versions: nothing is guessed."""
    with pytest.raises(ValueError, match=r"meta_info\.weight_versions") as err:
        parse_generate_response(_spanned(spans, served))
    assert err.match(match)


def test_weight_update_mid_request_labels_tokens_through_the_client(fakes):
    """A fake server that sends meta_info.weight_versions: a sample held after its first token while the server's
    version moves 3 -> 4 comes back with token_versions [3, 4, 4, 4]; the one generated after, all 4 (empty)."""
    for _, state in fakes:
        state.weight_versions, state.version = True, "3"
    held = _rids("p0", n=1)
    _hold(fakes, held)
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], client=ClientConfig(max_concurrency=4))
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(engine.generate, _reqs(1, n=1, max_new=4))
        _wait_holding(fakes, held)
        for _, state in fakes:
            state.version = "4"
            state.held -= held
        [[sample]] = first.result(timeout=60)
    assert (sample.weight_version, sample.token_versions, len(sample.response_ids)) == (3, [3, 4, 4, 4], 4)
    [[after]] = engine.generate(_reqs(1, n=1, max_new=4))
    assert (after.weight_version, after.token_versions, after.versions()) == (4, [], [4] * 4)
    engine.shutdown()


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


def test_buckets_keep_a_pair_together_past_the_size():
    """A pair the server fuses only within one request (DeepSeek-V3's q_a_proj / kv_a_proj_with_mqa) stays in one
    bucket past bucket_bytes, with what comes between; a partner that never comes, or a dtype change in between,
    is an error naming the pair; `weights.mapping.keep_together` lists the family's pairs for every layer."""
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.models.registry import family
    from megatron_dapo.weights.mapping import keep_together

    named = [(n, torch.zeros(100)) for n in ("a", "q_a", "q_b", "kv_a", "kv_b", "o")]  # 400 B each
    buckets = list(iter_buckets(iter(named), bucket_bytes=1000, keep_together={"q_a": "kv_a"}))
    assert [[m.name for m in b.metas] for b in buckets] == [["a", "q_a", "q_b", "kv_a"], ["kv_b", "o"]]
    assert [[m.name for m in b.metas] for b in iter_buckets(iter(named), bucket_bytes=1000)] == \
        [["a", "q_a"], ["q_b", "kv_a"], ["kv_b", "o"]]
    with pytest.raises(ValueError, match="never came"):
        list(iter_buckets(iter(named[:3]), bucket_bytes=1000, keep_together={"q_a": "kv_a"}))
    mixed = [named[1], ("bias", torch.zeros(3, dtype=torch.float64)), named[3]]
    with pytest.raises(ValueError, match="q_a|kv_a"):
        list(iter_buckets(iter(mixed), bucket_bytes=1000, keep_together={"q_a": "kv_a"}))
    fam = family("deepseek_v3")
    arch = ModelArch.from_hf({**fam.tiny_config, "model_type": "deepseek_v3"})
    assert keep_together(arch) == {f"model.layers.{i}.self_attn.q_a_proj.weight":
                                   f"model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight" for i in range(4)}
    lite = ModelArch.from_hf({**fam.tiny_config, "model_type": "deepseek_v3", "q_lora_rank": None})
    assert keep_together(lite) == {}  # no q_a_proj: SGLang loads kv_a_proj_with_mqa alone
    assert keep_together(ModelArch.from_hf({**family("qwen3_moe").tiny_config, "model_type": "qwen3_moe"})) == {}


def test_generate_order_parsing_and_spread(fakes):
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], client=ClientConfig(max_concurrency=4))
    reqs = _reqs(6, n=3, max_new=4, seed=5)
    groups = engine.generate(reqs)
    assert [g[0].request_id for g in groups] == [r.request_id for r in reqs]
    for req, group in zip(reqs, groups, strict=True):
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


def _hold(fakes, rids: set[str]) -> None:
    """Every fake server holds `rids` after their first token (fake_server: `state.held`)."""
    for _, state in fakes:
        state.held |= rids


def _wait_holding(fakes, rids: set[str]) -> None:
    """Waits until exactly `rids` are held on the servers (sent, one token generated, waiting): what is in flight."""
    deadline = time.monotonic() + 60  # a wait for a state, not a timing assertion: generous on a loaded machine
    while set().union(*(state.holding for _, state in fakes)) != rids:
        assert time.monotonic() < deadline, f"held {set().union(*(st.holding for _, st in fakes))}, want {rids}"
        time.sleep(0.005)


def _rids(*request_ids: str, n: int = 2) -> set[str]:
    return {sample_rid(r, k) for r in request_ids for k in range(n)}


def test_abort_of_everything_in_flight_is_one_abort_all_per_server(fakes):
    """abort() (collect.py's cut, the stop path): the held samples in flight stop after their one token, the queued
    ones never reach a server, every group still comes out; one {abort_all} per server, no per-rid call."""
    _hold(fakes, _rids(*(f"p{i}" for i in range(1, 10))))
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], client=ClientConfig(max_concurrency=4))
    reqs = _reqs(10, n=2, max_new=30)
    seen, aborted = [], []
    for group in engine.stream(reqs):
        seen.append(group)
        if len(seen) == 1:  # p0, the one not held; 4 held samples fill --sglang-max-concurrency 4 then
            _wait_holding(fakes, _rids("p1", "p2"))
            aborted = engine.abort()
    assert [g[0].request_id for g in seen][0] == "p0" and [len(s.response_ids) for s in seen[0]] == [30, 30]
    assert sorted(g[0].request_id for g in seen) == sorted(r.request_id for r in reqs)
    assert aborted == sorted(f"p{i}" for i in range(1, 10))
    late = {(s.request_id, s.index): s for g in seen[1:] for s in g}
    assert all(s.finish_reason == "abort" for s in late.values())
    sent = set().union(*(state.rids for _, state in fakes))
    assert sent == _rids("p0", "p1", "p2")  # p3-p9 were queued behind the semaphore: never sent
    assert sorted(len(s.response_ids) for s in late.values()) == [0] * 14 + [1] * 4  # the held ones had one token
    for _, state in fakes:
        assert state.abort_bodies == [{"abort_all": True}] and not state.aborted
    engine.shutdown()


@pytest.mark.parametrize("mode", ["tensor", "disk"])
def test_weight_update_buckets_reach_server(fakes, mode, tmp_path):
    urls = [_url(s) for s, _ in fakes]
    engine = SGLangEngine(server_urls=urls, client=ClientConfig(bucket_bytes=256, disk_dir=str(tmp_path)))
    named = [(f"model.layers.{i}.w", torch.randn(8, 8)) for i in range(3)]
    named.append(("lm_head.weight", torch.randn(5)))
    full_push(engine, mode).update(iter(named), version=4)
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


def test_attach_mode_generates_through_the_router_and_syncs_each_server(fakes, tmp_path):
    """--sglang-router-url: first tries of /generate go to the router (a fake server standing in for it), weight
    updates to each attached server, never to the router."""
    router, router_state = serve()
    try:
        urls = [_url(s) for s, _ in fakes]
        engine = SGLangEngine(server_urls=urls, router_url=_url(router) + "/",
                              client=ClientConfig(disk_dir=str(tmp_path), max_retries=2,
                                                  server_wait_s=30))
        groups = engine.generate(_reqs(4, n=2))
        assert sum(len(g) for g in groups) == 8
        assert len(router_state.rids) == 8 and [len(st.rids) for _, st in fakes] == [0, 0]
        full_push(engine, "disk").update(iter([("lm_head.weight", torch.randn(5))]), version=2)
        assert "/update_weights_from_disk" not in router_state.calls
        assert [st.calls["/update_weights_from_disk"] for _, st in fakes] == [1, 1]
        assert engine.generate(_reqs(1, n=1))[0][0].weight_version == 2
        engine.shutdown()
    finally:
        router.shutdown()
        router.server_close()
    with pytest.raises(ValueError, match="sglang-router-url.*attach mode"):
        SGLangEngine(ServerConfig(model_path="m"), router_url="http://127.0.0.1:1")


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
    wrapper = _fake_python(tmp_path)
    cfg = ServerConfig(model_path=str(tmp_path), num_servers=1, base_port=free_port_block(2), device="cpu",
                       python=str(wrapper), startup_timeout_s=30, log_dir=str(tmp_path / "logs"),
                       env={"FAKE_SGLANG_LIFETIME": "60"})
    engine = SGLangEngine(cfg, client=ClientConfig(disk_dir=str(tmp_path / "w")))
    try:
        assert engine.health()
        full_push(engine, "disk").update([("w", torch.ones(3))], version=2)
        engine.group.servers[0].proc.kill()
        engine.group.servers[0].proc.wait()
        groups = engine.generate(_reqs(3, n=2))
        assert len(groups) == 3 and all(s.finish_reason == "length" for g in groups for s in g)
        metrics = engine.take_metrics()
        assert metrics["rollout/servers_lost"] == 1
        assert metrics["rollout/server_restarts"] == 1 and metrics["sync/servers_recovered"] == 1
        assert metrics["rollout/retried_requests"] >= 1
        stats = httpx.get(f"{cfg.server_url(0)}/stats").json()
        assert stats["version"] == "2" and stats["weights"]["w"] == [1.0, 1.0, 1.0]
    finally:
        engine.shutdown()
    assert not engine.group.servers[0].alive()


def _fake_python(tmp_path: Path) -> Path:
    """An interpreter stand-in that runs the fake server with sglang.launch_server's arguments."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO}/tests/sglang/fake_server.py "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return wrapper


def test_taken_port_is_refused_before_any_server_starts(tmp_path):
    """A port of the group already listened on: start() names it and --sglang-base-port, and launches nothing."""
    import socket

    from megatron_dapo.rollout.sglang.server import ServerGroup

    base = free_port_block(3)
    cfg = ServerConfig(model_path="m", num_servers=2, base_port=base, device="cpu", python=str(_fake_python(tmp_path)),
                       log_dir=str(tmp_path / "logs"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))  # the router's port
        taken.listen()
        group = ServerGroup(cfg)
        with pytest.raises(RuntimeError, match=rf"port {base + 2} .*sglang router.*--sglang-base-port {base} \+ 2"):
            group.start()
        assert all(s.proc is None for s in group.servers)


def test_config_validation():
    with pytest.raises(ValueError, match="num_servers"):
        ServerConfig(model_path="m", num_servers=0)
    with pytest.raises(ValueError, match="exactly one"):
        SGLangEngine()
    assert ServerConfig(model_path="m", num_servers=2).router is True
    cmd = ServerConfig(model_path="m", device="cpu", base_port=31000).server_command(0)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "127.0.0.1" in cmd and "31000" in cmd
    assert os.path.basename(cmd[0]).startswith("python")


# ---- servers that die: attach mode (fake servers die and come back) ----------------------------------------


def _weights(count=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.w", torch.randn(4, 4, generator=g)) for i in range(count)]


def _killing(named, after, victim):
    """Yields `named`, killing the fake server `victim` (server, state) after `after` tensors."""
    for k, item in enumerate(named):
        if k == after:
            kill(*victim)
        yield item


def _poll(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_abort_of_some_requests_goes_by_rid_to_every_server(fakes):
    """abort(ids) of some of the requests in flight: one /abort_request {rid} per sample of theirs on every serving
    server (behind a router the engine does not know which holds it; SGLang ignores a rid it does not hold), no
    abort-all (it would stop the others too). p2 and p3 are held in flight, p3 is aborted, then p2 is let go."""
    _hold(fakes, _rids("p2", "p3"))
    engine = SGLangEngine(server_urls=[_url(s) for s, _ in fakes], client=ClientConfig(max_concurrency=8))
    seen = {}
    for group in engine.stream(_reqs(4, n=2, max_new=6)):
        seen[group[0].request_id] = group
        if len(seen) == 2:  # p0 and p1: the two not held
            assert sorted(seen) == ["p0", "p1"]
            _wait_holding(fakes, _rids("p2", "p3"))
            assert engine.abort(["p3", "p9"]) == ["p3"]  # p9 is no request of this engine: nothing to stop
            for _, state in fakes:
                assert sorted(b["rid"] for b in state.abort_bodies) == sorted(_rids("p3"))
                assert all(set(b) == {"rid"} for b in state.abort_bodies)
                state.held -= _rids("p2")
    assert sorted(seen) == ["p0", "p1", "p2", "p3"]
    assert [(s.finish_reason, len(s.response_ids)) for s in seen["p3"]] == [("abort", 1)] * 2
    assert all((s.finish_reason, len(s.response_ids)) == ("length", 6) for r in ("p0", "p1", "p2") for s in seen[r])
    for _, state in fakes:
        assert state.calls["/abort_request"] == 2
    engine.shutdown()


def test_attached_server_dies_while_generating_and_comes_back():
    """The only server dies with requests in flight and comes back 1 s later with its initial weights: the
    engine waits, re-syncs it to the current version, and redoes the lost samples."""
    server, state = serve(token_delay_s=0.01)
    port = server.server_address[1]
    engine = SGLangEngine(server_urls=[_url(server)], client=ClientConfig(max_concurrency=8, bucket_bytes=64,
                                                                           server_wait_s=30))
    named = _weights()
    full_push(engine).update(iter(named), version=3)
    engine.take_metrics()
    revived = []

    def die_and_return():
        kill(server, state)
        time.sleep(1.0)
        revived.append(serve(port=port))

    groups = []
    for group in engine.stream(_reqs(6, n=2, max_new=20)):
        groups.append(group)
        if len(groups) == 1:
            threading.Thread(target=die_and_return).start()
    assert sorted(g[0].request_id for g in groups) == [f"p{i}" for i in range(6)]
    assert all(s.finish_reason == "length" and len(s.response_ids) == 20 for g in groups for s in g)
    assert {s.weight_version for g in groups for s in g} == {3}
    new_state = revived[0][1]
    assert new_state.version == "3" and new_state.calls["/update_weights_from_tensor"] == 4  # one per bucket
    for name, t in named:
        torch.testing.assert_close(torch.tensor(new_state.weights[name]), t)
    metrics = engine.take_metrics()
    assert (metrics["rollout/server_returns"], metrics["sync/servers_recovered"]) == (1, 1)
    assert metrics["rollout/retried_requests"] >= 1 and metrics["rollout/recovery_s"] >= 1.0
    engine.shutdown()
    kill(*revived[0])


@pytest.mark.parametrize("mode", ["tensor", "disk"])
def test_attached_server_lost_during_update_catches_up(fakes, mode, tmp_path):
    """Server 0 dies in the middle of an update: the update completes on server 1, and server 0, once back,
    gets the whole new version before it takes requests."""
    urls = [_url(s) for s, _ in fakes]
    engine = SGLangEngine(server_urls=urls, client=ClientConfig(bucket_bytes=64, disk_dir=str(tmp_path),
                                                                server_wait_s=30))
    named = _weights(6, seed=1)
    port0 = fakes[0][0].server_address[1]
    full_push(engine, mode).update(_killing(iter(named), 2, fakes[0]), version=5)
    assert engine.weight_version == 5
    assert engine.take_metrics()["rollout/servers_lost"] == 1  # counted in the step that lost it
    for name, t in named:
        torch.testing.assert_close(torch.tensor(fakes[1][1].weights[name]), t)
    groups = engine.generate(_reqs(4, n=2))  # served by server 1 alone meanwhile
    assert all(s.weight_version == 5 and s.finish_reason == "length" for g in groups for s in g)
    back, back_state = serve(port=port0)
    try:
        recovered = []
        assert _poll(lambda: recovered.append(engine.take_metrics()["sync/servers_recovered"]) or sum(recovered))
        assert back_state.version == "5"
        for name, t in named:
            torch.testing.assert_close(torch.tensor(back_state.weights[name]), t)
        before = len(back_state.rids)
        engine.generate(_reqs(8, n=2))
        assert len(back_state.rids) > before  # back in rotation
    finally:
        engine.shutdown()
        kill(back, back_state)


def test_attached_server_that_never_returns_stops_the_run_naming_it():
    server, state = serve()
    url = _url(server)
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(server_wait_s=1.5))
    kill(server, state)
    # The wait is --sglang-server-wait-s (1.5 s here), not a default of minutes: 60 s only bounds a hang, and the
    # message below names the 1.5 s the wait was given.
    pool = ThreadPoolExecutor(1)
    with pytest.raises(UserError, match=rf"{url} did not answer /health for 1.5 s.*--sglang-server-wait-s"):
        pool.submit(engine.generate, _reqs(2, n=1)).result(timeout=60)  # one line: `error: ...`, exit 2
    pool.shutdown(wait=False)
    with pytest.raises(UserError, match=rf"{url} did not answer /health for 1.5 s"):  # a push after it: the same
        full_push(engine).update(iter(_weights()), version=1)
    engine.shutdown()


# ---- security: API keys and loopback binds ----------------------------------------------------------------


def test_client_sends_the_api_key_on_every_call():
    server, state = serve(api_key="s3cret", token_delay_s=0.005)
    url = _url(server)
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(api_key="s3cret", bucket_bytes=64,
                                                              max_concurrency=2))
    assert engine.health()
    full_push(engine).update(iter(_weights()), version=1)
    for k, _ in enumerate(engine.stream(_reqs(4, n=2, max_new=20))):
        if k == 0:
            engine.abort()
    engine.pause()
    engine.resume()
    calls = state.calls
    assert calls["/update_weights_from_tensor"] == 4 and calls["/generate"] >= 1 and calls["/abort_request"] == 1
    assert calls["/pause_generation"] == calls["/continue_generation"] == 1
    assert state.authorizations and set(state.authorizations) == {"Bearer s3cret"}
    engine.shutdown()
    with pytest.raises(UserError, match="--sglang-api-key"):  # refused at attach (/server_info answers 401)
        SGLangEngine(server_urls=[url])
    kill(server, state)


def test_launch_refuses_a_wide_bind_without_an_api_key():
    with pytest.raises(ValueError, match=r"0\.0\.0\.0.*--sglang-api-key.*--sglang-allow-no-api-key"):
        ServerConfig(model_path="m", host="0.0.0.0")
    with pytest.raises(ValueError, match="--sglang-api-key"):
        ServerConfig(model_path="m", host="10.1.2.3", num_servers=2)
    for host in ("127.0.0.1", "localhost", "::1"):
        assert "--api-key" not in ServerConfig(model_path="m", host=host).server_command(0)
    assert "--api-key" not in ServerConfig(model_path="m", host="0.0.0.0", allow_no_api_key=True).server_command(0)
    cfg = ServerConfig(model_path="m", host="0.0.0.0", api_key="k3y", num_servers=2)
    for cmd in (cfg.server_command(1, "/d/api_key.yaml"), cfg.router_command("/d/api_key.yaml")):
        # the key goes in a file (tests/unit/rollout/sglang/test_sglang_api_key.py)
        assert "/d/api_key.yaml" in cmd and "k3y" not in cmd
    assert ServerConfig(model_path="m").host == "127.0.0.1"


FAKE_PYTHON = """#!/usr/bin/env python3
import json, sys
argv = sys.argv[1:]
config = open(argv[argv.index("--config") + 1]).read() if "--config" in argv else None
with open({out!r}, "a") as f:
    f.write(json.dumps({{"argv": argv, "config": config}}) + "\\n")
"""


@pytest.mark.parametrize("host,env,ok", [
    ("", {}, True),                                        # default: loopback, no key needed
    ("0.0.0.0", {}, False),                                # wide bind, no key: refused
    ("0.0.0.0", {"SGLANG_API_KEY": 'k1"\\x'}, True),      # quote and backslash: escaped in the YAML
    ("0.0.0.0", {"SGLANG_ALLOW_NO_API_KEY": "1"}, True),
    ("0.0.0.0", {"SGLANG_API_KEY": "two words"}, False),   # no bearer token
], ids=["loopback", "wide-refused", "wide-key", "wide-allowed", "bad-key"])
def test_launch_script_binds_loopback_and_needs_a_key_when_wide(tmp_path, host, env, ok):
    """examples/launch_sglang_servers.sh runs the rollout-node supervisor (megatron_dapo.launch.rollout_node), which
    starts the servers with a stand-in SGLang interpreter (SGLANG_PY) recording each command line and the --config
    file it was handed: a refused key or bind fails the script itself, before anything starts."""
    out = tmp_path / "argv.jsonl"
    fake = tmp_path / "sglang-python"
    fake.write_text(FAKE_PYTHON.format(out=str(out)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    run_env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_API_KEY", "SGLANG_ALLOW_NO_API_KEY")}
    run_env.update(env, SGLANG_PY=str(fake), SGLANG_DEVICE="cpu", SGLANG_RUN_DIR=str(tmp_path / "runs"))
    args = ["bash", "examples/launch_sglang_servers.sh", "/models/fake", "2", "1", "31000"] + ([host] if host else [])
    res = subprocess.run(args, cwd=REPO, env=run_env, capture_output=True, text=True, timeout=120)
    if not ok:
        assert res.returncode != 0 and "SGLANG_API_KEY" in res.stderr and not out.exists()
        assert not (tmp_path / "runs" / "rollout-node.pid").exists()
        return
    assert res.returncode == 0, res.stderr
    assert _poll(lambda: out.exists() and len(out.read_text().splitlines()) == 2, 60)
    for line in out.read_text().splitlines():
        record = json.loads(line)
        argv = record["argv"]
        assert argv[argv.index("--host") + 1] == (host or "127.0.0.1")
        assert "--api-key" not in argv  # ps would show it to every user of the node
        if "SGLANG_API_KEY" in env:  # SGLang merges the --config YAML into its arguments
            assert env["SGLANG_API_KEY"] not in " ".join(argv)
            assert yaml.safe_load(record["config"]) == {"api-key": env["SGLANG_API_KEY"]}
        else:
            assert "--config" not in argv
    pid = int((tmp_path / "runs" / "rollout-node.pid").read_text())
    assert _poll(lambda: not running(pid), 60)  # the stand-ins exit at once: the supervisor gives up and stops


# ---- launched servers die with the trainer ----------------------------------------------------------------

TRAINER = """
import sys, time
sys.path.insert(0, {repo!r})
from megatron_dapo.rollout.sglang.engine import SGLangEngine
from megatron_dapo.rollout.sglang.server import ServerConfig
cfg = ServerConfig(model_path={model!r}, num_servers=2, router=False, base_port={port}, device="cpu",
                   python={python!r}, startup_timeout_s=30, log_dir={logs!r}, env={{"FAKE_SGLANG_LIFETIME": "60"}})
engine = SGLangEngine(cfg)
engine.group.servers[1].proc.kill()
engine.group.servers[1].proc.wait()
engine._call(engine._recover(1))  # restarts server 1 from the engine's launcher thread
print(*(s.pid for s in engine.group.servers), flush=True)
time.sleep(120)
"""


def test_launched_servers_die_when_the_trainer_is_sigkilled(tmp_path):
    """Both the servers started at launch (main thread) and one restarted later (launcher thread) die with a
    SIGKILLed trainer (PR_SET_PDEATHSIG): checked by pid."""
    wrapper = _fake_python(tmp_path)
    script = TRAINER.format(repo=str(REPO), model=str(tmp_path), port=free_port_block(3), python=str(wrapper),
                            logs=str(tmp_path / "logs"))
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in trainer.stdout.readline().split()]
        assert len(pids) == 2 and all(running(p) for p in pids)
    finally:
        trainer.kill()
        trainer.wait()
    assert _poll(lambda: not any(running(p) for p in pids), 10), [p for p in pids if running(p)]
