"""Worker (2 ranks, gloo): vocab-parallel token_logprob_entropy / fused linear vs a single-process run on
the full vocabulary. Every rank builds the same full tensors from one seed and takes its vocab slice."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from megatron_dapo.ops import fused_linear_logprob_entropy, token_logprob_entropy


def _loss(logp, ent, coef):
    return (logp * coef[0] + ent * coef[1]).sum()


def check_logits(backend: str, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(0)
    n, vocab = 8, 100 * world  # V_local = 100, so 32-wide triton tiles are ragged
    x = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(2, n, generator=g, dtype=torch.float64)
    x[0, :100] = float("-inf")  # rank 0's whole slice of row 0 is -inf: the empty-slice path
    t[0] = vocab - 1
    full = x.clone().requires_grad_()
    ref = token_logprob_entropy(full, t, backend="torch")
    _loss(*ref, coef).backward()
    sl = slice(rank * 100, (rank + 1) * 100)
    part = x[:, sl].clone().requires_grad_()
    chunk = 32 if backend == "triton" else 3
    got = token_logprob_entropy(part, t, tp_group=dist.group.WORLD, backend=backend, chunk_size=chunk)
    _loss(*got, coef).backward()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(part.grad, full.grad[:, sl], rtol=1e-10, atol=1e-10)
    print(f"rank{rank} logits-{backend} OK", flush=True)


def check_fused_linear(rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(1)
    n, hidden, vocab = 10, 16, 50 * world
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / 4
    t = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(2, n, generator=g, dtype=torch.float64)
    h_ref, w_ref = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = fused_linear_logprob_entropy(h_ref, w_ref, t, chunk_size=4)
    _loss(*ref, coef).backward()
    sl = slice(rank * 50, (rank + 1) * 50)
    h_tp, w_tp = h.clone().requires_grad_(), w[sl].clone().requires_grad_()
    got = fused_linear_logprob_entropy(h_tp, w_tp, t, tp_group=dist.group.WORLD, chunk_size=4)
    _loss(*got, coef).backward()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(h_tp.grad, h_ref.grad, rtol=1e-10, atol=1e-10)  # summed over TP
    torch.testing.assert_close(w_tp.grad, w_ref.grad[sl], rtol=1e-10, atol=1e-10)
    print(f"rank{rank} fused-linear OK", flush=True)


def main(backends: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for backend in backends:
        check_logits(backend, rank, world)
    check_fused_linear(rank, world)
    dist.destroy_process_group()


if __name__ == "__main__":
    assert os.environ.get("OMP_NUM_THREADS") == "1"
    main(sys.argv[1:])
