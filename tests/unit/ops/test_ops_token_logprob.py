"""token_logprob_entropy with the torch twin (eager and compiled) against the naive/fp64 references."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.ops import token_logprob_entropy
from megatron_dapo.ops.reference import float64_logprob_entropy, naive_logprob_entropy


def _inputs(n=8, vocab=100, dtype=torch.float32, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    t = torch.randint(0, vocab, (n,), generator=g)
    w_lp = torch.randn(n, generator=g, dtype=torch.float64)
    w_h = torch.randn(n, generator=g, dtype=torch.float64)
    return x, t, w_lp, w_h


def _value_and_grad(fn, x, t, w_lp, w_h):
    """(logp, entropy, d/dx of sum(w_lp * logp + w_h * entropy)), all detached."""
    x = x.clone().requires_grad_()
    logp, ent = fn(x, t)
    (logp * w_lp.to(logp.dtype) + ent * w_h.to(ent.dtype)).sum().backward()
    return logp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("backend", ["torch", pytest.param("torch_compile", marks=pytest.mark.slow)])
@pytest.mark.parametrize("chunk_size", [None, 3], ids=["one-chunk", "ragged-chunks"])
def test_matches_reference_values_and_grads(backend, chunk_size):
    x, t, w_lp, w_h = _inputs()
    got = _value_and_grad(lambda a, b: token_logprob_entropy(a, b, backend=backend, chunk_size=chunk_size),
                          x, t, w_lp, w_h)
    ref = _value_and_grad(naive_logprob_entropy, x.double(), t, w_lp, w_h)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


def test_fp64_gradcheck():
    x, t, _, _ = _inputs(n=6, vocab=37, dtype=torch.float64)
    fn = lambda a: token_logprob_entropy(a, t, backend="torch", chunk_size=4)
    assert torch.autograd.gradcheck(fn, (x.requires_grad_(),), fast_mode=True)


def test_bf16_input_accumulates_in_fp32():
    x, t, w_lp, w_h = _inputs(dtype=torch.bfloat16)
    fn = lambda a, b: token_logprob_entropy(a, b, backend="torch")
    logp, ent, grad = _value_and_grad(fn, x, t, w_lp, w_h)
    ref = _value_and_grad(naive_logprob_entropy, x.double(), t, w_lp, w_h)  # same bf16-rounded logits
    assert logp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp.double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad.double(), ref[2], rtol=1e-2, atol=1e-3)  # bf16 output rounding


def test_shifted_entropy_accumulator_is_accurate_at_32k_vocab():
    # Large, offset logits: the textbook lse - sum p x cancels two ~O(20) numbers in fp32.
    x, t, _, _ = _inputs(n=16, vocab=32000, scale=5.0)
    x = x + 20.0
    _, ent = token_logprob_entropy(x, t, backend="torch")
    _, ent_textbook = naive_logprob_entropy(x, t)
    _, ent64 = float64_logprob_entropy(x, t)
    err = (ent.double() - ent64).abs().max().item()
    err_textbook = (ent_textbook.double() - ent64).abs().max().item()
    assert err < 5e-6, err
    assert err_textbook > 10 * err, (err, err_textbook)  # why the shifted form is used


def test_leading_dims_and_logp_only():
    x, t, w_lp, _ = _inputs(n=12)
    x3, t3 = x.view(3, 4, 100), t.view(3, 4)
    xa = x3.clone().requires_grad_()
    logp, ent = token_logprob_entropy(xa, t3, compute_entropy=False, backend="torch")
    assert ent is None and logp.shape == (3, 4)
    (logp * w_lp.view(3, 4).float()).sum().backward()
    xr = x.clone().requires_grad_()
    ref, _ = naive_logprob_entropy(xr, t, compute_entropy=False)
    (ref * w_lp.float()).sum().backward()
    torch.testing.assert_close(logp.detach().view(-1), ref.detach())
    torch.testing.assert_close(xa.grad.view(12, 100), xr.grad)


def test_minus_inf_logits_are_excluded_not_nan():
    x, t, w_lp, w_h = _inputs()
    masked = x.clone()
    masked[:, 50:] = float("-inf")  # e.g. a masked vocabulary tail
    t = t % 50
    got = _value_and_grad(lambda a, b: token_logprob_entropy(a, b, backend="torch"), masked, t, w_lp, w_h)
    ref = _value_and_grad(naive_logprob_entropy, x[:, :50].double(), t, w_lp, w_h)
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1].double(), ref[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2][:, :50].double(), ref[2], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2][:, 50:], torch.zeros(8, 50))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        pytest.param({"backend": "cuda"}, ValueError, "backend='cuda' is not one of", id="bad-backend"),
        pytest.param({"chunk_size": 0}, ValueError, "chunk_size must be a positive int", id="bad-chunk"),
        pytest.param({"backend": "triton"}, RuntimeError, "TRITON_INTERPRET=1", id="triton-on-cpu"),
    ],
)
def test_bad_arguments_raise(monkeypatch, kwargs, error, match):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, t, _, _ = _inputs()
    with pytest.raises(error, match=match):
        token_logprob_entropy(x, t, **kwargs)


def test_bad_targets_raise():
    x, t, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"token ids in \[0, 100\)"):
        token_logprob_entropy(x, torch.full_like(t, 100))
    with pytest.raises(ValueError, match="targets shape"):
        token_logprob_entropy(x, t[:4])
    with pytest.raises(ValueError, match="integer token ids"):
        token_logprob_entropy(x, t.float())


def test_a_vocab_slice_of_padding_only_contributes_nothing():
    """Two TP-style vocab slices, the second holding only padded ids (filled with finfo.min / 2, as
    actor/logprob.mask_padded_vocab does): combined log-prob and entropy equal the softmax over the real
    columns, with finite gradients (a tiny vocab at TP2 gave nan entropy and grads before)."""
    from megatron_dapo.ops.stats import finalize, local_targets, rescale_to
    from megatron_dapo.ops.torch_kernels import local_stats

    torch.manual_seed(0)
    real, local = 80, 128  # vocab 80 padded to 256 at TP2: rank 1's slice is all padding
    x = torch.randn(5, 2 * local, requires_grad=True)
    targets = torch.randint(0, real, (5,))
    masked = x.masked_fill(torch.arange(2 * local) >= real, torch.finfo(torch.float32).min / 2)
    parts = [local_stats(masked[:, r * local:(r + 1) * local], local_targets(targets, r * local, local),
                         compute_entropy=True, chunk_size=None) for r in range(2)]
    top = torch.maximum(parts[0].max, parts[1].max)
    moved = [rescale_to(p, top) for p in parts]
    _, logp, entropy = finalize(type(moved[0])(max=top, sumexp=moved[0].sumexp + moved[1].sumexp,
                                               ent_acc=moved[0].ent_acc + moved[1].ent_acc,
                                               target_logit=moved[0].target_logit + moved[1].target_logit))
    ref = x[:, :real].log_softmax(-1)
    torch.testing.assert_close(logp, ref.gather(1, targets[:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, -(ref.exp() * ref).sum(-1), atol=1e-5, rtol=0)
    (logp.sum() + entropy.sum()).backward()
    assert torch.isfinite(x.grad).all() and (x.grad[:, real:] == 0).all()
