"""What one GPU of each pipeline stage holds in training: the plan's table (`plan_stages`).

Static memory (per pipeline stage, this TP rank's shards): weights in --params-dtype, the mcore DDP grad
buffer in fp32 (grad_reduce_in_fp32), and Adam state (fp32 main params + two moments; sharded over DP x CP
with --use-distributed-optimizer).

Pipeline (1F1B): stage i of p holds min(p - i, M) micro-batches in flight, so stage 0 holds p.
Interleaved 1F1B (--num-layers-per-virtual-pipeline-stage, v chunks of L / (p v) layers per stage):
megatron-core's schedule runs 2 (p - i - 1) + (v - 1) g warm-up chunk-forwards on stage i, g the schedule's
micro-batch group size (distributed.parallel.micro_batch_group_size: p, depth-first), so it holds that + 1
chunk-micro-batches (capped by M v); on stage 0 at g = p that is L (1 + (p - 1) / (p v)) layers' worth,
Korthikanti et al. 2022 section 4.2.3's interleaved factor. Embedding / head extras stay per micro-batch.
An uneven pipeline (--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers) changes only which
layers a stage holds (`stage_layers`, from `layer_range`): each stage's weights and activations are its own layer
count's, its in-flight count the same p - i (Qwen2.5-32B at TP8 x PP3 as 20/24/20 layers: the first stage's three
micro-batches over 20 layers, not 24).

Weights are counted off the family's name table for the Transformer Engine layout (stage_parameters): MLA's down
projections and latent norms whole on every TP rank, DeepSeek-V3's expert bias (a buffer) not at all.
Mixture of experts (Qwen3-MoE, DeepSeek-V3): expert weights, fp32 grads and Adam state are this rank's E / EP experts
of each MoE layer of its stage, each 1 / ETP of 3 h I (stage_expert_parameters); the distributed optimizer shards them
over expert-DP (TP x CP x DP / (ETP x EP)), not DP. The router (E x h) and the shared experts count with the dense
part. An MoE layer saves
the router's tensors per local token and, per routed token copy, its hidden state and the expert's fc1 / SwiGLU /
prob products (moe_layer_bytes, measured on CPU at EP1); copies per rank = local tokens x k x ETP x a factor: 1 at
EP1, the capacity factor, or MOE_DROPLESS_IMBALANCE (2, assumed and printed) for the busiest EP rank when dropless.
One layer's dispatcher buffers (moe_dispatch_buffer_bytes) sit next to the recompute working set. Qwen3-30B-A3B at
TP1 x EP8 x 32 GPUs, 24576-token micro-batches, full recompute: 58.1 GiB per 80 GB GPU (experts 30.4 GiB of it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_dapo.distributed.parallel import (
    ParallelLayout,
    layer_range,
    micro_batch_group_size,
    padded_vocab_size,
    validate_layout,
)
from megatron_dapo.models.family import MappingEntry
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.planner.activations import (
    ActivationSpec,
    layer_activation_bytes,
    logits_bytes,
    micro_batch_extra_bytes,
    moe_dispatch_buffer_bytes,
    recompute_input_bytes,
)

GIB = 1 << 30
FRAMEWORK_OVERHEAD_GIB = 2.0
"""Assumed, not modelled: CUDA context (~0.5 GiB), NCCL buffers, cuBLAS/TE workspaces, allocator slack."""
HEADROOM = 0.10
"""Launchers keep the planned peak under (1 - HEADROOM) x --gpu-memory-gib."""
MOE_DROPLESS_IMBALANCE = 2.0
"""Assumed: without --moe-expert-capacity-factor (dropless) the busiest EP rank receives this many times the
mean number of routed tokens in a micro-batch (load-balancing loss on; the per-step router statistics, tokens
per expert max / mean, show the real value). At EP1 a rank holds every expert and receives exactly T x k."""


def stage_layers(arch: ModelArch, layout: ParallelLayout, stage: int) -> list[list[int]]:
    """Global layer indices of each model chunk pipeline `stage` holds (one chunk without VPP; `layer_range`)."""
    return [list(layer_range(arch.num_layers, layout, stage, c)) for c in range(layout.virtual_stages(arch.num_layers))]


def shard_parameters(entry: MappingEntry, arch: ModelArch, tp: int) -> int:
    """Elements of one TP rank's shard of `entry`: whole when replicated (norms, the router, MLA's duplicated down
    projections), the vocab rows padded to 128 x TP then split, every other kind 1 / TP (`tp`: the expert-TP size
    for an expert entry)."""
    kind = entry.kind
    if kind == "replicated":
        return entry.numel(arch)
    if kind == "vocab":
        return padded_vocab_size(arch.vocab_size, tp) // tp * arch.hidden_size
    return entry.numel(arch) // tp


def stage_expert_parameters(arch: ModelArch, layout: ParallelLayout, stage: int) -> int:
    """Expert parameters this rank holds on pipeline `stage`: E / EP routed experts of every MoE layer, each split
    over ETP (the router and shared experts are not expert parameters). Qwen3-30B-A3B at EP8, ETP1:
    48 x 16 x 3 x 2048 x 768 = 3.62B."""
    if not arch.is_moe:
        return 0
    n_moe = sum(arch.is_moe_layer(i) for chunk in stage_layers(arch, layout, stage) for i in chunk)
    per_expert = sum(shard_parameters(e, arch, layout.expert_tp) for e in arch.family.mapping
                     if e.per_expert and e.present(arch))
    return n_moe * arch.num_experts // layout.ep * per_expert


def stage_parameters(arch: ModelArch, layout: ParallelLayout, stage: int) -> int:
    """Parameters this rank holds on pipeline `stage` in a Transformer Engine model, read off the family's name
    table: each tensor's TP shard (`shard_parameters`: norms, the router and MLA's down projections whole, the rest
    split over TP) times the stage's layers that hold it, the embedding on the first stage, the final norm and head
    on the last (a tied head too when the embedding lives on another stage), plus stage_expert_parameters. Buffers
    (DeepSeek-V3's expert bias) are not counted. DeepSeek-V3 at TP8: its q / kv down projections, 7168 x (1536 + 576)
    per layer = 15.1M, sit whole on every rank (0.92B over the 61 layers)."""
    layers = [i for chunk in stage_layers(arch, layout, stage) for i in chunk]
    first, last = stage == 0, stage == layout.pp - 1
    head = not arch.tie_word_embeddings or layout.pp > 1  # a tied copy when the embedding lives on another stage
    n = 0
    for entry in arch.family.mapping:
        if not entry.present(arch) or entry.buffer or entry.per_expert:
            continue
        if entry.stage == "layer":
            copies = sum(entry.in_layer(arch, i) for i in layers)
        else:
            copies = first if entry.stage == "first" else last and (head or not entry.tied_hf)
        n += copies * shard_parameters(entry, arch, layout.tp)
    return n + stage_expert_parameters(arch, layout, stage)


@dataclass(frozen=True, kw_only=True)
class PlanInputs:
    """Everything the plan depends on besides the architecture and layout."""

    tokens_per_micro_batch: int
    """--max-tokens-per-micro-batch (padded tokens of the largest micro-batch)."""
    max_seq_len: int
    """Longest row: --max-prompt-length + --max-response-length (capped by the budget)."""
    params_dtype: str = "bfloat16"
    use_distributed_optimizer: bool = True
    fused_logprob: bool = True
    packed: bool = False
    """--pack-sequences: tokens_per_micro_batch real tokens in one row (s = T for row-length terms)."""
    fused_linear_logprob: bool = False
    """--fused-linear-logprob: no [tokens, V/tp] logits on the last stage (see logits_bytes)."""
    num_micro_batches: int | None = None
    """Micro-batches per step per DP rank; None = at least pp (1F1B's steady state)."""
    gpu_memory_gib: float = 80.0
    sglang_gib: float = 0.0
    """What SGLang holds during the training phase: 0 on separate GPUs, SGLANG_RELEASED_GIB colocated."""
    colocate: bool = False
    """--colocate: the actor and an SGLang engine shard share every GPU (two phases; see colocated.py)."""
    rollout_gpus_per_engine: int = 1
    """--rollout-num-gpus-per-engine: GPUs (= SGLang TP ranks) of one engine."""
    mem_fraction_static: float | None = None
    """--mem-fraction-static given by the user (validated), or None (computed from the plan)."""
    moe_capacity_factor: float | None = None
    """--moe-expert-capacity-factor: a hard cap on each expert's tokens (None: dropless)."""
    moe_imbalance: float = MOE_DROPLESS_IMBALANCE
    """Dropless MoE at EP > 1: the busiest EP rank's routed tokens over the mean (assumed)."""
    reference: bool = False
    """--ref-load: a frozen reference model on the actor's layout, its weights in params_dtype beside the actor's
    (actor/reference.py); its forward-only pass runs before training, so it adds no activations at the peak."""
    teacher: ModelArch | None = None
    """--teacher-load: the distillation teacher's architecture (its own; frozen on the actor's layout, weights only,
    as the reference); None: none."""

    @property
    def moe_factor(self) -> float:
        """The routed-token factor of moe_routed_tokens at EP > 1: the capacity factor, else the assumed imbalance."""
        return self.moe_capacity_factor if self.moe_capacity_factor is not None else self.moe_imbalance

    def __post_init__(self) -> None:
        check_gpu_memory(self.gpu_memory_gib)
        if self.rollout_gpus_per_engine < 1:
            raise ValueError(f"--rollout-num-gpus-per-engine must be >= 1, got {self.rollout_gpus_per_engine}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")


def check_gpu_memory(gib: float) -> None:
    """Raise ValueError naming --gpu-memory-gib unless it is a finite number of GiB > 0: the plan's verdict and
    headroom divide by it, and a colocated run sizes SGLang's share (--mem-fraction-static) from it."""
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be a finite number of GiB > 0, got {gib!r}")


@dataclass(frozen=True)
class StagePlan:
    stage: int
    in_flight: int
    """Micro-batches whose activations this stage holds at its peak (1F1B)."""
    lines: dict[str, float]
    """Component -> bytes; keys starting with two spaces are details of the next line, not summed."""

    @property
    def total(self) -> float:
        return sum(v for k, v in self.lines.items() if not k.startswith("  "))


def moe_factor(layout: ParallelLayout, inputs: PlanInputs) -> float:
    """The routed-token factor the plan uses (moe_routed_tokens): 1 at EP1 (the rank holds every expert and gets
    exactly T x k copies; a capacity factor below 1 caps that), else the capacity factor or the assumed
    dropless imbalance (PlanInputs.moe_factor)."""
    if layout.ep == 1:
        return min(1.0, inputs.moe_capacity_factor or 1.0)
    return inputs.moe_factor


def _stage_activations(arch: ModelArch, layout: ParallelLayout, stage: int, *, dense: float, moe: float,
                       kept: float) -> tuple[float, float]:
    """(bytes of one model chunk's layers per micro-batch, recompute working set) of pipeline `stage`, given one
    dense and one MoE layer's bytes and a full-recompute unit's kept input. Chunks of a mixed model differ: the
    stage's mean chunk (VPP) and its largest recompute unit."""
    def of(layers: list[int]) -> float:
        n_moe = sum(arch.is_moe_layer(i) for i in layers)
        return (len(layers) - n_moe) * dense + n_moe * moe if n_moe else len(layers) * dense

    def mean(values: list[float]) -> float:
        return values[0] if len(set(values)) == 1 else sum(values) / len(values)

    chunks = stage_layers(arch, layout, stage)
    n = len(chunks[0])
    if layout.recompute_granularity != "full":
        return mean([of(c) for c in chunks]), 0.0
    unit = layout.layers_recomputed_per_unit
    if layout.recompute_method == "uniform":
        units = [c[i:i + unit] for c in chunks for i in range(0, n, unit)]
        return (n // unit) * kept, max(of(u) for u in units)
    recomputed = min(unit, n)  # block: the first n layers of each chunk are recomputed, the others keep everything
    rest = mean([of(c[recomputed:]) for c in chunks])
    working = max(of([i]) for c in chunks for i in c[:recomputed]) if recomputed else 0.0
    return recomputed * kept + rest, working


def _static_lines(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, stage: int) -> dict[str, float]:
    """Weights, fp32 grads and Adam state of pipeline `stage` (this rank's share): the dense part, then the experts."""
    pbytes = 2 if inputs.params_dtype == "bfloat16" else 4
    opt_per_param = 12 if pbytes == 2 else 8  # fp32 main params (bf16 only) + Adam exp_avg, exp_avg_sq
    opt_shards = layout.dp * layout.cp if inputs.use_distributed_optimizer else 1
    # expert parameters are replicated over the expert-DP group only, and the distributed optimizer shards them there
    expert_shards = layout.expert_dp if inputs.use_distributed_optimizer else 1
    experts = stage_expert_parameters(arch, layout, stage)
    params = stage_parameters(arch, layout, stage) - experts
    lines = {
        f"weights ({inputs.params_dtype})": params * pbytes,
        "grads (fp32 DDP buffer)": params * 4.0,
        f"optimizer (fp32 Adam{' + main params' if pbytes == 2 else ''}, /{opt_shards})":
            params * opt_per_param / opt_shards,
    }
    if arch.is_moe:
        lines |= {
            f"expert weights ({arch.num_experts // layout.ep} of {arch.num_experts} per layer, "
            f"/{layout.expert_tp} ETP)": experts * pbytes,
            "expert grads (fp32 DDP buffer)": experts * 4.0,
            f"expert optimizer (/{expert_shards} expert-DP)": experts * opt_per_param / expert_shards,
        }
    if inputs.reference:  # weights only: no grads, no optimizer state
        lines[f"reference model weights (frozen, {inputs.params_dtype})"] = (params + experts) * pbytes
    if inputs.teacher is not None:
        try:
            validate_layout(inputs.teacher, layout)
        except ValueError as err:
            raise ValueError(f"--teacher-load: its {inputs.teacher.model_type} on the actor's layout: {err}") from err
        lines[f"teacher model weights (frozen, {inputs.params_dtype}, {inputs.teacher.model_type} "
              f"{inputs.teacher.num_layers} layers)"] = stage_parameters(inputs.teacher, layout, stage) * pbytes
    return lines


def _in_flight(layout: ParallelLayout, inputs: PlanInputs, stage: int, vpp: int) -> tuple[int, int]:
    """(micro-batches, chunk-micro-batches) whose activations pipeline `stage` holds at its peak under 1F1B
    (interleaved: see the module doc; the two are equal without VPP), capped by the step's micro-batches."""
    in_flight = layout.pp - stage
    group = micro_batch_group_size(layout, inputs.num_micro_batches)
    chunks = in_flight if vpp == 1 else 2 * (layout.pp - stage - 1) + (vpp - 1) * group + 1
    if inputs.num_micro_batches is not None:
        in_flight = min(in_flight, inputs.num_micro_batches)
        chunks = min(chunks, inputs.num_micro_batches * vpp)
    return in_flight, chunks


def plan_stages(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec
                ) -> list[StagePlan]:
    """Bytes per component on each pipeline stage (this rank's share)."""
    validate_layout(arch, layout)
    tokens = inputs.tokens_per_micro_batch
    s = tokens if inputs.packed else min(inputs.max_seq_len, tokens)
    vpp = layout.virtual_stages(arch.num_layers)
    full = layout.recompute_granularity == "full"
    selective = layout.recompute_granularity == "selective"
    layer = layer_activation_bytes(spec, layout, tokens=tokens, seq_len=s, selective=selective)
    factor = moe_factor(layout, inputs) if arch.is_moe else None
    moe_layer = layer if factor is None else layer_activation_bytes(spec, layout, tokens=tokens, seq_len=s,
                                                                   selective=selective, moe_factor=factor)
    kept = recompute_input_bytes(spec, layout, tokens=tokens)
    plans = []
    for stage in range(layout.pp):
        first, last = stage == 0, stage == layout.pp - 1
        per_mb_layers, working = _stage_activations(arch, layout, stage, dense=layer, moe=moe_layer, kept=kept)
        in_flight, chunks = _in_flight(layout, inputs, stage, vpp)
        extra = micro_batch_extra_bytes(spec, layout, tokens=tokens, seq_len=s, first=first, last=last,
                                        recompute=full)
        per_mb = vpp * per_mb_layers + extra
        p2p = 0.0 if layout.pp == 1 else 2 * recompute_input_bytes(spec, layout, tokens=tokens)
        lines = _static_lines(arch, layout, inputs, stage)
        lines |= {
            "  activations per micro-batch": per_mb,
            "activations in flight (1F1B)": chunks * per_mb_layers + in_flight * extra,
            "recompute working set": working,
        }
        if arch.is_moe:
            lines["MoE dispatcher buffers (one layer, transient)"] = moe_dispatch_buffer_bytes(
                spec, layout, tokens=tokens, factor=factor)
        lines |= {
            "logits + grad (last stage)": logits_bytes(
                arch, layout, tokens=tokens, bytes_per_element=spec.bytes_per_element,
                fused_logprob=inputs.fused_logprob, fused_linear=inputs.fused_linear_logprob) if last else 0.0,
            "pipeline p2p buffers": p2p,
            "SGLang (colocated, released)" if inputs.colocate else "SGLang (not colocated)": inputs.sglang_gib * GIB,
            "CUDA context, NCCL, workspaces (assumed)": FRAMEWORK_OVERHEAD_GIB * GIB,
        }
        plans.append(StagePlan(stage, in_flight, lines))
    return plans


FROZEN_PREFIXES = ("reference model weights", "teacher model weights")
"""The plan's lines of the frozen models (--ref-load, --teacher-load): resident in training, offloaded while a
colocated run generates."""


def frozen_bytes(plan: StagePlan) -> float:
    """A stage's frozen models' weights (the reference's and the teacher's), 0 without them."""
    return sum(v for k, v in plan.lines.items() if k.startswith(FROZEN_PREFIXES))


def static_bytes(plan: StagePlan, kind: str) -> float:
    """A stage's 'weights', 'grads' or 'optimizer' bytes, dense and expert lines together."""
    return sum(v for k, v in plan.lines.items() if k.startswith((kind, "expert " + kind)))


def peak_gib(plans: list[StagePlan]) -> float:
    return max(p.total for p in plans) / GIB

