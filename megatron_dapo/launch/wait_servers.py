"""Wait until every SGLang server (or router) of a run answers /health, bounded, naming the nodes that did not.

`python -m megatron_dapo.launch.wait_servers URL... --timeout-s 900 [--watch-pid PID] [--log-hint TEXT]` is what
examples/slurm/ runs before it starts the trainer: the trainer then never spends its own start-up (at 32B a
minute or two of building the model and loading 65.5 GB) only to find a rollout node missing. SGLang answers
/health without the API key (sglang/srt/utils/auth.py exempts it), so no key is needed here.

At 32B a server is up 1-3 minutes after its start (weights from the shared filesystem, CUDA graphs); a node
whose servers did not come up in --timeout-s is named in the error with its URLs, and --watch-pid (the srun of
the rollout nodes) ends the wait at once when that step dies.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import httpx


def answering(url: str, timeout_s: float = 2.0) -> bool:
    """True when `url`/health answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for_servers(urls: Iterable[str], timeout_s: float, *, alive: Callable[[], bool] = lambda: True,
                     probe: Callable[[str], bool] = answering, poll_s: float = 1.0,
                     log: Callable[[str], None] = print) -> float:
    """Polls each URL of `urls` until all answer; returns the seconds waited. TimeoutError naming every node (the
    URL's host) whose servers are not up after `timeout_s`; RuntimeError as soon as `alive()` is false (the
    process that runs the servers died)."""
    pending = list(dict.fromkeys(urls))
    start = time.monotonic()
    while pending:
        pending = [u for u in pending if not probe(u)]
        waited = time.monotonic() - start
        if not pending:
            break
        if not alive():
            raise RuntimeError(f"the servers' launcher exited while waiting for {describe_pending(pending)}")
        if waited > timeout_s:
            raise TimeoutError(f"not answering /health after {timeout_s:.0f} s: {describe_pending(pending)}")
        time.sleep(poll_s)
    waited = time.monotonic() - start
    log(f"every server answers /health ({waited:.0f} s)")
    return waited


def describe_pending(urls: list[str]) -> str:
    """'node n9 (http://n9:30000, http://n9:30001); node n10 (...)': the URLs grouped by their host."""
    by_node: dict[str, list[str]] = {}
    for u in urls:
        by_node.setdefault(urlsplit(u).hostname or u, []).append(u)
    return "; ".join(f"node {node} ({', '.join(us)})" for node, us in by_node.items())


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_dapo.launch.wait_servers",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("urls", nargs="+", help="every server (and the router) the trainer will use")
    p.add_argument("--timeout-s", type=float, default=900.0, help="give up after this long (seconds)")
    p.add_argument("--watch-pid", type=int, default=None,
                   help="stop waiting as soon as this process (the servers' srun) is gone")
    p.add_argument("--log-hint", default="", help="appended to an error: where the servers' logs are")
    a = p.parse_args(argv)
    if a.timeout_s <= 0:
        p.error(f"--timeout-s must be > 0, got {a.timeout_s}")
    alive = (lambda: pid_alive(a.watch_pid)) if a.watch_pid is not None else (lambda: True)
    try:
        wait_for_servers(a.urls, a.timeout_s, alive=alive, log=lambda m: print(m, flush=True))
    except (TimeoutError, RuntimeError) as err:
        print(f"error: {err}{'; ' + a.log_hint if a.log_hint else ''}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
