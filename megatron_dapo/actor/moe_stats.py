"""Per-step MoE router statistics of a train_step: the load-balancing loss and tokens per expert.

- `moe/aux_loss`: megatron-core's Switch load-balancing loss without its coefficient, per MoE layer
  E * sum_i f_i P_i with f_i = (tokens routed to expert i) / (T * topk) and P_i = the mean over tokens of
  softmax(logits)_i (switch_load_balancing_loss_func; 1.0 = perfectly balanced, E / topk at worst), averaged
  over the MoE layers and the micro-batches, as Megatron-LM's `track_moe_metrics` reports it (moe_utils.py:955:
  summed over PP stages and the TP x CP group, averaged over DP). The loss added to the gradient is
  --moe-aux-loss-coeff (default: config.json's router_aux_loss_coef) times this, per layer and micro-batch;
  HF's Qwen3-MoE value is topk x this per layer and combines layers differently (docs/MODELS.md). Absent when
  the coefficient is 0 (megatron-core then neither computes nor applies it).
  Note: megatron scales it by the micro-batch's router tokens (padding included) and megatron divides by the
  loss tokens (response tokens): the effective coefficient is coeff x T_router / T_loss (actor.py).
- `moe/tokens_per_expert_max`, `moe/tokens_per_expert_mean`, `moe/tokens_per_expert_max_over_mean`: real
  (not padding) tokens each expert received in one MoE layer, after capacity dropping, summed over the step's
  micro-batches and all ranks; max and mean over (MoE layer, expert). mean = T x topk / E when nothing drops.
- `moe/dropped_tokens` (--moe-expert-capacity-factor only): (token, expert) assignments dropped by the
  capacity limit, summed over the MoE layers and the step.

Counted by a forward hook on each TopKRouter (its output routing_map [n, E], after replay and dropping); a
recomputed forward inside backward is not counted twice. Cost at Qwen3-30B-A3B: a [T, 128] bool column sum
per layer and micro-batch, a [48, 128] fp64 buffer per rank (48 KiB), and per step one all-reduce of
48 x 128 + 1 fp64 values (49 KiB) over all ranks plus megatron's [48] aux-loss reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils

from megatron_dapo.actor.moe_replay import ReplayState, in_backward
from megatron_dapo.distributed import comm

AUX_LOSS_NAME = "load_balancing_loss"
"""megatron-core's tracker key of the Switch aux loss (router.py _apply_aux_loss)."""


class RouterStats:
    """Tokens per expert and dropped assignments of one actor's routers, per step (forward hooks)."""

    def __init__(self, state: ReplayState, *, num_layers: int, num_experts: int, topk: int) -> None:
        self.state, self.topk = state, topk
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self.dropped = torch.zeros(1, dtype=torch.float64)

    def hook(self, layer: int):
        """A forward hook for the TopKRouter of global layer `layer` (returns None: output unchanged)."""
        def count(module, args: tuple, output) -> None:
            state = self.state
            if not state.training or in_backward() or state.valid is None:
                return
            routing_map = output[1]  # [n, E] bool, after dropping
            valid = state.slice_rows(state.valid, routing_map.shape[0])
            kept = routing_map[valid].sum(dim=0).double()
            self.counts = self.counts.to(kept.device)
            self.dropped = self.dropped.to(kept.device)
            self.counts[layer] += kept
            self.dropped += valid.sum() * self.topk - kept.sum()
        return count

    def reset(self) -> None:
        self.counts.zero_()
        self.dropped.zero_()
        moe_utils.clear_aux_losses_tracker()

    def metrics(self, *, moe_layers: list[int], num_layers: int, num_micro_batches: int, aux_loss_on: bool,
                capacity: bool, replicated_tp: int) -> dict[str, float]:
        """The step's metrics (every rank gets the same values; collective over all ranks), including
        `moe/routing_agreement` when forwards since the last call compared samples' routed_experts.

        replicated_tp: how many TP ranks route the same tokens (TP without sequence parallelism, else 1)."""
        agreement = self.state.take_agreement()
        flat = torch.cat([self.counts.flatten().cpu(), self.dropped.cpu(), agreement.cpu()])
        comm.all_reduce(flat)
        flat /= replicated_tp
        agree, compared = float(flat[-2]), float(flat[-1])
        flat = flat[:-2]
        counts = flat[:-1].view_as(self.counts)[moe_layers]
        out = {"moe/tokens_per_expert_max": float(counts.max()), "moe/tokens_per_expert_mean": float(counts.mean())}
        out["moe/tokens_per_expert_max_over_mean"] = (out["moe/tokens_per_expert_max"] /
                                                      out["moe/tokens_per_expert_mean"]
                                                      if out["moe/tokens_per_expert_mean"] > 0 else 0.0)
        if compared > 0:
            out["moe/routing_agreement"] = agree / compared
        if capacity:
            out["moe/dropped_tokens"] = float(flat[-1])
        if aux_loss_on:
            out["moe/aux_loss"] = reduced_aux_loss(num_layers, len(moe_layers)) / num_micro_batches
        self.reset()
        return out


def reduced_aux_loss(num_layers: int, num_moe_layers: int) -> float:
    """Mean over MoE layers of the tracker's per-layer aux loss / coeff (summed over micro-batches), reduced
    as megatron-core's reduce_aux_losses_tracker_across_ranks does: sum over PP, sum over the TP x CP group
    (each rank's value is its tokens' share), average over DP. A stage without MoE layers never wrote the
    tracker: it joins the same collectives with zeros."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    entry = tracker.get(AUX_LOSS_NAME)
    values = (entry["values"] if entry is not None else torch.zeros(num_layers)).detach().cpu().double()
    comm.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    comm.all_reduce(values, group=parallel_state.get_tensor_and_context_parallel_group())
    dp = parallel_state.get_data_parallel_group(with_context_parallel=False)
    comm.all_reduce(values, group=dp)
    values /= dist.get_world_size(dp)
    return float(values.sum()) / num_moe_layers


def install_router_hooks(modules: list[torch.nn.Module], state: ReplayState, *, num_layers: int, num_experts: int,
                         topk: int) -> RouterStats:
    """Give every TopKRouter of `modules` (this rank's model chunks) a ReplayTopK (its global layer:
    layer_number - 1) and a statistics forward hook; chosen once, when the actor is built."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_dapo.actor.moe_replay import ReplayTopK

    stats = RouterStats(state, num_layers=num_layers, num_experts=num_experts, topk=topk)
    for module in modules:
        for router in (m for m in module.modules() if isinstance(m, TopKRouter)):
            if router.config.moe_router_fusion or router.routing_type == "sinkhorn":
                raise ValueError("MoE router hooks need megatron-core's unfused top-k routing (moe_router_fusion "
                                 "off, no sinkhorn): the fused TE kernel has no replay hook")
            layer = router.layer_number - 1
            router.router_replay = ReplayTopK(state, layer)
            router.register_forward_hook(stats.hook(layer))
    return stats
