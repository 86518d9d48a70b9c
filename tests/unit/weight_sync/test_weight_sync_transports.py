"""The registry of weight-sync transports (weight_sync/transports/) and the contract every registered one keeps.

The contract tests are generated from the registry: a transport added as one file in weight_sync/transports/ is
checked here with no edit, against fake SGLang servers (tests/sglang/fake_server.py) of TP 1 and TP 2:
build_weight_sync makes it from its name and it attaches to the engine; a push reaches every TP rank of every
server with the version; a server that lost its weights gets the current version back from `recover`; a rank other
than 0 only keeps in step with the collective export; `close` (at the engine's shutdown) is idempotent and drops
the host copy.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.weight_sync.build import build_weight_sync
from megatron_dapo.weight_sync.server_push import ServerPush
from megatron_dapo.weight_sync.transports import register_transport, transport, transport_names, weight_sync_mode
from tests.ports import free_port
from tests.sglang.fake_server import kill, serve

NAMES = transport_names()


def test_the_registry_holds_the_transports_and_the_flag_offers_them():
    from megatron_dapo.arguments import build_parser

    assert NAMES[:3] == ("tensor", "distributed", "disk")  # the flag's choices, in their order of before
    flag = next(a for a in build_parser()._actions if "--weight-sync-mode" in a.option_strings)
    assert tuple(flag.choices) == NAMES
    for name in NAMES:
        assert issubclass(transport(name), ServerPush)
    with pytest.raises(ValueError, match=r"--weight-sync-mode must be one of \('tensor', 'distributed', 'disk'"):
        transport("nfs")
    with pytest.raises(ValueError, match="--weight-sync-mode must be one of"):
        weight_sync_mode(requested="nfs", attach=True, cuda=False, colocate=False)


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="--weight-sync-mode 'disk' is registered twice: .*DiskPush and .*Other"):
        @register_transport("disk")
        class Other(ServerPush):
            def send(self, targets, buckets, version, session):
                return set()
    assert transport("disk").__name__ == "DiskPush"


def test_the_engine_default_bucket_is_the_sync_default():
    """ClientConfig (rollout/sglang/, which imports nothing of weight_sync/) writes the default out."""
    from megatron_dapo.weight_sync.buckets import DEFAULT_BUCKET_BYTES

    assert ClientConfig().bucket_bytes == DEFAULT_BUCKET_BYTES


def _named(shift: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    return [(f"model.layers.{i}.w", torch.randn(16, 16, generator=gen) + shift) for i in range(3)]


def _holds(state, named, version: int) -> bool:
    return state.version == str(version) and all(
        torch.equal(torch.tensor(state.weights.get(n, [])), t) for n, t in named)


@pytest.fixture
def mixed():
    made = [serve(tp_size=1), serve(tp_size=2)]
    yield made
    for server, state in made:
        kill(server, state)


@pytest.mark.parametrize("name", NAMES)
def test_every_transport_pushes_recovers_and_closes(name, mixed):
    cls = transport(name)
    cls.check_placement(cuda=False, trainer_gpu=None, server_gpus=None)  # CPU servers: any transport reaches them
    cls.check_host(cuda=False, bucket_bytes=1024)
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s, _ in mixed]
    engine = SGLangEngine(server_urls=urls, client=ClientConfig(
        bucket_bytes=1024, sync_backend="gloo", sync_master_port=free_port(), control_timeout_s=60,
        server_wait_s=30))
    try:
        sync = build_weight_sync(engine, transport=name, wait_group=None)
        assert type(sync) is cls and engine.weight_sync is sync
        sync.update(iter(_named()), version=1)
        assert engine.weight_version == 1 and all(_holds(state, _named(), 1) for _, state in mixed)
        metrics = engine.take_metrics()
        assert metrics["sync/gbytes"] > 0 and metrics["rollout/servers_lost"] == 0

        port0 = mixed[0][0].server_address[1]
        kill(*mixed[0])
        mixed[0] = serve(port=port0, tp_size=1)  # back with its launch weights
        assert not _holds(mixed[0][1], _named(), 1)
        with engine.weights_lock:  # as the engine's recovery thread calls it
            sync.recover(0)
        assert _holds(mixed[0][1], _named(), 1) and _holds(mixed[1][1], _named(), 1)

        sync.update(iter(_named(1.0)), version=2)  # the next version reaches both again
        assert engine.weight_version == 2 and all(_holds(state, _named(1.0), 2) for _, state in mixed)
    finally:
        engine.shutdown()  # closes the sync while the servers answer
    assert sync.kept == []
    sync.close()  # idempotent


@pytest.mark.parametrize("name", NAMES)
def test_every_transport_off_rank0_only_keeps_in_step(name, monkeypatch):
    """Ranks other than 0 hold the transport without an engine: a push iterates the whole export (a collective)
    and moves nothing."""
    from types import SimpleNamespace

    from megatron_dapo.weights import export

    taken = []

    def named(chunks, arch):
        for n, t in _named():
            taken.append(n)
            yield n, t

    monkeypatch.setattr(export, "iter_hf_weights", named)
    sync = transport(name)(None)
    metrics = sync.push(SimpleNamespace(chunks=[], arch=None), 4)
    assert taken == [n for n, _ in _named()] and set(metrics) == {"time/sync_s"}
    sync.close()
