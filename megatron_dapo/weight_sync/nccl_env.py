"""NCCL_CUMEM_ENABLE of the trainer, the same as the SGLang servers' it shares an NCCL communicator with on one node.

Why. SGLang 0.5.23 sets NCCL_CUMEM_ENABLE in every server before its scheduler processes (which hold the NCCL
communicators) start (sglang/srt/entrypoints/engine.py `_set_envs_and_config`): to 0 where it is unset; to 1 with
--enable-symm-mem, whatever was set; a value set in its environment is otherwise kept
(tests/unit/weight_sync/test_nccl_env.py runs SGLang's own function). NCCL reads the variable once per process
(`ncclParamCuMemEnable`, cached) and, unset, turns cuMem on wherever the driver supports it (-2: `ncclCuMemEnable` in
nccl src/misc/cudawrap.cc), i.e. on every H100 with a CUDA 12 driver. A trainer left alone so runs cuMem on while its
servers run it off. In the weight-sync group (weight_sync/sync_group.py: trainer rank 0, or a pipeline stage's source
rank, and every server TP rank), two peers on one node connect through NCCL's P2P transport, where each side exports and
imports the other's buffers by its own setting (nccl src/transport/p2p.cc `ncclP2pImportShareableBuffer`: a cuMem handle
passed as a file descriptor, or a legacy cudaIpc handle): a pair that disagrees fails or hangs when the group first
broadcasts (seen with vLLM, which sets the same default: SkyRL PR 143; not reproduced here, no GPU). Peers on different
nodes meet in NCCL's network transport, where each side maps only its own memory; NVLS, which SGLang also turns
off, NCCL agrees on by itself (the minimum over ranks of its channels, nccl src/init.cc).

Where. A trainer process shares such a group with servers on its node when the weights go to SGLang over NCCL
(--rollout-engine sglang without --colocate, --weight-sync-mode distributed, the default then on CUDA) and the
servers are ones it launched (always on global rank 0's node: the single-node launchers' --sglang-gpus) or
attached ones whose URL names this machine. `match_sglang_cumem` then sets SGLang's value in the process's own
environment; train.py calls it on every rank before any process group exists, so it covers every launcher at
once (torchrun from the per-node and Slurm scripts and a single process all start the trainer through train.py),
and the servers the trainer launches inherit the value, explicitly set, which SGLang keeps. All ranks of a node
decide alike (from the flags and the node's addresses). Elsewhere NCCL's default stays, as at both production
settings: Qwen2.5-32B colocated on 16 x 8 H100 hands weights to its engines by CUDA IPC, not NCCL; Qwen3-30B-A3B's
split job (4 actor + 4 rollout nodes of 8 H100) runs its servers on nodes of their own. Turning cuMem off would
cost those trainers for nothing: NCCL then connects every algorithm's channels when a communicator is created
instead of at first use (runtime connection needs cuMem on every rank, nccl src/init.cc `runtimeConn`), more buffer
memory on every GPU, and its symmetric-memory kernels are off.

A value already in the environment is kept, with a log line: SGLang keeps it too, so both sides agree when they
share the environment (servers the trainer launches inherit it; by hand, set it on every node). Refused, naming
the fix: a value that SGLang overrides in the servers the trainer launches (0 with --enable-symm-mem in
--sglang-extra-args). Attached servers' flags are not visible to the trainer before NCCL starts: ones started with
--enable-symm-mem need NCCL_CUMEM_ENABLE=1 in the trainer's environment.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from megatron_dapo.errors import UserError

if TYPE_CHECKING:
    from megatron_dapo.rollout.build import RolloutEngineConfig

CUMEM_VAR = "NCCL_CUMEM_ENABLE"
SYMM_MEM_FLAG = "--enable-symm-mem"
"""The sglang.launch_server flag with which SGLang 0.5.23 sets NCCL_CUMEM_ENABLE=1 whatever the environment says."""


def sglang_cumem(given: str | None, server_flags: Sequence[str]) -> str:
    """NCCL_CUMEM_ENABLE as SGLang 0.5.23's `_set_envs_and_config` leaves it in a server started with `server_flags`
    whose environment holds `given` (None: unset): '1' with --enable-symm-mem, else `given` when set, else '0'.
    (Unset, it also picks '1' with --enable-kv-cache-sharding, and on a GB200/GB300 fabric for a server spanning
    nodes; launched servers never find it unset: match_sglang_cumem sets it first.)"""
    if SYMM_MEM_FLAG in server_flags:
        return "1"
    return given if given is not None else "0"


def is_local_host(host: str) -> bool:
    """Whether `host` (a URL's host name or address) is this machine: one of its addresses binds a socket here
    (loopback included). A name that does not resolve is not. One resolver lookup (milliseconds)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                sock.bind((sockaddr[0], 0))
                return True
            except OSError:  # EADDRNOTAVAIL: an address of another machine
                continue
    return False


def shares_node_group(cfg: RolloutEngineConfig, *, cuda: bool,
                      is_local: Callable[[str], bool] = is_local_host) -> bool:
    """Whether this process's node holds SGLang servers of the trainer's NCCL weight-sync group: on CUDA, SGLang
    rollouts without --colocate in --weight-sync-mode distributed, with servers launched by the trainer (on global
    rank 0's node; every rank answers alike) or an attached --sglang-server-urls URL naming this machine. Cost at
    Qwen3-30B-A3B's split job: 8 URLs (4 rollout nodes x 2 servers), so 8 resolver lookups and socket binds on each
    of the 32 ranks at start, milliseconds."""
    from megatron_dapo.weight_sync.transports import transport, weight_sync_mode

    if not cuda or cfg.colocate or cfg.kind != "sglang":
        return False
    attach = bool(cfg.sglang_server_urls)
    if not transport(weight_sync_mode(requested=cfg.weight_sync_mode, attach=attach, cuda=True,
                                      colocate=False)).server_group:
        return False
    return not attach or any(is_local(urlsplit(u).hostname or "") for u in cfg.sglang_server_urls)


def match_sglang_cumem(cfg: RolloutEngineConfig, environ: MutableMapping[str, str], *, cuda: bool,
                       is_local: Callable[[str], bool] = is_local_host) -> str | None:
    """Sets NCCL_CUMEM_ENABLE in `environ` (the trainer process's os.environ, before its first NCCL communicator) to
    the value SGLang 0.5.23 gives the servers of this node's weight-sync group, when it has any
    (`shares_node_group`) and the variable is unset. Returns the line to log (None: nothing to do here); UserError
    when the environment's value is one SGLang overrides in the servers the trainer launches."""
    if not shares_node_group(cfg, cuda=cuda, is_local=is_local):
        return None
    launched_flags = () if cfg.sglang_server_urls else cfg.sglang_extra_args
    given = environ.get(CUMEM_VAR)
    want = sglang_cumem(given, launched_flags)
    if given is not None and given != want:
        raise UserError(f"{CUMEM_VAR}={given} in the environment, but SGLang 0.5.23 runs servers started with "
                        f"{SYMM_MEM_FLAG} (--sglang-extra-args) with {CUMEM_VAR}={want}: NCCL peers of one node "
                        f"that disagree hang in the weight-sync group; unset {CUMEM_VAR} or drop {SYMM_MEM_FLAG}")
    if given is not None:
        return (f"[megatron-dapo] {CUMEM_VAR}={given} from the environment, kept: the SGLang servers on this node "
                f"must run with the same value (SGLang keeps one it finds set; servers this trainer launches "
                f"inherit it)")
    environ[CUMEM_VAR] = want
    return (f"[megatron-dapo] {CUMEM_VAR}={want} for the trainer, the value SGLang 0.5.23 gives its servers: NCCL "
            f"peers of one node that disagree on it hang in the weight-sync group (weight_sync/nccl_env.py)")
