"""Sampling math vs references written out separately (per-row loops over sorted probabilities)."""

import pytest
import torch

from megatron_dapo.rollout.sampling import filter_logits, row_seed, sample_tokens


def _reference_keep(logits_row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """SGLang's rule: top-k by rank and top-p on the full distribution, each separately; the token whose
    cumulative mass first exceeds top_p is still kept."""
    probs = torch.softmax(logits_row / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda v: -probs[v])
    keep, mass = set(), 0.0
    for rank, v in enumerate(order):
        if (top_k > 0 and rank >= top_k) or (top_p < 1.0 and mass > top_p):
            break
        keep.add(v)
        mass += probs[v]
    return keep


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [pytest.param(1.0, -1, 1.0, id="off"), pytest.param(0.7, 5, 1.0, id="top_k"),
     pytest.param(1.3, -1, 0.8, id="top_p"), pytest.param(1.0, 10, 0.5, id="both")],
)
def test_filter_keeps_reference_set(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 2
    out = filter_logits(
        logits, torch.full((6,), temperature), torch.full((6,), top_k), torch.full((6,), top_p)
    )
    for i in range(6):
        kept = {v for v in range(40) if torch.isfinite(out[i, v])}
        assert kept == _reference_keep(logits[i], temperature, top_k, top_p)
        finite = torch.isfinite(out[i])
        torch.testing.assert_close(out[i][finite], (logits[i] / temperature)[finite])


def test_sampling_frequencies_match_filtered_softmax():
    torch.manual_seed(1)
    logits = torch.randn(1, 8)
    temp, k, p = torch.tensor([0.8]), torch.tensor([5]), torch.tensor([0.9])
    expected = torch.softmax(filter_logits(logits, temp, k, p), dim=-1)[0]
    draws = 20_000
    # One row per draw, each with its own stream: the same path the engine takes for a big batch.
    gens = [torch.Generator().manual_seed(row) for row in range(draws)]
    many = lambda t: t.expand(draws, *t.shape[1:]).contiguous()
    tokens = sample_tokens(many(logits), many(temp), many(k), many(p), gens)
    counts = torch.bincount(tokens, minlength=8).float()
    freq = counts / draws
    # Binomial std <= 0.0036 at 20k draws: 0.015 is > 4 sigma.
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    assert counts[expected == 0].sum() == 0


def test_greedy_rows_take_argmax_and_rows_are_independent():
    logits = torch.randn(3, 50)
    temp = torch.tensor([0.0, 1.0, 0.0])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    tokens = sample_tokens(logits, temp, torch.tensor([-1, -1, -1]), torch.ones(3), gens)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    # Row 1 alone, with the same generator state, draws the same token as in the batch.
    alone = sample_tokens(logits[1:2], temp[1:2], torch.tensor([-1]), torch.ones(1),
                          [torch.Generator().manual_seed(2)])
    assert alone[0] == tokens[1]


def test_row_seed_distinct():
    seeds = {row_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400
