"""ProcessEngine (the embedded engine in a spawned process, --async-rollout 1 on CPU) against the in-process
EmbeddedEngine: same seeds and weights -> the same samples, token for token and log-prob for log-prob, before
and after a weight push through shared memory; abort from inside the stream; the child dies with its parent."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.process_engine import ProcessEngine, ProcessEngineError
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.conftest import REPO, train_env
from tests.dist.actor_common import TINY

CONFIG = dict(TINY, model_type="qwen2", tie_word_embeddings=False)


def _state(seed: int) -> dict[str, torch.Tensor]:
    engine = EmbeddedEngine(CONFIG, seed=seed)
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def _requests(tag: str) -> list[RolloutRequest]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 300, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(5)]
    return [RolloutRequest(prompt_ids=p, n=3, request_id=f"{tag}{i}",
                           sampling=SamplingParams(max_new_tokens=12, temperature=1.0, seed=100 + i))
            for i, p in enumerate(prompts)]


def _flat(groups) -> list[tuple]:
    return [(s.request_id, s.index, s.response_ids, s.logprobs, s.finish_reason, s.weight_version)
            for group in groups for s in group]


@pytest.fixture(scope="module")
def engines():
    init = _state(1)
    local = EmbeddedEngine(CONFIG, state_dict=init, max_batch_size=4)
    remote = ProcessEngine(CONFIG, state_dict=init, max_batch_size=4, bucket_bytes=64 << 10)  # several buckets
    yield local, remote
    remote.shutdown()


def test_same_samples_as_the_in_process_engine_before_and_after_a_weight_push(engines):
    local, remote = engines
    assert remote.health() and remote.pid != os.getpid()
    before = _flat(remote.generate(_requests("a")))
    assert before == _flat(local.generate(_requests("a")))
    assert sum(len(x[2]) for x in before) > 30

    new = _state(2)  # different weights, pushed as (name, tensor) pairs like iter_hf_weights yields
    local.update_weights(new.items(), version=3)
    remote.update_weights(((k, v) for k, v in new.items()), version=3)
    assert remote.weight_version == 3
    after = _flat(remote.generate(_requests("a")))
    assert after == _flat(local.generate(_requests("a")))
    assert [x[2] for x in after] != [x[2] for x in before]  # the push reached the child
    assert {x[5] for x in after} == {3}


def _open_with_additions(engine) -> list[list]:
    """open_stream over 'o' requests of 4 to 12 tokens (rows end at different steps), adding one more request after
    each of the first three groups back."""
    def varied(tag: str) -> list[RolloutRequest]:
        return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=4 + 2 * i))
                for i, r in enumerate(_requests(tag))]

    extra = iter(varied("x")[:3])
    stream = engine.open_stream(varied("o"))
    groups = []
    for group in stream:
        groups.append(group)
        if (more := next(extra, None)) is not None:
            stream.add([more])
    return groups


def test_an_open_stream_admits_additions_at_the_same_decode_step_as_in_process(engines):
    """An add reaches the child while its decode loop waits for the next pull and joins the batch at the same step
    it would in-process: the same samples, in the same order, whenever the parent sends it."""
    local, remote = engines
    ours = _open_with_additions(remote)
    assert _flat(ours) == _flat(_open_with_additions(local))
    assert sorted(g[0].request_id for g in ours) == [f"o{i}" for i in range(5)] + ["x0", "x1", "x2"]
    init = _state(1)  # and with a running batch refilled (continuous_batching), where the step an add joins at shows
    refilled = ProcessEngine(CONFIG, state_dict=init, max_batch_size=4, continuous_batching=True)
    try:
        assert _flat(_open_with_additions(refilled)) == _flat(_open_with_additions(
            EmbeddedEngine(CONFIG, state_dict=init, max_batch_size=4, continuous_batching=True)))
    finally:
        refilled.shutdown()
    plain = remote.stream(_requests("p"))
    with pytest.raises(RuntimeError, match="use open_stream"):
        plain.add(_requests("q")[:1])
    assert len(list(plain)) == 5


def test_abort_inside_the_stream_and_a_bad_push_are_reported(engines):
    _, remote = engines
    out = []
    for group in remote.stream(_requests("b")):
        out.append(group)
        if len(out) == 1:
            assert len(remote.abort()) == 4  # the other four are in flight or queued
    assert len(out) == 5  # every request comes out exactly once
    assert any(s.finish_reason == "abort" for g in out for s in g)
    # an early break leaves the pipe clean for the next call
    for _ in remote.stream(_requests("c")):
        break
    assert len(remote.generate(_requests("d"))) == 5
    with pytest.raises(ProcessEngineError, match="not sent"):
        remote.update_weights([("model.norm.weight", torch.ones(64))], version=9)
    assert remote.weight_version == 3 and remote.health()


CHILD = """
import sys, time
from megatron_dapo.rollout.process_engine import ProcessEngine
from tests.dist.actor_common import TINY
engine = ProcessEngine(dict(TINY, model_type="qwen2", tie_word_embeddings=False), max_batch_size=2)
print(engine.pid, flush=True)
time.sleep(600)
"""


def test_the_child_dies_with_a_sigkilled_parent():
    parent = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=train_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # running
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"the engine process {child} outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
