"""Benchmark the token log-prob / entropy paths side by side on CPU: time and peak memory of forward +
backward (log p and entropy, random upstream weights), each variant in its own process.

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench_loss.py [--tokens 4096 --vocab 32000 --hidden 256]

Variants: naive (log_softmax + gather, entropy from softmax: verl's torch path), chunked (torch twin),
compiled (torch twin under torch.compile), and for the last-stage path linear+naive vs fused_linear.
Peak memory = max RSS sampled during the run minus RSS before it (inputs excluded). Goals for the logits
path: peak <= 0.25x naive, time <= 1.2x naive.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import psutil
import torch

LOGITS_VARIANTS = ("naive", "chunked", "compiled")
LINEAR_VARIANTS = ("linear+naive", "fused_linear")


class PeakRSS:
    """Samples this process's RSS every ~1 ms in a thread (torch kernels release the GIL)."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.base = self.peak = self.proc.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _step(variant: str, args, tensors) -> None:
    from megatron_dapo.ops import fused_linear_logprob_entropy, token_logprob_entropy
    from megatron_dapo.ops.reference import naive_logprob_entropy

    x, hidden, weight, t, c0, c1 = tensors
    if variant in LOGITS_VARIANTS:
        x.grad = None
        if variant == "naive":
            logp, ent = naive_logprob_entropy(x, t)
        else:
            backend = "torch" if variant == "chunked" else "torch_compile"
            logp, ent = token_logprob_entropy(x, t, backend=backend, chunk_size=args.chunk)
    else:
        hidden.grad = weight.grad = None
        if variant == "linear+naive":
            logp, ent = naive_logprob_entropy(hidden @ weight.t(), t)
        else:
            logp, ent = fused_linear_logprob_entropy(hidden, weight, t)
    (logp * c0 + ent * c1).sum().backward()


def run_variant(variant: str, args) -> dict:
    """In the child process: one measured cold run for memory, then timed repeats."""
    torch.manual_seed(0)
    n, v, h = args.tokens, args.vocab, args.hidden
    linear = variant in LINEAR_VARIANTS
    x = None if linear else torch.randn(n, v).mul_(3).requires_grad_()
    hidden = torch.randn(n, h, requires_grad=True) if linear else None
    weight = (torch.randn(v, h) / h ** 0.5).requires_grad_() if linear else None
    tensors = (x, hidden, weight, torch.randint(0, v, (n,)), torch.randn(n), torch.randn(n))
    if variant == "compiled":  # compile on a small ragged shape first: compilation is not the kernel's cost
        small = (torch.randn(37, v, requires_grad=True), None, None, torch.randint(0, v, (37,)),
                 torch.randn(37), torch.randn(37))
        _step(variant, argparse.Namespace(chunk=16), small)
    with PeakRSS() as mem:
        _step(variant, args, tensors)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _step(variant, args, tensors)
        times.append(time.perf_counter() - t0)
    return {"variant": variant, "peak_mib": mem.extra_mib, "time_s": sorted(times)[len(times) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the fused-linear comparison")
    p.add_argument("--chunk", type=int, default=None, help="tokens per chunk of the torch twin")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--variants", nargs="*", default=list(LOGITS_VARIANTS + LINEAR_VARIANTS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_variant(args.child, args)))
        return
    # glibc serves the [N, V] buffers (> 32 MiB) by mmap, so they leave RSS when freed and peaks compare;
    # chunk-sized temporaries come from the heap and are reused, as in a long-running trainer.
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    rows = {}
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab",
               str(args.vocab), "--hidden", str(args.hidden), "--repeats", str(args.repeats)]
        if args.chunk:
            cmd += ["--chunk", str(args.chunk)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        rows[variant] = json.loads(out.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    print(f"[{args.tokens} x {args.vocab}] fp32 (fused linear: hidden {args.hidden}), forward+backward of "
          f"log p and entropy, commit {commit}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"{'variant':<14}{'time s':>9}{'peak MiB':>10}{'time/base':>11}{'peak/base':>11}   base")
    for variant, row in rows.items():
        base = rows.get("linear+naive" if variant in LINEAR_VARIANTS else "naive", row)
        ratio_t = row["time_s"] / base["time_s"]
        ratio_m = row["peak_mib"] / max(base["peak_mib"], 1e-9)
        print(f"{variant:<14}{row['time_s']:>9.3f}{row['peak_mib']:>10.0f}{ratio_t:>11.2f}{ratio_m:>11.2f}"
              f"   {base['variant']}")
    print("goal (logits path): peak/base <= 0.25, time/base <= 1.2")


if __name__ == "__main__":
    main()
