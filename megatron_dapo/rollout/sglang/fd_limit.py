"""The open-file limit (RLIMIT_NOFILE) the rollout client needs, raised at start or refused with a clear error.

Rank 0 keeps up to --sglang-max-concurrency HTTP connections open to the SGLang servers (plus httpx's pool
headroom, sglang_engine.py). At a soft limit of 1024 (the usual default) a concurrency of 2048 would fail its
connects with EMFILE, which reads like dead servers. `ensure_fd_limit` raises the soft limit up to the hard one
at start, or refuses naming --sglang-max-concurrency and `ulimit -n`.
"""

from __future__ import annotations

import resource

from megatron_dapo.errors import UserError

HTTP_POOL_EXTRA = 16
"""Connections the HTTP client's pool allows beyond --sglang-max-concurrency (SGLangEngine's httpx.Limits)."""
BASE_MARGIN = 256
"""Descriptors besides the HTTP connections and the per-rank sockets: log and metrics files, checkpoint
writers, the servers' log files and pipes, the TCP stores' clients, torch's own."""


def fds_needed(concurrency: int, world_size: int) -> int:
    """Descriptors rank 0 may hold at once: the HTTP connections, two sockets per trainer rank (its pair in the
    all-rank gloo groups; the weight-sync group's pairs and store connections, one per server GPU, which the
    production layout keeps under the world size) and BASE_MARGIN. Qwen2.5-32B on 16 x 8 GPUs at
    --sglang-max-concurrency 2048: 2048 + 16 + 2 x 128 + 256 = 2576."""
    return concurrency + HTTP_POOL_EXTRA + 2 * world_size + BASE_MARGIN


def ensure_fd_limit(concurrency: int, world_size: int) -> int | None:
    """Raises this process's soft RLIMIT_NOFILE to fds_needed() when it is lower; returns the new soft limit
    (None when it was already enough). Raises UserError when the hard limit is below the need."""
    need = fds_needed(concurrency, world_size)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard != resource.RLIM_INFINITY and hard < need:
        fits = hard - (need - concurrency)
        lower = f"lower --sglang-max-concurrency to {fits} or " if fits >= 1 else ""
        raise UserError(
            f"--sglang-max-concurrency {concurrency} needs {need} open files on rank 0 (the HTTP connections "
            f"plus {need - concurrency} for sockets to the other ranks, files and pool headroom), but the hard "
            f"limit is {hard}: {lower}raise the limit (`ulimit -n {need}` in the launching shell, or nofile in "
            f"/etc/security/limits.conf / LimitNOFILE for a service)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    print(f"[megatron-dapo] open-file limit raised from {soft} to {need} for --sglang-max-concurrency "
          f"{concurrency}", flush=True)
    return need
