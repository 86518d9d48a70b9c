"""Dynamic micro-batching: group samples under a token budget, balance them over DP ranks, and build
padded or packed tensors one micro-batch at a time.

A micro-batch of n rows padded to its longest row L costs n * L tokens; rows are sorted by length
(longest first) and packed greedily so each micro-batch stays under `max_tokens`. Right padding with
a causal mask leaves every real position's output unchanged, so log-probs do not depend on the split.

Host memory: the pipeline pulls micro-batches from an iterator (`iter_micro_batches`), so a rank holds
one micro-batch's tensors at a time: at the production setting (24576-token budget) about 24576 x
(5 x 8 + 4) B = 1 MiB, plus on the local spec only an explicit [1, 1, s, s] bool causal mask (0.47 GiB
at s = 22528, which is why TransformerEngine, whose causal kernel reads no mask, never gets one).

Packing (--pack-sequences): a micro-batch's rows are laid end to end as one [1, T] row, T = the sum of
their lengths (plus < pad_to tokens of padding under SP), so the budget counts real tokens and padding
waste is ~0. Row boundaries are kept by cu_seqlens ([n + 1] int32 offsets, TransformerEngine's THD
format via megatron's PackedSeqParams) or, on the local spec, by a block-diagonal causal [1, 1, T, T]
mask plus per-row position ids (RoPE restarts at 0 in each row). The loss-side tensors stay in the
padded [n, L] row layout; `MicroBatch.unpack` gathers [1, T] model outputs into it, so the loss and
its metrics are computed exactly as for a padded micro-batch.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_dapo.actor.config import TrainSample

MAX_SWAPS = 256
"""Bound of partition_for_dp's swap refinement (each swap: O(n log n))."""


def plan_micro_batches(lengths: Sequence[int], *, max_tokens: int | None, micro_batch_size: int,
                       num_micro_batches: int | None = None, packed: bool = False) -> list[list[int]]:
    """Index groups into `lengths`: each group's len(group) * max length <= max_tokens (padded), or its
    sum of lengths <= max_tokens (packed=True: first-fit decreasing bin packing).

    max_tokens=None: consecutive groups of micro_batch_size rows (the fixed-size fallback).
    num_micro_batches: when above the greedy count, the groups with the most rows are halved until there
    are that many (so every DP rank runs the same count; splitting only lowers padding). It stays below
    when every group is down to one row.
    Raises ValueError naming --max-tokens-per-micro-batch when one sequence alone exceeds the budget.
    """
    if max_tokens is None:
        idx = list(range(len(lengths)))
        groups = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    else:
        longest = max(lengths, default=0)
        if longest > max_tokens:
            raise ValueError(f"a sequence of {longest} tokens exceeds --max-tokens-per-micro-batch "
                             f"({max_tokens}); raise the budget to at least the longest prompt + response")
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        groups = []
        if packed:
            return _split_to(_first_fit(lengths, order, max_tokens), num_micro_batches, lengths, packed=True)
        for i in order:
            # sorted longest-first, so the group's first row is its longest
            if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
                groups[-1].append(i)
            else:
                groups.append([i])
    return _split_to(groups, num_micro_batches, lengths, packed=packed)


def _first_fit(lengths: Sequence[int], order: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: each row (longest first) joins the first group with room for it."""
    groups: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for k, free in enumerate(room):
            if lengths[i] <= free:
                groups[k].append(i)
                room[k] -= lengths[i]
                break
        else:
            groups.append([i])
            room.append(max_tokens - lengths[i])
    return groups


def _split_to(groups: list[list[int]], num_micro_batches: int | None, lengths: Sequence[int], *,
              packed: bool) -> list[list[int]]:
    """Halve the fullest groups (most rows; packed: most tokens, rows dealt alternately by length) until
    there are num_micro_batches or every group has one row. Subsets of a group stay within its budget."""
    while num_micro_batches is not None and len(groups) < num_micro_batches:
        if packed:
            k = max(range(len(groups)), key=lambda j: (sum(lengths[i] for i in groups[j]), -j))
        else:
            k = max(range(len(groups)), key=lambda j: (len(groups[j]), -j))
        if len(groups[k]) == 1:
            break
        if packed:
            rows = sorted(groups[k], key=lambda i: -lengths[i])
            groups[k:k + 1] = [rows[0::2], rows[1::2]]
        else:
            half = (len(groups[k]) + 1) // 2
            groups[k:k + 1] = [groups[k][:half], groups[k][half:]]
    return groups


def attention_cost_coefficient(hidden_size: int, ffn_hidden_size: int, num_heads: int, num_kv_heads: int,
                               head_dim: int) -> float:
    """Causal attention FLOPs per token per context token, relative to one token's GEMM FLOPs.

    Per layer, a token costs 2 x P_layer FLOPs in the GEMMs (P_layer = h(q + 2kv) + qh + 3hf) and, in a
    row of length L under a causal mask, about 2 x L x q FLOPs in QK^T and AV (4 L q halved). So a row
    of length L costs L (1 + c L) GEMM-token units with c = q / P_layer (Qwen2.5-32B: c = 1.05e-5, +21%
    at L = 20480).
    """
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    p_layer = hidden_size * (q + 2 * kv) + q * hidden_size + 3 * hidden_size * ffn_hidden_size
    return q / p_layer


def padded_cost(lengths: Sequence[int], groups: Sequence[Sequence[int]], attn_coef: float) -> float:
    """Compute cost of micro-batches as run (padded rows): sum over groups of n L (1 + attn_coef L)."""
    total = 0.0
    for g in groups:
        longest = max(lengths[i] for i in g)
        total += len(g) * longest * (1.0 + attn_coef * longest)
    return total


def partition_for_dp(lengths: Sequence[int], dp: int, *, attn_coef: float = 0.0) -> list[list[int]]:
    """Split row indices over `dp` ranks so each rank's compute cost is as equal as possible.

    Cost of a row of length L: L (1 + attn_coef L) (see attention_cost_coefficient). Longest-processing-
    time-first greedy (Graham): rows in decreasing cost, each to the rank with the least cost so far
    (ties: fewer rows), then pairwise swaps between the heaviest and lightest rank while they lower the
    maximum (at most MAX_SWAPS). Every rank gets at least one row (raises ValueError when
    len(lengths) < dp). Each rank's indices come back sorted. O(n log n) per swap; 2048 rows over 4 ranks: tens of ms.

    The token-mean loss is unaffected: megatron sums loss numerators and token counts over every rank
    before dividing, so which rank holds a row does not change the gradient.
    """
    if len(lengths) < dp:
        raise ValueError(f"{len(lengths)} responses cannot cover {dp} data-parallel ranks; raise "
                         "--global-batch-size or --rollout-batch-size x --n-samples-per-prompt")
    cost = [length * (1.0 + attn_coef * length) for length in lengths]
    order = sorted(range(len(lengths)), key=lambda i: (-cost[i], i))
    heap = [(0.0, 0, r) for r in range(dp)]
    parts: list[list[int]] = [[] for _ in range(dp)]
    loads = [0.0] * dp
    for i in order:
        load, n, r = heapq.heappop(heap)
        parts[r].append(i)
        loads[r] = load + cost[i]
        heapq.heappush(heap, (loads[r], n + 1, r))
    for _ in range(MAX_SWAPS):  # bounded local search: swap one row between the extremes
        hi = max(range(dp), key=loads.__getitem__)
        lo = min(range(dp), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        lo_sorted = sorted((cost[b], b) for b in parts[lo])
        lo_costs = [c for c, _ in lo_sorted]
        best, pair = 0.0, None
        for a in parts[hi]:
            # the ideal partner costs cost[a] - gap / 2 (it levels both ranks); look at its neighbours
            k = bisect.bisect_left(lo_costs, cost[a] - gap / 2)
            for j in (k - 1, k):
                if 0 <= j < len(lo_sorted):
                    d = cost[a] - lo_costs[j]
                    if 0 < d < gap and min(d, gap - d) > best:  # both ranks end strictly below the old max
                        best, pair = min(d, gap - d), (a, lo_sorted[j][1])
        if pair is None:
            break
        a, b = pair
        parts[hi].remove(a)
        parts[lo].remove(b)
        parts[hi].append(b)
        parts[lo].append(a)
        d = cost[a] - cost[b]
        loads[hi] -= d
        loads[lo] += d
    return [sorted(p) for p in parts]


@dataclass
class MicroBatch:
    """Tensors of one micro-batch; position t predicts token t + 1.

    Model side (tokens, position_ids, attention_mask, targets): [b, s] right-padded rows, or [1, T]
    packed rows. Loss side (response_mask, loss_mask, old_log_probs, ref_log_probs): always [n, L] rows, L = longest
    row (padded: L = s); `unpack` maps model-side [b, s] values to them.
    """

    indices: list[int]
    """Positions of these rows in the caller's sample list."""
    tokens: Tensor
    """[b, s] int64 input ids (0 in padding)."""
    position_ids: Tensor
    """[b, s] int64 (packed: restarting at 0 in each row)."""
    attention_mask: Tensor | None
    """[1, 1, s, s] bool, True = masked (strictly upper triangle: causal; packed: block-diagonal causal);
    None on TransformerEngine, whose causal attention reads no mask (packed: it reads cu_seqlens)."""
    targets: Tensor
    """[b, s] int64 next-token ids (0 where there is none)."""
    response_mask: Tensor
    """[n, L] bool: the target at this position is a response token."""
    loss_mask: Tensor
    """[n, L] fp32: response_mask times the sample's loss_mask."""
    old_log_probs: Tensor
    """[n, L] fp32 (0 where has_old is False or outside the response)."""
    has_old: Tensor
    """[b] bool: old log-probs were given (else on-policy)."""
    advantages: Tensor
    """[b] fp32."""
    response_lens: list[int]
    prompt_lens: list[int]
    unpack_index: Tensor | None = None
    """Packed only: [n, L] int64 positions in the [1, T] row of each row's token t (padding: the row's last
    token, masked out of the loss); None = model side is already [n, L]."""
    cu_seqlens: Tensor | None = None
    """Packed only: [segments + 1] int32 offsets of the rows (and of a trailing pad segment) in [1, T]."""
    max_seqlen: int = 0
    """Packed only: longest segment of cu_seqlens."""
    is_weights: Tensor | None = None
    """[b, s] fp32 rollout-correction weights (1 in rows without any); None when no row has them."""
    ref_log_probs: Tensor | None = None
    """[n, L] fp32 log pi_ref (0 outside the response); None when no row has them, an error when only some do."""
    token_advantages: Tensor | None = None
    """[n, L] fp32 per-token advantages added to each row's `advantages` (0 outside the response and in rows without
    any); None when no row has them. `loss_advantages` is what the loss gets."""

    @property
    def loss_advantages(self) -> Tensor:
        """The advantages the loss takes: [b] per row, or [n, L] per token when any row has token advantages."""
        if self.token_advantages is None:
            return self.advantages
        return self.advantages.unsqueeze(-1) + self.token_advantages

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)

    def unpack(self, values: Tensor | None) -> Tensor | None:
        """Model-side per-position values [b, s] -> loss-side [n, L] (a gather, differentiable)."""
        if values is None or self.unpack_index is None:
            return values
        return values.reshape(-1)[self.unpack_index]

    def gather_response(self, values: Tensor) -> list[Tensor]:
        """[n, L] per-position values -> per-row [response_len] tensors (response positions only)."""
        return gather_response(values, self.prompt_lens, self.response_lens)


def gather_response(values: Tensor, prompt_lens: Sequence[int], response_lens: Sequence[int]) -> list[Tensor]:
    """[b, s] per-position values of a micro-batch -> per-row [response_len] tensors."""
    return [values[r, p - 1:p - 1 + n] for r, (p, n) in enumerate(zip(prompt_lens, response_lens, strict=True))]


def padded_length(longest: int, pad_to: int) -> int:
    """Sequence length of a micro-batch whose longest row has `longest` tokens: the next multiple of
    pad_to (the TP size under sequence parallelism, which splits s over the TP ranks)."""
    return -(-longest // pad_to) * pad_to


def packed_length(lengths: Sequence[int], pad_to: int) -> int:
    """Length T of a packed micro-batch: the sum of its rows' lengths, rounded up to a multiple of pad_to."""
    return padded_length(sum(lengths), pad_to)


def _row_tensors(rows: Sequence[TrainSample], s: int) -> dict[str, Tensor]:
    """Right-padded [n, s] tokens, targets and loss-side tensors of `rows`."""
    b = len(rows)
    tokens = torch.zeros(b, s, dtype=torch.long)
    targets = torch.zeros(b, s, dtype=torch.long)
    response_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask = torch.zeros(b, s, dtype=torch.float32)
    old = torch.zeros(b, s, dtype=torch.float32)
    for r, row in enumerate(rows):
        ids = torch.tensor(row.tokens, dtype=torch.long)
        n, p = len(row.tokens), row.prompt_len
        tokens[r, :n] = ids
        targets[r, :n - 1] = ids[1:]
        # logits at positions p-1 .. n-2 predict the response tokens p .. n-1
        response_mask[r, p - 1:n - 1] = True
        loss_mask[r, p - 1:n - 1] = 1.0 if row.loss_mask is None else row.loss_mask.float()
        if row.old_log_probs is not None:
            old[r, p - 1:n - 1] = row.old_log_probs.float()
    with_ref = [row.ref_log_probs is not None for row in rows]
    if any(with_ref) and not all(with_ref):
        raise ValueError(f"{with_ref.count(False)} of {b} samples of a micro-batch lack ref_log_probs: the KL term "
                         f"needs the reference model's log-probs of every sample")
    is_weights = _response_values(rows, s, "is_weights", fill=1.0)
    ref = _response_values(rows, s, "ref_log_probs", fill=0.0)
    token_adv = _response_values(rows, s, "token_advantages", fill=0.0)
    return dict(tokens=tokens, targets=targets, response_mask=response_mask, loss_mask=loss_mask,
                old_log_probs=old, is_weights=is_weights, ref_log_probs=ref, token_advantages=token_adv)


def _response_values(rows: Sequence[TrainSample], s: int, name: str, *, fill: float) -> Tensor | None:
    """[n, s] fp32: each row's per-response-token `name` ([response_len]) at the positions that predict its response
    tokens, `fill` elsewhere (and in rows without any); None when no row has them."""
    if all(getattr(row, name) is None for row in rows):
        return None
    out = torch.full((len(rows), s), fill, dtype=torch.float32)
    for r, row in enumerate(rows):
        if (values := getattr(row, name)) is not None:
            out[r, row.prompt_len - 1:len(row.tokens) - 1] = values.float()
    return out


def _row_fields(rows: Sequence[TrainSample]) -> dict:
    return dict(
        has_old=torch.tensor([row.old_log_probs is not None for row in rows], dtype=torch.bool),
        advantages=torch.tensor([float(row.advantage) for row in rows], dtype=torch.float32),
        response_lens=[row.response_len for row in rows],
        prompt_lens=[row.prompt_len for row in rows],
    )


def build_micro_batch(samples: Sequence[TrainSample], indices: list[int], *, causal_mask: bool = True,
                      pad_to: int = 1) -> MicroBatch:
    """Padded tensors of samples[indices], s a multiple of pad_to; causal_mask=False leaves
    attention_mask None (TE path)."""
    rows = [samples[i] for i in indices]
    b, s = len(rows), padded_length(max(len(r.tokens) for r in rows), pad_to)
    return MicroBatch(
        indices=list(indices),
        position_ids=torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous(),
        attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1) if causal_mask else None,
        **_row_tensors(rows, s), **_row_fields(rows),
    )


def block_causal_mask(cu_seqlens: Tensor) -> Tensor:
    """[1, 1, T, T] bool, True = masked: position i attends to j iff j <= i within i's segment."""
    total = int(cu_seqlens[-1])
    seg = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().long())
    pos = torch.arange(total)
    allowed = (seg[:, None] == seg[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def build_packed_micro_batch(samples: Sequence[TrainSample], indices: list[int], *, causal_mask: bool = True,
                             pad_to: int = 1) -> MicroBatch:
    """samples[indices] packed into one [1, T] row, T = packed_length (trailing pad tokens form a segment
    of their own); causal_mask=False leaves attention_mask None (TE path: cu_seqlens only).

    Host memory: 5 x T int64/fp32 values plus the [n, L] loss side; the local spec's block-diagonal mask
    is T^2 bytes (a CPU-test path; TE never gets one).
    """
    rows = [samples[i] for i in indices]
    lengths = [len(r.tokens) for r in rows]
    total, longest = packed_length(lengths, pad_to), max(lengths)
    padded = _row_tensors(rows, longest)
    segments = lengths + ([total - sum(lengths)] if total > sum(lengths) else [])
    cu = torch.zeros(len(segments) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(segments), 0)
    valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]  # [n, L]
    tokens = torch.zeros(1, total, dtype=torch.long)
    targets = torch.zeros(1, total, dtype=torch.long)
    tokens[0, :sum(lengths)] = padded["tokens"][valid]
    targets[0, :sum(lengths)] = padded["targets"][valid]
    starts = cu[:len(rows)].long()
    # padding positions of row r point at its last token (masked out of the loss anyway)
    offsets = torch.minimum(torch.arange(longest)[None, :], torch.tensor(lengths)[:, None] - 1)
    position_ids = torch.cat([torch.arange(n) for n in segments]).unsqueeze(0)
    return MicroBatch(
        indices=list(indices), tokens=tokens, position_ids=position_ids,
        attention_mask=block_causal_mask(cu) if causal_mask else None, targets=targets,
        response_mask=padded["response_mask"], loss_mask=padded["loss_mask"],
        old_log_probs=padded["old_log_probs"], is_weights=padded["is_weights"],
        ref_log_probs=padded["ref_log_probs"], token_advantages=padded["token_advantages"], **_row_fields(rows),
        unpack_index=starts[:, None] + offsets,
        cu_seqlens=cu, max_seqlen=max(segments),
    )


def iter_micro_batches(samples: Sequence[TrainSample], groups: Sequence[list[int]], *, causal_mask: bool = True,
                       pad_to: int = 1, packed: bool = False) -> Iterator[MicroBatch]:
    """Build each group's MicroBatch only when the pipeline asks for it (host memory: one micro-batch)."""
    build = build_packed_micro_batch if packed else build_micro_batch
    for g in groups:
        yield build(samples, g, causal_mask=causal_mask, pad_to=pad_to)


def build_micro_batches(samples: Sequence[TrainSample], *, max_tokens: int | None, micro_batch_size: int,
                        causal_mask: bool = True, packed: bool = False) -> list[MicroBatch]:
    """All micro-batches at once (tests and small runs; the actor iterates lazily)."""
    groups = plan_micro_batches([len(s.tokens) for s in samples], max_tokens=max_tokens,
                                micro_batch_size=micro_batch_size, packed=packed)
    return list(iter_micro_batches(samples, groups, causal_mask=causal_mask, packed=packed))
