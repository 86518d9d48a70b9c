"""MegatronActor: DDP-wrapped GPTModel + megatron optimizer/scheduler; log-prob forward and DAPO step.

Both paths run through megatron's `get_forward_backward_func` (no pipelining, 1F1B under PP, or
interleaved 1F1B over model chunks under --num-layers-per-virtual-pipeline-stage) on
dynamically sized micro-batches. The train step returns the DAPO loss as (numerator, token count)
with `calculate_per_token_loss=True`, so megatron divides the gradients once by the tokens summed
over every micro-batch and every DP rank: the token-mean loss is exactly that of the whole mini-batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import ClassVar

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.utils import get_model_config
from torch import Tensor

from megatron_dapo.actor.batching import (
    MicroBatch,
    gather_response,
    iter_micro_batches,
    packed_length,
    padded_length,
    plan_micro_batches,
)
from megatron_dapo.actor.config import STEP_METRICS, ActorConfig, TrainSample
from megatron_dapo.actor.logprob import linear_token_log_probs, token_log_probs
from megatron_dapo.actor.moe_replay import ReplayState, routing_inputs
from megatron_dapo.actor.moe_stats import install_router_hooks
from megatron_dapo.algorithm.kl import kl_loss_term
from megatron_dapo.checkpoint.state import ShardedState
from megatron_dapo.distributed import comm
from megatron_dapo.distributed.parallel import (
    ParallelLayout,
    micro_batch_group_size,
    schedulable_micro_batches,
    validate_layout,
)
from megatron_dapo.errors import UserError
from megatron_dapo.models.gpt import build_gpt_model
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.spec import resolve_transformer_impl
from megatron_dapo.weights.load import mapped_tensors, unwrap
from megatron_dapo.weights.mapping import canonical_mcore_name


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def moe_overrides(arch: ModelArch, config: ActorConfig) -> dict[str, object]:
    """TransformerConfig fields of an MoE actor from its flags: the aux-loss coefficient (config.json's by
    default; 0 switches the loss off) and the expert capacity (dropless by default)."""
    coeff = arch.router_aux_loss_coef if config.moe_aux_loss_coeff is None else config.moe_aux_loss_coeff
    fields: dict[str, object] = {"moe_aux_loss_coeff": coeff,
                                 "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none"}
    if config.moe_expert_capacity_factor is not None:
        fields["moe_expert_capacity_factor"] = config.moe_expert_capacity_factor
    return fields


class MegatronActor:
    """This rank's stage/shard of the policy, its optimizer and LR schedule."""

    checkpoint_state: ClassVar[ShardedState] = ShardedState()
    """Checkpointed as the checkpoint's sharded part (dist_checkpointing, checkpoint/training.py): the model chunks,
    the optimizer, the LR scheduler and each rank's RNG, each rank its shard."""

    def __init__(self, arch: ModelArch, config: ActorConfig, layout: ParallelLayout, *, frozen: bool = False
                 ) -> None:
        """`frozen`: a model that only computes log-probs (the reference model, --ref-load): the same layout and
        modules, no gradients, no DDP buffers, no optimizer or LR schedule: its bf16 / fp32 weights alone in
        memory (a trainable actor adds grads and fp32 main params and Adam moments); `train_step` refuses."""
        validate_layout(arch, layout)
        config.check_model(arch)  # MoE-only flags on a dense model are refused, not ignored
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError("MegatronActor needs parallel state: call "
                               "megatron_dapo.actor.init_parallel(layout) first")
        world = (parallel_state.get_tensor_model_parallel_world_size(),
                 parallel_state.get_pipeline_model_parallel_world_size(),
                 parallel_state.get_data_parallel_world_size())
        if world != (layout.tp, layout.pp, layout.dp):
            raise ValueError(f"layout (tp, pp, dp)={(layout.tp, layout.pp, layout.dp)} differs from the "
                             f"initialised parallel state {world}")
        if layout.cp > 1:
            raise ValueError("--context-parallel-size > 1: the actor does not split micro-batches along the "
                             "sequence over CP ranks yet (the planner models CP); use --context-parallel-size 1")
        self.arch, self.config, self.layout = arch, config, layout
        self.transformer_impl = resolve_transformer_impl(layout.transformer_impl)
        if dist.get_rank() == 0:
            print(f"[megatron-dapo] decoder layers: {self.transformer_impl} "
                  f"({'requested' if layout.transformer_impl else 'default'}; --transformer-impl)")
        # variable_seq_lengths: every micro-batch has its own [b, s]; PP stages exchange shapes first.
        # (megatron rejects it with the default MoE dispatcher even for dense models, hence alltoall.)
        variable = {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}
        if layout.pp == 1:
            variable = {}
        # --num-layers-per-virtual-pipeline-stage: one GPTModel chunk per virtual stage (Megatron-LM's
        # get_model); chunk c of PP rank r holds layer_range(num_layers, layout, r, c).
        vpp = layout.virtual_stages(arch.num_layers)
        if vpp > 1:
            # Megatron-LM's p2p setting for interleaving: forward and backward exchanges as separate
            # calls (the shape exchange of a combined 4-way call pairs a grad with an activation at PP=2).
            variable.update(overlap_p2p_comm=True, batch_p2p_comm=False)
        if arch.is_moe:
            variable.update(moe_overrides(arch, config))
        modules = [build_gpt_model(arch, params_dtype=config.torch_params_dtype, calculate_per_token_loss=True,
                                   use_te=self.transformer_impl == "transformer_engine", layout=layout,
                                   vp_stage=c if vpp > 1 else None, **variable) for c in range(vpp)]
        if layout.overlap_param_gather and not config.use_distributed_optimizer:
            raise ValueError("--overlap-param-gather needs --use-distributed-optimizer")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=layout.overlap_grad_reduce,
            overlap_param_gather=layout.overlap_param_gather,
            use_distributed_optimizer=config.use_distributed_optimizer,
        )
        self.frozen = frozen
        if frozen:
            for m in modules:  # train mode kept: the same forward as the actor's compute_log_probs
                m.requires_grad_(False)
            self.chunks, self.optimizer, self.scheduler, self.steps = modules, None, None, 0
            self._install_routing(modules)
            return
        # Megatron-LM buckets only the first chunk's grads separately (its overlap trigger).
        self.chunks = [DistributedDataParallel(config=m.config, ddp_config=ddp_config, module=m,
                                               disable_bucketing=c > 0) for c, m in enumerate(modules)]
        # What megatron's training loop wires: grad sync + the 1 / (global token count) scaling.
        no_sync = self.chunks[0].no_sync if vpp == 1 else [chunk.no_sync for chunk in self.chunks]
        for m in modules:
            m.config.no_sync_func = no_sync
            m.config.finalize_model_grads_func = finalize_model_grads
        bf16 = config.torch_params_dtype == torch.bfloat16
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=config.min_lr, weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
            clip_grad=config.clip_grad, use_distributed_optimizer=config.use_distributed_optimizer,
            bf16=bf16, params_dtype=config.torch_params_dtype,
        ), self.chunks)
        # Counts rollout steps, not optimizer steps: num_steps = the last rollout step trained (0 before the
        # first), so rollout step k trains at lr * k / warmup during warmup (see train_step's rollout_step).
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=config.lr, min_lr=config.min_lr,
            lr_warmup_steps=config.lr_warmup_steps,
            lr_decay_steps=config.lr_decay_steps or config.lr_warmup_steps + 1,
            lr_decay_style=config.lr_decay_style, start_wd=config.weight_decay, end_wd=config.weight_decay,
            wd_incr_steps=1, wd_incr_style="constant",
        )
        self.steps = 0
        self._install_routing(modules)

    def _install_routing(self, modules: list[torch.nn.Module]) -> None:
        """MoE: rollout routing replay, routing agreement and router statistics (actor/moe_replay.py,
        moe_stats.py); None for a dense model."""
        self._routing = self._router_stats = None
        arch, layout = self.arch, self.layout
        if arch.is_moe:
            self._routing = ReplayState(replay=self.config.moe_routing_replay,
                                        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                        tp_size=layout.tp, sequence_parallel=layout.sp)
            self._router_stats = install_router_hooks(modules, self._routing, num_layers=arch.num_layers,
                                                      num_experts=arch.num_experts, topk=arch.num_experts_per_tok)

    @property
    def model(self) -> DistributedDataParallel:
        """The DDP-wrapped stage; an interleaved layout has several: use `chunks`."""
        if len(self.chunks) > 1:
            raise RuntimeError("MegatronActor.model: --num-layers-per-virtual-pipeline-stage gives this rank "
                               f"{len(self.chunks)} model chunks; use MegatronActor.chunks")
        return self.chunks[0]

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel stage (stage-local layer numbers, this TP rank's shards); one chunk only."""
        return unwrap(self.model)

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The unwrapped GPTModel chunks of this rank, virtual stage order (one without VPP)."""
        return [unwrap(chunk) for chunk in self.chunks]  # frozen: the modules themselves

    # ---- data plumbing -------------------------------------------------------------------------
    def _micro_batches(self, samples: list[TrainSample]) -> list[list[int]]:
        """This rank's micro-batch plan (index groups); every DP rank gets the same count.

        The greedy count is max-reduced over the DP group (one int64) and ranks below it halve their
        fullest micro-batches, so no DP rank's pipeline idles through extra micro-batches of another.
        """
        if not samples:
            raise ValueError("MegatronActor got no samples for this DP rank: give every rank at least one")
        lengths = [len(s.tokens) for s in samples]
        plan = dict(max_tokens=self.config.max_tokens_per_micro_batch, micro_batch_size=self.config.micro_batch_size,
                    packed=self.config.pack_sequences)
        groups = plan_micro_batches(lengths, **plan)
        if self.layout.dp > 1:
            count = torch.tensor([len(groups)], dtype=torch.int64, device=_device())
            comm.all_reduce(count, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
            groups = plan_micro_batches(lengths, **plan, num_micro_batches=int(count.item()))
        if len(self.chunks) > 1 and (target := schedulable_micro_batches(self.layout, len(groups))) != len(groups):
            # megatron-core's interleaved schedule runs micro-batches in groups (micro_batch_group_size); same
            # lengths and count on every DP rank, so they all agree.
            groups = plan_micro_batches(lengths, **plan, num_micro_batches=target)
            if len(groups) != target:
                raise ValueError(f"--num-layers-per-virtual-pipeline-stage needs {target} micro-batches here (the "
                                 f"interleaved schedule's groups of {micro_batch_group_size(self.layout, target)} at "
                                 f"--pipeline-model-parallel-size {self.layout.pp}), but {len(samples)} samples on "
                                 f"this DP rank split into at most {len(groups)}: give each DP rank at least "
                                 f"{target} samples or drop the interleaved pipeline")
        return groups

    def _run(self, samples: list[TrainSample], groups: list[list[int]], loss_fn, *, forward_only: bool
             ) -> list[dict[str, Tensor]]:
        device = _device()
        # TE's causal kernel reads no mask; the local spec needs the explicit [1, 1, s, s] one (packed:
        # block-diagonal). Sequence parallelism splits s over the TP ranks: pad it to a multiple of TP.
        pad_to = self.layout.tp if self.layout.sp else 1
        packed, te = self.config.pack_sequences, self.transformer_impl == "transformer_engine"
        def batches():
            return iter_micro_batches(samples, groups, causal_mask=not te, pad_to=pad_to, packed=packed)

        def forward_step(data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
            mb = next(data_iterator).to(device)
            extra = {}
            if packed and te:  # THD: attention and RoPE restart at every cu_seqlens offset
                extra["packed_seq_params"] = PackedSeqParams(
                    qkv_format="thd", cu_seqlens_q=mb.cu_seqlens, cu_seqlens_kv=mb.cu_seqlens,
                    max_seqlen_q=mb.max_seqlen, max_seqlen_kv=mb.max_seqlen)
            module = unwrap(model)
            if self._routing is not None:
                self._routing.set_micro_batch(*routing_inputs(
                    samples, mb.indices, mb.tokens, cu_seqlens=mb.cu_seqlens, num_layers=self.arch.num_layers,
                    topk=self.arch.num_experts_per_tok, num_experts=self.arch.num_experts,
                    moe_layers=self.arch.moe_layers), device=device)
            with self._rope_per_row(module, mb if packed and not te else None), self._hidden_output(module):
                # last stage: logits [b, s, V/tp], or hidden [b, s, h] with --fused-linear-logprob
                output = model(mb.tokens, mb.position_ids, mb.attention_mask, **extra)
            return output, partial(loss_fn, mb)

        if packed:
            seq_length, rows = max(packed_length([len(samples[i].tokens) for i in g], pad_to) for g in groups), 1
        else:
            seq_length = padded_length(max(len(samples[i].tokens) for g in groups for i in g), pad_to)
            rows = max(len(g) for g in groups)
        # Interleaved: one iterator per chunk, each yielding the same micro-batches in order.
        iterators = batches() if len(self.chunks) == 1 else [batches() for _ in self.chunks]
        if len(self.chunks) > 1:  # the interleaved schedule's group size, decided by the layout for this count
            group = micro_batch_group_size(self.layout, len(groups))
            for chunk in self.chunks:
                get_model_config(chunk).microbatch_group_size_per_vp_stage = group
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iterators, model=self.chunks,
            num_microbatches=len(groups), seq_length=seq_length, micro_batch_size=rows, forward_only=forward_only,
        )

    @contextmanager
    def _rope_per_row(self, module: torch.nn.Module, mb: MicroBatch | None):
        """Local spec, packed: RoPE angles of each token's own position id (megatron-core's bshd RoPE would
        number the [1, T] row 0..T-1 across row boundaries). RoPE scores depend only on q - k offsets, which
        the block-diagonal mask keeps within a row, so this changes rounding, not maths: the angles stay as
        small as in the padded run (fp32 angle error grows with the position). No-op for mb=None."""
        rope = getattr(module, "rotary_pos_emb", None)
        if mb is None or rope is None:
            yield
            return
        positions = mb.position_ids[0]

        def per_token(max_seq_len: int, *args, **kwargs) -> Tensor:
            emb = type(rope).forward(rope, max_seq_len, *args, **kwargs)  # [T, 1, 1, dim]
            return emb.index_select(0, positions)

        rope.forward = per_token
        try:
            yield
        finally:
            del rope.forward

    @contextmanager
    def _hidden_output(self, module: torch.nn.Module):
        """--fused-linear-logprob: the last stage's output layer returns its input (TP-replicated hidden
        states, gathered from the SP shards) instead of logits; `_token_log_probs` applies the weight."""
        layer = getattr(module, "output_layer", None)
        if not self.config.fused_linear_logprob or layer is None or not module.post_process:
            yield
            return

        def passthrough(hidden: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
            if layer.sequence_parallel:  # backward: this rank's slice of d hidden, already summed over TP
                hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            return hidden, None

        layer.forward = passthrough
        try:
            yield
        finally:
            del layer.forward

    def _output_weight(self) -> Tensor:
        """This TP rank's [V/tp, h] output weight, as GPTModel._postprocess picks it (tied: the embedding)."""
        m = self.modules[-1]  # the chunk with the head (the last virtual stage)
        return m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight

    def _token_log_probs(self, mb: MicroBatch, output: Tensor, *, compute_entropy: bool):
        """(log-probs, entropy or None) in the loss-side [n, L] layout from the last stage's output."""
        if self.config.fused_linear_logprob:
            logp, entropy = linear_token_log_probs(output, self._output_weight(), mb.targets,
                                                   vocab_size=self.arch.vocab_size, compute_entropy=compute_entropy)
        else:
            logp, entropy = token_log_probs(output, mb.targets, vocab_size=self.arch.vocab_size,
                                            use_fused=self.config.use_fused_logprob, compute_entropy=compute_entropy)
        return mb.unpack(logp), mb.unpack(entropy)

    # ---- forward only ------------------------------------------------------------------------------
    @torch.no_grad()
    def compute_log_probs(self, samples: list[TrainSample], *, with_entropy: bool = False
                          ) -> list[Tensor] | tuple[list[Tensor], list[Tensor]]:
        """Per-sample [response_len] fp32 log-probs (and entropies) of the response tokens.

        Computed on the last PP stage and broadcast to every rank of the pipeline (TP ranks agree).
        """
        groups = self._micro_batches(samples)
        if self._routing is not None:
            self._routing.begin(training=False)

        def loss_fn(mb: MicroBatch, logits: Tensor):
            logp, entropy = self._token_log_probs(mb, logits, compute_entropy=with_entropy)
            out = {"logp": logp.float()}
            if entropy is not None:
                out["entropy"] = entropy.float()
            return torch.zeros((), device=logits.device), torch.ones((), dtype=torch.int), out

        outputs = self._run(samples, groups, loss_fn, forward_only=True)
        keys = ("logp", "entropy") if with_entropy else ("logp",)
        lens = [s.response_len for s in samples]
        flat = torch.zeros(len(keys), sum(lens), dtype=torch.float32, device=_device())
        if parallel_state.is_pipeline_last_stage():
            per_sample: list[list[Tensor | None]] = [[None] * len(samples) for _ in keys]
            for group, out in zip(groups, outputs, strict=True):
                rows = [samples[i] for i in group]
                spans = ([r.prompt_len for r in rows], [r.response_len for r in rows])
                for k, key in enumerate(keys):
                    for i, values in zip(group, gather_response(out[key], *spans), strict=True):
                        per_sample[k][i] = values
            flat = torch.stack([torch.cat(rows) for rows in per_sample])  # type: ignore[arg-type]
        if self.layout.pp > 1:
            comm.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        split = [list(row.cpu().split(lens)) for row in flat]
        return (split[0], split[1]) if with_entropy else split[0]

    # ---- train -------------------------------------------------------------------------------------
    def _loss_fn(self, mb: MicroBatch, logits: Tensor):
        logp, entropy = self._token_log_probs(mb, logits, compute_entropy=True)
        old = torch.where(mb.has_old.unsqueeze(-1), mb.old_log_probs, logp.detach())
        # --policy-loss (algorithm/registry.py), chosen when the config was built
        loss = self.config.loss
        out = loss.fn(logp, old, mb.loss_advantages, mb.loss_mask, loss, entropy=entropy, is_weights=mb.is_weights)
        if undeclared := sorted(out.metrics.keys() - set(loss.metrics)):  # train_step reduces the declared ones only
            raise UserError(f"--policy-loss {loss.name!r} returned metrics {undeclared} that it does not declare "
                            f"(it declares {loss.metrics}): they would not be logged; name every metric it reports "
                            "in register_policy_loss(metrics=...) or, for a dotted path, in the function's `metrics` "
                            "attribute")
        # megatron sums this int count over micro-batches and DP ranks and scales grads by 1 / total.
        metrics = {k: v.detach() for k, v in out.metrics.items()}
        loss_sum = out.loss_sum
        if self.config.kl is not None:  # beta x KL(pi_theta || pi_ref), on the loss's own denominator
            if mb.ref_log_probs is None:
                raise ValueError("the KL term (--kl-coef) needs each sample's ref_log_probs (the reference model's, "
                                 "--ref-load); this micro-batch has none")
            kl_sum, kl_den, metrics["kl"] = kl_loss_term(logp, mb.ref_log_probs, mb.loss_mask, self.config.kl,
                                                         self.config.kl_agg_mode)
            if float(kl_den) != float(out.denominator):
                raise RuntimeError(f"the KL term's denominator ({float(kl_den):g}, {self.config.kl_agg_mode}) differs "
                                   f"from --policy-loss {loss.name!r}'s ({float(out.denominator):g})")
            loss_sum = loss_sum + kl_sum
        return loss_sum, out.denominator.round().to(torch.int), metrics

    def train_step(self, samples: list[TrainSample], *, rollout_step: int | None = None) -> dict[str, float]:
        """One optimizer step on this DP rank's share of a mini-batch; token-exact metrics over DP.

        `rollout_step` (1-based) is the training step this mini-batch belongs to: the LR schedule counts
        rollout steps, so every mini-batch of rollout step k trains at the same lr (lr * k / warmup while
        k <= --lr-warmup-steps). None makes this call a rollout step of its own (one update per step).
        Returns the loss's declared metrics but 'tokens' (`PolicyLossConfig.metrics`; every registered loss's:
        pg_loss, clipfrac_high, clipfrac_low, clipfrac_dual, approx_kl, ratio, entropy) as token means over the
        whole mini-batch, num_tokens, grad_norm, lr, update_successful; MoE models add the
        router statistics of actor/moe_stats.py (moe/aux_loss, moe/tokens_per_expert_*, moe/dropped_tokens,
        and moe/routing_agreement of the compute_log_probs calls since the last train_step).
        """
        if self.frozen:
            raise RuntimeError("MegatronActor.train_step on a frozen model (the reference model): it has no "
                               "optimizer")
        groups = self._micro_batches(samples)
        if self._routing is not None:
            self._router_stats.reset()
            self._routing.begin(training=True)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule_rollout_step(rollout_step)
        outputs = self._run(samples, groups, self._loss_fn, forward_only=False)
        update_successful, grad_norm, _ = self.optimizer.step()
        self.steps += 1
        # the configured loss's token sums: the same names, in the same order, on every rank (one all-reduce each)
        keys = self.config.metric_keys
        sums = torch.zeros(len(keys), dtype=torch.float64, device=_device())
        if parallel_state.is_pipeline_last_stage():
            for out in outputs:
                for k, key in enumerate(keys):
                    if key in out:
                        sums[k] += out[key].double()
        if self.layout.pp > 1:  # only the last stage holds loss metrics
            comm.all_reduce(sums, group=parallel_state.get_pipeline_model_parallel_group())
        if self.layout.dp > 1:
            comm.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        totals = dict(zip(keys, sums.tolist(), strict=True))
        tokens = totals.pop("tokens")
        metrics = {key: (value / tokens if tokens > 0 else 0.0) for key, value in totals.items()}
        step = (tokens, float(grad_norm) if grad_norm is not None else 0.0,
                float(self.optimizer.param_groups[0]["lr"]), float(update_successful))
        metrics.update(zip(STEP_METRICS, step, strict=True))
        if self._routing is not None:
            self._routing.training = False
            metrics.update(self._router_stats.metrics(
                moe_layers=list(self.arch.moe_layers), num_layers=self.arch.num_layers, num_micro_batches=len(groups),
                aux_loss_on=self.chunks[0].module.config.moe_aux_loss_coeff > 0,
                capacity=self.config.moe_expert_capacity_factor is not None,
                replicated_tp=1 if self.layout.sp else self.layout.tp))
        return metrics

    def _schedule_rollout_step(self, rollout_step: int | None) -> None:
        """Move the LR scheduler to `rollout_step` (it never goes back; a resume restores its count)."""
        current = self.scheduler.num_steps
        target = current + 1 if rollout_step is None else rollout_step
        if target < max(current, 1):
            raise ValueError(f"train_step(rollout_step={rollout_step}): the LR schedule is already at rollout "
                             f"step {current}; rollout steps are 1-based and never go back")
        if target > current:
            self.scheduler.step(increment=target - current)

    # ---- weights -----------------------------------------------------------------------------------
    def state_dict_for_export(self, chunk: int = 0) -> dict[str, Tensor]:
        """This TP rank's shards (detached, on the model's device) under local-spec names.

        Names are stage-local and canonical (weights/mapping.py): a Transformer Engine spec model's
        fused norms (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`) come out as
        `input_layernorm.weight` / `pre_mlp_layernorm.weight`, so both specs export the same keys.
        `chunk`: which model chunk under --num-layers-per-virtual-pipeline-stage (names local to it).
        """
        return {canonical_mcore_name(name, self.arch): p.detach()
                for name, p in mapped_tensors(self.modules[chunk], self.arch)}

    @torch.no_grad()
    def load_shards(self, shards: Mapping[str, Tensor], chunk: int = 0, *, reload: bool = True) -> None:
        """Copy this rank's shards (stage-local local-spec names, as `iter_mcore_shards` yields and
        `state_dict_for_export` returns) into the model, whichever layer spec (local or TE) it uses.

        Every parameter must be given with its exact shape; the optimizer's main params are refreshed
        (`reload=False` defers that, when loading several chunks). `chunk`: the model chunk under
        --num-layers-per-virtual-pipeline-stage; its shards are `weights.plan.stage_tensors(..., chunk=chunk)`'s
        (its layers: `distributed.parallel.layer_range`).
        """
        params = {canonical_mcore_name(name, self.arch): p
                  for name, p in mapped_tensors(self.modules[chunk], self.arch)}
        missing, unexpected = sorted(set(params) - set(shards)), sorted(set(shards) - set(params))
        if missing or unexpected:
            raise KeyError(f"load_shards: missing {missing}, unexpected {unexpected}")
        for name, p in params.items():
            if tuple(shards[name].shape) != tuple(p.shape):
                raise ValueError(f"load_shards: {name} has shape {tuple(shards[name].shape)}, the model "
                                 f"expects {tuple(p.shape)}")
            p.copy_(shards[name])
        if reload:
            self.reload_main_params()

    def reload_main_params(self) -> None:
        """The weights changed outside the optimizer: refresh its fp32 main params from them (a frozen model has
        none)."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()
