"""Batched next-token sampling with per-row temperature / top-k / top-p and per-row random streams.

Pure tensor functions used by the embedded engine's decode loop; they never touch a model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_MASK_SEED = (1 << 63) - 1


def row_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a request seeded with `seed` (a fixed mix, so streams do not overlap)."""
    return (seed * 1_000_003 + index * 7_919 + 12_345) & _MASK_SEED


def filter_logits(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Logits of the sampling distribution: divided by temperature, then top-k / top-p masked to -inf.

    logits [b, V] fp32; temperature [b] (> 0 rows only matter; 0 rows are greedy and handled by the
    caller); top_k [b] int (-1 = off); top_p [b] float (1.0 = off). Returns [b, V].
    The most likely token always survives, so every row keeps at least one finite logit.
    """
    scaled = logits / temperature.clamp_min(1e-6).unsqueeze(1)
    use_k = bool((top_k > 0).any())
    use_p = bool((top_p < 1.0).any())
    if not (use_k or use_p):
        return scaled
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if use_k:
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, vocab).unsqueeze(1)
        remove |= ranks >= k
    if use_p:
        # As SGLang: top-p on the full temperature-scaled distribution (not renormalised after top-k);
        # a token goes when the mass strictly before it exceeds top_p, so the crossing token stays.
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        remove |= (mass_before > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, order, sorted_logits)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """Draws one token per row; rows with temperature 0 take the argmax of the raw logits.

    Sampling is an exponential race, argmax(p / E) with E ~ Exp(1) i.i.d., which picks token v with
    probability p[v]; the noise of row i comes from generators[i] alone, so a seeded sample is the same
    whatever else shares its batch. logits [b, V] fp32 -> tokens [b] int64.
    """
    greedy = temperature == 0.0
    tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return tokens
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, tokens, sampled)


def skip_draws(generator: torch.Generator, vocab: int, tokens: int) -> None:
    """Advances `generator` past `tokens` sampled tokens of `sample_tokens` (one Exp(1) draw per vocabulary
    entry per token, fp32), so a partial-rollout continuation draws what the uninterrupted sample would have.

    Cost: tokens x vocab exponential draws (docs/BENCHMARKS.md, "Skipped draws"). The embedded engine is a CPU
    engine for small runs; SGLang needs no skipping.
    """
    if tokens <= 0:
        return
    noise = torch.empty(vocab, dtype=torch.float32, device=generator.device)
    for _ in range(tokens):
        noise.exponential_(generator=generator)
