"""The model provider: a megatron-core GPTModel stage of a decoder of any registered family."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megatron_dapo.compat import cpu
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.config import transformer_config_from_arch
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.spec import get_layer_spec, resolve_transformer_impl


def build_gpt_model(
    arch: ModelArch,
    *,
    tp: int | None = None,
    pp: int | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    vp_stage: int | None = None,
    **config_overrides,
) -> GPTModel:
    """This rank's pipeline stage of `arch` as a GPTModel (RoPE, padded vocab, tied or untied head).

    Needs megatron parallel_state initialised (`megatron_dapo.actor.init_parallel`); tp / pp default to
    its sizes and must match them; pre/post_process default to whether this is the first/last stage.
    The head returns vocab-parallel logits [b, s, padded_vocab / tp] (parallel_output=True).
    `vp_stage`: which model chunk of this PP rank to build under an interleaved layout (layers of
    virtual stage vp_stage * pp + pp_rank; pre/post_process then only on the first / last chunk).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "build_gpt_model needs megatron parallel_state: call megatron_dapo.actor.init_parallel() first"
        )
    cpu.install()
    world_tp = parallel_state.get_tensor_model_parallel_world_size()
    world_pp = parallel_state.get_pipeline_model_parallel_world_size()
    tp = world_tp if tp is None else tp
    pp = world_pp if pp is None else pp
    if (tp, pp) != (world_tp, world_pp):
        raise ValueError(
            f"build_gpt_model(tp={tp}, pp={pp}) does not match the initialised parallel state "
            f"(--tensor-model-parallel-size {world_tp}, --pipeline-model-parallel-size {world_pp})"
        )
    if use_te is None:
        use_te = resolve_transformer_impl(None) == "transformer_engine"
    if "layout" not in config_overrides:  # the layout parallel_state was initialised with (experts included)
        config_overrides["layout"] = ParallelLayout(
            tp=tp, pp=pp, cp=parallel_state.get_context_parallel_world_size(),
            dp=parallel_state.get_data_parallel_world_size(),
            ep=parallel_state.get_expert_model_parallel_world_size(),
            etp=parallel_state.get_expert_tensor_parallel_world_size() if arch.is_moe else None,
            sp=bool(config_overrides.get("sequence_parallel", False)))
    # The implementation the layers are built with, on the config where the weight paths read it (`layout_kind`).
    config_overrides["transformer_impl"] = "transformer_engine" if use_te else "local"
    if arch.is_moe:  # TEGroupedMLP (grouped GEMM) under TE, SequentialMLP of local experts otherwise
        config_overrides = {"moe_grouped_gemm": use_te, **config_overrides}
    config = transformer_config_from_arch(arch, tp=tp, pp=pp, params_dtype=params_dtype, **config_overrides)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_layer_spec(use_te, config, arch.family.layer_spec_options(arch), vp_stage),
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=(parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
                     if pre_process is None else pre_process),
        post_process=(parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
                      if post_process is None else post_process),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        vp_stage=vp_stage,
        **arch.family.model_kwargs(arch),  # positions: rope type, base, scaling
    )
    if params_dtype != torch.float32:
        # Megatron-LM's Float16Module casts the whole model: the local spec's torch RMSNorms are built
        # in fp32 regardless of params_dtype, and a mixed-dtype model breaks the fp16/bf16 optimizer's
        # checkpoint (its param-id map assumes every param is in the float16 groups).
        model.to(params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
