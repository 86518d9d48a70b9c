"""Rollout routing replay (R3, arXiv 2510.11370) and the router-induced rollout/actor mismatch.

An MoE policy's log-prob depends on which experts each token is routed to, and the routing is a discrete
top-k that flips under tiny numerical differences: the inference engine (SGLang, bf16, other kernels) and the
training forward route a sizeable fraction of (token, layer) pairs to different expert sets, which makes
pi_rollout and pi_train differ far more than in a dense model. Replay (--moe-routing-replay) makes the
training forward use the rollout's expert ids for every token that has them (TrainSample.routed_experts);
the routing *weights* stay the router's own scores at those experts, so the router is still trained:

- norm_topk_prob (megatron moe_router_pre_softmax=False): weights = softmax over the k chosen logits;
- moe_router_pre_softmax=True: weights = softmax over all E logits, gathered at the chosen experts.

Both come out of megatron-core's own `topk_routing_with_score_function` (moe_utils.py:608): it calls
`router.router_replay.get_replay_topk(scores, k, ..., default_compute_topk)` for the top-k step, with
`scores` the logits (pre_softmax=False) or the softmax (pre_softmax=True), and applies the score function to
what that returns. `ReplayTopK` is that object: it computes the router's own top-k, replaces the rows that
have a rollout routing, and gathers the scores there (differentiable: gradients reach the router through
the chosen logits). megatron's own `RouterReplay` replays whole batches only; ours keeps the router's choice
for tokens without a row (each sample's last token, padding) and measures the agreement on the others.

Token order. A router sees its MoE layer's input [s, b, h] (under sequence parallelism the TP rank's slice
[s/tp, b, h]) flattened s-major, token n = s_i * b + b_i; `replay_table` lays the micro-batch's ids out in
that order, and `ReplayTopK` slices this TP rank's part under SP. Layers are global (layer_number - 1), so
PP stages and virtual chunks read their own layers' columns. Routing happens before the token dispatch, so
expert parallelism needs nothing more.

--recompute-granularity full: megatron's CheckpointFunction runs the layer's forward under no_grad and runs
it again inside backward. The recomputed forward must route as the first one did, or the gradient belongs to
another network. In training, a no_grad forward pushes the ids it used on a per-layer queue and the
recomputation (detected as a forward inside the autograd engine) pops them; micro-batches are recomputed in
their forward order (1F1B and interleaved schedules run each chunk's backwards in forward order), and each
layer of a micro-batch once. Tested against the run without recompute (tests/unit/actor/test_actor_moe_replay.py).

Cost at Qwen3-30B-A3B (48 MoE layers, top-8, 128 experts), a 24,576-token micro-batch: the table is
24,576 x 48 x 8 int16 = 18.9 MB on the device per micro-batch (host: the samples' own uint8/int rows); per
layer a top-k over [T, 128] that the router computes anyway, one [T, 8] gather and a [T, 8] compare.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_dapo.actor.config import TrainSample

NO_ROUTE = -1
"""Table entry of a token without a rollout routing: the router's own top-k is used."""


def replay_table(samples: Sequence[TrainSample], indices: Sequence[int], tokens: Tensor, *,
                 cu_seqlens: Tensor | None, num_layers: int, topk: int, num_experts: int,
                 moe_layers: Sequence[int]) -> Tensor | None:
    """[s * b, num_layers, topk] int16 expert ids of a micro-batch in the routers' token order (s-major over
    the model-side [b, s] `tokens`), NO_ROUTE where a token has none; None when no row has routed_experts.

    Padded micro-batch: row r's token i is at (i, r); packed ([1, T]): at cu_seqlens[r] + i. Raises
    ValueError naming the sample when its ids do not fit the model (layers, top-k, expert range)."""
    rows = [samples[i] for i in indices]
    if all(r.routed_experts is None for r in rows):
        return None
    b, s = tokens.shape
    table = torch.full((s, b, num_layers, topk), NO_ROUTE, dtype=torch.int16)
    for r, (index, row) in enumerate(zip(indices, rows, strict=True)):
        routed = row.routed_experts
        if routed is None:
            continue
        if tuple(routed.shape[1:]) != (num_layers, topk):
            raise ValueError(f"sample {index}: routed_experts has [num_layers, top_k] = {tuple(routed.shape[1:])}, "
                             f"the model has ({num_layers}, {topk})")
        ids = routed.to(torch.int64)
        used = ids[:, list(moe_layers)]  # dense layers' rows are never read
        if used.numel() and not (int(used.min()) >= 0 and int(used.max()) < num_experts):
            raise ValueError(f"sample {index}: routed_experts holds ids outside [0, {num_experts}) in an MoE layer")
        if cu_seqlens is None:
            table[:len(ids), r] = ids.to(torch.int16)
        else:
            start = int(cu_seqlens[r])
            table[start:start + len(ids), 0] = ids.to(torch.int16)
    return table.reshape(s * b, num_layers, topk)


def routing_inputs(samples: Sequence[TrainSample], indices: Sequence[int], tokens: Tensor, *,
                   cu_seqlens: Tensor | None, num_layers: int, topk: int, num_experts: int,
                   moe_layers: Sequence[int]) -> tuple[Tensor | None, Tensor]:
    """(replay_table, [s * b] bool real-token mask) of a micro-batch, both in the routers' token order."""
    b, s = tokens.shape
    lengths = torch.tensor([len(samples[i].tokens) for i in indices])
    if cu_seqlens is None:
        valid = torch.arange(s)[:, None] < lengths[None, :]  # [s, b]
    else:
        valid = (torch.arange(s) < int(lengths.sum()))[:, None]  # [T, 1]
    table = replay_table(samples, indices, tokens, cu_seqlens=cu_seqlens, num_layers=num_layers, topk=topk,
                         num_experts=num_experts, moe_layers=moe_layers)
    return table, valid.reshape(-1)


def same_expert_set(a: Tensor, b: Tensor) -> Tensor:
    """[n] bool: rows of the [n, k] id tensors a and b hold the same set of experts (order ignored)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


class ReplayState:
    """What the routers of one actor read during a forward: the current micro-batch's table and how to
    slice it, whether to replay, and the agreement counts. Owned by the actor; one per actor."""

    def __init__(self, *, replay: bool, tp_rank: int, tp_size: int, sequence_parallel: bool) -> None:
        self.replay = replay
        self.tp_rank, self.tp_size, self.sequence_parallel = tp_rank, tp_size, sequence_parallel
        self.table: Tensor | None = None
        self.valid: Tensor | None = None
        """[s * b] bool: the micro-batch's real (not padding) tokens, router order."""
        self.training = False
        """True inside train_step: enables the recompute queues."""
        self.agreement = torch.zeros(2, dtype=torch.float64)
        """(token, MoE layer) pairs whose own top-k set equals the rollout's, and pairs that had a rollout
        routing, counted in forwards outside backward since the last `take_agreement` (this rank's routers)."""
        self.hooks: list[ReplayTopK] = []

    def set_micro_batch(self, table: Tensor | None, valid: Tensor, device: torch.device) -> None:
        """The micro-batch the next forward runs (moved to the device once, not once per layer)."""
        self.table = None if table is None else table.to(device, non_blocking=True)
        self.valid = valid.to(device, non_blocking=True)

    def begin(self, *, training: bool) -> None:
        """Start a forward pass over a batch (clears recompute queues a failed step may have left)."""
        self.training = training
        for hook in self.hooks:
            hook.recompute_queue.clear()

    def slice_rows(self, values: Tensor, num_tokens: int) -> Tensor:
        """The [num_tokens, ...] part of a micro-batch-wide [s * b, ...] tensor a router sees (its SP slice
        under sequence parallelism)."""
        total = values.shape[0]
        if num_tokens == total:
            return values
        if self.sequence_parallel and num_tokens * self.tp_size == total:
            return values[self.tp_rank * num_tokens:(self.tp_rank + 1) * num_tokens]
        raise RuntimeError(f"MoE router saw {num_tokens} tokens, the micro-batch has {total} "
                           f"(TP {self.tp_size}, sequence parallel {self.sequence_parallel})")

    def take_agreement(self) -> Tensor:
        """[agreeing, compared] since the last call (this rank), then reset."""
        counts, self.agreement = self.agreement, torch.zeros(2, dtype=torch.float64)
        return counts


def in_backward() -> bool:
    """True while the autograd engine runs (a checkpointed layer's recomputed forward)."""
    return torch._C._current_graph_task_id() != -1


class ReplayTopK:
    """megatron-core's `router.router_replay` hook of one TopKRouter (global layer `layer`): the top-k step
    of `topk_routing_with_score_function`, with the rollout's ids where the table has them."""

    def __init__(self, state: ReplayState, layer: int) -> None:
        self.state, self.layer = state, layer
        self.recompute_queue: deque[Tensor | None] = deque()
        state.hooks.append(self)

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups=None, group_topk=None, default_compute_topk=None
                        ) -> tuple[Tensor, Tensor]:
        state = self.state
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if in_backward():  # recomputation: route exactly as this micro-batch's first forward did
            if not self.recompute_queue:
                raise RuntimeError(f"routing replay: layer {self.layer} is recomputed in backward but recorded no "
                                   "forward; --recompute-granularity full needs the forward under train_step")
            chosen = self.recompute_queue.popleft()
            if chosen is None:
                return own_scores, own
            return scores.gather(1, chosen), chosen
        chosen = None
        if state.table is not None:
            rows = state.slice_rows(state.table, scores.shape[0])[:, self.layer].long()  # [n, k]
            has = rows[:, 0] != NO_ROUTE
            if not state.training:  # the log-prob recompute: the rollout's policy, before any update
                same = same_expert_set(own, rows) & has
                counts = torch.stack([same.sum(), has.sum()]).double()  # no host sync on a GPU
                state.agreement = state.agreement.to(counts.device) + counts
            if state.replay:
                chosen = torch.where(has[:, None], rows, own)
        if state.training and not torch.is_grad_enabled():  # a checkpointed forward: keep for the recompute
            self.recompute_queue.append(chosen)
        if chosen is None:
            return own_scores, own
        return scores.gather(1, chosen), chosen
