"""Choices made before SGLang servers take work: which GPUs launched servers use and whether a seeded run's
rollouts are reproducible on them; the layout of the weight-sync group the servers join. Pure functions of the
flags, plus /server_info queries of attached servers (their determinism; with --moe-routing-replay, whether they
return routed experts). How weights reach the servers (--weight-sync-mode) is weight_sync/'s choice
(weight_sync/transports/): that package imports this one, never the reverse."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx

DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def check_sglang_serves(arch: Any, where: str) -> None:
    """Raises ValueError if SGLang 0.5.23 would serve this model wrong without saying so: the family's
    `sglang_refusal` (e.g. a Qwen3-MoE config with dense layers, which SGLang's qwen3_moe builds sparse and leaves
    unloaded; a DeepSeek-V3 config's dense first layers it serves right). `arch`: the model's ModelArch; `where`: the
    config.json path, named in the error. Pure and cheap (no server asked): called before any server is launched or
    attached."""
    hook = arch.family.sglang_refusal
    why = hook(arch) if hook is not None else None
    if why:
        raise ValueError(f"{where}: {why}")


def gpu_list(spec: str) -> list[str]:
    """The GPUs a comma-separated list (--sglang-gpus, CUDA_VISIBLE_DEVICES) names."""
    return [g.strip() for g in spec.split(",") if g.strip()]


def launched_server_gpus(*, cuda: bool, sglang_gpus: str | None, colocate: bool) -> dict[str, str]:
    """Environment of launched servers: CUDA_VISIBLE_DEVICES=--sglang-gpus, or nothing with --colocate.

    On CUDA one of the two is required: without either, server i would start at GPU i x --sglang-tp-size of
    the actor's own devices (SGLang's base GPU id) and take the memory the actor needs. The values themselves (a
    list of GPUs, not both) are RolloutEngineConfig's checks.
    """
    if sglang_gpus is not None:
        return {"CUDA_VISIBLE_DEVICES": sglang_gpus}
    if cuda and not colocate:
        raise ValueError(
            "launching SGLang servers on CUDA needs --sglang-gpus (their own GPUs, apart from the actor's, e.g. "
            "--sglang-gpus 4,5,6,7) or --colocate (share the actor's GPUs; the planner sets their "
            "--mem-fraction-static). Attach to running servers with --sglang-server-urls instead"
        )
    return {}


def physical_gpu(local_index: int, visible: str | None) -> str:
    """CUDA device `local_index` of a process as CUDA_VISIBLE_DEVICES names it (an index or a UUID)."""
    ids = gpu_list(visible) if visible else []
    if not ids:
        return str(local_index)
    if local_index >= len(ids):
        raise ValueError(f"CUDA device {local_index} is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[local_index]


def deterministic_server_args(*, seeded: bool, wanted: bool, device: str,
                              extra_args: Sequence[str]) -> tuple[tuple[str, ...], str | None]:
    """(flags to add to launched servers, the log line saying what was decided) for reproducible rollouts.

    SGLang 0.5.23 uses a request's sampling_seed only in its deterministic inference mode (DETERMINISTIC_FLAG;
    batch-invariant kernels: slower decoding); --sglang-deterministic-inference (default on) adds it to
    launched CUDA servers of a seeded run. SGLang's CPU attention (torch_native) has no deterministic mode, so
    CPU servers run without it and ignore the seeds.
    """
    if not seeded:
        return (), None
    if DETERMINISTIC_FLAG in extra_args:
        return (), (f"[megatron-dapo] SGLang servers run with {DETERMINISTIC_FLAG} (from --sglang-extra-args): "
                    "seeded rollouts are reproducible")
    if device == "cpu":
        return (), ("[megatron-dapo] warning: SGLang on CPU has no deterministic mode and ignores sampling_seed: "
                    "CPU rollouts are not reproducible from --seed")
    if not wanted:
        return (), (f"[megatron-dapo] warning: --no-sglang-deterministic-inference: the servers run without "
                    f"{DETERMINISTIC_FLAG} and ignore sampling_seed, so rollouts are not reproducible from --seed")
    return (DETERMINISTIC_FLAG,), (
        f"[megatron-dapo] SGLang servers launched with {DETERMINISTIC_FLAG}: seeded rollouts are reproducible "
        f"(slower decoding; --no-sglang-deterministic-inference turns it off)")


def server_info(url: str, get: Callable[..., Any] = httpx.get, timeout_s: float = 10.0,
                headers: dict[str, str] | None = None) -> dict | None:
    """A running server's /server_info (or the older /get_server_info) as a dict; None when neither answers."""
    for path in ("/server_info", "/get_server_info"):
        try:
            resp = get(f"{url.rstrip('/')}{path}", timeout=timeout_s, headers=headers or {})
        except httpx.HTTPError:
            continue
        if resp.status_code != 200:
            continue
        try:
            info = resp.json()
        except ValueError:
            continue
        if isinstance(info, dict):
            return info
    return None


def server_deterministic(url: str, get: Callable[..., Any] = httpx.get, timeout_s: float = 10.0,
                         headers: dict[str, str] | None = None) -> bool | None:
    """enable_deterministic_inference of a running server from /server_info (or the older /get_server_info);
    None when neither answers with it. `headers`: e.g. the Authorization of a server with an API key."""
    info = server_info(url, get, timeout_s, headers)
    if info is not None and "enable_deterministic_inference" in info:
        return bool(info["enable_deterministic_inference"])
    return None


def sync_ranks(url: str, info: dict | None) -> int:
    """How many ranks a server adds to the weight-sync group: its tp_size (SGLang numbers them
    rank_offset + tp_rank). SGLang 0.5.23's /init_weights_update_group asserts dp_size == 1, so a DP server
    is refused here, naming its URL."""
    if info is None or "tp_size" not in info:
        raise RuntimeError(f"SGLang server {url}: could not read tp_size from /server_info (or /get_server_info); "
                           f"the weight-sync group size depends on it")
    tp, dp = int(info["tp_size"]), int(info.get("dp_size") or 1)
    if tp < 1:
        raise RuntimeError(f"SGLang server {url}: /server_info reports tp_size={tp}")
    if dp != 1:
        raise RuntimeError(f"SGLang server {url} runs with dp_size={dp}: SGLang's /init_weights_update_group "
                           f"supports dp_size 1 only; start one server per replica instead")
    return tp


def sync_group_layout(ranks_per_server: Sequence[int]) -> tuple[int, list[int]]:
    """World size and each server's rank_offset of the weight-sync group: rank 0 is the trainer, server k's
    ranks are offset_k + tp_rank, offsets the running sum from 1. At 32B, 16 servers at TP4: world 65,
    offsets 1, 5, ..., 61. Each update broadcasts 65 GB (bf16, one server copy) once over this group.
    Before, attached servers were taken as TP1 (world 17, offsets 1..16): ranks overlapped, the group never
    formed, and rank 0 failed after the 600 s rendezvous timeout while the servers hung."""
    if any(int(r) < 1 for r in ranks_per_server):
        raise ValueError(f"sync_group_layout: every server needs >= 1 rank, got {list(ranks_per_server)}")
    offsets, nxt = [], 1
    for r in ranks_per_server:
        offsets.append(nxt)
        nxt += int(r)
    return nxt, offsets


def attached_determinism_warnings(urls: Sequence[str], *, seeded: bool, get: Callable[..., Any] = httpx.get,
                                  headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> list[str]:
    """Warnings for attached servers of a seeded run that ignore sampling_seed (or could not be asked)."""
    if not seeded:
        return []
    lines = []
    for url in urls:
        state = server_deterministic(url, get, timeout_s, headers=headers)
        if state is False:
            lines.append(f"[megatron-dapo] warning: SGLang server {url} runs without {DETERMINISTIC_FLAG}: it "
                         f"ignores sampling_seed, so rollouts are not reproducible from --seed (start it with "
                         f"{DETERMINISTIC_FLAG})")
        elif state is None:
            lines.append(f"[megatron-dapo] warning: could not read enable_deterministic_inference from {url}"
                         f"/server_info: rollouts are reproducible from --seed only if it runs with "
                         f"{DETERMINISTIC_FLAG}")
    return lines


def check_attached_routes(urls: Sequence[str], *, get: Callable[..., Any] = httpx.get,
                          headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> None:
    """--moe-routing-replay with attached servers: UserError naming every server whose /server_info says it runs
    without --enable-return-routed-experts (each /generate asking for the routed experts would get none, and the
    run would stop at the first response, after the start-up and the first weight push); one that does not say is
    left to that first response. One /server_info GET a server, milliseconds each."""
    from megatron_dapo.errors import UserError
    from megatron_dapo.rollout.sglang.server import RETURN_ROUTES_FLAG

    off = [u for u in urls if (server_info(u, get, timeout_s, headers) or {}).get("enable_return_routed_experts")
           is False]
    if off:
        raise UserError(f"--moe-routing-replay needs every SGLang server started with {RETURN_ROUTES_FLAG}, and "
                        f"{', '.join(off)} run(s) without it (/server_info): restart them with it "
                        f"(examples/launch_sglang_servers.sh: SGLANG_EXTRA_ARGS={RETURN_ROUTES_FLAG}; a Slurm job "
                        f"adds it from the recipe's trainer flags)")


def check_attached(urls: Sequence[str], router_url: str | None, *, timeout_s: float, wait_s: float,
                   headers: dict[str, str] | None = None, get: Callable[..., Any] = httpx.get) -> None:
    """Raises UserError unless every attached server answers GET /health with 200 and /server_info (or the older
    /get_server_info) with a JSON object, and the router (if any) answers /health with 200: what SGLang does.

    A URL that answers something else (a 404, a page that is not JSON, a refusal of the API key), or accepts the
    connection and answers nothing within `timeout_s` (--sglang-http-timeout), is named with what it answered,
    within seconds. One that refuses connections or answers 503 (SGLang still loading its model) is waited for up
    to `wait_s` (--sglang-server-wait-s). The URLs are checked in parallel: at 16 servers, 32 GETs in ~one round
    trip."""
    from concurrent.futures import ThreadPoolExecutor

    checks = [(u, "--sglang-server-urls", True) for u in urls]
    if router_url is not None:
        checks.append((router_url, "--sglang-router-url", False))
    with ThreadPoolExecutor(len(checks), thread_name_prefix="sglang-attach-check") as pool:
        futures = [pool.submit(_check_one, url, flag, info, timeout_s=timeout_s, wait_s=wait_s,
                               headers=headers or {}, get=get) for url, flag, info in checks]
        for f in futures:
            f.result()


def _check_one(url: str, flag: str, info: bool, *, timeout_s: float, wait_s: float, headers: dict[str, str],
               get: Callable[..., Any]) -> None:
    """check_attached for one URL (`flag` names where it came from; `info`: ask /server_info too)."""
    import time

    from megatron_dapo.errors import UserError

    def ask(path: str) -> httpx.Response | None:
        """The answer to GET `path`; None when the connection is refused or drops (not up yet)."""
        try:
            return get(f"{url}{path}", timeout=timeout_s, headers=headers)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError):
            return None
        except httpx.TimeoutException:
            raise UserError(f"{flag} {url} accepted the connection but did not answer GET {path} within "
                            f"{timeout_s:g} s (--sglang-http-timeout): it is not an SGLang server, or a hung one"
                            ) from None
        except httpx.TransportError:
            return None

    def refuse(path: str, resp: httpx.Response) -> UserError:
        if resp.status_code in (401, 403):
            return UserError(f"{flag} {url} refused GET {path} ({resp.status_code}): give the API key it runs with "
                             f"(--sglang-api-key-file or SGLANG_API_KEY)")
        return UserError(f"{flag} {url} is not an SGLang server: GET {path} answered {resp.status_code} "
                         f"{resp.text[:200]!r}")

    deadline, said = time.monotonic() + wait_s, False
    while True:
        resp = ask("/health")
        if resp is not None and resp.status_code == 200:
            break
        if resp is not None and resp.status_code != 503:
            raise refuse("/health", resp)
        if time.monotonic() > deadline:
            raise UserError(f"{flag} {url} did not answer GET /health with 200 for {wait_s:g} s "
                            f"(--sglang-server-wait-s): start it, or fix the URL")
        if not said:
            print(f"[megatron-dapo] waiting up to {wait_s:g} s for SGLang at {url} (--sglang-server-wait-s)",
                  flush=True)
            said = True
        time.sleep(1.0)
    if not info:
        return
    for path in ("/server_info", "/get_server_info"):
        resp = ask(path)
        if resp is None:
            raise UserError(f"{flag} {url} answered /health but dropped GET {path}: is it an SGLang server?")
        if resp.status_code == 404 and path == "/server_info":
            continue  # an older SGLang: /get_server_info
        if resp.status_code != 200:
            raise refuse(path, resp)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            return
        raise UserError(f"{flag} {url} is not an SGLang server: GET {path} answered 200 with {resp.text[:200]!r}, "
                        f"not SGLang's JSON object")
