"""The one place a parallel layout (TP, PP, CP, DP, SP, EP, recompute) is checked against a model.

Errors name the flag to change, so a launcher typo is caught before any process group exists. The same
ParallelLayout feeds parallel_state (dist_init), the TransformerConfig (models/config.py), the actor's
DDP config and the memory planner (planner/); `layer_range` says which layers a pipeline stage (and each of its
virtual chunks) holds, for all of them; see docs/PARALLELISM.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_dapo.flag_field import flag_field
from megatron_dapo.models.hf_config import ModelArch

VOCAB_DIVISIBLE_BY = 128
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = (None, "uniform", "block")
TRANSFORMER_IMPLS = (None, "transformer_engine", "local")


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """A parallel layout: the sizes of each parallel dimension and the memory/overlap options that go with them.

    Every field but dp is declared with the flag that sets it (`flag_field`): its help, choices and default live
    here, and arguments.py's "parallelism" group and startup.py's reading of it are built from these fields."""

    tp: int = flag_field("--tensor-model-parallel-size", default=1, type=int)
    pp: int = flag_field("--pipeline-model-parallel-size", default=1, type=int)
    dp: int = 1
    """data-parallel size = world size / (tp * pp * cp)"""
    layers_per_virtual_stage: int | None = flag_field(
        "--num-layers-per-virtual-pipeline-stage", default=None, type=int,
        help="interleaved pipeline (Megatron's VPP): each PP rank holds num_layers / (PP x this) model chunks; "
             "needs --pipeline-model-parallel-size > 1")
    """Each PP rank holds num_layers / (pp * this) model chunks (`virtual_stages`); None: one chunk per PP rank."""
    cp: int = flag_field("--context-parallel-size", default=1, type=int,
                         help="split each sequence over this many ranks (ring attention; TransformerEngine only)")
    ep: int = flag_field("--expert-model-parallel-size", default=1, type=int,
                         help="MoE models: split each layer's experts over this many ranks (experts / this each); "
                              "EP x expert-TP must divide TP x CP x DP")
    etp: int | None = flag_field("--expert-tensor-parallel-size", default=None, type=int,
                                 help="MoE models: split each expert's linears over this many ranks (default: the TP "
                                      "size, megatron-core's default)")
    """None: the TP size. The expert grid etp x ep x expert-DP x pp covers the same world as tp x cp x dp x pp."""
    sp: bool = flag_field("--sequence-parallel", default=False, action="store_true",
                          help="shard norm/residual activations along the sequence over the TP ranks (needs TP > 1)")
    recompute_granularity: str | None = flag_field(
        "--recompute-granularity", default=None, choices=RECOMPUTE_GRANULARITIES[1:],
        help="activation recomputation: full (whole layers; with --recompute-method) or selective (core attention "
             "only)")
    recompute_method: str | None = flag_field(
        "--recompute-method", default=None, choices=RECOMPUTE_METHODS[1:],
        help="full recompute: uniform (every layer, in units of --recompute-num-layers) or block (the first "
             "--recompute-num-layers layers of each stage)")
    recompute_num_layers: int | None = flag_field(
        "--recompute-num-layers", default=None, type=int,
        help="layers per recompute unit (uniform) or recomputed per stage (block); default 1")
    overlap_grad_reduce: bool = flag_field(
        "--overlap-grad-reduce", default=False, action="store_true",
        help="overlap the DP gradient reduce(-scatter) with the backward pass (mcore DDP)")
    overlap_param_gather: bool = flag_field(
        "--overlap-param-gather", default=False, action="store_true",
        help="overlap the distributed optimizer's parameter all-gather with the next forward")
    transformer_impl: str | None = flag_field(
        "--transformer-impl", default=None, choices=TRANSFORMER_IMPLS[1:],
        help="decoder layer implementation; default: transformer_engine on CUDA (required: it fails when TE does "
             "not import), local (megatron-core's torch spec) without CUDA")

    def __post_init__(self) -> None:
        for name, flag in (("tp", "--tensor-model-parallel-size"), ("pp", "--pipeline-model-parallel-size"),
                           ("cp", "--context-parallel-size"), ("dp", "data-parallel size")):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer, got {value!r}")
        if self.sp and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it shards activations "
                             "over the TP ranks); drop --sequence-parallel or raise the TP size")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity must be one of {RECOMPUTE_GRANULARITIES[1:]}, "
                             f"got {self.recompute_granularity!r}")
        if self.recompute_method not in RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method must be one of {RECOMPUTE_METHODS[1:]}, "
                             f"got {self.recompute_method!r}")
        if self.recompute_granularity == "full" and self.recompute_method is None:
            raise ValueError("--recompute-granularity full needs --recompute-method uniform or block")
        if self.recompute_granularity != "full" and (self.recompute_method is not None
                                                     or self.recompute_num_layers is not None):
            raise ValueError("--recompute-method / --recompute-num-layers only apply to "
                             "--recompute-granularity full")
        if self.recompute_num_layers is not None and self.recompute_num_layers < 1:
            raise ValueError(f"--recompute-num-layers must be >= 1, got {self.recompute_num_layers}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl must be one of {TRANSFORMER_IMPLS[1:]}, "
                             f"got {self.transformer_impl!r}")
        if self.transformer_impl == "local" and self.cp > 1:
            raise ValueError("--context-parallel-size > 1 needs TransformerEngine attention; megatron-core's "
                             "local spec has no ring attention: drop --transformer-impl local or use "
                             "--context-parallel-size 1")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"--expert-model-parallel-size must be a positive integer, got {self.ep!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ValueError(f"--expert-tensor-parallel-size must be a positive integer, got {self.etp!r}")
        if (self.tp * self.cp * self.dp) % (self.expert_tp * self.ep):
            raise ValueError(
                f"--expert-model-parallel-size ({self.ep}) x --expert-tensor-parallel-size ({self.expert_tp}) = "
                f"{self.ep * self.expert_tp} must divide the {self.tp * self.cp * self.dp} ranks of a pipeline stage "
                f"(--tensor-model-parallel-size {self.tp} x --context-parallel-size {self.cp} x data-parallel "
                f"{self.dp}): megatron-core lays the experts over the same ranks as the attention")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (megatron-core's rule)")
        if self.layers_per_virtual_stage is not None:
            if not isinstance(self.layers_per_virtual_stage, int) or self.layers_per_virtual_stage < 1:
                raise ValueError("--num-layers-per-virtual-pipeline-stage must be a positive integer, got "
                                 f"{self.layers_per_virtual_stage!r}")
            if self.pp == 1:
                raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1 "
                                 "(it interleaves model chunks over the pipeline ranks)")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in use (--expert-tensor-parallel-size, default the TP size)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: replicas of each expert (ranks of a stage / (etp x ep))."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    def virtual_stages(self, num_layers: int) -> int:
        """Model chunks per PP rank (Megatron's virtual_pipeline_model_parallel_size); 1 without VPP."""
        if self.layers_per_virtual_stage is None:
            return 1
        if num_layers % (self.pp * self.layers_per_virtual_stage):
            raise ValueError(
                f"num_hidden_layers ({num_layers}) is not divisible by --pipeline-model-parallel-size "
                f"({self.pp}) x --num-layers-per-virtual-pipeline-stage ({self.layers_per_virtual_stage})")
        return num_layers // (self.pp * self.layers_per_virtual_stage)

    @property
    def layers_recomputed_per_unit(self) -> int:
        """recompute_num_layers with Megatron's default of 1 when full recompute leaves it unset."""
        return self.recompute_num_layers or 1

    def transformer_config_fields(self) -> dict[str, Any]:
        """The TransformerConfig fields this layout sets (sizes, SP, recompute)."""
        fields: dict[str, Any] = dict(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp, sequence_parallel=self.sp,
            recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
            recompute_num_layers=(self.layers_recomputed_per_unit if self.recompute_granularity == "full"
                                  else None),
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.expert_tp,
        )
        return fields

    @classmethod
    def from_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, **options: Any
                   ) -> ParallelLayout:
        """Derive dp from the world size; raise naming the flags when it does not divide.

        `options` are the remaining fields (sp, recompute_*, overlap_*)."""
        if world_size % (tp * pp * cp):
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}); change the process "
                "count or the layout"
            )
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // (tp * pp * cp), **options)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Smallest multiple of divisible_by * tp that holds vocab_size (Megatron's rule)."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def validate_layout(arch: ModelArch, layout: ParallelLayout) -> None:
    """Raise ValueError naming the flag when `arch` cannot be split over `layout`."""
    if arch.num_heads % layout.tp:
        raise ValueError(
            f"num_attention_heads ({arch.num_heads}) is not divisible by --tensor-model-parallel-size "
            f"({layout.tp})"
        )
    if arch.num_kv_heads % layout.tp:
        raise ValueError(
            f"num_key_value_heads ({arch.num_kv_heads}) is not divisible by --tensor-model-parallel-size "
            f"({layout.tp}); GQA query groups cannot be split across more TP ranks than there are groups"
        )
    if not arch.all_layers_moe and arch.intermediate_size % layout.tp:
        raise ValueError(
            f"intermediate_size ({arch.intermediate_size}) is not divisible by "
            f"--tensor-model-parallel-size ({layout.tp})"
        )
    _validate_experts(arch, layout)
    stage_layers = len(layer_range(arch.num_layers, layout, 0))  # layers of one model chunk (every chunk's count)
    if layout.recompute_granularity == "full":
        n = layout.layers_recomputed_per_unit
        if n > stage_layers or (layout.recompute_method == "uniform" and stage_layers % n):
            raise ValueError(
                f"--recompute-num-layers ({n}) must be <= the {stage_layers} layers of a pipeline stage"
                + (" and divide them (--recompute-method uniform)" if layout.recompute_method == "uniform" else "")
            )


def layer_range(num_layers: int, layout: ParallelLayout, pp_rank: int, chunk: int = 0) -> range:
    """Global indices of the decoder layers that model chunk `chunk` of pipeline rank `pp_rank` holds: the one
    derivation of "which layers a stage holds" (megatron-core's get_transformer_layer_offset and
    get_num_layers_to_build), for the layout check, the memory planner and the weight plan alike.

    The layers are cut into pp x v equal runs, v = layout.virtual_stages(num_layers) chunks per rank (1 without
    --num-layers-per-virtual-pipeline-stage), and chunk c of rank r holds run c x pp + r: 8 layers at PP2 x VPP2
    put [0, 1] and [4, 5] on rank 0, [2, 3] and [6, 7] on rank 1. Raises ValueError naming the flags when the
    layers do not cut evenly."""
    if num_layers % layout.pp:
        raise ValueError(
            f"num_hidden_layers ({num_layers}) is not divisible by --pipeline-model-parallel-size ({layout.pp})"
        )
    vpp = layout.virtual_stages(num_layers)
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{layout.pp - 1}")
    if not 0 <= chunk < vpp:
        raise ValueError(f"chunk {chunk} is outside 0..{vpp - 1}")
    per_chunk = num_layers // (layout.pp * vpp)
    start = (chunk * layout.pp + pp_rank) * per_chunk
    return range(start, start + per_chunk)


def micro_batch_group_size(layout: ParallelLayout, num_micro_batches: int | None) -> int:
    """Micro-batches each model chunk runs back to back under the interleaved (VPP) 1F1B schedule of a step with
    `num_micro_batches` (None: not known yet): megatron-core's microbatch_group_size_per_vp_stage. The schedule is
    decided here alone: the actor hands it to megatron-core each step, rounds its micro-batch count with
    `schedulable_micro_batches`, and the planner counts the activations in flight from it.

    PP: the depth-first schedule (megatron-core's default), the fewest micro-batches in flight."""
    return layout.pp


def schedulable_micro_batches(layout: ParallelLayout, count: int) -> int:
    """The smallest micro-batch count >= `count` that megatron-core's interleaved schedule runs with this layout's
    group size G (`micro_batch_group_size`): PP <= G <= M, and the last group either full or of at least PP
    micro-batches (M % G == 0 or M % G >= PP). Without VPP, `count` itself."""
    if layout.layers_per_virtual_stage is None:
        return count
    m = max(count, 1)
    while True:
        g = micro_batch_group_size(layout, m)
        if layout.pp <= g <= m and (m % g == 0 or m % g >= layout.pp):
            return m
        m += 1


def _validate_experts(arch: ModelArch, layout: ParallelLayout) -> None:
    """The expert-parallel half of `validate_layout`."""
    if not arch.is_moe:
        if layout.ep > 1 or layout.etp is not None:
            raise ValueError("--expert-model-parallel-size / --expert-tensor-parallel-size apply to mixture-of-experts "
                             f"models; {arch.model_type} has no experts (drop the flags)")
        return
    if arch.num_experts % layout.ep:
        raise ValueError(f"num_experts ({arch.num_experts}) is not divisible by --expert-model-parallel-size "
                         f"({layout.ep})")
    if arch.moe_intermediate_size % layout.expert_tp:
        raise ValueError(f"moe_intermediate_size ({arch.moe_intermediate_size}) is not divisible by "
                         f"--expert-tensor-parallel-size ({layout.expert_tp})")
    if layout.tp > 1 and not layout.sp:
        raise ValueError("a mixture-of-experts model with --tensor-model-parallel-size > 1 needs --sequence-parallel "
                         "(megatron-core's MoE layer refuses to train without it)")
