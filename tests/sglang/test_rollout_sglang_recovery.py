"""A real SGLang 0.5.23 server (CPU) killed by pid while generating and during a weight update, in launch mode:
no sample is lost, the server is restarted and re-synced, and what it generates afterwards has the log-probs of
the current weights (teacher-forced HF forward of those weights). One server launch for the module; each kill
costs one restart (~20 s on CPU). Needs .venv-sglang (`make sglang-env`); skipped otherwise."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.sglang import full_push
from tests.sglang.real_server import MARKS, cpu_server_config, free_port, max_logprob_error, tiny_model

pytestmark = MARKS


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang-recovery")
    tiny_model(0).save_pretrained(root / "model")
    cfg = cpu_server_config(root)
    engine = SGLangEngine(cfg, client=ClientConfig(max_concurrency=16, control_timeout_s=120, bucket_bytes=40_000,
                                                   sync_backend="gloo", sync_master_port=free_port()))
    yield engine
    engine.shutdown()


def _reqs(count, n, max_new, tag, **kw):
    sp = SamplingParams(max_new_tokens=max_new, **kw)
    return [RolloutRequest(prompt_ids=[5, 6, 7 + i], n=n, sampling=sp, request_id=f"{tag}{i}")
            for i in range(count)]


def _process_group(pgid: int) -> list[int]:
    """Live (non-zombie) pids whose process group is `pgid`: a server and its scheduler / detokenizer."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) == pgid:
                out.append(int(entry.name))
    return out


def _mixed_reqs(tag, seed):
    """One 2-token request, then six of 300 tokens: when the short one comes back, the long ones are mid-way."""
    return _reqs(1, n=2, max_new=2, tag=f"{tag}s", seed=seed) + _reqs(6, n=2, max_new=300, tag=tag, seed=seed)


def _complete(groups, reqs) -> bool:
    """Every request came back once, with all n samples run to their length or to eos (id 1)."""
    by_id = {g[0].request_id: g for g in groups}
    if sorted(by_id) != sorted(r.request_id for r in reqs) or len(groups) != len(reqs):
        return False
    return all(len(by_id[r.request_id]) == r.n and all(
        (s.finish_reason, len(s.response_ids)) == ("length", r.sampling.max_new_tokens)
        or (s.finish_reason == "stop" and s.response_ids[-1] == 1) for s in by_id[r.request_id]) for r in reqs)


def _kill_and_check(engine, old_pids, metrics):
    assert metrics["rollout/server_restarts"] == 1 and metrics["sync/servers_recovered"] == 1, metrics
    print(f"recovery (restart + re-sync) took {metrics['rollout/recovery_s']:.1f} s")
    assert not [p for p in old_pids if p in _process_group(old_pids[0])]  # no orphan of the killed server
    assert engine.group.servers[0].pid not in old_pids


def test_server_killed_while_generating(served):
    engine = served
    current = tiny_model(1)
    full_push(engine).update(current.named_parameters(), version=1)
    engine.take_metrics()
    victim = engine.group.servers[0].pid
    old_pids = _process_group(victim)
    assert len(old_pids) >= 2  # the server and its scheduler
    reqs = _mixed_reqs("g", seed=3)
    groups = []
    for group in engine.stream(reqs):
        groups.append(group)
        if len(groups) == 1:
            os.kill(victim, signal.SIGKILL)
    assert _complete(groups, reqs)
    assert groups[0][0].request_id == "gs0"  # the kill came while the long ones were generating
    samples = [s for g in groups for s in g]
    assert {s.weight_version for s in samples} == {1}
    assert max_logprob_error(current, samples) < 1e-4  # the redone samples come from the re-synced server
    metrics = engine.take_metrics()
    assert metrics["rollout/retried_requests"] >= 1
    _kill_and_check(engine, old_pids, metrics)


def test_server_killed_during_weight_update(served):
    engine = served
    current = tiny_model(2)
    victim = engine.group.servers[0].pid
    old_pids = _process_group(victim)
    named = list(current.named_parameters())

    def killing():  # the server dies after a few buckets have gone in (bucket_bytes=40 kB: ~20 buckets)
        for k, item in enumerate(named):
            if k == len(named) // 2:
                os.kill(victim, signal.SIGKILL)
                time.sleep(0.5)
            yield item

    full_push(engine).update(killing(), version=2)
    assert engine.weight_version == 2
    reqs = _reqs(4, n=2, max_new=16, tag="u", seed=4)
    groups = engine.generate(reqs)  # waits for the restart + re-sync
    samples = [s for g in groups for s in g]
    assert _complete(groups, reqs) and {s.weight_version for s in samples} == {2}
    assert max_logprob_error(current, samples) < 1e-4
    _kill_and_check(engine, old_pids, engine.take_metrics())


def test_distributed_mode_server_killed_while_generating(served):
    """Distributed weight sync: the restarted server is re-synced over a broadcast group of its own, and the
    next update rebuilds the group."""
    engine = served
    current = tiny_model(3)
    full_push(engine, "distributed").update(current.named_parameters(), version=3)
    engine.take_metrics()
    victim = engine.group.servers[0].pid
    old_pids = _process_group(victim)
    reqs = _mixed_reqs("d", seed=5)
    groups = []
    for group in engine.stream(reqs):
        groups.append(group)
        if len(groups) == 1:
            os.kill(victim, signal.SIGKILL)
    samples = [s for g in groups for s in g]
    assert _complete(groups, reqs)
    assert max_logprob_error(current, samples) < 1e-4
    metrics = engine.take_metrics()
    assert metrics["rollout/retried_requests"] >= 1
    _kill_and_check(engine, old_pids, metrics)
    newer = tiny_model(4)
    full_push(engine, "distributed").update(newer.named_parameters(), version=4)
    samples = [s for g in engine.generate(_reqs(2, n=2, max_new=16, tag="e", seed=6)) for s in g]
    assert {s.weight_version for s in samples} == {4} and max_logprob_error(newer, samples) < 1e-4
