"""Triton kernels under the interpreter against the references (pytest module, not collected by `make test`).

tests/unit/ops/test_ops_triton.py runs this file in a fresh `TRITON_INTERPRET=1 python -m pytest` process, because
triton fixes interpreter mode when it is first imported.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_dapo.ops import fused_linear_logprob_entropy, token_logprob_entropy
from megatron_dapo.ops.reference import naive_logprob_entropy

triton = pytest.importorskip("triton")

# Tiny shapes: the interpreter runs each program in numpy. BLOCK 32 over V=100 -> 4 tiles, last ragged.
N, V, BLOCK = 8, 100, 32


if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (see tests/unit/ops/test_ops_triton.py)", allow_module_level=True)


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(N, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    w = torch.randn(2, N, generator=g, dtype=torch.float64)
    return x, t, w


def _value_and_grad(fn, x, t, w, compute_entropy=True):
    x = x.clone().requires_grad_()
    logp, ent = fn(x, t)
    loss = (logp * w[0].to(logp.dtype)).sum()
    if compute_entropy:
        loss = loss + (ent * w[1].to(ent.dtype)).sum()
    loss.backward()
    return logp.detach(), None if ent is None else ent.detach(), x.grad


@pytest.mark.parametrize("compute_entropy", [True, False], ids=["logp+entropy", "logp-only"])
def test_interpreter_matches_reference(compute_entropy):
    x, t, w = _inputs()
    fn = lambda a, b: token_logprob_entropy(a, b, backend="triton", chunk_size=BLOCK,
                                            compute_entropy=compute_entropy)
    logp, ent, grad = _value_and_grad(fn, x, t, w, compute_entropy)
    ref = _value_and_grad(lambda a, b: naive_logprob_entropy(a, b, compute_entropy=compute_entropy),
                          x.double(), t, w, compute_entropy)
    torch.testing.assert_close(logp.double(), ref[0], rtol=1e-5, atol=1e-5)
    if compute_entropy:
        torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-5)
    else:
        assert ent is None
    torch.testing.assert_close(grad.double(), ref[2], rtol=1e-5, atol=1e-5)


def test_interpreter_fp64_gradcheck():
    x, t, _ = _inputs(dtype=torch.float64)
    fn = lambda a: token_logprob_entropy(a, t, backend="triton", chunk_size=BLOCK)
    assert torch.autograd.gradcheck(fn, (x.requires_grad_(),), fast_mode=True)


def test_interpreter_bf16_and_minus_inf():
    x, t, w = _inputs(dtype=torch.bfloat16)
    x[:, 70:] = float("-inf")  # whole last tile and part of the third are -inf
    t = t % 70
    logp, ent, grad = _value_and_grad(lambda a, b: token_logprob_entropy(a, b, backend="triton",
                                                                         chunk_size=BLOCK), x, t, w)
    ref = _value_and_grad(naive_logprob_entropy, x[:, :70].double(), t, w)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp.double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad[:, :70].double(), ref[2], rtol=1e-2, atol=1e-3)
    assert torch.equal(grad[:, 70:].float(), torch.zeros(N, V - 70))


def test_interpreter_fused_linear_matches_torch():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=g)
    fn = lambda h, w: fused_linear_logprob_entropy(h, w, t, backend="triton", chunk_size=3)
    assert torch.autograd.gradcheck(fn, (hidden, weight), fast_mode=True)
