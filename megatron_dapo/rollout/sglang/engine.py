"""SGLangEngine: the RolloutEngine over SGLang HTTP servers.

Requests go out one per sample from an asyncio loop on a background thread (bounded by a semaphore) to
the router, or round-robin to the servers. A sample whose server dies (connection error, 5xx) is retried
on another server; the dead server is restarted (when this engine launched it) and re-synced before it
takes work again, so no prompt is lost. The engine pushes no weights itself: it exposes its servers to the
weight sync (megatron_dapo/weight_sync/: the serving set, their TP sizes, an update session that holds
the weights lock and sets the version, HTTP calls to each server), and a lost server is brought back to the current
version by the attached sync's `recover(server)` (attach_sync; a transport's ServerPush, StagePush or
ColocatedSync). Imports run one way: weight_sync/ imports this package (the transports drive these servers), and
nothing here imports weight_sync/; the engine knows its sync only as `Recovers`, and which transport pushes is
weight_sync/'s choice (weight_sync/transports/), so a new transport changes nothing here.

What survives what (tests/sglang/test_rollout_sglang_recovery.py kills real servers by pid):
- A server that dies while generating (connection refused / reset, 5xx): its samples are retried on the
  other servers (or, if it was the only one, once it is back); a launched server is restarted, an attached
  one is waited for (ClientConfig.server_wait_s, then the run stops with an error naming its URL). Before
  it takes new work it is re-synced to the current weights.
- A server that dies during a weight update: the update completes on the others, the whole new version is
  kept (see below), and the lost server catches up from it once it is back, before it takes new work.
- A server that accepts connections and answers nothing (hung): the same as a dead one once a call to it times
  out (ClientConfig.http_timeout_s; a /generate call: generate_timeout_s of its max_new_tokens).
- The router failing while its servers answer /health: samples go to the servers directly for ROUTER_RETRY_S
  (logged once per outage, counted in rollout/router_fallbacks), then it is tried again.
- The trainer killed with SIGKILL: launched servers die with it (PR_SET_PDEATHSIG, sglang_server.py).
Nothing is lost and the step goes on; take_metrics() counts it (rollout/servers_lost, rollout/server_restarts,
rollout/retried_requests, rollout/router_fallbacks, sync/servers_recovered, rollout/recovery_s).
Attached URLs are checked at construction (server_setup.check_attached): one that is not SGLang is a UserError.

The last pushed weights, from which a lost server is re-synced: the sync's host copy (weight_sync/server_push.py).

Production (Qwen2.5-32B, 16 servers at TP4, 65 GB bf16): a restart is a process start, a 65 GB load and CUDA
graphs; the re-sync from the host copy moves 65 GB (tensor: each TP rank reads 65 GB from shared memory;
distributed: a broadcast group of the trainer and that server's 4 ranks, bounded by rank 0's host-to-device copy
and the network), from disk 65 GB of shards (how long each takes: docs/BENCHMARKS.md, "Weight sync at
Qwen2.5-32B"). Meanwhile the other 15 servers keep generating (1/16 less throughput, the dead server's in-flight
samples redone there) and a weight update meanwhile goes to those 15 without waiting for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from megatron_dapo.rollout.engine import OpenStream, RolloutEngine, check_unique_ids
from megatron_dapo.rollout.sglang.fd_limit import HTTP_POOL_EXTRA
from megatron_dapo.rollout.sglang.protocol import (  # ServerDied: re-exported, raised here
    CALL_MARGIN_S,
    ServerDied,
    ServersUnavailable,
    ServerTimeout,
    aborted_sample,
    check_success,
    generate_payload,
    parse_generate_response,
    read_reply,
    sample_rid,
    to_sample,
)
from megatron_dapo.rollout.sglang.server import ServerConfig, ServerGroup
from megatron_dapo.rollout.sglang.setup import check_attached, server_info, sync_ranks
from megatron_dapo.rollout.types import RolloutRequest, RoutingShape, Sample


@dataclass(kw_only=True)
class ClientConfig:
    """How the engine talks to its servers."""

    max_concurrency: int = 256
    """Requests in flight at once over all servers (--sglang-max-concurrency)."""
    http_timeout_s: float = 60.0
    """Seconds a server has to answer a health, info or short control call (HTTP_CALLS) and to accept any
    connection; one that does not counts as lost and is recovered (--sglang-http-timeout). SGLang's /health
    itself waits up to 20 s for a busy scheduler. Attach mode: also the limit of each check that a URL is SGLang."""
    min_tokens_per_s: float = 10.0
    """A /generate call gets http_timeout_s + max_new_tokens / min_tokens_per_s seconds before its server counts
    as lost (--sglang-min-tokens-per-s): at 20480 new tokens and the defaults 60 + 2048 s (~35 min), twice what
    a 20k-token response takes at 20 tokens/s including a wait in the server's queue."""
    max_retries: int = 3
    """Attempts per sample after a server failure (on another server, or on the same one once it is back)
    before the error is raised."""
    bucket_bytes: int = 512 << 20
    """Flat bucket size for weight sync (--weight-sync-bucket-mb x 2**20; the default is weight_sync/buckets.py
    DEFAULT_BUCKET_BYTES, which this package does not import: tests/unit/weight_sync/test_weight_sync_transports.py
    checks they agree)."""
    sync_backend: str = "nccl"
    """Backend of the update_weights_from_distributed group ('gloo' on CPU)."""
    sync_master_address: str = "127.0.0.1"
    sync_master_port: int = 29650
    disk_dir: str | None = None
    """Where 'disk' mode writes weights (must be visible to the servers); default a temp dir."""
    control_timeout_s: float = 600.0
    """Weight-update and memory calls (WEIGHT_CALLS: a 65 GB load at 32B, a group rendezvous, a post-load pass)
    time out after this instead of hanging a step."""
    broadcast_floor_s: float = 30.0
    """The fixed part of each NCCL weight-sync broadcast's deadline (weight_sync/sync_group.py broadcast_deadline_s:
    this plus the bucket's bytes at 1 GB/s, 30.5 s for a 512 MiB bucket); a broadcast not done by then counts as
    stalled: its group is aborted, and the run stops naming the lost server if other servers of the group answer."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer <key>` on every call (--sglang-api-key, or SGLANG_API_KEY)."""
    server_wait_s: float = 600.0
    """Attach mode: how long a server that stopped answering may take to answer /health again before the run
    stops with an error naming its URL (--sglang-server-wait-s)."""
    recovery_attempts: int = 3
    """Restarts (launch) or waits (attach) of one dead server, each followed by a re-sync, before giving up."""
    routing: RoutingShape | None = None
    """--moe-routing-replay: ask each /generate for the experts every token was routed to (`return_routed_experts`;
    the servers run with --enable-return-routed-experts) and keep them in Sample.routed_experts, decoded for this
    model's (num_layers, top_k, num_experts). None: not asked (dense models, replay off).
    Cost at Qwen3-30B-A3B (48 layers x top-8): 2,048 B a token of base64 JSON from the servers (int32 on the wire),
    384 B a token once decoded to uint8 on rank 0. A DAPO step of 512 prompts x 16 responses (44.8 M tokens at the
    lognormal lengths of tools/bench_dataplane.py, median 4k, cap 20k): ~92 GB of JSON parsed by rank 0's client over
    the rollout, 17.2 GB held by rank 0 until the data plane has sent it. Every sample carries its prompt's rows, so
    a group's prompt is sent 16 times (not deduplicated: `routed_experts_start_len` could)."""

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (--sglang-max-concurrency), got "
                f"{self.max_concurrency}")
        if not self.http_timeout_s > 0:
            raise ValueError(f"--sglang-http-timeout must be > 0 seconds, got {self.http_timeout_s}")
        if not self.min_tokens_per_s > 0:
            raise ValueError(f"--sglang-min-tokens-per-s must be > 0, got {self.min_tokens_per_s}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1 (--weight-sync-bucket-mb), got {self.bucket_bytes}")
        if self.server_wait_s <= 0:
            raise ValueError(f"server_wait_s must be > 0 (--sglang-server-wait-s), got {self.server_wait_s}")
        if self.broadcast_floor_s <= 0:
            raise ValueError(f"broadcast_floor_s must be > 0, got {self.broadcast_floor_s}")
        if self.recovery_attempts < 1:
            raise ValueError(f"recovery_attempts must be >= 1, got {self.recovery_attempts}")
        if self.api_key == "":
            raise ValueError("api_key is empty (--sglang-api-key / SGLANG_API_KEY): give a key or none")

    def generate_timeout_s(self, max_new_tokens: int) -> float:
        """Seconds one /generate call of `max_new_tokens` may take before its server counts as lost."""
        return self.http_timeout_s + max_new_tokens / self.min_tokens_per_s

    def generate_timeout_text(self, max_new_tokens: int) -> str:
        """generate_timeout_s and the flags it comes from, for an error line."""
        return (f"{self.generate_timeout_s(max_new_tokens):g} s (--sglang-http-timeout {self.http_timeout_s:g} + "
                f"{max_new_tokens} new tokens / --sglang-min-tokens-per-s {self.min_tokens_per_s:g})")

    def timeout_for(self, path: str) -> float:
        """The timeout of a call to `path` other than /generate: control_timeout_s for WEIGHT_CALLS, else
        http_timeout_s."""
        return self.control_timeout_s if path.startswith(WEIGHT_CALLS) else self.http_timeout_s


WEIGHT_CALLS = ("/update_weights", "/init_weights_update_group", "/destroy_weights_update_group",
                "/begin_weight_update", "/end_weight_update", "/release_memory_occupation",
                "/resume_memory_occupation")
"""Paths (prefixes) of the calls that move or free weights and get ClientConfig.control_timeout_s; every other
call but /generate (health, info, abort, pause, flush) gets http_timeout_s."""
ROUTER_RETRY_S = 60.0
"""After the router failed, samples go to the servers directly for this long before one tries it again."""


class Recovers(Protocol):
    """What the engine needs of its weight sync (megatron_dapo/weight_sync/base.py WeightSync)."""

    def recover(self, server: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class UpdateSession:
    """One weight update of the serving servers (SGLangEngine.weight_update)."""

    targets: list[int]
    """The servers serving when the update began (indices into SGLangEngine.urls)."""
    lost: set[int] = field(default_factory=set)
    """Servers lost during the update: recovered (from the sync's copy) after it."""
    nbytes: int = 0
    """Bytes pushed (tensor: per server; distributed: once over the group; disk: once), for sync/gbytes."""


class SGLangEngine(RolloutEngine):
    """RolloutEngine over SGLang servers it launches (ServerConfig) or already running ones (server_urls)."""

    def __init__(
        self,
        servers: ServerConfig | None = None,
        *,
        client: ClientConfig | None = None,
        server_urls: Sequence[str] | None = None,
        router_url: str | None = None,
    ) -> None:
        if (servers is None) == (server_urls is None):
            raise ValueError("SGLangEngine: give exactly one of ServerConfig (launch) or "
                "server_urls (attach)")
        if router_url is not None and server_urls is None:
            raise ValueError("SGLangEngine: router_url (--sglang-router-url) is for attach mode; give the servers "
                             "behind it as server_urls (--sglang-server-urls)")
        self.client = client or ClientConfig()
        self._closed = True  # until the client exists, shutdown() has nothing to do
        self.group = ServerGroup(servers) if servers is not None else None
        api_key = self.client.api_key or (servers.api_key if servers is not None else None)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if self.group is not None:
            self.group.start()  # on this thread, which outlives the servers (PR_SET_PDEATHSIG)
            self.urls = [s.url for s in self.group.servers]
            self._tps: list[int] | None = [servers.tp_per_server] * len(self.urls)
            self.entry_url = self.group.router.url if self.group.router is not None else None
        else:
            self.urls = [u.rstrip("/") for u in server_urls]
            # A router the cluster runs in front of these servers: first tries of /generate go through it;
            # weight sync, health, aborts and retries go to each server directly.
            self.entry_url = router_url.rstrip("/") if router_url is not None else None
            check_attached(self.urls, self.entry_url, timeout_s=self.client.http_timeout_s,
                           wait_s=self.client.server_wait_s, headers=self._headers)
            self._tps = None  # read from the servers' /server_info at the first tensor / distributed push
        self._version = 0
        self.weight_sync: Recovers | None = None
        """The sync that pushes this engine's weights and recovers a lost server (attach_sync)."""
        self.weights_lock = threading.Lock()  # one push at a time: an update, or a lost server's re-sync
        self.losses = [0] * len(self.urls)
        """Times each server was lost: a sync rebuilds a broadcast group one of whose members was lost since."""
        self._stale: set[int] = set()  # dead, restarting or re-syncing servers: they take no requests
        self._recovering: dict[int, asyncio.Future] = {}
        self._fatal: BaseException | None = None
        self._router_down_at: float | None = None  # when the router last failed; None while it serves
        self._metrics: dict[str, float] = dict.fromkeys(METRIC_KEYS, 0.0)
        self._rr = itertools.count()
        self._inflight: dict[str, set[str]] = {}  # request_id -> rids of its samples in flight
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        # Restarts run here: one thread living as long as the engine, so a restarted server's parent-death
        # signal fires when the trainer dies, not when a pool thread retires.
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="sglang-launcher")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-client", daemon=True)
        self._thread.start()
        self._http = self._call(self._make_client())
        self._closed = False

    # ---- plumbing ------------------------------------------------------------------------------

    async def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.client.max_concurrency + HTTP_POOL_EXTRA)  # fd_limit counts it
        self._sem = asyncio.Semaphore(self.client.max_concurrency)
        return httpx.AsyncClient(limits=limits, timeout=self.client.http_timeout_s, headers=self._headers)

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _post(self, url: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        timeout = timeout if timeout is not None else self.client.timeout_for(path)
        try:
            resp = await self._http.post(f"{url}{path}", json=body or {}, timeout=timeout)
        except httpx.TimeoutException as e:  # httpx's own text is often empty: say what and how long
            raise ServerTimeout(f"{url} did not answer {path} within {timeout:g} s", timeout_s=timeout) from e
        except httpx.TransportError as e:
            raise ServerDied(f"{url}{path}: {type(e).__name__}: {e}") from e
        return read_reply(resp, url, path)

    def _generate_failure(self, err: ServerDied, url: str, req: RolloutRequest) -> str:
        """One line on a failed /generate call: a timeout with the flags that set it, else the error."""
        if isinstance(err, ServerTimeout):
            limit = self.client.generate_timeout_text(req.sampling.max_new_tokens)
            return f"{url} did not answer /generate within {limit}"
        return str(err)

    async def _pick_server(self, avoid: set[int]) -> int:
        """A serving server not in `avoid` (else any serving one); waits for a recovery when none serves."""
        while True:
            self._raise_fatal()
            serving = self.serving()
            if serving:
                choices = [i for i in serving if i not in avoid] or serving
                return choices[next(self._rr) % len(choices)]
            pending = [t for t in self._recovering.values() if not t.done()]
            if not pending:
                raise RuntimeError("SGLangEngine: no server is serving and none is being recovered")
            await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)

    def _count(self, key: str, value: float = 1.0) -> None:
        with self._lock:
            self._metrics[key] += value

    def take_metrics(self) -> dict[str, float]:
        with self._lock:
            out, self._metrics = self._metrics, dict.fromkeys(METRIC_KEYS, 0.0)
        return out

    # ---- generation ----------------------------------------------------------------------------

    async def _one(self, req: RolloutRequest, index: int) -> Sample:
        rid = sample_rid(req.request_id, index)
        tried: set[int] = set()
        failures = 0
        async with self._sem:
            while True:
                if req.request_id in self._aborted:
                    return aborted_sample(req, index, self._version)
                server = await self._pick_server(tried)
                # First try through the router while every server serves; otherwise (a retry, or a server
                # out of rotation that the router would still pick) go to a serving server directly.
                want_router = self.entry_url is not None and failures == 0 and not self._stale
                use_router = want_router and self._router_usable()
                if want_router and not use_router:
                    self._count("rollout/router_fallbacks")
                url = self.entry_url if use_router else self.urls[server]
                with self._lock:
                    self._inflight.setdefault(req.request_id, set()).add(rid)
                    if req.request_id in self._aborted:  # abort() ran between the check and now
                        return aborted_sample(req, index, self._version)
                try:
                    payload = generate_payload(req, index, routed_experts=self.client.routing is not None)
                    body = await self._post(url, "/generate", payload,
                                            timeout=self.client.generate_timeout_s(req.sampling.max_new_tokens))
                except ServerDied as err:
                    failures += 1
                    why = self._generate_failure(err, url, req)
                    if failures > self.client.max_retries:
                        hint = ("raise those flags if the servers are only slow, else restart them"
                                if isinstance(err, ServerTimeout) else "see that server's log")
                        raise ServersUnavailable(f"SGLang sample {rid} failed {failures} tries, the last: {why}; "
                                                 f"{hint}") from err
                    lost = [server] if not use_router else await self._find_dead()
                    if use_router and not lost:  # the router itself failed: the servers behind it answer
                        self._router_failed(err)
                    else:
                        self._count("rollout/retried_requests")
                    for dead in lost:
                        tried.add(dead)
                        self._start_recovery(dead, why)
                    continue
                finally:
                    with self._lock:
                        self._inflight.get(req.request_id, set()).discard(rid)
                if use_router and self._router_down_at is not None:
                    self._router_down_at = None
                    print(f"[megatron-dapo] SGLang router {self.entry_url} answers again: generation goes through "
                          f"it", file=sys.stderr, flush=True)
                out = parse_generate_response(body, routing=self.client.routing)
                if self._served_stale(out):
                    # A server restarted without this engine seeing a failure (a router had retried its requests
                    # elsewhere, or none were in flight) serves its launch weights: the sample is thrown away, the
                    # server found by its weight version and re-synced, the request sent again.
                    failures += 1
                    if failures > self.client.max_retries:
                        raise ServersUnavailable(f"SGLang sample {rid}: {failures} tries came back from servers "
                                                 f"serving weight version {out.served_version}, not "
                                                 f"{self._version}: a server keeps restarting; see its log")
                    self._count("rollout/retried_requests")
                    for stale in await self._lost_unseen():
                        tried.add(stale)
                        self._start_recovery(stale, f"it served weight version {out.served_version} instead of "
                                                    f"{self._version} (restarted without a failure seen here)")
                    continue
                if out.finish_reason == "abort" and req.request_id not in self._aborted:
                    # Aborted by the server, not by us (a restart, an abort-all racing a new request): redo it.
                    failures += 1
                    if failures > self.client.max_retries:
                        raise RuntimeError(f"sample {rid} was aborted by the servers {failures} times")
                    self._count("rollout/retried_requests")
                    continue
                return to_sample(req, index, out, self._version)

    def _served_stale(self, out) -> bool:
        """Whether a /generate response came from a server that does not hold the weights pushed last: it reports
        another weight version (a restarted server reports its launch version, 'default'). Nothing is checked
        before the first push (version 0) or when the response does not say (None)."""
        return self._version > 0 and out.served_version is not None and out.served_version != str(self._version)

    def _router_usable(self) -> bool:
        """Whether a first try goes through the router: it has not failed, or failed ROUTER_RETRY_S ago."""
        return self._router_down_at is None or time.monotonic() - self._router_down_at > ROUTER_RETRY_S

    def _router_failed(self, err: ServerDied) -> None:
        """The router failed a request while every server answers /health: this sample goes to a server directly
        (rollout/router_fallbacks), and so do first tries for ROUTER_RETRY_S. Logged once per outage."""
        self._count("rollout/router_fallbacks")
        if self._router_down_at is None:
            print(f"[megatron-dapo] warning: SGLang router {self.entry_url} failed ({err}); requests go to the "
                  f"servers directly (rollout/router_fallbacks counts them) and the router is tried again every "
                  f"{ROUTER_RETRY_S:.0f} s", file=sys.stderr, flush=True)
        self._router_down_at = time.monotonic()

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
        return self.open_stream(requests)

    def open_stream(self, requests: Sequence[RolloutRequest]) -> OpenStream:
        """Every request goes to the servers at once (the router or the least-loaded server places each sample);
        `add` sends more while the others run, so a server's freed slot is refilled by SGLang's own scheduler."""
        self._check_open()
        check_unique_ids(requests)
        results: queue.Queue = queue.Queue()
        count = [0]

        def add(more: Sequence[RolloutRequest], first: bool = False) -> None:
            self._check_open()
            with self._lock:
                clash = {r.request_id for r in more} & set(self._inflight)
                if clash and not first:  # the first call keeps stream()'s contract: an id may be reused
                    raise ValueError(f"request ids already in flight: {sorted(clash)[:5]}")
                for r in more:
                    self._aborted.discard(r.request_id)
                    self._inflight.setdefault(r.request_id, set())
            for r in more:
                asyncio.run_coroutine_threadsafe(self._group(r, results), self._loop)
            count[0] += len(more)

        add(requests, first=True)
        return OpenStream(self._drain(results, count), add)

    def _drain(self, results: queue.Queue, count: list[int]) -> Iterator[list[Sample]]:
        """Each submitted request's group as it completes; `count` [1] grows with every `add`."""
        done = 0
        while done < count[0]:
            item = results.get()
            done += 1
            if isinstance(item, BaseException):
                raise item
            yield item

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """Queued samples see `_aborted` before they are sent. In-flight ones: when everything in flight is
        aborted, one /abort_request {abort_all} per server; otherwise one per rid on every server (the router
        does not say which server holds a request; SGLang 0.5.23's tokenizer manager ignores a rid it does not
        hold, and its scheduler matches rids by prefix, which `sample_rid`'s '::' keeps within one request).

        The trainer only aborts everything (collect.py's cut once the batch is full, the stop path): at 32B on
        16 servers that is 16 calls however many of the up to --sglang-max-concurrency (256) samples are in
        flight, where per rid it would be 16 per sample (4,096 for 256, through the 16 connections the HTTP
        pool keeps beyond the in-flight /generate calls). Aborting some requests by id (the RolloutEngine
        contract, kept as in the embedded engines) costs 16 calls per sample of theirs in flight, and leaves
        the others running, which an abort-all would stop."""
        with self._lock:
            ids = set(self._inflight) if request_ids is None else set(request_ids) & set(self._inflight)
            everything = ids == set(self._inflight)
            self._aborted |= ids
            rids = [rid for i in ids for rid in self._inflight.get(i, ())]
        if everything:
            bodies = [{"abort_all": True}] if ids else []
        else:
            bodies = [{"rid": rid} for rid in rids]
        urls = [self.urls[i] for i in self.serving()]

        async def send():
            await asyncio.gather(*(self._post(u, "/abort_request", b) for u in urls for b in bodies),
                                 return_exceptions=True)  # a dead server has nothing left to abort

        if bodies and urls:
            self._call(send(), self.client.http_timeout_s + CALL_MARGIN_S)
        return sorted(ids)

    # ---- control -------------------------------------------------------------------------------

    def pause(self) -> None:
        # 'retract' keeps the requests (recomputing their KV after resume) instead of aborting them.
        self._control_serving("/pause_generation", {"mode": "retract"})

    def resume(self) -> None:
        self._control_serving("/continue_generation", {})

    def release_memory_occupation(self, tags: Sequence[str]) -> None:
        """Colocated mode (megatron_dapo/trainer/colocate.py): every serving server frees the GPU memory of `tags`
        ('weights', 'kv_cache', 'cuda_graph'; servers launched with --enable-memory-saver). SGLang requires an
        idle server: a release that reaches a busy one kills its scheduler (an assertion, measured on CPU), so
        each server is first asked /flush_cache until it answers 200, which it does only when idle. On CPU
        SGLang 0.5.23 answers 200 and keeps its weights: nothing is freed there."""
        self._wait_idle()
        self._control_serving("/release_memory_occupation", {"tags": list(tags)})

    def _wait_idle(self, poll_s: float = 0.05) -> None:
        """Returns once every serving server answered /flush_cache with 200 (SGLang: no running or waiting
        request); at most ClientConfig.control_timeout_s."""
        async def go():
            deadline = time.monotonic() + self.client.control_timeout_s
            for i in self.serving():
                while True:
                    resp = await self._http.post(f"{self.urls[i]}/flush_cache", timeout=self.client.http_timeout_s)
                    if resp.status_code == 200:
                        break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"SGLang {self.urls[i]} stayed busy for {self.client.control_timeout_s:.0f} "
                                           f"s before a memory release ({resp.status_code}: {resp.text[:200]})")
                    await asyncio.sleep(poll_s)

        self._call(go(), self.client.control_timeout_s + self.client.http_timeout_s + CALL_MARGIN_S)

    def resume_memory_occupation(self, tags: Sequence[str]) -> None:
        """Re-allocates what release_memory_occupation freed; resumed weights hold garbage until a push."""
        self._control_serving("/resume_memory_occupation", {"tags": list(tags)})

    def set_weight_version(self, version: int) -> None:
        """Colocated mode: the weights were pushed by every rank (weight_sync/colocated_push.py ColocatedSync), not
        in a weight_update session; samples from now on carry `version`."""
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"set_weight_version: version must be an int >= 0, got {version!r}")
        self._version = version

    def _control_serving(self, path: str, body: dict) -> None:
        """`path` on every serving server; one that turns out dead goes to recovery (it comes back unpaused,
        with no requests, and takes work only once re-synced)."""
        self._check_open()

        async def go():
            targets = self.serving()
            replies = await asyncio.gather(*(self._post(self.urls[i], path, body) for i in targets),
                                           return_exceptions=True)
            for i, reply in zip(targets, replies, strict=True):  # gather: one reply per target
                if isinstance(reply, ServerDied):
                    self._start_recovery(i)
                elif isinstance(reply, BaseException):
                    raise reply

        self._call(go(), self.client.timeout_for(path) + CALL_MARGIN_S)

    def health(self) -> bool:
        async def check(url):
            try:
                return (await self._http.get(f"{url}/health")).status_code == 200  # http_timeout_s
            except httpx.HTTPError:
                return False

        async def all_ok():
            return all(await asyncio.gather(*(check(u) for u in self.urls)))

        return not self._closed and self._call(all_ok())

    @property
    def capacity(self) -> int:
        """--sglang-max-concurrency: the samples this client keeps in flight across the servers."""
        return self.client.max_concurrency

    @property
    def weight_version(self) -> int:
        return self._version

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        for task in list(self._recovering.values()):
            self._loop.call_soon_threadsafe(task.cancel)
        if self.weight_sync is not None:
            self.weight_sync.close()  # its broadcast group and host copy, while the servers still answer
        if self.group is not None:
            self.group.stop()  # also ends a server that a restart in progress just started ...
        self._launcher.shutdown(wait=True, cancel_futures=True)  # ... so that restart returns at once
        if self.group is not None:
            self.group.stop()
        self._call(self._http.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SGLangEngine was shut down; create a new one")
        self._raise_fatal()

    def _raise_fatal(self) -> None:
        if isinstance(self._fatal, ServersUnavailable):  # an attached server that did not come back: one line
            raise ServersUnavailable(str(self._fatal)) from self._fatal
        if self._fatal is not None:
            raise RuntimeError(f"SGLangEngine: a lost server could not be recovered: {self._fatal}") \
                from self._fatal

    # ---- failure recovery ----------------------------------------------------------------------

    def _start_recovery(self, server: int, why: str = "it failed") -> None:
        """Takes `server` out of rotation and recovers it in the background (one recovery per server at a
        time; a second failure report joins the running one). Runs on the loop thread. `why`: how it failed, for
        the error should it not come back."""
        task = self._recovering.get(server)
        if task is None or task.done():
            self.losses[server] += 1  # a broadcast group it belongs to is rebuilt before its next use
            self._stale.add(server)
            self._count("rollout/servers_lost")
            task = self._recovering[server] = asyncio.ensure_future(self._recover(server, why))
            # its failure reaches the run through _fatal: retrieved here, so asyncio does not log it as unseen
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _find_dead(self) -> list[int]:
        """Servers that are down now (a failure through the router does not say which one failed)."""
        if self.group is not None:
            return [i for i, s in enumerate(self.group.servers) if not s.alive()]

        async def down(url: str) -> bool:
            try:
                return (await self._http.get(f"{url}/health")).status_code != 200  # http_timeout_s
            except httpx.HTTPError:
                return True

        flags = await asyncio.gather(*(down(u) for u in self.urls))
        return [i for i, d in enumerate(flags) if d]

    async def _recover(self, server: int, why: str = "it failed") -> None:
        """Restarts (launch) or waits for (attach) `server`, re-syncs it to the current weights, and puts it
        back in rotation. A failure after ClientConfig.recovery_attempts tries stops the run (_fatal)."""
        t0 = time.monotonic()
        url = self.urls[server]
        last: BaseException | None = None
        try:
            for _ in range(self.client.recovery_attempts):
                try:
                    t_back = time.monotonic()
                    if self.group is not None:
                        await asyncio.get_running_loop().run_in_executor(self._launcher, self.group.restart, server)
                        self._count("rollout/server_restarts")
                    else:
                        await self._wait_back(url, why)
                        self._count("rollout/server_returns")
                    t_sync = time.monotonic()
                    await asyncio.to_thread(self._resync, server)
                    print(f"[megatron-dapo] SGLang server {url} lost: {'restarted' if self.group else 'back'} "
                          f"after {t_sync - t_back:.1f} s, re-synced to weight version {self._version} in "
                          f"{time.monotonic() - t_sync:.1f} s", file=sys.stderr, flush=True)
                    break
                except ServerDied as e:  # died again while re-syncing: start over
                    last = e
            else:
                raise RuntimeError(f"{url} failed {self.client.recovery_attempts} recoveries; last: {last}")
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._fatal = e
            raise
        self._count("sync/servers_recovered")
        self._count("rollout/recovery_s", time.monotonic() - t0)

    async def _wait_back(self, url: str, why: str = "it failed") -> None:
        """Attach mode: polls `url`/health until it answers 200, at most ClientConfig.server_wait_s; then
        ServersUnavailable naming the server, `why` it was lost and the flag."""
        deadline = time.monotonic() + self.client.server_wait_s
        while time.monotonic() < deadline:
            try:
                if (await self._http.get(f"{url}/health")).status_code == 200:  # http_timeout_s
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
        raise ServersUnavailable(f"attached SGLang server {url} did not answer /health for "
            f"{self.client.server_wait_s:g} s (--sglang-server-wait-s) after it was lost ({why}); restart it with the "
            f"same model and port, or drop it from --sglang-server-urls")

    def _resync(self, server: int) -> None:
        """Brings one server that lost it back to the current version through the attached sync's
        `recover(server)` (from its host copy, or the disk copy). Runs on a worker thread; waits for an update in
        progress, so it always pushes the newest version. At version 0 a restarted server loads the initial
        weights itself."""
        with self.weights_lock:
            if self._version > 0:
                if self.weight_sync is None:
                    raise RuntimeError(f"{self.urls[server]} was lost at weight version {self._version} and no "
                                       f"weight sync is attached to this engine to re-sync it")
                self.weight_sync.recover(server)
            # Back in rotation before the lock is released: the next update includes it.
            self._stale.discard(server)

    # ---- the servers, as the weight sync sees them (megatron_dapo/weight_sync/) -----------------------

    def attach_sync(self, sync: Recovers) -> None:
        """`sync` pushes this engine's weights from now on: a lost server is recovered with `sync.recover(i)` and
        `sync.close()` runs at shutdown, before the servers stop. One per engine (it owns the host copy)."""
        if self.weight_sync is not None and self.weight_sync is not sync:
            raise RuntimeError(f"SGLangEngine already has weight sync {type(self.weight_sync).__name__}; one "
                               f"engine has one (it owns the copy a lost server is re-synced from)")
        self.weight_sync = sync

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[UpdateSession]:
        """One update of the serving servers to `version`: servers restarted unseen go to recovery first, then,
        under the weights lock (no re-sync meanwhile), the body pushes to `session.targets` and records the
        servers it lost and the bytes it pushed. On a clean exit the version is set, sync/* reported (take_metrics)
        and the lost servers recovered in the background (from the new version); a body that raises sets
        nothing. Costs one /model_info per server before the update (16 at 32B)."""
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"weight update: version must be an int >= 0, got {version!r}")
        unseen = self._call(self._lost_unseen(), self.client.control_timeout_s)  # restarted behind a router
        if unseen:
            self._call(self._start_recoveries(unseen), self.client.control_timeout_s)
        with self.weights_lock:
            start = time.perf_counter()
            session = UpdateSession(targets=self.serving())
            yield session
            self._version = version
            self._sync_report(version, time.perf_counter() - start, len(session.targets) - len(session.lost),
                              session.nbytes)
        if session.lost:
            self._call(self._start_recoveries(session.lost), self.client.control_timeout_s)
        self._raise_fatal()

    @property
    def tps(self) -> list[int]:
        """Each server's TP size: its ranks in the sync group, its payloads per tensor push. Attached servers
        are asked once (/server_info tp_size; dp_size > 1 is refused, naming the URL)."""
        if self._tps is None:
            self._tps = [sync_ranks(u, server_info(u, headers=self._headers, timeout_s=self.client.http_timeout_s))
                         for u in self.urls]
        return self._tps

    @property
    def api_key(self) -> str | None:
        """The key every call carries (ClientConfig.api_key, else the launched servers' ServerConfig.api_key)."""
        return self._headers.get("Authorization", "").removeprefix("Bearer ") or None

    @property
    def model_path(self) -> str | None:
        """Launched servers' model directory (its config.json goes next to disk-mode weights); None attached."""
        return self.group.config.model_path if self.group is not None else None

    def serving(self) -> list[int]:
        """The servers in rotation now (not dead, restarting or re-syncing)."""
        return [i for i in range(len(self.urls)) if i not in self._stale]

    def send(self, targets: list[int], path: str, body: dict, lost: set[int]) -> list[int]:
        """POSTs `body` to each target at once; returns those that answered. A ServerDied adds the server to
        `lost`; a refusal (success: false, 4xx) is raised."""
        async def go():
            return await asyncio.gather(*(self._post(self.urls[i], path, body) for i in targets),
                                        return_exceptions=True)

        ok = []
        replies = self._call(go(), self.client.timeout_for(path) + CALL_MARGIN_S)
        for i, reply in zip(targets, replies, strict=True):  # gather: one reply per target
            if isinstance(reply, ServerDied):
                lost.add(i)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                check_success(reply, path.lstrip("/"))
                ok.append(i)
        return ok

    def post_later(self, server: int, path: str, body: dict) -> Future:
        """Starts a POST to one server on the client loop; its future (the reply, or ServerDied). For calls that
        block in a collective until this process joins it (group init, a bucket broadcast)."""
        return asyncio.run_coroutine_threadsafe(self._post(self.urls[server], path, body), self._loop)

    def post_quietly(self, servers: list[int], path: str, body: dict) -> None:
        """POSTs to each server at once, ignoring failures (a group teardown on servers that may be gone)."""
        async def go():
            await asyncio.gather(*(self._post(self.urls[i], path, body) for i in servers), return_exceptions=True)

        self._call(go(), self.client.timeout_for(path) + CALL_MARGIN_S)

    def answers(self, server: int) -> bool:
        """Whether `server` answers /health with 200 now (within http_timeout_s)."""
        async def check():
            try:
                return (await self._http.get(f"{self.urls[server]}/health")).status_code == 200  # http_timeout_s
            except httpx.HTTPError:
                return False

        return self._call(check(), self.client.http_timeout_s + CALL_MARGIN_S)

    def flush(self, targets: list[int]) -> None:
        """/flush_cache on each target: drops prefix-cache entries computed with the old weights."""
        async def go():
            await asyncio.gather(*(self._http.post(f"{self.urls[i]}/flush_cache") for i in targets),  # http_timeout_s
                                 return_exceptions=True)  # a server that died since is being recovered

        self._call(go(), self.client.http_timeout_s + CALL_MARGIN_S)

    def _sync_report(self, version: int, seconds: float, servers: int, nbytes: int) -> None:
        """sync/seconds, sync/gbytes (bytes pushed / 1e9), sync/gbps of this update into take_metrics(), and
        one line on stdout. At 32B (bf16) one server copy is 65 GB: "distributed" broadcasts it once over the
        group of the trainer and the 16 servers' 128 TP ranks (65 GB); "tensor" hands it
        to each server (65 GB per server); "disk" writes it once (65 GB of shards)."""
        gbytes = nbytes / 1e9
        gbps = gbytes / seconds if seconds > 0 else 0.0
        with self._lock:
            self._metrics["sync/seconds"] += seconds
            self._metrics["sync/gbytes"] += gbytes
            self._metrics["sync/gbps"] = gbps
        print(f"[megatron-dapo] weight sync v{version}: {gbytes:.2f} GB in {seconds:.2f} s ({gbps:.2f} GB/s) "
              f"to {servers} servers", flush=True)

    # ---- before a weight update ---------------------------------------------------------------------

    async def _lost_unseen(self) -> list[int]:
        """Serving servers that no longer hold the last pushed version: down now, or restarted without this
        engine seeing a failure (a router retried their requests on another server, or none went to them).
        A restarted server reports its launch weight_version at /model_info instead of the one pushed last,
        and is not in the broadcast group: pushing to it would hang the group's collective. One GET per
        server before each update, and whenever a /generate response reports another weight version than the
        one pushed last (`_served_stale`: such a server's samples are generated again) (16 at 32B). A server
        whose recovery started while its GET was out is left out: that recovery re-syncs it to the version pushed
        last, and a second one would count one restart twice (two stale responses checked at once)."""
        if self._version == 0:
            return []
        losses = list(self.losses)

        async def lost(i: int) -> bool:
            try:
                resp = await self._http.get(f"{self.urls[i]}/model_info")  # http_timeout_s
            except httpx.HTTPError:
                return True
            if resp.status_code != 200:
                return resp.status_code >= 500
            return str(resp.json().get("weight_version")) != str(self._version)

        serving = self.serving()
        flags = await asyncio.gather(*(lost(i) for i in serving))
        return [i for i, f in zip(serving, flags, strict=True) if f and self.losses[i] == losses[i]]

    async def _start_recoveries(self, servers: Iterable[int]) -> None:
        for i in sorted(servers):
            self._start_recovery(i)


METRIC_KEYS = ("rollout/servers_lost", "rollout/server_restarts", "rollout/server_returns",
               "rollout/retried_requests", "rollout/router_fallbacks", "sync/servers_recovered", "rollout/recovery_s",
               "sync/seconds", "sync/gbytes", "sync/gbps")
"""What take_metrics() reports, summed since its last call: servers found dead (while generating, in a control
call or a weight update), launched servers restarted, attached servers waited for, samples sent again after a
server failure, first tries sent to a server directly because the router failed, servers re-synced and put
back in rotation, seconds from a loss to its server's return; weight updates' seconds and GB pushed, and the
GB/s of the last one (see _sync_report)."""
