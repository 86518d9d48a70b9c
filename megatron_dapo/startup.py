"""The flags, parsed once at start-up into the run's typed configs: the one module below the parser that reads them.

`check_flags` turns the namespace of `arguments.build_parser()` into a `RunConfig` (every component's config, the
model architecture from --hf-checkpoint's config.json and the parallel layout over $WORLD_SIZE), checking the
flags in the order the run depends on them; each config validates its own fields and names the flag to fix.
Everything below takes the config it is handed, never the namespace (tests/unit/test_import_graph.py enforces it).
`dry_run` is `--dry-run` and `python -m megatron_dapo.planner`: the memory plan of the same flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.errors import UserError
from megatron_dapo.flag_field import flag_dest, flag_fields
from megatron_dapo.models.hf_config import ModelArch, hf_config_path
from megatron_dapo.planner.activations import ActivationSpec
from megatron_dapo.planner.colocated import SGLANG_RELEASED_GIB
from megatron_dapo.planner.report import (
    Plan,
    check_plan_flags,
    plan_world_size,
    print_plan,
    served_teacher_line,
    stream_state_line,
    tool_use_line,
)
from megatron_dapo.planner.stages import PlanInputs
from megatron_dapo.rollout.build import RolloutEngineConfig, rollout_engine_kind
from megatron_dapo.rollout.types import SamplingParams

if TYPE_CHECKING:  # the trainer's modules import megatron-core: the dry run (planner's own CLI) needs none of it
    from megatron_dapo.actor.config import ActorConfig
    from megatron_dapo.rollout.collect import CollectConfig, RewardFn
    from megatron_dapo.trainer.loop import TrainerConfig
    from megatron_dapo.trainer.run_config import CheckpointConfig, InputsConfig, LogConfig, RunConfig

def check_flags(args: argparse.Namespace) -> tuple[RunConfig, RewardFn]:
    """The flags (same verdict on every rank): config dataclasses, batch arithmetic, prompt limits, the model family of
    --hf-checkpoint's config.json (and no mixture-of-experts flag for a model without experts), the planner's flags,
    the parallel layout over the world (EP x expert-TP within its ranks: init_parallel builds it next, on every rank).

    Returns the run config (built here, once) and the --reward-fn function (a dotted path is imported here, so a
    typo fails before the model).
    """
    from megatron_dapo.data import PromptLengthLimit, default_max_prompt_chars
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.rollout.sglang.api_key import resolve_api_key
    from megatron_dapo.trainer.colocate import check_colocate_flags
    from megatron_dapo.trainer.run_config import RunConfig
    from megatron_dapo.trainer.run_record import argv_has_secret, run_record, secrets_of
    from megatron_dapo.trainer.validation import check_batch_arithmetic, data_parallel_size

    try:
        actor, collect, trainer = build_configs(args)
        api_key = resolve_api_key(args.sglang_api_key, args.sglang_api_key_file, os.environ)
        PromptLengthLimit(max_tokens=args.max_prompt_length, on_long=args.on_long_prompt,
                          max_chars=args.max_prompt_chars or default_max_prompt_chars(args.max_prompt_length))
        reward_fn = get_reward_fn(args.reward_fn)
        arch = model_arch(args.hf_checkpoint)
        if arch is not None:  # MoE-only flags on a dense model: refused, not ignored
            actor.check_model(arch)
        engine = engine_config(args, arch, api_key=api_key)  # e.g. a model SGLang would serve wrong, an open bind
        check_plan_flags(gpu_memory_gib=args.gpu_memory_gib, world_size=args.world_size)  # sizes SGLang's share
    except UserError:
        raise
    except ValueError as err:  # the config dataclasses name the flag
        raise UserError(str(err)) from err
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = data_parallel_size(world, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, cp=args.context_parallel_size)
    try:  # the layout (EP x ETP within the ranks, SP, recompute, VPP) on every rank, before init_parallel builds it
        layout = ParallelLayout.from_world(world, **layout_options(args))
    except ValueError as err:
        raise UserError(str(err)) from err
    check_batch_arithmetic(rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
                           global_batch_size=args.global_batch_size, dp=dp)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        check_colocate_flags(colocate=args.colocate, world_size=world,
                             gpus_per_node=int(local) if local else None, gpus_per_engine=args.sglang_tp_size,
                             num_servers=args.sglang_num_servers, server_urls=args.sglang_server_urls,
                             rollout_engine=args.rollout_engine)
    except ValueError as err:
        raise UserError(str(err)) from err
    flags = vars(args) | {"sglang_api_key": api_key}  # the key as resolved: the record redacts it
    run = RunConfig(actor=actor, collect=collect, trainer=trainer, engine=engine, inputs=inputs_config(args),
                    checkpoint=checkpoint_config(args), log=log_config(args, private_argv=argv_has_secret(flags)),
                    arch=arch, layout=layout, seed=args.seed, flags=run_record(flags),
                    secrets=tuple(secrets_of(flags)))
    return run, reward_fn


def model_arch(hf_checkpoint: str) -> ModelArch | None:
    """--hf-checkpoint's config.json describes a supported model: its model_type a registered family (an unknown or
    missing one lists the supported ones and points to docs/MODELS.md) whose parse accepts the fields. Every rank
    reads the file (milliseconds), before rank 0 creates --save and before any model is built; a missing
    config.json is load_inputs' error (None here)."""
    path = hf_config_path(hf_checkpoint)
    if not os.path.isfile(path):
        return None
    try:
        return ModelArch.from_hf(path)
    except ValueError as err:
        raise UserError(f"--hf-checkpoint {err}") from err


# ---- the components' configs ----------------------------------------------------------------------------
def build_configs(args: argparse.Namespace, eos_ids: tuple[int, ...] = ()
                  ) -> tuple[ActorConfig, CollectConfig, TrainerConfig]:
    """Flags -> (ActorConfig, CollectConfig, TrainerConfig); each dataclass validates its fields.

    The LR schedule counts rollout steps: warmup over --lr-warmup-steps of them, decay (when not
    constant) reaching --min-lr at --lr-decay-steps (default --num-steps)."""
    import torch

    from megatron_dapo.actor.config import ActorConfig
    from megatron_dapo.algorithm import DynamicSamplingConfig, OffPolicyConfig, OverlongConfig
    from megatron_dapo.algorithm.loss import takes_behaviour_weights
    from megatron_dapo.algorithm.registry import get_advantage_estimator, policy_loss_config
    from megatron_dapo.rollout.collect import CollectConfig
    from megatron_dapo.trainer.loop import TrainerConfig
    decay_steps = None
    if args.lr_decay_style != "constant":
        decay_steps = args.num_steps if args.lr_decay_steps is None else args.lr_decay_steps
    actor = ActorConfig(
        lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, seed=args.seed,
        use_fused_logprob=args.use_fused_logprob, pack_sequences=args.pack_sequences,
        fused_linear_logprob=args.fused_linear_logprob, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor, moe_routing_replay=args.moe_routing_replay,
        params_dtype=args.params_dtype or ("bfloat16" if torch.cuda.is_available() else "float32"),
        loss=policy_loss_config(args.policy_loss, eps_low=args.clip_ratio_low, eps_high=args.clip_ratio_high,
                                dual_clip_c=args.clip_ratio_c, agg_mode=args.loss_agg_mode,
                                max_response_length=args.max_response_length,
                                behav_weight_cap=args.behav_weight_cap),
        kl=kl_config(args),
    )
    sampling = _sampling("--max-response-length, --rollout-temperature, --rollout-top-p, --rollout-top-k",
                         max_new_tokens=args.max_response_length, temperature=args.rollout_temperature,
                         top_p=args.rollout_top_p, top_k=args.rollout_top_k, stop_token_ids=eos_ids)
    collect = CollectConfig(
        n_samples_per_prompt=args.n_samples_per_prompt, sampling=sampling,
        over_sample_factor=args.over_sample_factor, seed=args.seed, partial_rollout=args.partial_rollout,
        partial_rollout_max_staleness=max_staleness(args),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=args.rollout_batch_size,
                                               enabled=args.dynamic_sampling,
                                               max_num_gen_batches=args.max_num_gen_batches,
                                               on_exhausted=args.on_gen_exhausted),
        overlong=OverlongConfig(max_response_length=args.max_response_length,
                                buffer_length=args.overlong_buffer_length,
                                penalty_factor=args.overlong_penalty_factor,
                                filter_truncated=args.overlong_filter),
    )
    eval_length = args.max_response_length if args.eval_max_response_length is None \
        else args.eval_max_response_length
    eval_sampling = _sampling("--eval-max-response-length, --eval-temperature, --eval-top-p",
                              max_new_tokens=eval_length,
                              temperature=args.eval_temperature, top_p=args.eval_top_p, stop_token_ids=eos_ids)
    trainer = TrainerConfig(
        num_steps=args.num_steps, global_batch_size=args.global_batch_size, eval_interval=args.eval_interval,
        eval_n_samples=args.n_samples_per_eval_prompt, save_dir=args.save, save_interval=args.save_interval,
        eval_sampling=eval_sampling, rollout_timeout_h=args.rollout_timeout,
        async_rollout=args.async_rollout, exit_save_timeout_s=args.exit_save_timeout_s,
        max_staleness=args.max_staleness, stale_policy=args.stale_policy,
        max_in_flight_groups=args.max_in_flight_groups,
        distill=distill_config(args),
        kl_reward=kl_reward_config(args),
        off_policy=OffPolicyConfig(use_tis=use_tis(args, actor.loss.fn), tis_cap=args.tis_cap,
                                   mis_mode=args.mis_mode, mis_threshold=args.mis_threshold,
                                   use_icepop=args.use_icepop, icepop_low=args.icepop_low,
                                   icepop_high=args.icepop_high,
                                   behaviour_weights=takes_behaviour_weights(actor.loss.fn)),
        advantage_estimator=get_advantage_estimator(args.advantage_estimator),
    )
    check_staleness_flags(args, trainer.off_policy)
    return actor, collect, trainer


def check_staleness_flags(args: argparse.Namespace, off_policy: Any) -> None:
    """UserError for a --max-staleness run that mixes modes it cannot run with, or trains tokens K >= 2 versions old
    with no off-policy correction unless --allow-uncorrected-staleness."""
    k = args.max_staleness
    if not k:
        if args.allow_uncorrected_staleness:
            raise UserError("--allow-uncorrected-staleness is given without --max-staleness: nothing to allow")
        return
    if args.partial_rollout:
        raise UserError(f"--max-staleness {k} and --partial-rollout exclude each other: the fully async rollout "
                        "carries every group in flight across a push itself; drop --partial-rollout")
    if args.max_num_gen_batches:
        raise UserError(f"--max-num-gen-batches {args.max_num_gen_batches} counts generation rounds of a step; the "
                        f"fully async rollout (--max-staleness {k}) has no rounds: drop it")
    corrected = off_policy.enabled
    if k >= 2 and not corrected and not args.allow_uncorrected_staleness:
        raise UserError(f"--max-staleness {k} trains tokens up to {k} weight versions old with no off-policy "
                        "correction: pass --use-tis, --use-icepop, --mis-mode or --policy-loss decoupled, or "
                        "--allow-uncorrected-staleness to train them as if on-policy")


def kl_config(args: argparse.Namespace) -> Any:
    """--kl-coef / --kl-estimator -> the actor's KLConfig with --ref-load, None without; UserError for a KL flag given
    without a reference model. With --kl-in-reward the actor's term has coef 0 (train/kl logged, nothing added to the
    loss): beta goes to the reward penalty (`kl_reward_config`)."""
    from megatron_dapo.algorithm.kl import KLConfig

    if args.ref_load is None:
        given = [flag for flag, on in (("--kl-coef", args.kl_coef != 0.0),
                                       ("--kl-estimator", args.kl_estimator is not None),
                                       ("--kl-in-reward", args.kl_in_reward)) if on]
        if given:
            raise UserError(f"{' and '.join(given)} need a reference model: --ref-load initial (the weights this run "
                            f"started from) or a checkpoint directory")
        return None
    return KLConfig(coef=0.0 if args.kl_in_reward else args.kl_coef, estimator=args.kl_estimator or "k3")


def kl_reward_config(args: argparse.Namespace) -> Any:
    """--kl-in-reward -> the trainer's KLConfig of the reward penalty (beta = --kl-coef, --kl-estimator), None
    without. `kl_config` refuses it without --ref-load; TrainerConfig at --kl-coef 0 and beside --distill-only."""
    from megatron_dapo.algorithm.kl import KLConfig

    return KLConfig(coef=args.kl_coef, estimator=args.kl_estimator or "k3") if args.kl_in_reward else None


def distill_config(args: argparse.Namespace) -> Any:
    """--teacher-load / --distill-coef / --distill-only -> the trainer's DistillConfig, None without a teacher;
    UserError for a distillation flag without a teacher, or --distill-only beside --dynamic-sampling (its filter
    reads the verifier's rewards, which --distill-only does not train on)."""
    from megatron_dapo.algorithm.distill import DistillConfig

    if args.teacher_load is not None and args.teacher_url is not None:
        raise UserError("--teacher-load and --teacher-url are two places for one teacher: give one (--teacher-load: "
                        "a frozen model on the actor's GPUs; --teacher-url: SGLang servers of their own)")
    if args.teacher_load is None and args.teacher_url is None:
        given = [flag for flag, on in (("--distill-coef", args.distill_coef != 0.0),
                                       ("--distill-only", args.distill_only),
                                       ("--teacher-api-key-file", args.teacher_api_key_file is not None)) if on]
        if given:
            raise UserError(f"{' and '.join(given)} need a teacher: --teacher-load DIR (an HF checkpoint with the "
                            f"student's tokenizer) or --teacher-url URL (SGLang servers serving one)")
        return None
    if args.distill_only and args.dynamic_sampling:
        raise UserError("--distill-only trains on the teacher's advantage alone, and --dynamic-sampling (on by "
                        "default) drops the groups whose verifier rewards are all equal, which carry the teacher's "
                        "signal as much as any: pass --no-dynamic-sampling")
    return DistillConfig(coef=args.distill_coef, only=args.distill_only)


def teacher_server_config(args: argparse.Namespace) -> Any:
    """--teacher-url and its flags -> TeacherServerConfig (rollout/sglang/teacher.py), None without --teacher-url;
    UserError for a bad URL or count, or --teacher-api-key-file without --teacher-url."""
    from megatron_dapo.rollout.sglang.teacher import TeacherServerConfig

    if args.teacher_url is None:
        if args.teacher_api_key_file is not None and args.teacher_load is not None:
            raise UserError("--teacher-api-key-file is the key of --teacher-url's servers; --teacher-load needs none")
        return None
    try:
        return TeacherServerConfig(urls=tuple(args.teacher_url), api_key_file=args.teacher_api_key_file,
                                   max_concurrency=args.teacher_max_concurrency)
    except ValueError as err:
        raise UserError(str(err)) from err


def use_tis(args: argparse.Namespace, loss_fn: Callable | None = None) -> bool:
    """--use-tis / --no-use-tis as given; unset: on exactly when --async-rollout 1 or --max-staleness K (the batch
    was generated by weights one or more updates behind the actor, the gap TIS corrects) and the --policy-loss
    `loss_fn` does not weight by the behaviour ratio itself (`takes_behaviour_weights`: decoupled) and --use-icepop
    is off (IcePop weights by it). UserError for --use-tis given with such a loss or with --use-icepop (the ratio
    would weight each token twice)."""
    from megatron_dapo.algorithm.loss import takes_behaviour_weights

    own = loss_fn is not None and takes_behaviour_weights(loss_fn)
    if args.use_tis and own:
        raise UserError(f"--use-tis with --policy-loss {args.policy_loss}: that loss weights each token by "
                        "pi_old / pi_rollout itself (the decoupled objective); drop --use-tis, cap its weights "
                        "with --behav-weight-cap")
    if args.use_tis and args.use_icepop:
        raise UserError("--use-tis with --use-icepop: both weight each token by pi_old / pi_rollout (TIS capped at "
                        "--tis-cap, IcePop zeroed outside [--icepop-low, --icepop-high]); choose one")
    off_policy = args.async_rollout > 0 or args.max_staleness > 0
    return args.use_tis if args.use_tis is not None else off_policy and not own and not args.use_icepop


def max_staleness(args: argparse.Namespace) -> int | None:
    """--partial-rollout-max-staleness as given; unset: partial_rollout.DEFAULT_MAX_STALENESS with
    --partial-rollout, None without it (nothing is carried)."""
    from megatron_dapo.rollout.partial_rollout import DEFAULT_MAX_STALENESS

    given = args.partial_rollout_max_staleness
    return given if given is not None or not args.partial_rollout else DEFAULT_MAX_STALENESS


def _sampling(flags: str, **params) -> SamplingParams:
    """SamplingParams whose validation error names the flags the values came from."""
    try:
        return SamplingParams(**params)
    except ValueError as e:
        raise ValueError(f"{e} (set by {flags})") from None


def layout_options(args: argparse.Namespace) -> dict[str, Any]:
    """Every ParallelLayout field but dp from the "parallelism" flags (dp follows from the world size): one
    value per field declared with its flag (flag_field)."""
    return {f.name: getattr(args, flag_dest(f)) for f in flag_fields(ParallelLayout)}


def engine_config(args: argparse.Namespace, arch: ModelArch | None, *, api_key: str | None) -> RolloutEngineConfig:
    """The "rollout" flags -> rank 0's engine config, which checks them (ValueError naming the flag); `api_key` as
    resolve_api_key found it. With --colocate and no --mem-fraction-static, the memory plan that sizes SGLang's
    share (`arch` known)."""
    planned = args.colocate and args.mem_fraction_static is None and arch is not None
    return RolloutEngineConfig(
        kind=rollout_engine_kind(args.rollout_engine), hf_checkpoint=args.hf_checkpoint, arch=arch,
        tokenizer=args.tokenizer, seed=args.seed,
        max_batch_size=args.rollout_batch_size * args.n_samples_per_prompt, async_rollout=args.async_rollout,
        max_staleness=args.max_staleness,
        colocate=args.colocate, log_dir=args.log_dir, moe_routing_replay=args.moe_routing_replay,
        rollout_timeout_h=args.rollout_timeout, mem_fraction_static=args.mem_fraction_static,
        colocated_plan=plan_from_flags(args, arch) if planned else None,
        sglang_num_servers=args.sglang_num_servers, sglang_tp_size=args.sglang_tp_size,
        sglang_base_port=args.sglang_base_port, sglang_host=args.sglang_host,
        sglang_extra_args=tuple(args.sglang_extra_args.split()), sglang_python=args.sglang_python,
        sglang_gpus=args.sglang_gpus,
        sglang_server_urls=tuple(args.sglang_server_urls) if args.sglang_server_urls else None,
        sglang_router_url=args.sglang_router_url, sglang_max_concurrency=args.sglang_max_concurrency,
        sglang_api_key=api_key, sglang_allow_no_api_key=args.sglang_allow_no_api_key,
        sglang_server_wait_s=args.sglang_server_wait_s, sglang_http_timeout=args.sglang_http_timeout,
        sglang_min_tokens_per_s=args.sglang_min_tokens_per_s,
        sglang_deterministic_inference=args.sglang_deterministic_inference,
        weight_sync_mode=args.weight_sync_mode, weight_sync_bucket_mb=args.weight_sync_bucket_mb,
        weight_sync_master_addr=args.weight_sync_master_addr, weight_sync_master_port=args.weight_sync_master_port,
        tools=tool_use_config(args),
    )


def tool_use_config(args: argparse.Namespace):
    """The "tool use" flags -> ToolUseConfig, None without --tool-template. Refuses the combinations a conversation does
    not support yet, naming the flags: --max-staleness (the fully async rollout's cuts and refills are not wired to
    conversations), --moe-routing-replay (a conversation's routed experts are not assembled across turns)."""
    if args.tool_template is None:
        return None
    from megatron_dapo.rollout.multi_turn import MultiTurnConfig, ToolUseConfig
    from megatron_dapo.tool_use.sandbox import SandboxLimits

    for flag, given, why in (("--max-staleness", args.max_staleness, "the fully async rollout's cuts and refills "
                              "are not wired to conversations"),
                             ("--moe-routing-replay", args.moe_routing_replay, "a conversation's routed experts are "
                              "not assembled across its turns")):
        if given:
            raise UserError(f"--tool-template and {flag} cannot be combined yet: {why} (docs/TOOL_USE.md)")
    return ToolUseConfig(
        template=args.tool_template,
        turns=MultiTurnConfig(max_turns=args.max_turns, max_output_chars=args.tool_output_max_chars,
                              schedule=args.tool_schedule),
        workers=args.tool_workers if args.tool_workers is not None else max(1, os.cpu_count() or 1),
        limits=SandboxLimits(cpu_s=args.tool_cpu_s, wall_s=args.tool_timeout_s, memory_mib=args.tool_memory_mib))


def inputs_config(args: argparse.Namespace) -> InputsConfig:
    from megatron_dapo.trainer.run_config import InputsConfig

    return InputsConfig(
        hf_checkpoint=args.hf_checkpoint, tokenizer=args.tokenizer, prompt_data=args.prompt_data,
        eval_prompt_data=args.eval_prompt_data, eval_interval=args.eval_interval,
        eval_max_prompts=args.eval_max_prompts, prompt_format=args.prompt_format,
        max_prompt_length=args.max_prompt_length, max_prompt_chars=args.max_prompt_chars,
        on_long_prompt=args.on_long_prompt, max_response_length=args.max_response_length,
        allow_exceed_context=args.allow_exceed_context,
    )


def checkpoint_config(args: argparse.Namespace) -> CheckpointConfig:
    from megatron_dapo.trainer.run_config import CheckpointConfig

    return CheckpointConfig(load=args.load, save=args.save, overwrite_save=args.overwrite_save,
                            mcore_checkpoint=args.mcore_checkpoint, fully_parallel_save=args.ckpt_fully_parallel_save,
                            async_save=args.async_save, export_hf=args.export_hf, ref_load=args.ref_load,
                            teacher_load=args.teacher_load, teacher_server=teacher_server_config(args))


def log_config(args: argparse.Namespace, *, private_argv: bool) -> LogConfig:
    from megatron_dapo.trainer.run_config import LogConfig

    return LogConfig(log_dir=args.log_dir, wandb_project=args.wandb_project, wandb_run_name=args.wandb_run_name,
                     use_wandb=not args.no_wandb, progress=not args.no_progress, private_argv=private_argv)


# ---- --dry-run -------------------------------------------------------------------------------------------
def plan_from_flags(args: argparse.Namespace, arch: ModelArch) -> Plan:
    """Flags -> what the planner needs (the layout over planner.report.plan_world_size's ranks)."""
    layout = ParallelLayout.from_world(
        plan_world_size(args.world_size, tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                        cp=args.context_parallel_size, ep=args.expert_model_parallel_size,
                        etp=args.expert_tensor_parallel_size),
        **layout_options(args))
    impl = layout.transformer_impl or "transformer_engine"  # the dry run plans a GPU run
    params_dtype = args.params_dtype or "bfloat16"
    max_len = args.max_prompt_length + args.max_response_length
    inputs = PlanInputs(tokens_per_micro_batch=args.max_tokens_per_micro_batch or max_len, max_seq_len=max_len,
                        params_dtype=params_dtype, use_distributed_optimizer=args.use_distributed_optimizer,
                        fused_logprob=args.use_fused_logprob, gpu_memory_gib=args.gpu_memory_gib,
                        packed=args.pack_sequences, fused_linear_logprob=args.fused_linear_logprob,
                        colocate=args.colocate, rollout_gpus_per_engine=args.sglang_tp_size,
                        mem_fraction_static=args.mem_fraction_static,
                        sglang_gib=SGLANG_RELEASED_GIB if args.colocate else 0.0,
                        moe_capacity_factor=args.moe_expert_capacity_factor, reference=args.ref_load is not None,
                        teacher=planned_teacher(args.teacher_load, arch))
    spec = ActivationSpec.for_arch(arch, transformer_impl=impl, bytes_per_element=2 if params_dtype ==
                                   "bfloat16" else 4)
    return Plan(arch=arch, layout=layout, inputs=inputs, spec=spec)


def planned_teacher(teacher_load: str | None, arch: ModelArch) -> ModelArch | None:
    """The teacher's architecture for the plan: an HF directory's own config.json, else (initial, a torch_dist
    checkpoint) the actor's `arch`; None without --teacher-load."""
    if teacher_load is None:
        return None
    config = Path(teacher_load) / "config.json"
    return ModelArch.from_hf(teacher_load) if teacher_load != "initial" and config.is_file() else arch


def dry_run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the per-GPU plan of these flags (planner.report.print_plan); 0 when the peak fits --gpu-memory-gib, else 1.
    Bad flags: one line `plan: error: ...` on `err` (stderr), 2. Reads only --hf-checkpoint's config.json. Rank 0's
    weight-sync transport (its host copy is a line of the plan) is resolved here, as attached CUDA servers would
    have it (weight_sync/transports/)."""
    from megatron_dapo.weight_sync.transports import weight_sync_mode

    try:
        check_plan_flags(gpu_memory_gib=args.gpu_memory_gib, world_size=args.world_size)
        plan = plan_from_flags(args, ModelArch.from_hf(args.hf_checkpoint))
    except (ValueError, FileNotFoundError) as exc:
        print(f"plan: error: {exc}", file=err or sys.stderr)
        return 2
    mode = weight_sync_mode(requested=args.weight_sync_mode, attach=True, cuda=True, colocate=args.colocate)
    host = [stream_state_line(max_staleness=args.max_staleness, batch_groups=args.rollout_batch_size,
                              n_samples=args.n_samples_per_prompt, max_response_length=args.max_response_length,
                              over_sample_factor=args.over_sample_factor,
                              max_in_flight=stream_in_flight_cap(args))] if args.max_staleness else []
    if args.teacher_url:
        host.append(served_teacher_line(batch_groups=args.rollout_batch_size, n_samples=args.n_samples_per_prompt,
                                        max_prompt_length=args.max_prompt_length,
                                        max_response_length=args.max_response_length, dp=plan.layout.dp,
                                        max_concurrency=args.teacher_max_concurrency))
    if args.tool_template:
        from megatron_dapo.tool_use.sandbox import SandboxLimits

        fixed = SandboxLimits()
        host.append(tool_use_line(workers=args.tool_workers or os.cpu_count() or 1, memory_mib=args.tool_memory_mib,
                                  max_processes=fixed.max_processes, max_file_mib=fixed.max_file_mib,
                                  batch_groups=args.rollout_batch_size, n_samples=args.n_samples_per_prompt,
                                  max_turns=args.max_turns, max_response_length=args.max_response_length))
    return print_plan(plan, weight_sync_mode=mode, out=out, err=err, host_lines=host)


def stream_in_flight_cap(args: argparse.Namespace) -> int:
    """The fully async rollout's cap on groups in flight: --max-in-flight-groups, or 1.25x the engine's capacity in
    groups (SGLang: --sglang-max-concurrency samples; embedded: --rollout-batch-size x --n-samples-per-prompt rows),
    as trainer/loop.py derives it from the engine."""
    from megatron_dapo.rollout.streaming import in_flight_cap

    if args.max_in_flight_groups:
        return args.max_in_flight_groups
    capacity = args.sglang_max_concurrency if args.rollout_engine == "sglang" else \
        args.rollout_batch_size * args.n_samples_per_prompt
    return in_flight_cap(capacity, args.n_samples_per_prompt)


def dry_run_main(argv: list[str] | None = None) -> int:
    """`python -m megatron_dapo.planner <train.py flags>`: the plan `python -m megatron_dapo.train <flags> --dry-run`
    prints, and its exit status."""
    from megatron_dapo.arguments import build_parser

    return dry_run(build_parser().parse_args(argv))
