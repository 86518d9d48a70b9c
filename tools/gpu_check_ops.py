"""One-call GPU check of megatron_dapo.ops: the Triton kernels compiled for the real device (no
interpreter) against the fp64 reference, then timing/peak memory vs the naive path and Liger.

    python tools/gpu_check_ops.py            # needs CUDA; prints PASS/FAIL lines and a timing table

Exits non-zero if any correctness check fails. Timings are printed, never asserted. Sizes fit a few
minutes on one 80-140 GiB GPU; --quick shrinks the timing shapes.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from megatron_dapo.ops import fused_linear_logprob_entropy, token_logprob_entropy
from megatron_dapo.ops.reference import naive_logprob_entropy

FAILURES: list[str] = []


def check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """Prints PASS/FAIL of max |got - ref| <= tol (failures are collected in FAILURES); returns the error."""
    err = (got.double() - ref.double()).abs().max().item()
    ok = err <= tol
    print(f"{'PASS' if ok else 'FAIL'} {name:<48} max|err|={err:.2e} (tol {tol:.0e})", flush=True)
    if not ok:
        FAILURES.append(name)
    return err


def gradcheck(name: str, fn, inputs) -> None:
    try:
        ok = torch.autograd.gradcheck(fn, inputs, fast_mode=True)
    except Exception as exc:  # gradcheck raises on mismatch; report it as a failure line
        ok = False
        print(f"  {name}: {exc}")
    print(f"{'PASS' if ok else 'FAIL'} {name}", flush=True)
    if not ok:
        FAILURES.append(name)


def _grads(fn, x, t, coef):
    x = x.clone().requires_grad_()
    logp, ent = fn(x, t)
    (logp * coef[0].to(logp.dtype) + ent * coef[1].to(ent.dtype)).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def correctness(dev: str) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    cases = ((8, 100, torch.float32, 32, 1e-5), (257, 32000, torch.float32, None, 2e-5),
             (64, 152064, torch.bfloat16, None, 2e-5), (33, 1000, torch.float64, 128, 1e-10))
    for n, v, dtype, block, tol in cases:
        x = (torch.randn(n, v, device=dev, generator=g, dtype=torch.float64) * 3).to(dtype)
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        coef = torch.randn(2, n, device=dev, generator=g, dtype=torch.float64)
        got = _grads(lambda a, b, blk=block: token_logprob_entropy(a, b, backend="triton", chunk_size=blk),
                     x, t, coef)
        ref = _grads(naive_logprob_entropy, x.double(), t, coef)
        tag = f"triton [{n}x{v}] {str(dtype).split('.')[-1]}"
        check(f"{tag} logp", got[0], ref[0], tol)
        check(f"{tag} entropy", got[1], ref[1], tol)
        check(f"{tag} d logits", got[2], ref[2], 2e-2 if dtype == torch.bfloat16 else tol)
    x = torch.randn(6, 300, device=dev, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 300, (6,), device=dev)
    fn = lambda a: token_logprob_entropy(a, t, backend="triton", chunk_size=64)
    gradcheck("triton fp64 gradcheck (fast mode)", fn, (x,))
    h = torch.randn(40, 64, device=dev, dtype=torch.float64, requires_grad=True)
    w = torch.randn(500, 64, device=dev, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 500, (40,), device=dev)
    fn = lambda a, b: fused_linear_logprob_entropy(a, b, t, backend="triton", chunk_size=16)
    gradcheck("fused linear (triton) fp64 gradcheck (fast mode)", fn, (h, w))


def measure(fn, repeats: int = 5) -> tuple[float, float]:
    """(median ms, peak extra GiB) of fn() = forward + backward; the peak is NaN without CUDA."""
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else float("nan")
    return sorted(times)[len(times) // 2], peak


def timing_logits(dev: str, quick: bool) -> list[tuple[str, float, float]]:
    rows = []
    n, v = (1024, 32000) if quick else (4096, 32000)
    x = torch.randn(n, v, device=dev).mul_(3).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    c = torch.randn(n, device=dev)

    def logits_path(f):
        def run():
            x.grad = None
            lp, h = f()
            (lp * c + h * c).sum().backward()
        return run

    rows.append((f"naive [{n}x{v}] fp32", *measure(logits_path(lambda: naive_logprob_entropy(x, t)))))
    rows.append((f"triton [{n}x{v}] fp32", *measure(logits_path(
        lambda: token_logprob_entropy(x, t, backend="triton")))))
    return rows


def timing_linear(dev: str, quick: bool) -> list[tuple[str, float, float]]:
    rows = []
    n, hid, v = (2048, 4096, 152064) if quick else (8192, 4096, 152064)
    h = (torch.randn(n, hid, device=dev, dtype=torch.bfloat16)).requires_grad_()
    w = (torch.randn(v, hid, device=dev, dtype=torch.bfloat16) / hid ** 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev)
    c = torch.randn(n, device=dev)

    def linear_path(f, entropy=True):
        def run():
            h.grad = w.grad = None
            lp, ent = f()
            loss = (lp * c).sum() + ((ent * c).sum() if entropy else 0)
            loss.backward()
        return run

    tag = f"[{n}x{hid}]x[{v}] bf16"
    rows.append((f"linear+naive {tag}", *measure(linear_path(lambda: naive_logprob_entropy(h @ w.t(), t)))))
    rows.append((f"fused_linear triton {tag}", *measure(linear_path(
        lambda: fused_linear_logprob_entropy(h, w, t, backend="triton")))))
    rows.append((f"fused_linear triton logp-only {tag}", *measure(linear_path(
        lambda: fused_linear_logprob_entropy(h, w, t, backend="triton", compute_entropy=False), False))))
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        print("liger_kernel not importable: skipping the Liger comparison")
    else:
        liger = LigerFusedLinearCrossEntropyLoss(reduction="sum")

        def run_liger():
            h.grad = w.grad = None
            liger(w, h, t).backward()
        rows.append((f"liger fused linear CE {tag}", *measure(run_liger)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller timing shapes")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check_ops needs a CUDA device")
        return 2
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    correctness("cuda")
    rows = timing_logits("cuda", args.quick) + timing_linear("cuda", args.quick)
    print(f"\n{'variant':<52}{'ms':>10}{'peak GiB':>10}")
    for name, ms, gib in rows:
        print(f"{name:<52}{ms:>10.1f}{gib:>10.2f}")
    print(f"\n{'ALL PASS' if not FAILURES else 'FAILED: ' + ', '.join(FAILURES)}")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
