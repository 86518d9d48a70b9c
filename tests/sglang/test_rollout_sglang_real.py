"""A real SGLang 0.5.23 server (CPU, torch-native) behind SGLangEngine: one tiny random Qwen2, a few
requests, abort, and a weight update through each path. The server is launched with an API key (as on a
multi-node run), which must be on no command line. Needs .venv-sglang (tools/setup_sglang_env.sh); skipped
otherwise. Reference for log-probs: a teacher-forced HF forward of the same weights."""

import dataclasses
import os
import time

import pytest
import torch

from megatron_dapo.rollout.sglang.api_key import remove_server_key_file, write_server_key_file
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.sglang.server import ServerConfig
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.ports import free_port_block
from tests.procs import processes
from tests.sglang import full_push
from tests.sglang.real_server import MARKS, SGLANG_PY, cpu_server_config, free_port, max_logprob_error, tiny_model

pytestmark = MARKS
API_KEY = "real-s3cret-9f2c"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    model = tiny_model(0)
    model.save_pretrained(root / "model")
    cfg = cpu_server_config(root, api_key=API_KEY)
    engine = SGLangEngine(cfg, client=ClientConfig(max_concurrency=16, control_timeout_s=120,
                                                   sync_backend="gloo", sync_master_port=free_port(),
                                                   disk_dir=str(root / "weights")))
    yield engine, model
    engine.shutdown()


def _reqs(count, n, max_new, **kw):
    sp = SamplingParams(max_new_tokens=max_new, **kw)
    return [RolloutRequest(prompt_ids=[5, 6, 7 + i], n=n, sampling=sp, request_id=f"q{i}")
            for i in range(count)]


def test_generate_logprobs_match_hf(served):
    engine, model = served
    assert engine.health()
    groups = engine.generate(_reqs(4, n=2, max_new=8, seed=1))
    samples = [s for g in groups for s in g]
    for s in samples:  # a random model samples eos (id 1) now and then
        assert (s.finish_reason, len(s.response_ids)) == ("length", 8) or \
            (s.finish_reason == "stop" and s.response_ids[-1] == 1)
    assert max_logprob_error(model, samples) < 1e-4
    every_token = tuple(range(128))  # bos (0) too: an unseeded first token of 0 went on past it (a clean run's flake)
    (stopped,) = engine.generate(_reqs(1, n=1, max_new=8, stop_token_ids=every_token))[0]
    assert stopped.finish_reason == "stop" and len(stopped.response_ids) == 1


def test_scoring_a_sequence_returns_the_teachers_log_probs_of_its_response(served):
    """The SGLang teacher's path (rollout/sglang/scoring.py): /generate with the whole sequence, no new token, log-probs
    from prompt_len - 1; every response token's log-prob equals HF's teacher-forced one (fp32 server), for prompts
    and responses of several lengths, the API key sent; a sequence with no response is refused before any call."""
    import torch

    from megatron_dapo.actor import TrainSample
    from megatron_dapo.rollout.sglang.scoring import SGLangScorer, score_payload

    engine, model = served
    samples = [TrainSample(tokens=[5 + i] * p + list(range(20, 20 + r)), prompt_len=p)
               for i, (p, r) in enumerate([(1, 1), (3, 7), (6, 12), (2, 30)])]
    scorer = SGLangScorer(engine.urls, api_key=API_KEY, max_concurrency=4)
    try:
        got = scorer.compute_log_probs(samples)
    finally:
        scorer.close()
    worst = 0.0
    for s, lp in zip(samples, got, strict=True):
        with torch.no_grad():
            ref = model(torch.tensor([s.tokens])).logits[0].log_softmax(-1)
        want = ref[s.prompt_len - 1:-1].gather(1, torch.tensor(s.tokens[s.prompt_len:]).unsqueeze(1)).squeeze(1)
        assert lp.shape == (s.response_len,)
        worst = max(worst, (lp - want).abs().max().item())
    assert worst < 1e-4, worst
    with pytest.raises(ValueError, match="prompt_len"):
        score_payload([5, 6], 2)


def test_abort_loses_nothing(served):
    engine, _ = served
    reqs = _reqs(12, n=2, max_new=200)
    seen = []
    for group in engine.stream(reqs):
        seen.append(group)
        if len(seen) == 1:
            engine.abort()
    assert sorted(g[0].request_id for g in seen) == sorted(r.request_id for r in reqs)
    assert all(len(g) == 2 for g in seen)


def test_an_open_stream_takes_requests_while_others_generate(served):
    """The fully async rollout's refill on a real server: a request added after the first group is back runs
    beside the long ones still generating and comes back before them, with the weights' log-probs; an id still in
    flight is refused; an abort of everything stops the added requests too."""
    engine, model = served
    long = [RolloutRequest(prompt_ids=[5, 6, 7 + i], n=2, request_id=f"long{i}",
                           sampling=SamplingParams(max_new_tokens=120, seed=3)) for i in range(4)]
    short = RolloutRequest(prompt_ids=[9, 10], n=1, request_id="short",
                           sampling=SamplingParams(max_new_tokens=2, seed=4))
    added = RolloutRequest(prompt_ids=[11, 12, 13], n=2, request_id="added",
                           sampling=SamplingParams(max_new_tokens=3, seed=5))
    stream = engine.open_stream([*long, short])
    order, groups = [], {}
    for group in stream:
        rid = group[0].request_id
        order.append(rid)
        groups[rid] = group
        if rid == "short":
            with pytest.raises(ValueError, match="already in flight"):
                stream.add([dataclasses.replace(long[0])])
            stream.add([added])
    # a random model samples eos (id 1) now and then: a group of 2 still runs after 20 tokens with p ~0.98
    running = [rid for rid in order if rid.startswith("long") and max(len(s.response_ids) for s in groups[rid]) >= 20]
    assert running and all(order.index("added") < order.index(rid) for rid in running), (order, running)
    samples = [s for g in groups.values() for s in g]
    assert max_logprob_error(model, [s for s in samples if s.finish_reason != "abort"]) < 1e-4
    # q0 (4 tokens) comes back first while q1 has up to 400 to go: the abort cuts q1 and the request added after it.
    # (Two groups of 200 each raced: the second could finish all 200 tokens before the abort arrived, a clean-clone
    # failure.) q1 ending first, both its samples at eos within q0's 4 tokens, leaves nothing to check on it.
    quick, slow = (RolloutRequest(prompt_ids=[5, 6, 7 + i], n=2, request_id=f"q{i}",
                                  sampling=SamplingParams(max_new_tokens=m)) for i, m in enumerate((4, 400)))
    stream = engine.open_stream([quick, slow])
    seen = [next(stream)]
    stream.add([dataclasses.replace(added, request_id="late")])
    engine.abort()
    seen += list(stream)
    assert sorted(g[0].request_id for g in seen) == ["late", "q0", "q1"]
    if seen[0][0].request_id == "q0":
        (cut,) = [g for g in seen if g[0].request_id == "q1"]
        assert all(len(s.response_ids) < 400 for s in cut), [len(s.response_ids) for s in cut]


def test_aborted_prefix_is_continued(served):
    """Partial rollout on a real server: /abort_request returns each running sample's partial output_ids with
    their log-probs (finish 'abort'); prompt + prefix resubmitted (partial_rollout.continuation_request)
    generates the remaining budget, and prefix + continuation has the weights' log-probs at every token.
    Greedy, so every token must be the argmax of the teacher-forced logits (one uninterrupted greedy run)."""
    from megatron_dapo.rollout.partial_rollout import continuation_request, extend, settle

    engine, model = served
    sp = SamplingParams(max_new_tokens=48, temperature=0.0, stop_token_ids=(1,))
    short = RolloutRequest(prompt_ids=[9, 9], n=1, request_id="short",
                           sampling=dataclasses.replace(sp, max_new_tokens=4))
    longs = [RolloutRequest(prompt_ids=[5, 6, 7 + i], n=2, sampling=sp, request_id=f"p{i}") for i in range(6)]
    cut = []
    for group in engine.stream([short, *longs]):
        if group[0].request_id == "short":
            engine.abort()
        else:
            cut += [settle(s, sp) for s in group]
    partial = [s for s in cut if s.finish_reason == "abort" and s.response_ids]
    assert partial, [(s.finish_reason, len(s.response_ids)) for s in cut]
    assert max_logprob_error(model, partial) < 1e-4  # the prefix's log-probs came back with it
    prompts = {r.request_id: r.prompt_ids for r in longs}
    todo = [s for s in cut if s.finish_reason == "abort"]
    reqs = [continuation_request(prompts[s.request_id], s, sp, None, f"{s.request_id}-c{s.index}") for s in todo]
    merged = [extend(s, cont, prompts[s.request_id]) for s, (cont,) in zip(todo, engine.generate(reqs), strict=True)]
    for s, prefix in zip(merged, todo, strict=True):
        assert s.response_ids[:len(prefix.response_ids)] == prefix.response_ids
        assert s.finish_reason in ("stop", "length") and len(s.response_ids) <= sp.max_new_tokens
        assert s.finish_reason == "stop" or len(s.response_ids) == sp.max_new_tokens
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            lp = model(ids).logits[0].log_softmax(-1)[len(s.prompt_ids) - 1: -1]
        chosen = lp.gather(1, torch.tensor(s.response_ids).unsqueeze(1)).squeeze(1)
        assert (lp.max(-1).values - chosen).max() < 1e-4  # greedy all along
    assert max_logprob_error(model, merged) < 1e-4


def test_server_info_reports_deterministic_inference(served):
    """The field megatron_dapo reads to warn about attached servers that ignore sampling_seed."""
    from megatron_dapo.rollout.sglang.setup import server_deterministic

    engine, _ = served
    headers = engine.group.servers[0].headers
    assert server_deterministic(engine.urls[0], headers=headers) is False  # no --enable-deterministic-inference


def _cmdline(pid: int) -> bytes:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read()
    except OSError:
        return b""


def test_the_api_key_is_on_no_command_line(served):
    """The keyed server got its key through the 0600 --config file: no process of its group (launch_server, the
    scheduler and detokenizer it spawns) has the key on its command line, yet a call without the key is
    refused (401) and one with it answered."""
    import httpx

    engine, _ = served
    server = engine.group.servers[0]
    group = [pid for pid, f in processes() if int(f[2]) == server.pid]
    cmdlines = [_cmdline(pid) for pid in group]
    assert len(group) >= 3 and all(cmdlines), cmdlines  # server, scheduler, detokenizer (+ resource tracker)
    assert not [c for c in cmdlines if API_KEY.encode() in c], cmdlines
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{server.url}/generate", json=body, headers=server.headers, timeout=60).status_code == 200
    assert os.stat(engine.group.key_file).st_mode & 0o777 == 0o600
    assert os.stat(server.log_path).st_mode & 0o777 == 0o600  # as well, for a form of the key the filter does not know

def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every live process of process group `pgid`."""
    ticks = sum(int(f[11]) + int(f[12]) for _, f in processes() if int(f[2]) == pgid)  # utime + stime of pgrp
    return ticks / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_does_not_spin(served):
    """ServerConfig launches with --sleep-on-idle: an idle server's processes use under a quarter of a core.
    Without it SGLang's scheduler polls in a busy loop (measured: 20 CPU-s per 20 s idle, 27 at TP 2), which on
    the CI's 2 cores took one from every test that trains next to a server."""
    engine, _ = served
    pgid = engine.group.servers[0].pid
    time.sleep(1.5)  # the last request's tail (detokenizer, logging) settles
    cpu0, t0 = _group_cpu_s(pgid), time.monotonic()
    time.sleep(4.0)
    used, wall = _group_cpu_s(pgid) - cpu0, time.monotonic() - t0
    assert used < 0.25 * wall, f"idle server used {used:.2f} CPU-s in {wall:.1f} s"


@pytest.mark.parametrize("mode", ["tensor", "distributed", "disk"])
def test_weight_update_paths(served, mode):
    engine, _ = served
    new = tiny_model({"tensor": 1, "distributed": 2, "disk": 3}[mode])
    version = engine.weight_version + 1
    full_push(engine, mode).update(new.named_parameters(), version=version)
    samples = [s for g in engine.generate(_reqs(2, n=2, max_new=8, seed=4)) for s in g]
    assert {s.weight_version for s in samples} == {version}
    assert max_logprob_error(new, samples) < 1e-4


def test_router_round_robins(tmp_path):
    """sglang-router (ServerConfig.router_command) in front of two keyed fake servers spreads /generate; it has
    the key from the group's key file (the workers answer it, and it refuses calls without it), and not on its
    command line."""
    import httpx

    from megatron_dapo.rollout.sglang.server import ServerProcess
    from tests.sglang.fake_server import serve

    fakes = [serve(api_key=API_KEY) for _ in range(2)]
    cfg = ServerConfig(model_path="unused", num_servers=2, base_port=free_port_block(3),
                       python=str(SGLANG_PY), api_key=API_KEY)
    key_file = write_server_key_file(API_KEY)
    cmd = cfg.router_command(str(key_file))
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s, _ in fakes]
    cmd = cmd[: cmd.index("--worker-urls") + 1] + urls
    router = ServerProcess("router", cmd, cfg.router_url, tmp_path / "router.log", {}, API_KEY)
    router.start()
    try:
        router.wait_healthy(60)
        assert API_KEY.encode() not in _cmdline(router.pid)
        for k in range(4):
            body = {"rid": f"x{k}", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3},
                    "return_logprob": True}
            reply = httpx.post(f"{cfg.router_url}/generate", json=body, headers=router.headers, timeout=30).json()
            assert reply["meta_info"]["id"] == f"x{k}" and len(reply["output_ids"]) == 3
        assert [len(state.rids) for _, state in fakes] == [2, 2]  # the workers answer keyed calls only
        assert httpx.post(f"{cfg.router_url}/generate", json=body, timeout=30).status_code == 401
    finally:
        router.stop()
        remove_server_key_file(key_file)
        for server, _ in fakes:
            server.shutdown()
            server.server_close()
