"""The one place a parallel layout (TP, PP, CP, DP, SP, EP, recompute) is checked against a model.

Errors name the flag to change, so a launcher typo is caught before any process group exists. The same
ParallelLayout feeds parallel_state (dist_init), the TransformerConfig (models/config.py), the actor's
DDP config and the memory planner (planner/); `layer_range` says which layers a pipeline stage (and each of its
virtual chunks) holds, for all of them; see docs/PARALLELISM.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_dapo.flag_field import flag_field, flag_name
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
    layers_in_first_stage: int | None = flag_field(
        "--decoder-first-pipeline-num-layers", default=None, type=int,
        help="uneven pipeline: decoder layers on the first pipeline stage (the one that also holds the embedding); "
             "the layers left split evenly over the stages not set by this flag or "
             "--decoder-last-pipeline-num-layers, e.g. 64 layers at PP3 as 20/24/20; needs "
             "--pipeline-model-parallel-size > 1")
    """megatron-core's num_layers_in_first_pipeline_stage; None: stage 0 takes its even share (`layer_range`)."""
    layers_in_last_stage: int | None = flag_field(
        "--decoder-last-pipeline-num-layers", default=None, type=int,
        help="uneven pipeline: decoder layers on the last pipeline stage (the one that also holds the final norm, "
             "the output layer and the [tokens, vocab / TP] logits); the layers left split evenly over the other "
             "stages; needs --pipeline-model-parallel-size > 1")
    """megatron-core's num_layers_in_last_pipeline_stage; None: the last stage takes its even share."""
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
        for value, flag in ((self.layers_in_first_stage, "--decoder-first-pipeline-num-layers"),
                            (self.layers_in_last_stage, "--decoder-last-pipeline-num-layers")):
            if value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag} must be a positive integer (megatron-core builds no empty stage), "
                                 f"got {value!r}")
            if self.pp == 1:
                raise ValueError(f"{flag} needs --pipeline-model-parallel-size > 1 (it sets the layers of one "
                                 "pipeline stage)")
            if self.layers_per_virtual_stage is not None:
                # megatron-core would take a chunk count, but "layers per virtual stage" has no one meaning when
                # the stages differ; Megatron-LM refuses the pair too (its --num-virtual-stages-per-pipeline-rank,
                # which megatron-dapo does not have, sizes an uneven interleaved pipeline)
                raise ValueError(f"{flag} and --num-layers-per-virtual-pipeline-stage cannot be combined: with "
                                 "uneven stages a layer count per virtual stage does not fix the chunks of each stage "
                                 "(Megatron-LM refuses the pair as well); drop one of the two")

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
        """The TransformerConfig fields this layout sets (sizes, SP, recompute, an uneven pipeline's end stages)."""
        fields: dict[str, Any] = dict(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            context_parallel_size=self.cp, sequence_parallel=self.sp,
            recompute_granularity=self.recompute_granularity, recompute_method=self.recompute_method,
            recompute_num_layers=(self.layers_recomputed_per_unit if self.recompute_granularity == "full"
                                  else None),
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.expert_tp,
            num_layers_in_first_pipeline_stage=self.layers_in_first_stage,
            num_layers_in_last_pipeline_stage=self.layers_in_last_stage,
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
    if dict(arch.family_options).get("multi_latent_attention") and layout.tp > 1 and not layout.sp:
        raise ValueError(
            f"multi-head latent attention at --tensor-model-parallel-size {layout.tp} needs --sequence-parallel: "
            "without it megatron-core 0.16.1 leaves the shared rope key's gradient partial on each TP rank "
            "(Megatron-LM issue #1699; Megatron-LM's own arguments require it too)"
        )
    _validate_experts(arch, layout)
    for stage in range(layout.pp):  # each stage's layers (every chunk of a stage holds the same count)
        chunk_layers = len(layer_range(arch.num_layers, layout, stage))
        if layout.recompute_granularity != "full":
            continue
        n = layout.layers_recomputed_per_unit
        if n > chunk_layers or (layout.recompute_method == "uniform" and chunk_layers % n):
            where = "each model chunk of " if layout.layers_per_virtual_stage is not None else ""
            raise ValueError(
                f"--recompute-num-layers ({n}) must be <= the {chunk_layers} layers of {where}pipeline stage {stage}"
                + (" and divide them (--recompute-method uniform)" if layout.recompute_method == "uniform" else "")
            )


def uneven_end_stages(layout: ParallelLayout) -> dict[str, int]:
    """The end stages an uneven pipeline sets, flag -> layers, first then last, only those given (empty: every stage
    holds num_layers / PP)."""
    return {flag_name(ParallelLayout, name): n for name in ("layers_in_first_stage", "layers_in_last_stage")
            if (n := getattr(layout, name)) is not None}


def stage_layer_counts(num_layers: int, layout: ParallelLayout) -> list[int]:
    """Decoder layers of each pipeline stage (all its chunks together): --decoder-first-pipeline-num-layers /
    --decoder-last-pipeline-num-layers on the first / last stage where given, the layers left cut evenly over the
    other stages (megatron-core's get_num_layers_to_build); num_layers / PP each without them. Raises ValueError
    naming the flags when the layers do not cut so (megatron-core's TransformerConfig checks, plus a negative
    remainder, which megatron-core lets through)."""
    ends = uneven_end_stages(layout)
    if not ends:
        if num_layers % layout.pp:
            raise ValueError(
                f"num_hidden_layers ({num_layers}) is not divisible by --pipeline-model-parallel-size ({layout.pp})"
            )
        return [num_layers // layout.pp] * layout.pp
    given = " - ".join(f"{flag} ({n})" for flag, n in ends.items())
    middle_stages, middle = layout.pp - len(ends), num_layers - sum(ends.values())
    if middle_stages == 0 and middle:
        raise ValueError(f"num_hidden_layers ({num_layers}) - {given} = {middle}: at --pipeline-model-parallel-size "
                         f"{layout.pp} the two end stages must hold every layer")
    if middle_stages and (middle < middle_stages or middle % middle_stages):
        raise ValueError(f"num_hidden_layers ({num_layers}) - {given} = {middle} layers do not split evenly over the "
                         f"{middle_stages} other pipeline stage(s) of --pipeline-model-parallel-size {layout.pp}, at "
                         "least one layer each")
    counts = [middle // middle_stages if middle_stages else 0] * layout.pp
    if layout.layers_in_first_stage is not None:
        counts[0] = layout.layers_in_first_stage
    if layout.layers_in_last_stage is not None:
        counts[-1] = layout.layers_in_last_stage
    return counts


def layer_range(num_layers: int, layout: ParallelLayout, pp_rank: int, chunk: int = 0) -> range:
    """Global indices of the decoder layers that model chunk `chunk` of pipeline rank `pp_rank` holds: the one
    derivation of "which layers a stage holds" (megatron-core's get_transformer_layer_offset and
    get_num_layers_to_build), for the layout check, the memory planner and the weight plan alike.

    Stage r holds stage_layer_counts(...)[r] layers (num_layers / pp each, unless --decoder-first-pipeline-num-layers
    or --decoder-last-pipeline-num-layers set an end stage), cut into v equal chunks, v =
    layout.virtual_stages(num_layers) (1 without --num-layers-per-virtual-pipeline-stage). The layers run chunk-major:
    chunk c of every stage, stage by stage, then chunk c + 1. 8 layers at PP2 x VPP2 put [0, 1] and [4, 5] on rank 0,
    [2, 3] and [6, 7] on rank 1; 64 layers at PP3 with 20 first and 20 last put 0..19, 20..43, 44..63. Raises
    ValueError naming the flags when the layers do not cut so."""
    counts = stage_layer_counts(num_layers, layout)
    vpp = layout.virtual_stages(num_layers)
    if not 0 <= pp_rank < layout.pp:
        raise ValueError(f"pp_rank {pp_rank} is outside 0..{layout.pp - 1}")
    if not 0 <= chunk < vpp:
        raise ValueError(f"chunk {chunk} is outside 0..{vpp - 1}")
    per_chunk = [n // vpp for n in counts]  # virtual_stages (and __post_init__ for uneven stages) make them divide
    start = chunk * sum(per_chunk) + sum(per_chunk[:pp_rank])
    return range(start, start + per_chunk[pp_rank])


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
