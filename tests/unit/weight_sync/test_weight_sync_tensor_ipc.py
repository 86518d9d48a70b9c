"""Tensor-mode weight sync handles (megatron_dapo/weight_sync/tensor_ipc.py): the /dev/shm check on CPU, the
bucket's device, and CUDA IPC handles that name the GPU by UUID as SGLang's patched rebuild expects."""

from __future__ import annotations

import base64
import pickle
from collections import namedtuple
from contextlib import contextmanager

import pytest
import torch
from torch.multiprocessing import reductions

from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.weight_sync import tensor_ipc
from megatron_dapo.weight_sync.tensor_ipc import (
    CUDA_DEVICE_ARG,
    bucket_device,
    check_shm_space,
    serialize_named_tensors,
    stage_bucket,
)
from tests.sglang import full_push
from tests.sglang.fake_server import serve


def test_shm_check_names_the_flags_and_passes_with_room():
    with pytest.raises(RuntimeError, match="--weight-sync-bucket-mb") as err:
        check_shm_space(512 << 20, "/dev/shm", free_bytes=lambda _: 64 << 20)  # docker's default /dev/shm
    msg = str(err.value)
    assert "512 MiB" in msg and "64 MiB are free" in msg and "--weight-sync-mode disk" in msg
    check_shm_space(512 << 20, "/dev/shm", free_bytes=lambda _: 513 << 20)

    def unusable(path):
        raise FileNotFoundError(path)

    with pytest.raises(RuntimeError, match="--weight-sync-mode disk"):
        check_shm_space(1, "/no/shm", free_bytes=unusable)


def test_bucket_device_choice():
    assert bucket_device(torch.device("cpu"), cuda=False) == torch.device("cpu")
    # CUDA: the bucket stays on its GPU, or goes to this process's current GPU; never to host memory.
    assert bucket_device(torch.device("cpu"), cuda=True, current_cuda=lambda: 3) == torch.device("cuda", 3)
    assert bucket_device(torch.device("cuda", 1), cuda=True, current_cuda=lambda: 3) == torch.device("cuda", 1)


def test_cpu_bucket_is_staged_in_shared_memory(tmp_path):
    flat = torch.arange(10, dtype=torch.float32)
    staged = stage_bucket(flat, cuda=False, shm_dir=str(tmp_path))
    assert staged.is_shared() and staged.device.type == "cpu"
    torch.testing.assert_close(staged, torch.arange(10, dtype=torch.float32))


def test_cuda_handle_carries_the_gpu_uuid(monkeypatch):
    """A CUDA tensor's reduction (faked: no GPU here) leaves with the device UUID in place of the index;
    every other argument and the rebuild function (by name, which SGLang's SafeUnpickler allows) stay."""
    received = []

    def rebuild_cuda_tensor(*args):  # stands in for SGLang's patched rebuild on the receiving side
        received.append(args)
        return "rebuilt"

    rebuild_cuda_tensor.__module__ = "torch.multiprocessing.reductions"  # pickled by name, as torch's
    rebuild_cuda_tensor.__qualname__ = "rebuild_cuda_tensor"
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild_cuda_tensor)
    fake_args = ("cls", (4,), (1,), 0, "storage_cls", "dtype", 2, b"handle", 16, 0, False, "ref", 0, b"ev", True)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, fake_args))
    payload = serialize_named_tensors([("w", torch.zeros(4))], uuid_of=lambda i: f"GPU-uuid-of-{i}")
    assert pickle.loads(base64.b64decode(payload)) == [("w", "rebuilt")]
    (args,) = received
    assert args[CUDA_DEVICE_ARG] == "GPU-uuid-of-2"
    assert args[:CUDA_DEVICE_ARG] + args[CUDA_DEVICE_ARG + 1:] == \
        fake_args[:CUDA_DEVICE_ARG] + fake_args[CUDA_DEVICE_ARG + 1:]


def test_cpu_tensors_keep_torchs_shared_memory_format():
    torch.multiprocessing.set_sharing_strategy("file_system")
    t = torch.arange(6, dtype=torch.float32).share_memory_()
    payload = serialize_named_tensors([("a", t[:2]), ("b", t[2:].view(2, 2))])
    back = dict(pickle.loads(base64.b64decode(payload)))
    torch.testing.assert_close(back["a"], t[:2])
    torch.testing.assert_close(back["b"], t[2:].view(2, 2))


def test_engine_checks_shm_before_the_update_session(monkeypatch):
    server, state = serve()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(tensor_ipc.shutil, "disk_usage", lambda p: usage(64 << 20, 0, 64 << 20))
    engine = SGLangEngine(server_urls=[f"http://127.0.0.1:{server.server_address[1]}"],
                          client=ClientConfig(bucket_bytes=512 << 20))
    try:
        with pytest.raises(RuntimeError, match="--weight-sync-bucket-mb"):
            full_push(engine, "tensor").update([("w", torch.ones(3))], version=1)
        assert "/begin_weight_update" not in state.calls  # failed before the servers' session opened
        assert engine.weight_version == 0
    finally:
        engine.shutdown()
        server.shutdown()
        server.server_close()


class _RecordingPool(tensor_ipc.IpcBucketPool):
    """IpcBucketPool whose torch.cuda.MemPool / use_mem_pool are fakes that record; allocations land on the CPU.
    `reserved` / `expandable`: the allocator's reserved bytes (one value a call) and the snapshot's verdict."""

    def __init__(self, log: list, reserved=None, expandable=False):
        def make_pool():
            log.append("make_pool")
            return "pool"

        @contextmanager
        def use_pool(pool, device):
            log.append(("enter", pool, str(device)))
            yield
            log.append("exit")

        def is_expandable(ptr):
            log.append("snapshot")
            return expandable

        sizes = iter(reserved or [])
        super().__init__(make_pool=make_pool, use_pool=use_pool, reserved=lambda device: next(sizes, 0),
                         is_expandable=is_expandable)
        self.log = log

    def empty(self, numel, dtype, device):
        self.log.append(("empty", numel, dtype, str(device)))
        return super().empty(numel, dtype, torch.device("cpu"))  # no GPU here: the same code path on the CPU


def test_cuda_bucket_is_copied_into_the_ipc_pool():
    """A CUDA bucket is copied into the private pool (allocated inside use_mem_pool, the pool made once, on the
    first bucket) instead of being shared from the trainer's allocator, whose expandable segments need
    pidfd_getfd (ptrace) to open in SGLang; the copy holds the same bytes. The CPU path never touches a pool."""
    log: list = []
    pool = _RecordingPool(log)
    assert log == []  # nothing allocated before the first CUDA bucket (free on CPU runs)
    flat = torch.arange(12, dtype=torch.float32)
    staged = stage_bucket(flat, cuda=True, pool=pool, current_cuda=lambda: 2)
    assert staged.data_ptr() != flat.data_ptr() and torch.equal(staged, flat)
    stage_bucket(flat[:5], cuda=True, pool=pool, current_cuda=lambda: 2)
    assert log == [("empty", 12, torch.float32, "cuda:2"), "make_pool", ("enter", "pool", "cpu"), "exit",
                   ("empty", 5, torch.float32, "cuda:2"), ("enter", "pool", "cpu"), "exit"]
    pool.release()
    assert pool._pool is None
    with pytest.raises(ValueError, match="IpcBucketPool"):
        stage_bucket(flat, cuda=True, current_cuda=lambda: 0)
    log.clear()
    shm = stage_bucket(flat, cuda=False, pool=pool)
    assert log == [] and shm.is_shared() and torch.equal(shm, flat)


@pytest.mark.parametrize("conf, last, want", [
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None, True, id="launchers-env"),
    pytest.param({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"}, None, True,
                 id="new-env-name"),
    pytest.param({"PYTORCH_ALLOC_CONF": "expandable_segments:False",
                  "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None, False, id="new-name-first"),
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,expandable_segments:False"}, None, False,
                 id="last-wins"),
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:False", False,
                 id="set-at-run-time"),
    pytest.param({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "max_split_size_mb:64", True,
                 id="run-time-string-without-the-key"),
    pytest.param({}, None, False, id="unset"),
])
def test_expandable_segments_setting_is_read_like_torch(conf, last, want):
    assert tensor_ipc.expandable_segments_on(last, conf) is want


def test_pool_allocates_with_expandable_segments_off_and_gives_the_setting_back(monkeypatch):
    """Issue 37 defect 3: a recent torch's MemPool() follows the global expandable_segments setting, which the
    launchers turn on, so the pool alone does not keep buckets out of expandable segments. The allocation must
    run with the setting off (inside the pool's context) and the trainer's setting come back after it, on error
    too; with the setting off already nothing is touched."""
    state = {"conf": "expandable_segments:True"}
    calls: list = []

    def set_settings(conf):
        calls.append(conf)
        state["conf"] = conf

    monkeypatch.setattr(tensor_ipc, "_last_allocator_settings", lambda: state["conf"])
    monkeypatch.setattr(tensor_ipc, "_set_allocator_settings", set_settings)
    seen: list = []

    @contextmanager
    def use_pool(pool, device):
        seen.append(state["conf"])  # the setting the pool's allocation is made under
        yield

    pool = tensor_ipc.IpcBucketPool(make_pool=lambda: "pool", use_pool=use_pool, reserved=lambda d: 0)
    staged = pool.empty(4, torch.float32, torch.device("cpu"))  # no GPU here: the same path on the CPU
    assert staged.numel() == 4
    assert seen == ["expandable_segments:False"]
    assert calls == ["expandable_segments:False", "expandable_segments:True"]

    @contextmanager
    def failing_pool(pool, device):
        raise torch.OutOfMemoryError("CUDA out of memory")
        yield

    calls.clear()
    pool = tensor_ipc.IpcBucketPool(make_pool=lambda: "pool", use_pool=failing_pool, reserved=lambda d: 0)
    with pytest.raises(torch.OutOfMemoryError):
        pool.empty(4, torch.float32, torch.device("cpu"))
    assert calls == ["expandable_segments:False", "expandable_segments:True"]  # given back on error

    calls.clear()
    state["conf"] = "expandable_segments:False"
    pool = tensor_ipc.IpcBucketPool(make_pool=lambda: "pool", use_pool=use_pool, reserved=lambda d: 0)
    pool.empty(4, torch.float32, torch.device("cpu"))
    assert calls == []


def test_the_real_allocator_settings_switch_and_come_back(tmp_path):
    """The same switch through this torch's own settings calls (torch._C._accelerator_{get,set}AllocatorSettings
    or the older wrapper), in a process started with the launchers' setting. Only the settings plumbing shows on
    CPU; the segment it produces is the GPU smoke's `ipc` part."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from megatron_dapo.weight_sync import tensor_ipc as t\n"
        "assert t.expandable_segments_on(t._last_allocator_settings())\n"
        "with t.expandable_segments_off():\n"
        "    assert not t.expandable_segments_on(t._last_allocator_settings()), t._last_allocator_settings()\n"
        "assert t.expandable_segments_on(t._last_allocator_settings())\n"
        "print('ok')\n")
    from tests.torchrun import REPO, subprocess_env

    env = dict(subprocess_env(), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    env.pop("PYTORCH_ALLOC_CONF", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_pool_segment_that_is_expandable_anyway_is_refused_naming_the_way_out():
    """A torch whose private pools ignored the switch would hand SGLang a segment it cannot open without ptrace:
    refused at the allocation, naming the setting and the other sync mode. Only a bucket that grew the pool
    (reserved bytes changed) is looked up in the snapshot."""
    log: list = []
    pool = _RecordingPool(log, reserved=[0, 0], expandable=True)
    pool.empty(4, torch.float32, torch.device("cpu"))  # reserved unchanged: from a checked segment
    assert "snapshot" not in log
    pool = _RecordingPool(log, reserved=[0, 2 << 20], expandable=True)
    with pytest.raises(RuntimeError, match="expandable_segments:True.*--weight-sync-mode distributed"):
        pool.empty(4, torch.float32, torch.device("cpu"))
    assert log[-1] == "snapshot"
    log.clear()
    pool = _RecordingPool(log, reserved=[0, 2 << 20], expandable=False)
    assert pool.empty(4, torch.float32, torch.device("cpu")).numel() == 4 and log[-1] == "snapshot"
