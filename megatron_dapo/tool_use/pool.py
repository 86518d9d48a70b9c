"""Many sandboxed executions at once: a thread pool whose threads each wait on one jail (tool_use/sandbox.py).

A thread costs no CPU while its jail runs (it sleeps in select on the jail's pipes); the jails themselves are
separate processes, so `workers` executions use up to `workers` cores. At the production setting (512 prompts x 16
responses x ~3 tool calls = 24,576 executions per step) the rollout node's cores are the bound, not the threads:
docs/TOOL_SANDBOX.md has the measured rate and the arithmetic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from megatron_dapo.tool_use.sandbox import Execution, SandboxLimits, ToolResult


class SandboxPool:
    """Runs code in the jail on `workers` threads, each waiting on one execution; `close()` kills what still runs."""

    def __init__(self, workers: int, limits: SandboxLimits) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"SandboxPool: workers must be an integer >= 1, got {workers!r}")
        self.limits = limits
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
        self._running: set[Execution] = set()
        self._lock = threading.Lock()
        self._closed = False

    def _run(self, code: str) -> ToolResult:
        """One execution on a pool thread; 'cancelled' when the pool closed before it started."""
        with self._lock:
            if self._closed:
                return ToolResult("", "", None, "cancelled", 0.0)
            execution = Execution(code, self.limits)
            self._running.add(execution)
        try:
            return execution.wait()
        finally:
            with self._lock:
                self._running.discard(execution)

    def submit(self, code: str) -> Future[ToolResult]:
        """Queue `code`; its Future holds the ToolResult. Raises RuntimeError once the pool is closed."""
        if self._closed:
            raise RuntimeError("SandboxPool.submit: the pool is closed")
        return self._executor.submit(self._run, code)

    def run_many(self, codes: Iterable[str]) -> list[ToolResult]:
        """Run every code (up to `workers` at once) and return their results in the order given."""
        return [f.result() for f in [self.submit(c) for c in codes]]

    def close(self) -> None:
        """Stop the running executions (their jails are killed: 'cancelled'), drop the queued ones and wait for the
        threads. Idempotent."""
        with self._lock:
            self._closed = True
            running = list(self._running)
        for execution in running:
            execution.stop()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

