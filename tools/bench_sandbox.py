"""Executions per second (and per core) of the code sandbox, and the jail's start-up overhead.

    python tools/bench_sandbox.py [--n 50] [--workers N]

For a trivial program (`print(1)`) and a math one (`print(pow(123456789, 10**5, 10**9+7))`) it runs --n executions
serially (one `run_python` at a time) and --n through a `SandboxPool` of --workers (default os.cpu_count())
workers, and the same programs --n times as plain `python -I -c` subprocesses (no jail), side by side in the same
run. Per row: executions/s; per core (executions/s divided by the cores the row can use: 1 serially, min(workers,
cores) in the pool); mean and p95 latency (ms, one execution from call to result); CPU ms per execution (every
process of the jail plus this process's reading thread: RUSAGE_CHILDREN + RUSAGE_SELF deltas). The last lines give
the jail's overhead over the plain interpreter (mean latency and CPU ms, serial). Numbers: docs/TOOL_SANDBOX.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.tool_use.pool import SandboxPool  # noqa: E402
from megatron_dapo.tool_use.sandbox import SandboxLimits, ToolResult, base_python, run_python  # noqa: E402

PROGRAMS = {"trivial": "print(1)", "math": "print(pow(123456789, 10**5, 10**9+7))"}


def cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for descendants so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def plain(code: str) -> ToolResult:
    """`code` run by the base interpreter in isolated mode with no jail (the baseline)."""
    start = time.monotonic()
    proc = subprocess.run([base_python(), "-I", "-c", code], capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return ToolResult(proc.stdout, proc.stderr, proc.returncode, None, time.monotonic() - start)


def measure(run_all: Callable[[], list[ToolResult]], n: int, cores: int, expect: str) -> dict[str, float]:
    """Run a batch of `n` executions; its rate, per-core rate, latencies (ms) and CPU ms per execution."""
    cpu0, t0 = cpu_s(), time.monotonic()
    results = run_all()
    wall, cpu = time.monotonic() - t0, cpu_s() - cpu0
    bad = [r for r in results if not (r.ok and r.stdout == expect)]
    if bad:
        raise SystemExit(f"bench_sandbox: {len(bad)} of {n} executions failed, e.g. {bad[0]}")
    lat = sorted(r.wall_s * 1e3 for r in results)
    return {"rate": n / wall, "per_core": n / wall / cores, "mean": statistics.fmean(lat),
            "p95": lat[min(n - 1, int(0.95 * n))], "cpu_ms": cpu / n * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=50, help="executions per row (default 50)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="SandboxPool workers (default os.cpu_count())")
    args = parser.parse_args()
    if args.n < 1 or args.workers < 1:
        parser.error("--n and --workers must be >= 1")
    cores = os.cpu_count() or 1
    limits = SandboxLimits()
    rows = []
    for name, code in PROGRAMS.items():
        expect = plain(code).stdout
        rows.append((f"{name}, plain python -I (no jail), serial",
                     measure(lambda c=code: [plain(c) for _ in range(args.n)], args.n, 1, expect)))
        rows.append((f"{name}, jail, serial",
                     measure(lambda c=code: [run_python(c, limits) for _ in range(args.n)], args.n, 1, expect)))
        with SandboxPool(args.workers, limits) as pool:
            rows.append((f"{name}, jail, SandboxPool({args.workers})",
                         measure(lambda c=code, p=pool: p.run_many([c] * args.n), args.n,
                                 min(args.workers, cores), expect)))
    print(f"# {args.n} executions per row; {cores} cores; {sys.version.split()[0]}; {os.uname().release}")
    print(f"| {'what':<45} | exec/s | per core | mean ms | p95 ms | CPU ms/exec |")
    print(f"|{'-' * 47}|-------:|---------:|--------:|-------:|------------:|")
    for what, m in rows:
        print(f"| {what:<45} | {m['rate']:6.1f} | {m['per_core']:8.1f} | {m['mean']:7.1f} | {m['p95']:6.1f} |"
              f" {m['cpu_ms']:11.1f} |")
    for name in PROGRAMS:
        base = next(m for w, m in rows if w.startswith(f"{name}, plain"))
        jail = next(m for w, m in rows if w == f"{name}, jail, serial")
        print(f"jail overhead ({name}, serial): +{jail['mean'] - base['mean']:.1f} ms latency, "
              f"+{jail['cpu_ms'] - base['cpu_ms']:.1f} CPU ms per execution")


if __name__ == "__main__":
    main()
