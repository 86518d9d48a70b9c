"""fused_linear_logprob_entropy against the unfused reference on hidden @ weight.T."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megatron_dapo.ops import fused_linear_logprob_entropy
from megatron_dapo.ops.reference import naive_logprob_entropy


def _inputs(n=20, hidden=16, vocab=100, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=torch.float64).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / hidden ** 0.5).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    coef = torch.randn(2, n, generator=g, dtype=torch.float64)
    return h, w, t, coef


def _run(fn, h, w, t, coef, weight_grad=True):
    h = h.clone().requires_grad_()
    w = w.clone().requires_grad_(weight_grad)
    logp, ent = fn(h, w, t)
    (logp * coef[0].to(logp.dtype) + ent * coef[1].to(ent.dtype)).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [None, 7], ids=["one-chunk", "ragged-chunks"])
def test_matches_unfused_reference(chunk_size):
    h, w, t, coef = _inputs()
    got = _run(lambda a, b, c: fused_linear_logprob_entropy(a, b, c, chunk_size=chunk_size), h, w, t, coef)
    ref = _run(lambda a, b, c: naive_logprob_entropy(a @ b.t(), c), h.double(), w.double(), t, coef)
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def test_fp64_gradcheck():
    h, w, t, _ = _inputs(n=9, vocab=30, dtype=torch.float64)
    fn = lambda a, b: fused_linear_logprob_entropy(a, b, t, chunk_size=4)
    assert torch.autograd.gradcheck(fn, (h.requires_grad_(), w.requires_grad_()), fast_mode=True)


def test_bf16_and_frozen_weight():
    h, w, t, coef = _inputs(dtype=torch.bfloat16)
    fused = lambda a, b, c: fused_linear_logprob_entropy(a, b, c, chunk_size=8)
    logp, ent, dh, dw = _run(fused, h, w, t, coef, weight_grad=False)
    assert dw is None and dh.dtype == torch.bfloat16 and logp.dtype == torch.float32
    # Reference on the same bf16 GEMM output, upcast: isolates the fused loss from GEMM rounding.
    unfused = lambda a, b, c: naive_logprob_entropy((a @ b.t()).double(), c)
    ref = _run(unfused, h, w, t, coef, weight_grad=False)
    torch.testing.assert_close(logp.double(), ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent.double(), ref[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dh.double(), ref[2].double(), rtol=2e-2, atol=2e-2)


def test_bad_shapes_raise():
    h, w, t, _ = _inputs()
    with pytest.raises(ValueError, match="same H"):
        fused_linear_logprob_entropy(h, w[:, :8], t)
    with pytest.raises(ValueError, match="share one float dtype"):
        fused_linear_logprob_entropy(h, w.double(), t)
    with pytest.raises(ValueError, match="targets must be integer ids"):
        fused_linear_logprob_entropy(h, w, t[:5])


class _LargestOutput(TorchDispatchMode):
    """Records the largest tensor (elements) any aten op returns while active: every allocation of the forward and of
    the autograd backward (which runs these CPU ops on this thread, under this mode) is some op's output."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape = 0, ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape = t.numel(), tuple(t.shape)
        return out


def test_no_tensor_of_tokens_x_vocab_is_ever_made():
    """docs/ARCHITECTURE.md's "never materialising [tokens x vocab] logits": in the forward and in the backward, no
    tensor the fused head makes is larger than one [chunk, V] logits block, while the unfused path makes the [N, V]
    logits (N = 256 tokens, V = 512, chunk 16: 8,192 vs 131,072 elements; the inputs are smaller than a block). At the
    production setting (Qwen2.5-32B, V = 152,064 / TP8, a 24,576-token micro-batch) the default chunk is 882 tokens:
    one 64 MiB fp32 block instead of 1.74 GiB of logits per TP rank."""
    n, h, v, chunk = 256, 8, 512, 16
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).requires_grad_()
    weight = torch.randn(v, h, generator=gen).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    assert max(hidden.numel(), weight.numel()) < chunk * v < n * v
    with _LargestOutput() as forward:
        logp, ent = fused_linear_logprob_entropy(hidden, weight, targets, chunk_size=chunk)
    with _LargestOutput() as backward:
        (logp.sum() + ent.sum()).backward()
    # the backward recomputes each block: seeing one there shows the mode watches the backward too
    assert forward.shape == backward.shape == (chunk, v)
    with _LargestOutput() as unfused:
        naive_logprob_entropy(hidden.detach() @ weight.detach().t(), targets)
    assert unfused.shape == (n, v)
