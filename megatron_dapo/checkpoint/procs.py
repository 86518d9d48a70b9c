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
- a writer that finds the disk full reports the OSError itself, not torch's zip writer's "unexpected pos"
  that follows it (`install_write_errors`), so the save ends in one error line naming --save.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import logging
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


def install_write_errors() -> None:
    """Make a writer's full disk reach the trainer as `[Errno 28]` (ENOSPC; EDQUOT alike), once per process.

    A writer puts each `.distcp` item with `torch.save(obj, stream)` (filesystem_async._write_item). When the disk
    fills inside a record, the stream's write raises OSError(ENOSPC) and torch's zip writer, finishing the archive
    while that propagates, raises RuntimeError "unexpected pos N vs M" with the OSError only as its __context__;
    the worker's exception then travels to the trainer pickled through a queue, which drops __context__, so the
    save ended in a raw "Worker failure: ... unexpected pos" traceback (issue 38 item 5). Wrapping `_write_item`
    re-raises that OSError itself (errno and text kept, the zip writer's message appended), which
    errors.is_disk_full recognises; any other error passes unchanged. The writer's own log line of it ("Local
    process i encountered an error: [Errno 28] ...") is dropped: the save reports it as one error line. Forked
    writers inherit both. Cost: one try block per written item."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with _lock:
        write_item = filesystem_async._write_item
        if getattr(write_item, "keeps_errno", False):  # installed (checked on the function: tests swap it)
            return

        @functools.wraps(write_item)  # megatron reads its signature (inspect follows __wrapped__)
        def write_item_keeping_errno(*args: Any, **kwargs: Any) -> Any:
            try:
                return write_item(*args, **kwargs)
            except OSError:
                raise
            except Exception as err:
                full = _disk_full_cause(err)
                if full is None:
                    raise
                raise OSError(full.errno, f"{full.strerror} ({type(err).__name__}: {err})") from err

        write_item_keeping_errno.keeps_errno = True  # type: ignore[attr-defined]
        filesystem_async._write_item = write_item_keeping_errno
        logger = logging.getLogger(filesystem_async.__name__)
        if _not_disk_full not in logger.filters:
            logger.addFilter(_not_disk_full)


def _disk_full_cause(err: BaseException) -> OSError | None:
    """The OSError of a full disk that `err` was raised from or while handling, if any."""
    from megatron_dapo.errors import DISK_FULL_ERRNOS

    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


def _not_disk_full(record: logging.LogRecord) -> bool:
    """A logging filter: False (drop) for a record reporting a full disk."""
    from megatron_dapo.errors import is_disk_full

    return not is_disk_full(Exception(record.getMessage()))


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
