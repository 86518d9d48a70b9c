"""ProcessEngine: the EmbeddedEngine in a child process of its own, behind the same RolloutEngine interface.

Why: with --async-rollout 1 on CPU, generation has to run while the actor trains. Two threads of one
process would take turns on the interpreter lock and torch's intra-op pool, so the embedded engine runs in
a `spawn`ed process instead (its own interpreter, its own torch threads: OMP_NUM_THREADS is inherited).

Protocol over one duplex multiprocessing pipe (pickled messages):
- parent -> child: ("stream", requests), ("open", requests) (open_stream), ("add", requests) (OpenStream.add:
  the requests join the stream when the main thread next resumes it, after the pull), ("abort", ids | None),
  ("pause",), ("resume",),
  ("weights", (buffer or None, [(name, offset, dtype, shape)])), ("version", int), ("shutdown",).
- child -> parent: ("group", samples) per finished request, ("end",) when a stream is exhausted,
  ("stream_error", text); ("reply", value) / ("reply_error", text) for every other message, in order.
- Streams are pulled, as a generator in this process would be: after each group the child's decode loop
  waits for a ("next",) (no reply) that the parent sends when its consumer asks for the next group. So an
  abort called between two groups lands at the same decode step as in-process, and a run that cuts its batch
  (--partial-rollout) carries the same prefixes every time (a resumed run matches the uninterrupted one).
In the child a reader thread takes every message: abort / pause / resume act at once (abort is called
while the consumer iterates a stream, and the decode loop checks the abort set at every step); stream and
weight loads queue for the child's main thread, so a weight load waits for the stream in flight (the
trainer's push waits for its batch anyway). One stream at a time per engine.

Weights travel through shared memory: a flat byte buffer (torch `share_memory_()`; its file descriptor
crosses the pipe once, when the buffer is created or grown), filled by the parent bucket by bucket
(`bucket_bytes`, default 256 MiB, or one tensor when larger), read by the child into the model, then
reused. Cost: one bucket of host memory in /dev/shm; for a 0.5B fp32 model 2 GB cross in 8 buckets.
This is a CPU path (the demo and tests); GPU runs use SGLang servers, whose generation is already
asynchronous HTTP.

Lifetime: the child asks the kernel for SIGKILL when its parent thread dies (PR_SET_PDEATHSIG, see
checkpoint_procs.py), so a trainer killed with SIGKILL takes it along; create the engine on the thread that
lives as long as the trainer (the main thread). `shutdown()` asks it to exit and kills it by pid after
`stop_timeout_s`.
"""

from __future__ import annotations

import collections
import ctypes
import multiprocessing
import os
import queue
import signal
import threading
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers the shared-memory tensor reductions with ForkingPickler

from megatron_dapo.rollout.engine import OpenStream, RolloutEngine, check_unique_ids
from megatron_dapo.rollout.types import RolloutRequest, Sample

PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h), as checkpoint_procs.py uses it (not imported: its atexit hook imports megatron)."""
ALIGN = 64
"""Byte alignment of each tensor inside the shared weight buffer."""


class ProcessEngineError(RuntimeError):
    """The child process failed (its traceback is in the message) or died."""


class ProcessEngine(RolloutEngine):
    """EmbeddedEngine(*args, **kwargs) in a spawned child process; the same samples for the same seeds.

    `tokenizer` may be a directory (the child loads it). The child boots in the background: the first call
    waits for it, so start the engine early and do other work meanwhile.

    `start_timeout_s`: how long the child may take to import torch and build the model.
    """

    def __init__(self, *args: Any, bucket_bytes: int = 256 << 20, start_timeout_s: float = 600.0,
                 stop_timeout_s: float = 10.0, **kwargs: Any) -> None:
        if bucket_bytes < ALIGN:
            raise ValueError(f"ProcessEngine: bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_serve, args=(child, os.getpid(), args, kwargs), daemon=True,
                                 name="embedded-rollout")
        self._proc.start()
        child.close()  # the child's end lives in the child only: its death is EOF here
        self._lock = threading.RLock()  # one reader of the pipe at a time
        self._inbox: collections.deque = collections.deque()  # stream messages read while waiting for a reply
        self._streaming = False
        self._closed = False
        self._version = 0
        self._buffer: torch.Tensor | None = None
        self._bucket_bytes = bucket_bytes
        self._stop_timeout_s = stop_timeout_s
        self._start_timeout_s = start_timeout_s
        self._max_batch_size: int | None = kwargs.get("max_batch_size")  # None: the EmbeddedEngine default
        self._ready = False  # the child boots (imports torch, builds the model) while the caller goes on

    def _wait_ready(self) -> None:
        """Block until the child reported that its engine is built (the first call waits for it)."""
        if self._ready:
            return
        if not self._conn.poll(self._start_timeout_s):
            self._kill()
            raise ProcessEngineError(f"the embedded rollout process (pid {self._proc.pid}) did not start within "
                                     f"{self._start_timeout_s:.0f} s")
        kind, value = self._recv()
        if kind != "reply":
            self._kill()
            raise ProcessEngineError(f"the embedded rollout process failed to start:\n{value}")
        self._ready = True

    @property
    def pid(self) -> int:
        return int(self._proc.pid)

    # ---- pipe --------------------------------------------------------------------------------------

    def _recv(self) -> tuple[str, Any]:
        try:
            msg = self._conn.recv()
        except (EOFError, OSError) as err:
            self._proc.join(1.0)
            raise ProcessEngineError(f"the embedded rollout process (pid {self._proc.pid}) died (exit code "
                                     f"{self._proc.exitcode})") from err
        return msg[0], (msg[1] if len(msg) > 1 else None)

    def _call(self, op: str, payload: Any = None) -> Any:
        """Send one message and wait for its reply; stream messages read meanwhile go to the inbox."""
        self._check_open()
        with self._lock:
            self._wait_ready()
            self._conn.send((op, payload))
            while True:
                kind, value = self._recv()
                if kind == "reply":
                    return value
                if kind == "reply_error":
                    raise ProcessEngineError(f"embedded rollout process, {op}:\n{value}")
                self._inbox.append((kind, value))

    def _next_stream_message(self, pull: bool = True) -> tuple[str, Any]:
        """The next stream message; `pull` first lets the child's decode loop go on past its last group."""
        with self._lock:
            if pull:
                self._conn.send(("next", None))
            if self._inbox:
                return self._inbox.popleft()
            kind, value = self._recv()
            if kind in ("reply", "reply_error"):
                raise ProcessEngineError(f"unexpected {kind} from the embedded rollout process: {value}")
            return kind, value

    # ---- RolloutEngine -----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def capacity(self) -> int:
        from megatron_dapo.rollout.embedded import DEFAULT_MAX_BATCH_SIZE

        return DEFAULT_MAX_BATCH_SIZE if self._max_batch_size is None else int(self._max_batch_size)

    def health(self) -> bool:
        return not self._closed and self._proc.is_alive()

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        return self._start("stream", requests)

    def open_stream(self, requests: Sequence[RolloutRequest]) -> OpenStream:
        """EmbeddedEngine.open_stream in the child. An `add` reaches the child at once and joins its stream at the
        next pull, as it would between two groups in-process: the same samples whenever the parent adds."""
        return self._start("open", requests)

    def _start(self, op: str, requests: Sequence[RolloutRequest]) -> OpenStream:
        self._check_open()
        check_unique_ids(requests)
        if self._streaming:
            raise RuntimeError("ProcessEngine runs one stream at a time: finish (or close) the previous one first")
        self._streaming = True
        try:
            self._call(op, list(requests))  # accepted (or the child's ValueError, e.g. paused)
        except BaseException:
            self._streaming = False
            raise
        ids = [r.request_id for r in requests]

        def add(more: Sequence[RolloutRequest]) -> None:
            if op != "open":
                raise RuntimeError("ProcessEngine.stream takes no requests once started: use open_stream")
            clash = {r.request_id for r in more} & set(ids)
            if clash:
                raise ValueError(f"request ids already in this stream: {sorted(clash)[:5]}")
            self._call("add", list(more))
            ids.extend(r.request_id for r in more)

        return OpenStream(self._drain(ids), add)

    def _drain(self, ids: list[str]) -> Iterator[list[Sample]]:
        ended, pull = False, False  # the child produces its first group unasked, each later one on a pull
        try:
            while True:
                kind, value = self._next_stream_message(pull)
                pull = True
                if kind == "end":
                    ended = True
                    return
                if kind == "stream_error":
                    ended = True
                    raise ProcessEngineError(f"embedded rollout process, stream:\n{value}")
                yield value
        finally:
            if not ended and not self._closed and self._proc.is_alive():
                # The consumer stopped early: stop the rest and read up to the end, so the pipe is clean.
                self._call("abort", ids)
                while self._next_stream_message(pull)[0] not in ("end", "stream_error"):
                    pass
            self._streaming = False

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        return self._call("abort", None if request_ids is None else list(request_ids))

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copies the tensors into the shared buffer bucket by bucket; the child loads each bucket, then the
        whole set is checked (every parameter exactly once) and `version` set. Waits for a stream in flight."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        self._check_open()
        meta: list[tuple[str, int, str, tuple[int, ...]]] = []
        used = 0
        self._call("weights_begin")
        for name, tensor in named_tensors:
            tensor = tensor.detach()
            nbytes = tensor.numel() * tensor.element_size()
            start = -(-used // ALIGN) * ALIGN
            if meta and start + nbytes > self._capacity():
                self._send_bucket(meta)
                meta, start = [], 0
            new_buffer = self._ensure_capacity(start + nbytes)
            if new_buffer and meta:  # cannot happen (a bucket is flushed before growing), kept as a guard
                raise AssertionError("shared weight buffer grown under a pending bucket")
            view = self._buffer[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.cpu())
            meta.append((name, start, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            used = start + nbytes
        if meta:
            self._send_bucket(meta)
        self._call("weights_end", version)
        self._version = version

    def _capacity(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def _ensure_capacity(self, nbytes: int) -> bool:
        """(Re)allocate the shared buffer when `nbytes` do not fit; True when a new buffer was made."""
        if nbytes <= self._capacity():
            return False
        self._buffer = torch.empty(max(nbytes, self._bucket_bytes), dtype=torch.uint8).share_memory_()
        self._buffer_sent = False
        return True

    def _send_bucket(self, meta: list) -> None:
        buffer = None if getattr(self, "_buffer_sent", False) else self._buffer
        self._call("weights", (buffer, meta))
        self._buffer_sent = True

    def take_metrics(self) -> dict[str, float]:
        return {}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._proc.is_alive():
                self._conn.send(("shutdown", None))
                self._proc.join(self._stop_timeout_s)
        except (OSError, ValueError):
            pass
        self._kill()
        self._conn.close()

    def _kill(self) -> None:
        if self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)  # by its pid, never by name
            self._proc.join(5.0)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("ProcessEngine was shut down; create a new one")
        if not self._proc.is_alive():
            raise ProcessEngineError(f"the embedded rollout process (pid {self._proc.pid}) is not running (exit "
                                     f"code {self._proc.exitcode})")


# ---- child ---------------------------------------------------------------------------------------------

def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the parent thread that started it dies (Linux); exit if it already has."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def _serve(conn, parent_pid: int, args: tuple, kwargs: dict) -> None:
    """The child's main loop: build the engine, then run streams and weight loads queued by the reader thread."""
    _die_with_parent(parent_pid)
    # A terminal's Ctrl-C reaches the whole process group, Slurm's SIGTERM every process of the step: the trainer
    # acts on them (megatron_dapo/trainer/stop.py) and ends this process, by shutdown or by dying
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            try:
                conn.send(msg)
            except OSError:  # the parent is gone (its pipe end closes before PR_SET_PDEATHSIG lands): leave quietly
                os._exit(0)

    try:
        from megatron_dapo.rollout.embedded import EmbeddedEngine

        if isinstance(kwargs.get("tokenizer"), str):  # a directory: loaded here, not pickled across
            from transformers import AutoTokenizer

            kwargs = kwargs | {"tokenizer": AutoTokenizer.from_pretrained(kwargs["tokenizer"])}
        engine = EmbeddedEngine(*args, **kwargs)
    except BaseException:
        send("reply_error", traceback.format_exc())
        return
    work: queue.Queue = queue.Queue()
    adds: list[list] = []  # [requests, aborted]: open_stream additions waiting for the next pull
    adds_lock = threading.Lock()
    pulls = threading.Semaphore(0)  # ("next",) from the parent: the stream may go past its last group

    def reader() -> None:
        while True:
            try:
                op, payload = conn.recv()
            except (EOFError, OSError):
                op, payload = "shutdown", None
            try:
                if op == "next":
                    pulls.release()
                    continue
                if op == "add":  # joins the stream at the next pull, on the main thread (below)
                    with adds_lock:
                        adds.append([payload, False])
                    send("reply", None)
                elif op == "abort":
                    with adds_lock:  # an abort of everything also stops what was added and has not joined yet
                        for entry in adds:
                            entry[1] = entry[1] or payload is None
                    send("reply", engine.abort(payload))
                elif op == "pause":
                    send("reply", engine.pause())
                elif op == "resume":
                    send("reply", engine.resume())
                else:
                    work.put((op, payload))
            except BaseException:
                send("reply_error", traceback.format_exc())
            if op == "shutdown":
                pulls.release()  # a stream waiting for a pull ends (the engine is shut down next)
                return

    threading.Thread(target=reader, name="pipe-reader", daemon=True).start()
    send("reply", None)  # ready
    buffer: torch.Tensor | None = None
    pending: list[tuple[str, torch.Tensor]] = []
    while True:
        op, payload = work.get()
        if op == "shutdown":
            engine.shutdown()
            return
        if op in ("stream", "open"):
            try:
                groups = engine.stream(payload) if op == "stream" else engine.open_stream(payload)
            except BaseException:
                send("reply_error", traceback.format_exc())
                continue
            send("reply", None)
            try:
                for group in groups:
                    send("group", group)
                    pulls.acquire()  # as a generator in the parent's process: no decoding ahead of the consumer
                    with adds_lock:
                        joining, adds[:] = list(adds), []
                    for more, aborted in joining:
                        groups.add(more)
                        if aborted:
                            engine.abort([r.request_id for r in more])
                send("end")
            except BaseException:
                send("stream_error", traceback.format_exc())
            continue
        try:
            if op == "weights_begin":
                pending = []
            elif op == "weights":
                new_buffer, meta = payload
                if new_buffer is not None:
                    buffer = new_buffer
                # copies: the parent refills the buffer with the next bucket once this reply is sent
                pending += [(name, buffer[off:off + _nbytes(dtype, shape)].view(getattr(torch, dtype))
                             .view(shape).clone()) for name, off, dtype, shape in meta]
            elif op == "weights_end":
                engine.update_weights(pending, version=payload)
                pending = []
            else:
                raise ValueError(f"unknown message {op!r}")
            send("reply", None)
        except BaseException:
            pending = []
            send("reply_error", traceback.format_exc())


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    for d in shape:
        n *= d
    return n
