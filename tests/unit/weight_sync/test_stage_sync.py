"""Distributed weight sync from every pipeline stage at once (megatron_dapo/weight_sync/stage_sync.py).

One 4-rank torchrun launch (tests/dist/stage_sync.py) pushes a tiny Qwen2 at TP1 x PP2 x DP2 and TP2 x PP2 to
two fake SGLang servers (TP1 and TP2, running in this process, one collective request at a time each as SGLang's
scheduler). The servers must end with exactly the tensors of the old whole-model export (iter_hf_weights) and of
the HF checkpoint, each stage's tensors must arrive over that stage's group, and only the two stage sources may
send anything to the servers. The rest are unit tests of the plan, the lock and the master-address rule.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weight_sync.stage_sync import (
    SYNC_ADDR_ENV,
    StageOutcome,
    SyncPlan,
    TicketLock,
    choose_source_address,
    merge_outcomes,
    routed_address,
    stage_master_address,
)
from tests.dist.actor_common import tiny_hf_model
from tests.ports import free_port_block
from tests.sglang.fake_server import serve
from tests.torchrun import REPO, run_torchrun, subprocess_env

WORKER = REPO / "tests" / "dist" / "stage_sync.py"
LAYOUTS = ["tp1pp2dp2", "tp2pp2"]
ROLES = {  # global rank -> (stage, source) under megatron's tp-dp-pp rank order
    "tp1pp2dp2": {0: (0, True), 1: (0, False), 2: (1, True), 3: (1, False)},
    "tp2pp2": {0: (0, True), 1: (0, False), 2: (1, True), 3: (1, False)},
}


def free_ports(n: int, stride: int = 8) -> list[int]:
    """n blocks of `stride` consecutive free ports (the stage groups use base + s), from one free block."""
    base = free_port_block(n * stride)
    return [base + i * stride for i in range(n)]


def stage_of(name: str, num_layers: int) -> int:
    """Pipeline stage (of 2) that owns an HF tensor: embeddings and the first half of the layers on stage 0."""
    if name.startswith("model.layers."):
        return int(int(name.split(".")[2]) >= num_layers // 2)
    return 0 if name.startswith("model.embed_tokens") else 1


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stage_sync")
    hf = tiny_hf_model(seed=3, num_hidden_layers=4)
    servers = [serve(tp_size=1), serve(tp_size=2)]
    data = {"arch": vars(ModelArch.from_hf(hf.config)),
            "hf_state_dict": {k: v.clone() for k, v in hf.state_dict().items()}, "layouts": LAYOUTS,
            "urls": [f"http://127.0.0.1:{s.server_address[1]}" for s, _ in servers], "bucket_bytes": 64 << 10,
            "ports": free_ports(len(LAYOUTS))}
    torch.save(data, tmp / "in.pt")
    try:
        run_torchrun(WORKER, tmp / "in.pt", tmp, nproc=4, timeout=600)
        ranks = {name: [torch.load(tmp / f"{name}_rank{r}.pt", weights_only=False) for r in range(4)]
                 for name in LAYOUTS}
        yield data, hf, [state for _, state in servers], ranks
    finally:
        for server, _ in servers:
            server.shutdown()
            server.server_close()


def test_servers_end_with_the_whole_model_export_and_the_hf_weights(pushed):
    data, hf, states, ranks = pushed
    hf_sd = hf.state_dict()
    for version, name in enumerate(LAYOUTS, start=1):
        reference = ranks[name][0]["reference"]  # the single-group export of every rank, as before
        assert set(reference) == set(hf_sd)
        assert all(torch.equal(reference[n], hf_sd[n]) for n in hf_sd)
        for state in states:
            got = {n for group, names, v in state.received if v == str(version) for n in names}
            assert got == set(reference), name  # every tensor of the version arrived, nothing else
        assert sorted(ranks[name][0]["kept"]) == sorted(reference)  # rank 0's host copy is the whole version
    for state in states:  # the last version's values, bit for bit, on every TP rank's copy
        for n, t in hf_sd.items():
            assert torch.equal(torch.tensor(state.weights[n], dtype=t.dtype), t), n
        assert state.version == str(len(LAYOUTS))


def test_each_stage_arrives_over_its_own_group_from_its_source(pushed):
    data, hf, states, ranks = pushed
    layers = hf.config.num_hidden_layers
    for state in states:  # the stage groups are the only groups anyone made with the servers
        assert len(state.group_inits) == 2 * len(LAYOUTS)
    for version in range(1, len(LAYOUTS) + 1):
        port = data["ports"][version - 1]
        for state in states:
            inits = {i["group_name"]: i for i in state.group_inits if i["master_port"] in (port, port + 1)}
            assert sorted(i["master_port"] for i in inits.values()) == [port, port + 1]  # one group per stage
            stage_groups = {int(g.rsplit("_pp", 1)[1]): g for g in inits}
            assert set(stage_groups) == {0, 1}
            assert inits[stage_groups[0]]["world_size"] == 1 + 1 + 2  # the source, then both servers' TP ranks
            for group, names, v in state.received:
                if v == str(version):
                    assert {stage_of(n, layers) for n in names} == {int(group.rsplit("_pp", 1)[1])}, (group, names)
                    assert group in inits


def test_only_stage_sources_send_to_the_servers_and_nobody_else_moves_the_model(pushed):
    data, hf, states, ranks = pushed
    total = sum(t.numel() * t.element_size() for t in hf.state_dict().values())
    for name in LAYOUTS:
        by_stage = [0, 0]
        for rank, out in enumerate(ranks[name]):
            stage, source = ROLES[name][rank]
            assert (out["stage"], out["source"]) == (stage, source), (name, rank)
            stats = out["stats"]
            if not source:
                assert (stats.to_servers, stats.pp_sent, stats.pp_received) == (0, 0, 0), (name, rank)
            by_stage[stage] += stats.to_servers
            # only stage 1's source sends its host copy to rank 0, over PP
            assert stats.pp_sent == (stats.to_servers if rank == 2 else 0)
            assert stats.pp_received == (ranks[name][2]["stats"].to_servers if rank == 0 else 0)
        assert sum(by_stage) == total and all(by_stage), (name, by_stage)
        m = ranks[name][0]["metrics"]
        assert set(m) == {"sync/stage0_s", "sync/stage1_s"} and all(v > 0 for v in m.values())
        assert ranks[name][0]["engine_metrics"]["sync/gbytes"] == pytest.approx(total / 1e9)


def test_the_path_is_chosen_once_at_build_and_no_push_broadcasts_a_path_decision(pushed):
    """Every rank holds the implementation build_weight_sync chose from rank 0's engine (sent once, at build): a
    per-stage push broadcasts exactly one object, the plan (rank 0's targets and ports), and a full push at the same
    PP 2 (disk mode) broadcasts none; the old StageSync sent ("full", None) to every rank at every such push."""
    data, hf, states, ranks = pushed
    for name in LAYOUTS:
        for rank, out in enumerate(ranks[name]):
            assert out["sync"] == "StagePush", (name, rank)
            assert out["broadcasts"] == ["stage"], (name, rank)
    for rank, out in enumerate(ranks[LAYOUTS[0]]):
        assert out["full_sync"] == "DiskPush" and out["full_broadcasts"] == [], rank


def _plan(**kw) -> SyncPlan:
    base = dict(version=1, urls=("http://a:1",), tps=(2,), tag=7, first_port=32000, master_address="10.0.0.1",
                rank0_host="node0", backend="gloo", bucket_bytes=1 << 20, api_key=None, timeout_s=60)
    return SyncPlan(**base | kw)


def test_plan_names_a_group_and_port_per_stage_and_validates():
    plan = _plan()
    assert [plan.group_name(s) for s in (0, 1)] == ["megatron_dapo_stage_sync_7_pp0", "megatron_dapo_stage_sync_7_pp1"]
    assert [plan.port(s) for s in (0, 1)] == [32000, 32001]
    with pytest.raises(ValueError, match="1 urls but 2 TP sizes"):
        _plan(tps=(1, 2))
    with pytest.raises(ValueError, match="--weight-sync-bucket-mb"):
        _plan(bucket_bytes=0)


def test_master_address_of_each_stage():
    plan = _plan()
    resolve = {"node0": "10.0.0.1", "node1": "10.0.0.2", "lo": "127.0.1.1"}.__getitem__
    routes = {"node1": "10.0.0.2", "lo": "10.0.0.3"}  # the interface each host reaches 10.0.0.1 through

    def addr(stage, host, env=None, plan=plan, route=None):
        return stage_master_address(stage, plan, env=env or {}, hostname=lambda: host,
                                    resolve=lambda h: resolve(h) if h in ("node0", "node1", "lo") else
                                    (_ for _ in ()).throw(OSError("unknown host")),
                                    route=route or (lambda target: routes[host]))

    assert addr(0, "node1") == "10.0.0.1"  # rank 0: --weight-sync-master-addr
    assert addr(1, "node0") == "10.0.0.1"  # on rank 0's host: the same address
    assert addr(1, "node1") == "10.0.0.2"  # elsewhere: the interface that reaches rank 0
    assert addr(1, "node1", {SYNC_ADDR_ENV: "node0"}) == "node0"  # the variable wins
    assert addr(1, "lo") == "10.0.0.3"  # issue 24: a hostname on 127.0.1.1 (stock Ubuntu) no longer matters
    no_route = lambda target: (_ for _ in ()).throw(OSError("Network is unreachable"))  # noqa: E731
    assert addr(1, "node1", route=no_route) == "10.0.0.2"  # no route: the hostname's address
    with pytest.raises(ValueError, match=rf"only addresses found \(127.0.1.1: the route to --weight-sync-master-addr "
                                         rf"10.0.0.1, then its hostname\) are loopback.*set {SYNC_ADDR_ENV}"):
        addr(1, "lo", route=no_route)
    loopback_route = lambda target: "127.0.0.1"  # noqa: E731  (--weight-sync-master-addr on loopback)
    with pytest.raises(ValueError, match=r"only addresses found \(127.0.0.1, 127.0.1.1"):
        addr(1, "lo", route=loopback_route)
    local = _plan(urls=("http://lo:30000",))  # every server on this source's host: loopback reaches them
    assert addr(1, "lo", plan=local, route=loopback_route) == "127.0.0.1"
    with pytest.raises(ValueError, match=rf"{SYNC_ADDR_ENV}='nowhere' on node1 .* does not resolve"):
        addr(1, "node1", {SYNC_ADDR_ENV: "nowhere"})


@pytest.mark.parametrize("candidates,remote,expected", [
    pytest.param(["127.0.1.1", "10.1.2.3"], True, "10.1.2.3", id="first-routable"),
    pytest.param(["10.1.2.3", "192.168.0.5"], True, "10.1.2.3", id="route-first"),
    pytest.param(["127.0.0.1", "127.0.1.1"], True, None, id="only-loopback-remote-servers"),
    pytest.param(["127.0.0.1", "127.0.1.1"], False, "127.0.0.1", id="only-loopback-local-servers"),
    pytest.param(["::1", "fd00::7"], True, "fd00::7", id="ipv6"),
    pytest.param([], False, None, id="none"),
])
def test_source_address_choice(candidates, remote, expected):
    assert choose_source_address(candidates, servers_remote=remote) == expected


def test_routed_address_to_loopback_is_loopback():
    assert routed_address("127.0.0.1") == "127.0.0.1"  # a real UDP connect(): no packet leaves


def test_ticket_lock_admits_one_holder_at_a_time_in_arrival_order():
    store = torch.distributed.HashStore()
    lock = TicketLock(store, timeout_s=10)
    inside, order, overlap = [], [], []

    def holder(k):
        with lock.held():
            inside.append(k)
            if len(inside) > 1:
                overlap.append(k)
            order.append(k)
            threading.Event().wait(0.01)
            inside.remove(k)

    threads = [threading.Thread(target=holder, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(order) == list(range(6)) and not overlap
    with pytest.raises(Exception, match="(?i)timeout|wait"):  # a holder that never releases: the waiter times out
        short = TicketLock(torch.distributed.HashStore(), timeout_s=0.2)
        ctx = short.held()
        ctx.__enter__()
        with short.held():
            pass


def test_merge_keeps_stage_order_and_raises_a_source_failure():
    a, b = StageOutcome(stage=0, lost={1}, nbytes=3, seconds=1.0), StageOutcome(stage=1, broken=True, nbytes=4)
    merged = merge_outcomes([a, b])
    assert (merged.lost, merged.broken, merged.nbytes, merged.stage_seconds) == ({1}, True, 7, [1.0, 0.0])
    with pytest.raises(RuntimeError, match="source of pipeline stage 1 failed: boom"):
        merge_outcomes([a, StageOutcome(stage=1, error="boom")])


def _fake_process(port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.sglang.fake_server", "--port", str(port), "--lifetime",
                             "300", "--startup-delay", "0", *extra], cwd=REPO, env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stats(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/stats", timeout=5).json()
    except httpx.HTTPError:
        return None


def _lost_mid_push(tmp_path, server1_flags: tuple[str, ...], lose, control_timeout_s: float = 60) -> None:
    """Two fake servers (real processes) at TP1 x PP2; `lose(procs, urls)` loses server 1 during the per-stage push
    (on a watcher thread), which then restarts it on its port once rank 0 has closed the update. The update must
    complete on server 0 (the whole version re-pushed from rank 0's host copy), and server 1, back, be re-synced from
    that copy: both end with every tensor of the version though no stage pushed to server 1 again."""
    hf = tiny_hf_model(seed=4, num_hidden_layers=4)
    sync_base, server_base = free_ports(2)
    urls = [f"http://127.0.0.1:{server_base + k}" for k in range(2)]
    procs = [_fake_process(server_base, "--receive-delay", "0.02"),
             _fake_process(server_base + 1, "--receive-delay", "0.02", *server1_flags)]
    stop = threading.Event()

    def chaos():
        lose(procs, urls, stop)
        while not stop.is_set() and not (_stats(urls[0]) or {}).get("calls", {}).get("/end_weight_update"):
            time.sleep(0.05)
        procs[1] = _fake_process(server_base + 1)

    watcher = threading.Thread(target=chaos, daemon=True)
    try:
        for url in urls:
            deadline = time.monotonic() + 30
            while _stats(url) is None and time.monotonic() < deadline:
                time.sleep(0.1)
        watcher.start()
        data = {"arch": vars(ModelArch.from_hf(hf.config)), "layouts": ["tp1pp2"], "urls": urls, "kill": True,
                "hf_state_dict": {k: v.clone() for k, v in hf.state_dict().items()}, "bucket_bytes": 32 << 10,
                "ports": [sync_base], "control_timeout_s": control_timeout_s}
        torch.save(data, tmp_path / "in.pt")
        log = run_torchrun(WORKER, tmp_path / "in.pt", tmp_path, nproc=2, timeout=600)
        rank0 = torch.load(tmp_path / "tp1pp2_rank0.pt", weights_only=False)
        assert rank0["stale"] == [], (rank0["engine_metrics"], log[-6000:])
        assert rank0["engine_metrics"]["rollout/servers_lost"] >= 1
        assert rank0["engine_metrics"]["sync/servers_recovered"] >= 1
        for url in urls:
            stats = _stats(url)
            assert stats["version"] == "1", url
            for n, t in hf.state_dict().items():
                assert torch.equal(torch.tensor(stats["weights"][n], dtype=t.dtype), t), (url, n)
        assert not any(g.startswith("megatron_dapo_stage_sync") for g, _, _ in _stats(urls[1])["received"])
    finally:
        stop.set()
        watcher.join(10)
        for p in procs:
            p.kill()
            p.wait()


def test_a_server_killed_during_a_per_stage_push_is_recovered_with_the_whole_version(tmp_path):
    """SIGKILL of server 1 at its first bucket (whichever stage sends it)."""
    def kill_at_first_bucket(procs, urls, stop):
        while not stop.is_set() and not (_stats(urls[1]) or {}).get("received"):
            time.sleep(0.02)
        procs[1].kill()
        procs[1].wait()

    _lost_mid_push(tmp_path, (), kill_at_first_bucket)


def test_a_server_lost_before_a_stage_group_forms_does_not_hold_the_push(tmp_path):
    """Server 1 dies as the first stage group's /init_weights_update_group reaches it: the group can never form.
    Rank 0's rendezvous used to wait out the group's timeout (300 s: the push above, once in CI, when stage 1 took the
    lock first and the kill landed before stage 0's group formed); it now stops when the server's call fails, and the
    update completes on server 0 as above (the worker waits at most 120 s for server 1's re-sync)."""
    def dies_by_itself(procs, urls, stop):
        procs[1].wait()

    # the group's timeout is the control timeout: 300 s here, so a rendezvous waiting it out leaves server 1 stale
    # past the worker's 120 s wait for its re-sync
    _lost_mid_push(tmp_path, ("--die-at-group-init",), dies_by_itself, control_timeout_s=300)


def test_rank0_holds_one_host_copy_during_a_per_stage_push():
    """Defect: the previous version's host copy stayed until every stage had arrived (130 GB on rank 0 at 32B).
    The engine must have dropped it by the time the stages push, and keep exactly the new version after."""
    from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
    from megatron_dapo.weight_sync.buckets import Bucket
    from megatron_dapo.weight_sync.stage_push import StageCoordinator
    from megatron_dapo.weight_sync.stage_sync import StagesOutcome
    from megatron_dapo.weight_sync.transports.distributed import DistributedPush

    server, _ = serve(tp_size=1)
    engine = SGLangEngine(server_urls=[f"http://127.0.0.1:{server.server_address[1]}"],
                          client=ClientConfig())
    full = DistributedPush(engine)
    coordinator = StageCoordinator(full)
    held_during_push: list[int] = []

    def push_stages(version_bytes: int):
        def push(urls, tps, tag, first_port):
            held_during_push.append(sum(b.flat.numel() * b.flat.element_size() for b in full.kept))
            kept = [Bucket(flat=torch.zeros(version_bytes // 4), metas=[])]
            return StagesOutcome(lost=set(), broken=False, kept=kept, nbytes=version_bytes, stage_seconds=[0.0])
        return push

    try:
        coordinator.update(1, push_stages(4096), stages=2)
        coordinator.update(2, push_stages(8192), stages=2)
        assert held_during_push == [0, 0]  # old code: [0, 4096], the previous version still held
        assert sum(b.flat.numel() * 4 for b in full.kept) == 8192 and engine.weight_version == 2
    finally:
        engine.shutdown()
        server.shutdown()
        server.server_close()
