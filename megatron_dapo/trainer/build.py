"""Builders of the run's components from its flags and config: the flags' verdict (`check_flags`), rank 0's
preparation (`prepare_rank0`), the inputs read before any model exists, the actor with its initial weights,
rank 0's metrics logger and report. The entry point (megatron_dapo/train.py) calls
them in start-up order."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.data.prompt_set import load_prompt_set
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout import build as rollout_build
from megatron_dapo.rollout.collect import RewardFn
from megatron_dapo.rollout.types import Prompt
from megatron_dapo.trainer.run_config import RunConfig
from megatron_dapo.trainer.validation import (
    check_batch_arithmetic,
    check_context,
    check_model_layout,
    check_vocab,
    data_parallel_size,
)


@dataclass
class Inputs:
    """What the run reads before any model exists; the prompt lists are filled on global rank 0 only."""

    arch: ModelArch
    tokenizer: Any
    train_prompts: list[Prompt] = field(default_factory=list)
    eval_prompts: list[Prompt] = field(default_factory=list)


def load_inputs(args: argparse.Namespace, *, with_data: bool) -> Inputs:
    """config.json, the tokenizer against the model's vocab, the context; with_data: --export-hf and every prompt."""
    from transformers import AutoTokenizer

    try:
        arch = ModelArch.from_hf(args.hf_checkpoint)
    except FileNotFoundError as err:
        raise UserError(f"--hf-checkpoint: {err}") from err
    tokenizer_dir = args.tokenizer or args.hf_checkpoint
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"no tokenizer loads from {tokenizer_dir} (--tokenizer, default --hf-checkpoint): "
                        f"{first_line}") from err
    check_vocab(tokenizer_size=len(tokenizer), vocab_size=arch.vocab_size, tokenizer_dir=tokenizer_dir,
                hf_checkpoint=args.hf_checkpoint)
    check_context(max_prompt_length=args.max_prompt_length, max_response_length=args.max_response_length,
                  context=arch.max_position_embeddings, allow_exceed=args.allow_exceed_context)
    check_model_layout(arch, ParallelLayout.from_args(args, int(os.environ.get("WORLD_SIZE", "1"))),
                       hf_checkpoint=args.hf_checkpoint)
    inputs = Inputs(arch=arch, tokenizer=tokenizer)
    if not with_data:
        return inputs
    if args.export_hf:
        from megatron_dapo.checkpoint.hf_export import check_export_target

        check_export_target(args.export_hf)
    limits = dict(prompt_format=args.prompt_format, max_prompt_length=args.max_prompt_length,
                  max_prompt_chars=args.max_prompt_chars, on_long_prompt=args.on_long_prompt)
    inputs.train_prompts = load_prompt_set(args.prompt_data, tokenizer, **limits, flag="--prompt-data")
    if args.eval_prompt_data and args.eval_interval:
        inputs.eval_prompts = load_prompt_set(args.eval_prompt_data, tokenizer, **limits, flag="--eval-prompt-data",
                                              limit=args.eval_max_prompts or None)
    return inputs


def load_hf_into_actor(actor, hf_dir: str) -> None:
    """Copy HF safetensors weights into this rank's Megatron shards through the mapping table.

    The shards carry local-spec names; `MegatronActor.load_shards` matches them to the model's own
    parameter names (local or Transformer Engine spec) through `weights.mapping.canonical_mcore_name`.
    First every rank checks the checkpoint holds exactly the tensors config.json implies (as hf-to-mcore does):
    one it has no place for (a Qwen2 checkpoint's biases under a llama config.json, experts beyond num_experts)
    is an error naming it, not a weight dropped in silence. Headers only, parsed on open: milliseconds.
    """
    from megatron.core import parallel_state

    from megatron_dapo.weights import iter_rank_shards
    from megatron_dapo.weights.hf_format import HFCheckpointReader
    from megatron_dapo.weights.plan import hf_tensor_specs
    from megatron_dapo.weights.safetensors_io import CheckpointError

    ranks = dict(tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                 ep_rank=parallel_state.get_expert_model_parallel_rank(),
                 etp_rank=parallel_state.get_expert_tensor_parallel_rank())
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dtype = actor.config.torch_params_dtype
    arch = actor.arch
    try:
        reader = HFCheckpointReader(hf_dir)
    except CheckpointError as err:  # a damaged file: every rank parses the same headers, rank 0 prints
        raise UserError(f"--hf-checkpoint: {err}", echo=os.environ.get("RANK", "0") == "0") from err
    with reader:
        try:  # the same verdict on every rank (the same headers), rank 0 prints it
            reader.check_expected(hf_tensor_specs(arch, dtype), model=f"model_type {arch.model_type!r}")
        except CheckpointError as err:
            raise UserError(f"--hf-checkpoint: {err}", echo=os.environ.get("RANK", "0") == "0") from err
        for chunk in range(len(actor.chunks)):  # several under --num-layers-per-virtual-pipeline-stage
            try:
                shards = {name: shard.to(dtype) for name, shard in
                          iter_rank_shards(reader.get, arch, actor.layout, pp_rank=pp_rank, chunk=chunk, **ranks)}
            except CheckpointError as err:  # a tensor this rank reads is missing or unreadable
                raise UserError(f"--hf-checkpoint: {err}") from err
            actor.load_shards(shards, chunk, reload=False)
    actor.optimizer.reload_model_params()


def build_actor(args: argparse.Namespace, arch: ModelArch, actor_cfg, layout, init_ckpt: str | None):
    """The Megatron actor with its initial weights: a torch_dist checkpoint's model weights at any TP/PP
    (`init_ckpt`, converter output passed as --load: iteration 0, fresh optimizer), else --hf-checkpoint
    re-sharded."""
    from megatron_dapo.actor import MegatronActor
    from megatron_dapo.checkpoint.dist_load import load_model_weights

    actor = MegatronActor(arch, actor_cfg, layout)
    if init_ckpt is not None:
        for module in actor.modules:  # one chunk, or several under --num-layers-per-virtual-pipeline-stage
            load_model_weights(module, init_ckpt, arch)
        actor.optimizer.reload_model_params()  # the weights changed outside the optimizer
    else:
        load_hf_into_actor(actor, args.hf_checkpoint)
    return actor


def make_logger(run: RunConfig):
    """Rank 0's metrics logger; the run record (run_config.json next to metrics.jsonl, and wandb's config) says
    what ran, secrets redacted."""
    from megatron_dapo.trainer.metrics_log import MetricsLogger
    from megatron_dapo.trainer.run_record import argv_has_secret

    args = run.flags
    run.write(args.log_dir)
    return MetricsLogger(args.log_dir, total_steps=run.trainer.num_steps, wandb_project=args.wandb_project,
                         run_name=args.wandb_run_name, config=run.record(), use_wandb=not args.no_wandb,
                         progress=not args.no_progress, private_argv=argv_has_secret(args))


def write_report(log_dir: str | Path) -> None:
    """report.png of metrics.jsonl in `log_dir` (rank 0, at the end of the run)."""
    from megatron_dapo.trainer.metrics_log import read_metrics
    from megatron_dapo.trainer.report import plot

    log_dir = Path(log_dir)
    records = read_metrics(log_dir / "metrics.jsonl")
    if records:
        plot(records, log_dir / "report.png", title=str(log_dir))
        print(f"[megatron-dapo] report: {log_dir / 'report.png'}")


def virtual_stage_layers(args: argparse.Namespace, *, echo: bool) -> int | None:
    """--num-layers-per-virtual-pipeline-stage: the model's layer count, by which init_parallel sizes the virtual
    stages (every rank reads config.json; a layout that does not cut is the same verdict on every rank, printed by
    the one with `echo`). None without it."""
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    try:
        arch = ModelArch.from_hf(args.hf_checkpoint)
    except FileNotFoundError as err:
        raise UserError(f"--hf-checkpoint: {err}") from err
    try:
        check_model_layout(arch, ParallelLayout.from_args(args, int(os.environ.get("WORLD_SIZE", "1"))),
                           hf_checkpoint=args.hf_checkpoint)
    except UserError as err:
        err.echo = echo
        raise
    return arch.num_layers


def export_hf(actor, export_dir: str, hf_checkpoint: str, step: int) -> None:
    """--export-hf: the trained policy as an HF checkpoint (megatron_dapo/checkpoint/hf_export.py)."""
    from megatron_dapo.checkpoint.hf_export import export_hf as export

    path = export(actor, export_dir, hf_checkpoint)
    if path is not None:
        print(f"[megatron-dapo] exported step {step} as an HF checkpoint: {path}")


def check_model_config(hf_checkpoint: str) -> ModelArch | None:
    """--hf-checkpoint's config.json describes a supported model: its model_type a registered family (an unknown or
    missing one lists the supported ones and points to docs/MODELS.md) whose parse accepts the fields. Every rank
    reads the file (milliseconds), before rank 0 creates --save and before any model is built; a missing
    config.json is load_inputs' error (None here)."""
    path = os.path.join(hf_checkpoint, "config.json") if os.path.isdir(hf_checkpoint) else hf_checkpoint
    if not os.path.isfile(path):
        return None
    try:
        return ModelArch.from_hf(path)
    except ValueError as err:
        raise UserError(f"--hf-checkpoint {err}") from err


def check_flags(args: argparse.Namespace) -> tuple[RunConfig, RewardFn]:
    """The flags (same verdict on every rank): config dataclasses, batch arithmetic, prompt limits, the model family of
    --hf-checkpoint's config.json (and no mixture-of-experts flag for a model without experts), the planner's flags,
    the parallel layout over the world (EP x expert-TP within its ranks: init_parallel builds it next, on every rank).

    Returns the run config (built here, once) and the --reward-fn function (a dotted path is imported here, so a
    typo fails before the model).
    """
    from megatron_dapo.data import PromptLengthLimit, default_max_prompt_chars
    from megatron_dapo.planner import check_plan_flags
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.rollout.sglang.api_key import resolve_api_key
    from megatron_dapo.rollout.sglang.server import check_bind

    try:
        run = RunConfig.from_flags(args)
        args.sglang_api_key = resolve_api_key(args.sglang_api_key, args.sglang_api_key_file, os.environ)
        launched = rollout_build.rollout_engine_kind(args) == "sglang" and not args.sglang_server_urls
        if launched:  # checked before minutes of model build
            check_bind(args.sglang_host, args.sglang_api_key, allow_no_api_key=args.sglang_allow_no_api_key)
        PromptLengthLimit(max_tokens=args.max_prompt_length, on_long=args.on_long_prompt,
                          max_chars=args.max_prompt_chars or default_max_prompt_chars(args.max_prompt_length))
        reward_fn = get_reward_fn(args.reward_fn)
        arch = check_model_config(args.hf_checkpoint)
        if arch is not None:  # MoE-only flags on a dense model: refused, not ignored
            run.actor.check_model(arch)
        rollout_build.check_rollout_model(args)  # e.g. a model SGLang would serve wrong, before minutes of start-up
        check_plan_flags(args)  # --gpu-memory-gib sizes a colocated run's SGLang share
    except UserError:
        raise
    except ValueError as err:  # the config dataclasses name the flag
        raise UserError(str(err)) from err
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp = data_parallel_size(world, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, cp=getattr(args, "context_parallel_size", 1))
    try:  # the layout (EP x ETP within the ranks, SP, recompute, VPP) on every rank, before init_parallel builds it
        ParallelLayout.from_args(args, world)
    except ValueError as err:
        raise UserError(str(err)) from err
    check_batch_arithmetic(rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
                           global_batch_size=args.global_batch_size, dp=dp)
    from megatron_dapo.trainer.colocate import check_colocate_flags

    local = os.environ.get("LOCAL_WORLD_SIZE")
    try:
        check_colocate_flags(colocate=args.colocate, world_size=int(os.environ.get("WORLD_SIZE", "1")),
                             gpus_per_node=int(local) if local else None, gpus_per_engine=args.sglang_tp_size,
                             num_servers=args.sglang_num_servers, server_urls=args.sglang_server_urls,
                             sglang_gpus=args.sglang_gpus, weight_sync_mode=args.weight_sync_mode,
                             rollout_engine=args.rollout_engine, extra_args=args.sglang_extra_args.split(),
                             mem_fraction_static=args.mem_fraction_static, async_rollout=args.async_rollout)
    except ValueError as err:
        raise UserError(str(err)) from err
    return run, reward_fn


def prepare_rank0(args: argparse.Namespace):
    """Rank 0 before any process group: checks --load, --save and --log-dir (and locks --save for the run),
    raises the fd limit for the SGLang connections, starts an --async-rollout embedded engine early, reads every
    input, then (--overwrite-save) deletes the previous run's steps. Returns (engine or None, Inputs)."""
    from megatron_dapo.checkpoint.save_dir import clear_previous_steps, prepare_run_dirs
    from megatron_dapo.rollout.sglang.fd_limit import ensure_fd_limit

    engine = None
    # milliseconds, before anything is started or built (checkpoint/save_dir.py)
    _, overwritten = prepare_run_dirs(args)
    if rollout_build.rollout_engine_kind(args) == "sglang":  # rank 0 holds the HTTP connections to the servers
        ensure_fd_limit(args.sglang_max_concurrency, int(os.environ.get("WORLD_SIZE", "1")))
    if args.async_rollout and rollout_build.rollout_engine_kind(args) == "embedded":
        # its process boots (~25 s of imports on a busy 2-core machine) while this one reads the data and
        # builds the actor; it loads the tokenizer itself
        engine = rollout_build.make_rollout_engine(args, None)
    inputs = load_inputs(args, with_data=True)
    if overwritten:  # only once the inputs proved readable
        clear_previous_steps(Path(args.save), overwritten)
    return engine, inputs
