"""The processes dist_checkpointing starts during a save, and making them die with the trainer.

Where megatron-core 0.16.1 creates processes in a torch_dist save (sync or async alike, every save
goes through `FileSystemWriterAsync`):

- `filesystem_async._get_write_results_queue()` starts, on the first save of the process, a
  `spawn`-context `multiprocessing.Manager()` (a server process, which also starts Python's
  resource tracker) and keeps it for the life of the process. Spawn re-imports `__main__`, the server
  is never shut down explicitly, and neither process has a parent-death signal: a trainer killed with
  SIGKILL (or exiting past `atexit`) leaves both behind, reparented to pid 1.
- `write_preloaded_data_multiproc` forks `thread_count` (2) writer processes per rank and save
  (copies of the trainer, a few hundred MB resident each); with `--async-save`,
  `TemporalAsyncCaller` first forks a proxy process that runs it.

What this module does instead:

- the results queue is installed before megatron creates one: a thread `queue.Queue` for
  synchronous saves (the writers' results are collected in the trainer itself: no extra process), or
  a `fork`-context Manager queue for async saves (the proxy is a forked child; fork re-imports
  nothing and starts no resource tracker). `shutdown()` stops that Manager; it also runs at exit.
- `os.register_at_fork` gives every child forked by Python in this process (writers, async proxy,
  Manager) `prctl(PR_SET_PDEATHSIG, SIGKILL)`, so a SIGKILL of the trainer kills them too; a child
  whose parent died before the prctl exits at once. (Children started by `subprocess` are exec'd
  without the hook, e.g. SGLang servers, which have their own shutdown.)
"""

from __future__ import annotations

import atexit
import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
from typing import Any

PR_SET_PDEATHSIG = 1

_lock = threading.Lock()
_hook_installed = False
_parent_pid: int | None = None
_mode: str | None = None
_manager: Any = None


def _before_fork() -> None:
    global _parent_pid
    _parent_pid = os.getpid()


def _after_fork_in_child() -> None:
    """Ask the kernel to SIGKILL this child when the thread that forked it exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: not Linux
        return
    if _parent_pid is not None and os.getppid() != _parent_pid:
        os._exit(1)  # the parent died between fork and prctl


def install_parent_death_signal() -> bool:
    """Register the at-fork hook once per process (Linux); return whether it is active."""
    global _hook_installed
    with _lock:
        if not _hook_installed and sys.platform.startswith("linux"):
            os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
            _hook_installed = True
    return _hook_installed


def install_results_queue(*, async_save: bool) -> None:
    """Give megatron's FileSystemWriterAsync a results queue before it makes its spawn Manager.

    Sync: a thread queue. Async: a fork-context Manager queue (the writer runs in a forked proxy).
    Switching modes replaces the queue (and stops the Manager): call it with no save in flight.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _mode, _manager
    mode = "async" if async_save else "sync"
    install_parent_death_signal()
    if _mode == mode and filesystem_async._results_queue is not None:
        return
    shutdown()
    with _lock:
        if async_save:
            _manager = multiprocessing.get_context("fork").Manager()
            filesystem_async._results_queue = _manager.Queue()
        else:
            filesystem_async._results_queue = queue.Queue()
        _mode = mode


def shutdown() -> None:
    """Stop the async-save Manager (if any) and forget the queue; safe to call twice."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _mode, _manager
    with _lock:
        filesystem_async._results_queue = None
        if _manager is not None:
            _manager.shutdown()
        _mode, _manager = None, None


atexit.register(shutdown)
