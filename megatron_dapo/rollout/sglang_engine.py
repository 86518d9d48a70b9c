"""SGLangEngine: the RolloutEngine over SGLang HTTP servers.

Requests go out one per sample from an asyncio loop on a background thread (bounded by a semaphore) to
the router, or round-robin to the servers. A sample whose server dies (connection error, 5xx) is retried
on another server; the dead server is restarted (when this engine launched it) and re-synced before it
takes work again, so no prompt is lost. Weight updates go in flat buckets through one of three paths:
- "tensor": /update_weights_from_tensor, buckets passed by handle: CUDA IPC on GPU (servers that see the
  trainer's GPU, i.e. colocated), shared memory on CPU (megatron_dapo/rollout/tensor_ipc.py);
- "distributed": /init_weights_update_group once, then one broadcast per bucket (separate GPUs, NCCL);
- "disk": safetensors shards + /update_weights_from_disk (fallback; any topology with a shared disk).
The tensor and distributed paths are wrapped in /begin_weight_update ... /end_weight_update, which
SGLang 0.5.23 requires.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from megatron_dapo.rollout.buckets import DEFAULT_BUCKET_BYTES, Bucket, iter_buckets
from megatron_dapo.rollout.engine import RolloutEngine, check_unique_ids
from megatron_dapo.rollout.sglang_protocol import (
    aborted_sample,
    generate_payload,
    parse_generate_response,
    sample_rid,
    to_sample,
)
from megatron_dapo.rollout.sglang_server import ServerConfig, ServerGroup
from megatron_dapo.rollout.tensor_ipc import check_shm_space, serialize_named_tensors, stage_bucket
from megatron_dapo.rollout.types import RolloutRequest, Sample

UPDATE_MODES = ("tensor", "distributed", "disk")


@dataclass(kw_only=True)
class ClientConfig:
    """How the engine talks to its servers."""

    max_concurrency: int = 256
    """Requests in flight at once over all servers (--sglang-max-concurrency)."""
    request_timeout_s: float = 3600.0
    """One /generate call; long responses on a busy server take minutes."""
    max_retries: int = 3
    """Attempts per sample on other servers after a server failure, before the error is raised."""
    update_mode: str = "tensor"
    """'tensor' (colocated), 'distributed' (separate GPUs) or 'disk' (--weight-sync-mode)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Flat bucket size for weight sync (--weight-sync-bucket-mb x 2**20)."""
    sync_backend: str = "nccl"
    """Backend of the update_weights_from_distributed group ('gloo' on CPU)."""
    sync_master_address: str = "127.0.0.1"
    sync_master_port: int = 29650
    disk_dir: str | None = None
    """Where 'disk' mode writes weights (must be visible to the servers); default a temp dir."""
    control_timeout_s: float = 600.0
    """Every control call (abort, pause, weight update) times out instead of hanging a step."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (--sglang-max-concurrency), got "
                f"{self.max_concurrency}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"--weight-sync-mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 (--weight-sync-bucket-mb), got {self.bucket_bytes}")


class ServerDied(RuntimeError):
    """A server stopped answering (connection refused / reset, or a 5xx)."""


class SGLangEngine(RolloutEngine):
    """RolloutEngine over SGLang servers it launches (ServerConfig) or already running ones (server_urls)."""

    def __init__(
        self,
        servers: ServerConfig | None = None,
        *,
        client: ClientConfig | None = None,
        server_urls: Sequence[str] | None = None,
        weight_source: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
    ) -> None:
        if (servers is None) == (server_urls is None):
            raise ValueError("SGLangEngine: give exactly one of ServerConfig (launch) or "
                "server_urls (attach)")
        self.client = client or ClientConfig()
        self.weight_source = weight_source
        """Called to re-sync a restarted server when no on-disk copy of the current weights exists."""
        self.group = ServerGroup(servers) if servers is not None else None
        if self.group is not None:
            self.group.start()
            self.urls = [s.url for s in self.group.servers]
            self.tp = servers.tp_per_server
            self.entry_url = self.group.router.url if self.group.router is not None else None
        else:
            self.urls = [u.rstrip("/") for u in server_urls]
            self.tp = 1
            self.entry_url = None
        self._version = 0
        self._disk_weights: str | None = None
        self._sync_group = None
        self._stale: set[int] = set()  # restarted servers still on old weights: take no requests
        self._restarts: dict[int, asyncio.Future] = {}
        self.restarts = 0
        """How many server restarts this engine performed (a metric worth logging)."""
        self._rr = itertools.count()
        self._inflight: dict[str, set[str]] = {}  # request_id -> rids of its samples in flight
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        self._http = self._call(self._make_client())
        self._closed = False

    # ---- plumbing ------------------------------------------------------------------------------

    async def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.client.max_concurrency + 16)
        self._sem = asyncio.Semaphore(self.client.max_concurrency)
        return httpx.AsyncClient(limits=limits, timeout=self.client.request_timeout_s)

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _post(self, url: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        try:
            resp = await self._http.post(f"{url}{path}", json=body or {},
                                         timeout=timeout or self.client.control_timeout_s)
        except httpx.TransportError as e:
            raise ServerDied(f"{url}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code >= 500:
            raise ServerDied(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        if resp.status_code != 200:
            raise RuntimeError(f"SGLang {url}{path} answered {resp.status_code}: {resp.text[:500]}")
        return resp.json() if resp.content else None

    async def _post_all(self, path: str, body: dict | None = None) -> list[Any]:
        return await asyncio.gather(*(self._post(u, path, body) for u in self.urls))

    def _pick_server(self, avoid: set[int]) -> int:
        healthy = [i for i in range(len(self.urls)) if i not in self._stale]
        choices = [i for i in healthy if i not in avoid] or healthy
        if not choices:
            raise RuntimeError("SGLangEngine: no server is serving (all dead or stale)")
        return choices[next(self._rr) % len(choices)]

    # ---- generation ----------------------------------------------------------------------------

    async def _one(self, req: RolloutRequest, index: int) -> Sample:
        rid = sample_rid(req.request_id, index)
        tried: set[int] = set()
        async with self._sem:
            for attempt in range(self.client.max_retries + 1):
                if req.request_id in self._aborted:
                    return aborted_sample(req, index, self._version)
                server = self._pick_server(tried)
                # First try through the router; retries go to a server directly, avoiding failed ones.
                use_router = self.entry_url is not None and attempt == 0
                url = self.entry_url if use_router else self.urls[server]
                with self._lock:
                    self._inflight.setdefault(req.request_id, set()).add(rid)
                    if req.request_id in self._aborted:  # abort() ran between the check and now
                        return aborted_sample(req, index, self._version)
                try:
                    body = await self._post(url, "/generate", generate_payload(req, index),
                                            timeout=self.client.request_timeout_s)
                except ServerDied:
                    if attempt == self.client.max_retries:
                        raise
                    if not use_router:
                        tried.add(server)
                    await self._recover(None if use_router else server)
                    continue
                finally:
                    with self._lock:
                        self._inflight.get(req.request_id, set()).discard(rid)
                out = parse_generate_response(body)
                if out.finish_reason == "abort" and req.request_id not in self._aborted:
                    # Aborted by the server, not by us (e.g. a restart or pause in 'abort' mode): redo it.
                    continue
                return to_sample(req, index, out, self._version)
        raise RuntimeError(f"sample {rid} failed {self.client.max_retries + 1} times")

    async def _group(self, req: RolloutRequest, out: queue.Queue) -> None:
        try:
            samples = await asyncio.gather(*(self._one(req, i) for i in range(req.n)))
            result: list[Sample] | BaseException = list(samples)
        except BaseException as e:  # delivered to the consuming thread, never swallowed
            result = e
        with self._lock:  # done: no longer abortable, and its id may be reused
            self._inflight.pop(req.request_id, None)
            self._aborted.discard(req.request_id)
        out.put(result)

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        self._check_open()
        check_unique_ids(requests)
        results: queue.Queue = queue.Queue()
        with self._lock:
            for r in requests:
                self._aborted.discard(r.request_id)
                self._inflight.setdefault(r.request_id, set())
        for r in requests:
            asyncio.run_coroutine_threadsafe(self._group(r, results), self._loop)
        return self._drain(results, len(requests))

    def _drain(self, results: queue.Queue, count: int) -> Iterator[list[Sample]]:
        for _ in range(count):
            item = results.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        with self._lock:
            ids = set(self._inflight) if request_ids is None else set(request_ids) & set(self._inflight)
            self._aborted |= ids
            rids = [rid for i in ids for rid in self._inflight.get(i, ())]

        async def send():
            # Queued samples see _aborted before they are sent; in-flight ones are aborted by rid on every
            # server (the router does not know which worker holds a request).
            await asyncio.gather(*(self._post(u, "/abort_request", {"rid": rid}) for u in self.urls
                                   for rid in rids), return_exceptions=True)

        if rids:
            self._call(send(), self.client.control_timeout_s)
        return sorted(ids)

    # ---- control -------------------------------------------------------------------------------

    def pause(self) -> None:
        # 'retract' keeps the requests (recomputing their KV after resume) instead of aborting them.
        self._call(self._post_all("/pause_generation", {"mode": "retract"}))

    def resume(self) -> None:
        self._call(self._post_all("/continue_generation", {}))

    def health(self) -> bool:
        async def check(url):
            try:
                return (await self._http.get(f"{url}/health", timeout=10)).status_code == 200
            except httpx.HTTPError:
                return False

        async def all_ok():
            return all(await asyncio.gather(*(check(u) for u in self.urls)))

        return not self._closed and self._call(all_ok())

    @property
    def weight_version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._call(self._http.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if self.group is not None:
            self.group.stop()
        if self._disk_weights and self.client.disk_dir is None:
            shutil.rmtree(self._disk_weights, ignore_errors=True)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine was shut down; create a new one")

    # ---- failure recovery ----------------------------------------------------------------------

    async def _recover(self, server: int | None) -> None:
        """Restarts dead servers this engine launched (`server`, or every dead one when a failure came
        through the router) and puts each back once it has the current weights. Concurrent failures of
        the same server wait on one restart."""
        if self.group is None:
            return
        if server is None:
            dead = [i for i, s in enumerate(self.group.servers) if not s.alive()]
        else:
            dead = [server]
        for i in dead:
            task = self._restarts.get(i)
            if task is None or task.done():
                task = self._restarts[i] = asyncio.ensure_future(self._restart(i))
            await asyncio.shield(task)

    async def _restart(self, server: int) -> None:
        self._stale.add(server)
        await asyncio.to_thread(self.group.restart, server)
        self.restarts += 1
        if self._version == 0:
            self._stale.discard(server)  # it loaded model_path: already current
        elif self._disk_weights is not None:
            await self._post(self.urls[server], "/update_weights_from_disk",
                             {"model_path": self._disk_weights, "weight_version": str(self._version)})
            self._stale.discard(server)
        elif self.weight_source is not None:
            await asyncio.to_thread(self._push_tensor, [server], self.weight_source(), self._version)
            self._stale.discard(server)
        # else: it stays out of rotation until the next update_weights reaches it.

    # ---- weight updates ------------------------------------------------------------------------

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        targets = list(range(len(self.urls)))
        mode = self.client.update_mode
        if mode == "disk":
            self._push_disk(targets, named_tensors, version)
        elif mode == "tensor":
            self._push_tensor(targets, named_tensors, version)
        else:
            self._push_distributed(named_tensors, version)
        self._stale.clear()
        self._version = version

    def _bracket(self, targets: list[int], path: str) -> None:
        async def go():
            await asyncio.gather(*(self._post(self.urls[i], path, {}) for i in targets))

        self._call(go(), self.client.control_timeout_s)

    def _push_tensor(
        self, targets: list[int], named: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Buckets by handle (megatron_dapo/rollout/tensor_ipc.py): CUDA IPC on GPU, /dev/shm on CPU."""
        cuda = torch.cuda.is_available()
        if not cuda:
            torch.multiprocessing.set_sharing_strategy("file_system")
            check_shm_space(self.client.bucket_bytes)  # before the servers enter their update session
        self._bracket(targets, "/begin_weight_update")
        try:
            for bucket in iter_buckets(named, self.client.bucket_bytes):
                flat = stage_bucket(bucket.flat, cuda=cuda)
                views = Bucket(flat=flat, metas=bucket.metas).named_tensors()
                # One payload per server TP rank: each rank's deserialization takes one IPC reference.
                body = {"serialized_named_tensors": [serialize_named_tensors(views) for _ in range(self.tp)],
                        "flush_cache": False, "weight_version": str(version)}

                async def send(body=body):
                    path = "/update_weights_from_tensor"
                    return await asyncio.gather(*(self._post(self.urls[i], path, body) for i in targets))

                for reply in self._call(send(), self.client.control_timeout_s):
                    _check_success(reply, "update_weights_from_tensor")
                del flat, views, body  # the servers have loaded it: at most one bucket alive at a time
                if cuda:
                    torch.cuda.ipc_collect()  # free the bucket's GPU block now that no server holds it
        finally:
            self._bracket(targets, "/end_weight_update")
        self._flush(targets)

    def _push_distributed(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from megatron_dapo.rollout.sync_group import init_weight_sync_group

        group_name = "megatron_dapo_weight_sync"
        if self._sync_group is None:
            world = 1 + len(self.urls) * self.tp
            futures = [asyncio.run_coroutine_threadsafe(self._post(url, "/init_weights_update_group", {
                "master_address": self.client.sync_master_address,
                "master_port": self.client.sync_master_port,
                "rank_offset": 1 + i * self.tp, "world_size": world, "group_name": group_name,
                "backend": self.client.sync_backend}), self._loop) for i, url in enumerate(self.urls)]
            self._sync_group = init_weight_sync_group(
                master_address=self.client.sync_master_address, master_port=self.client.sync_master_port,
                world_size=world, group_name=group_name, backend=self.client.sync_backend,
                timeout_s=self.client.control_timeout_s)
            for f in futures:
                _check_success(f.result(self.client.control_timeout_s), "init_weights_update_group")
        targets = list(range(len(self.urls)))
        self._bracket(targets, "/begin_weight_update")
        try:
            for bucket in iter_buckets(named, self.client.bucket_bytes):
                body = {"names": [m.name for m in bucket.metas],
                        "dtypes": [str(m.dtype).removeprefix("torch.") for m in bucket.metas],
                        "shapes": [list(m.shape) for m in bucket.metas], "group_name": group_name,
                        "load_format": "flattened_bucket", "flush_cache": False,
                        "weight_version": str(version)}
                # The servers block in their receive until we broadcast: post first, then send.
                path = "/update_weights_from_distributed"
                futures = [asyncio.run_coroutine_threadsafe(self._post(url, path, body), self._loop)
                           for url in self.urls]
                flat = bucket.flat.contiguous()
                if self.client.sync_backend == "nccl":
                    flat = flat.cuda()
                torch.distributed.broadcast(flat.view(torch.uint8), src=0, group=self._sync_group)
                for f in futures:
                    _check_success(f.result(self.client.control_timeout_s), "update_weights_from_distributed")
        finally:
            self._bracket(targets, "/end_weight_update")
        self._flush(targets)

    def _push_disk(self, targets: list[int], named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        from safetensors.torch import save_file

        root = Path(self.client.disk_dir or tempfile.mkdtemp(prefix="sglang_weights_"))
        out = root / f"v{version}"
        out.mkdir(parents=True, exist_ok=True)
        index: dict[str, str] = {}
        for k, bucket in enumerate(iter_buckets(named, self.client.bucket_bytes)):
            shard = f"model-{k:05d}.safetensors"
            save_file({n: t.clone() for n, t in bucket.named_tensors()}, str(out / shard))
            index.update({m.name: shard for m in bucket.metas})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
        if self.group is not None:  # the servers need the config next to the weights
            src = Path(self.group.config.model_path)
            for name in ("config.json", "generation_config.json"):
                if (src / name).is_file():
                    shutil.copy(src / name, out / name)

        async def send():
            return await asyncio.gather(*(self._post(self.urls[i], "/update_weights_from_disk", {
                "model_path": str(out), "weight_version": str(version)}) for i in targets))

        for reply in self._call(send(), self.client.control_timeout_s):
            _check_success(reply, "update_weights_from_disk")
        old, self._disk_weights = self._disk_weights, str(out)
        if old and old != str(out):
            shutil.rmtree(old, ignore_errors=True)

    def _flush(self, targets: list[int]) -> None:
        async def go():
            await asyncio.gather(*(self._http.post(f"{self.urls[i]}/flush_cache",
                                                   timeout=self.client.control_timeout_s) for i in targets))

        self._call(go(), self.client.control_timeout_s)


def _check_success(reply: Any, what: str) -> None:
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {reply.get('message')}")
