"""A server lost during a weight-sync broadcast over NCCL (issue 37, weight_sync/sync_group.py).

Over NCCL a broadcast with a lost member never completes and never raises: before the fix the push waited in it (or in
the next device-to-host copy behind it) until the 600 s watchdog killed rank 0. Now each bucket's broadcast is polled
against a deadline (broadcast_deadline_s), given up at once when a server's call fails, the group is aborted, and the
update stops with WeightSyncStalled naming the server and the step (decision (b)), unless no other server of the group
answers, when the lost ones are recovered as before.

No CPU backend has NCCL's "never completes" semantics, so these tests take the NCCL path (sync_group.raises_on_loss
patched to False) over a real gloo group whose lost member never enters the broadcast: a fake server whose receive
hangs (`stuck_receive`, /health 503), or one killed while its receive hangs; gloo's own broadcast would only fail at the
group's timeout (control_timeout_s), after the deadline. The polling itself is tested on a Work-like object whose
is_completed() stays False, with a fake clock (no timed assertion anywhere)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from torch.distributed.distributed_c10d import _world

from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.weight_sync import sync_group
from megatron_dapo.weight_sync.sync_group import (
    BROADCAST_MIN_GBPS,
    WeightSyncStalled,
    broadcast_bucket,
    broadcast_deadline_s,
    wait_until,
)
from tests.ports import free_port
from tests.sglang import full_push
from tests.sglang.fake_server import kill, serve

MIB = 1 << 20
EMBEDDING_32B = 152064 * 5120 * 2
"""Bytes of Qwen2.5-32B's embedding (vocab x hidden, bf16): its largest bucket, alone over 512 MiB."""


@pytest.mark.parametrize("nbytes, floor_s, min_gbps, expected", [
    pytest.param(0, 30.0, 1.0, 30.0, id="empty"),
    pytest.param(512 * MIB, 30.0, 1.0, 30.0 + 536_870_912 / 1e9, id="512MiB-bucket"),
    pytest.param(EMBEDDING_32B, 30.0, 1.0, 30.0 + 1_557_135_360 / 1e9, id="32B-embedding"),
    pytest.param(512 * MIB, 5.0, 2.0, 5.0 + 536_870_912 / 2e9, id="faster-floor"),
])
def test_deadline_is_the_floor_plus_the_bytes_at_the_minimum_rate(nbytes, floor_s, min_gbps, expected):
    assert BROADCAST_MIN_GBPS == 1.0
    got = broadcast_deadline_s(nbytes, 600.0, floor_s=floor_s, min_gbps=min_gbps)
    assert got == pytest.approx(expected, rel=1e-12)


def test_deadline_must_be_under_the_group_timeout_and_inputs_valid():
    with pytest.raises(ValueError, match=r"1\.56 GB gets a 31\.6 s deadline \(30 s floor.* \+ its bytes at 1 GB/s\), "
                                         r"not under its group's 30 s timeout.*--weight-sync-bucket-mb"):
        broadcast_deadline_s(EMBEDDING_32B, 30.0, floor_s=30.0)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        broadcast_deadline_s(-1, 600.0, floor_s=30.0)
    with pytest.raises(ValueError, match="floor_s and min_gbps must be > 0"):
        broadcast_deadline_s(1, 600.0, floor_s=0.0)


class FakeClock:
    """A monotonic clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
        self.sleeps += 1


def test_wait_gives_up_at_the_deadline_on_work_that_never_completes():
    clock = FakeClock()
    assert not wait_until(lambda: False, deadline_s=2.0, poll_s=0.5, clock=clock, sleep=clock.sleep)
    assert clock.now == 2.0 and clock.sleeps == 4  # polled at 0, 0.5, 1, 1.5, 2: given up at the deadline, not later


def test_wait_returns_when_done_and_stops_early_when_a_member_is_gone():
    clock = FakeClock()
    assert wait_until(lambda: clock.sleeps == 3, deadline_s=10.0, poll_s=0.5, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == 3
    clock = FakeClock()
    assert not wait_until(lambda: False, deadline_s=10.0, gone=lambda: clock.sleeps == 2, poll_s=0.5, clock=clock,
                          sleep=clock.sleep)
    assert clock.now == 1.0  # the lost member was seen at the third poll, long before the deadline


class NeverDone:
    """A Work whose broadcast never completes (NCCL with a lost member)."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None):
        raise AssertionError("wait() on a broadcast that never completes blocks until the watchdog")


class Done(NeverDone):
    def is_completed(self) -> bool:
        return True

    def wait(self, timeout=None):
        self.waited = True
        return True


@pytest.fixture
def nccl_path(monkeypatch):
    """Every group takes broadcast_bucket's NCCL path (async broadcast, polled)."""
    monkeypatch.setattr(sync_group, "raises_on_loss", lambda group: False)


def _bucket(deadline_s: float, **kw) -> bool:
    return broadcast_bucket(object(), torch.zeros(4, dtype=torch.uint8), deadline_s=deadline_s,
                            **{"call_timeout_s": 30.0} | kw)


def test_broadcast_bucket_reports_a_stall_without_waiting_on_the_work(nccl_path, monkeypatch):
    def returns(work):
        monkeypatch.setattr(sync_group.comm, "broadcast_async", lambda tensor, src, group: work)

    def raises(kind):
        def call(tensor, src, group):
            raise kind("boom")
        monkeypatch.setattr(sync_group.comm, "broadcast_async", call)

    returns(NeverDone())
    assert not _bucket(0.05)  # given up, never waited on (NeverDone.wait raises)
    returns(done := Done())
    assert _bucket(30.0) and done.waited
    raises(RuntimeError)  # NCCL: a member lost while the communicator is made
    assert not _bucket(30.0)
    raises(ValueError)  # a bad call is not a lost member
    with pytest.raises(ValueError, match="boom"):
        _bucket(30.0)


def test_a_first_call_that_never_returns_is_given_up_too(nccl_path, monkeypatch):
    """NCCL makes a group's communicator inside its first broadcast call, blocking until every member joins: the call
    runs on a helper thread, given up at call_timeout_s or at once when a member's call failed."""
    release = threading.Event()
    monkeypatch.setattr(sync_group.comm, "broadcast_async", lambda tensor, src, group: release.wait() and Done())
    try:
        assert not _bucket(30.0, call_timeout_s=0.05)
        assert not _bucket(30.0, gone=lambda: True)
    finally:
        release.set()


def _named(shift: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.w", torch.randn(16, 16, generator=gen) + shift) for i in range(3)]


@pytest.fixture
def servers():
    made = [serve(tp_size=1), serve(tp_size=2)]
    yield made
    for server, state in made:
        kill(server, state)


def _engine(servers, floor_s: float = 0.5) -> SGLangEngine:
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s, _ in servers]
    return SGLangEngine(server_urls=urls, client=ClientConfig(
        bucket_bytes=1024, sync_backend="gloo", sync_master_port=free_port(), control_timeout_s=20,
        http_timeout_s=5, server_wait_s=5, broadcast_floor_s=floor_s))


def _calls(state, path: str) -> int:
    with state.lock:
        return state.calls.get(path, 0)


def test_a_hung_server_stops_the_update_naming_it_and_the_group_is_aborted(nccl_path, servers):
    """Server 0 hangs in its receive at step 2 while server 1 answers: the broadcast is given up at its deadline,
    the group aborted here, and the update raises naming server 0 and the step, with no further call to server 1
    (no /end_weight_update: it could be stuck in the receive). Before: the broadcast waited until the group's
    timeout (the NCCL watchdog's 600 s at production), then re-pushed to server 1 over a fresh group."""
    engine = _engine(servers)
    try:
        push = full_push(engine, "distributed")
        push.update(iter(_named()), version=1)  # the polled path delivers a whole version
        for _, state in servers:
            assert state.version == "1"
            for name, t in _named():
                torch.testing.assert_close(torch.tensor(state.weights[name]), t)
        group, ends = push.group, _calls(servers[1][1], "/end_weight_update")
        servers[0][1].stuck_receive = True
        with pytest.raises(WeightSyncStalled) as err:
            push.update(iter(_named(1.0)), version=2)
        url0 = engine.urls[0]
        assert str(err.value) == (
            f"weight sync of step 2: SGLang server {url0} lost during the NCCL broadcast of bucket 0 (0.00 GB; not "
            f"done within its 0.5 s deadline); 1 other server(s) of the group may be stuck in that receive, which "
            f"SGLang cannot abort, so the run stops: restart the servers (launched ones stop with this run) and "
            f"resume from the last checkpoint (--load)")
        assert push.group is None and group not in _world.pg_map  # aborted here, unregistered
        assert _calls(servers[1][1], "/end_weight_update") == ends
        assert engine.weight_version == 1  # the update set nothing
    finally:
        engine.shutdown()


def test_a_server_killed_in_its_receive_is_seen_at_once_not_at_the_deadline(nccl_path, servers):
    """Server 0 dies while its receive hangs: its call fails, and that alone gives the broadcast up (the message says
    so; with a 15 s floor the deadline would say 'not done within')."""
    engine = _engine(servers, floor_s=15.0)
    try:
        push = full_push(engine, "distributed")
        push.update(iter(_named()), version=1)
        server0, state0 = servers[0]
        received = _calls(state0, "/update_weights_from_distributed")
        state0.stuck_receive = True

        def killer():
            while _calls(state0, "/update_weights_from_distributed") == received:
                time.sleep(0.01)
            kill(server0, state0)

        threading.Thread(target=killer, daemon=True).start()
        with pytest.raises(WeightSyncStalled, match=rf"SGLang server {engine.urls[0]} lost .*the lost server's call "
                                                    rf"failed\); 1 other server"):
            push.update(iter(_named(1.0)), version=2)
    finally:
        engine.shutdown()


def test_a_stall_with_no_other_server_answering_is_recovered(nccl_path):
    """The only target hangs: nobody can be stuck in the receive, so the group is aborted and the server counted
    lost (to be recovered); the update completes (version set), as for any lost server."""
    made = [serve(tp_size=1)]
    engine = _engine(made)
    try:
        push = full_push(engine, "distributed")
        push.update(iter(_named()), version=1)
        engine.take_metrics()
        made[0][1].stuck_receive = True
        push.update(iter(_named(1.0)), version=2)
        assert engine.weight_version == 2 and push.group is None
        assert engine.take_metrics()["rollout/servers_lost"] == 1
        assert sum(b.flat.numel() for b in push.kept) == 3 * 256  # the whole version kept, for the recovery
    finally:
        engine.shutdown()
        kill(*made[0])


def test_a_stage_source_reports_the_stall_and_the_coordinator_makes_no_more_calls(nccl_path, servers):
    """Per-stage push (stage_sync.StageSender): a stall with another server answering goes to StageOutcome.stalled and
    the store's broken key says STALLED (the other stages abort their groups, no teardown call); merge_outcomes
    raises it; StageCoordinator then sends no /end_weight_update (it does for any other failure)."""
    from megatron_dapo.weight_sync.stage_push import StageCoordinator
    from megatron_dapo.weight_sync.stage_sync import STALLED, StageSender, SyncPlan, TicketLock, merge_outcomes
    from megatron_dapo.weight_sync.transports.distributed import DistributedPush

    urls = tuple(f"http://127.0.0.1:{s.server_address[1]}" for s, _ in servers)
    plan = SyncPlan(version=2, urls=urls, tps=(1, 2), tag=5, first_port=free_port(), master_address="127.0.0.1",
                    rank0_host="here", backend="gloo", bucket_bytes=1024, api_key=None, timeout_s=20,
                    http_timeout_s=5, broadcast_floor_s=0.5)
    for url in urls:
        httpx.post(f"{url}/begin_weight_update", json={}, timeout=5).raise_for_status()
    lock = TicketLock(torch.distributed.HashStore(), timeout_s=30)
    sender = StageSender(0)
    assert merge_outcomes([sender.push(plan, iter(_named()), lock)]).broken is False  # the polled path works
    servers[0][1].stuck_receive = True
    destroys = _calls(servers[1][1], "/destroy_weights_update_group")
    plan2 = SyncPlan(**{**vars(plan), "version": 3})
    out = sender.push(plan2, iter(_named(1.0)), lock)
    assert out.stalled is not None and out.lost == {0} and out.broken and sender.group is None
    assert f"SGLang server {urls[0]} lost during the NCCL broadcast of bucket 0 of pipeline stage 0" in out.stalled
    assert "weight sync of step 3" in out.stalled
    assert lock.store.get("megatron_dapo/stage_sync_broken/5/3") == STALLED
    assert _calls(servers[1][1], "/destroy_weights_update_group") == destroys
    assert len(out.kept) == 3  # the version was still drained and kept
    with pytest.raises(WeightSyncStalled, match=r"step 3: SGLang server"):
        merge_outcomes([out])

    engine = _engine(servers[1:])
    try:
        coordinator = StageCoordinator(DistributedPush(engine))
        state1 = servers[1][1]

        def stalls(urls, tps, tag, first_port):
            raise WeightSyncStalled(out.stalled)

        ends = _calls(state1, "/end_weight_update")
        with pytest.raises(WeightSyncStalled):
            coordinator.update(4, stalls, stages=2)
        assert _calls(state1, "/end_weight_update") == ends

        def fails(urls, tps, tag, first_port):
            raise RuntimeError("the source of pipeline stage 1 failed: boom")

        with pytest.raises(RuntimeError, match="boom"):
            coordinator.update(5, fails, stages=2)
        assert _calls(state1, "/end_weight_update") == ends + 1  # other failures still close the servers' session
    finally:
        engine.shutdown()
