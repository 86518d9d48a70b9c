"""Entry point: `python -m megatron_dapo.train --help` (or under torchrun for TP/PP/DP).

Builds the pieces from flags (see megatron_dapo/arguments.py), loads the HF policy into the Megatron
actor, starts the rollout engine on global rank 0, resumes from --load when a checkpoint exists, and
runs `Trainer.run` (megatron_dapo/trainer/loop.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_dapo.algorithm import DynamicSamplingConfig, OffPolicyConfig, OverlongConfig, PolicyLossConfig
from megatron_dapo.arguments import build_parser
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout.collect import CollectConfig, Prompt, RewardFn
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.trainer.validation import (
    check_batch_arithmetic,
    check_context,
    check_model_layout,
    check_vocab,
    data_parallel_size,
    share_verdict,
)


def build_configs(args: argparse.Namespace, eos_ids: tuple[int, ...] = ()):
    """Flags -> (ActorConfig, CollectConfig, TrainerConfig); each dataclass validates its fields.

    The LR schedule counts rollout steps: warmup over --lr-warmup-steps of them, decay (when not
    constant) reaching --min-lr at --lr-decay-steps (default --num-steps)."""
    from megatron_dapo.actor import ActorConfig
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
        fused_linear_logprob=args.fused_linear_logprob,
        params_dtype=args.params_dtype or ("bfloat16" if torch.cuda.is_available() else "float32"),
        loss=PolicyLossConfig(eps_low=args.clip_ratio_low, eps_high=args.clip_ratio_high,
                              dual_clip_c=args.clip_ratio_c, agg_mode=args.loss_agg_mode),
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
        async_rollout=args.async_rollout,
        off_policy=OffPolicyConfig(use_tis=use_tis(args), tis_cap=args.tis_cap, mis_mode=args.mis_mode,
                                   mis_threshold=args.mis_threshold),
    )
    return actor, collect, trainer


def use_tis(args: argparse.Namespace) -> bool:
    """--use-tis / --no-use-tis as given; unset: on exactly when --async-rollout 1 (the batch was generated
    by the weights one update behind the actor, the gap TIS corrects)."""
    return args.use_tis if args.use_tis is not None else args.async_rollout > 0


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


def load_prompt_set(path: str, tokenizer, *, prompt_format: str, max_prompt_length: int,
                    max_prompt_chars: int | None = None, on_long_prompt: str = "skip", limit: int | None = None,
                    flag: str | None = None) -> list[Prompt]:
    """Dataset rows -> token-id prompts within the length limits; every row is read and validated.

    A prompt over `max_prompt_chars` (default: data.default_max_prompt_chars) is measured, never
    tokenized; one over `max_prompt_length` tokens after the template is skipped (counted) or, with
    on_long_prompt="error", rejected. Any problem raises UserError, prefixed with `flag`, the flag
    that named `path`, when given.
    """
    from megatron_dapo.data import (
        PromptLengthLimit,
        default_max_prompt_chars,
        encode_within_limits,
        load_prompts,
        render_prompt,
    )

    def encode(record) -> list[int]:
        if prompt_format == "chat":
            return render_prompt(record, tokenizer)
        return tokenizer.encode("\n".join(m["content"] for m in record.messages), add_special_tokens=False)

    prefix = f"{flag} " if flag else ""
    limits = PromptLengthLimit(max_tokens=max_prompt_length, on_long=on_long_prompt,
                               max_chars=max_prompt_chars or default_max_prompt_chars(max_prompt_length))
    try:
        kept, report = encode_within_limits(load_prompts(path, limit=limit), encode, limits, source=str(path))
    except (UserError, FileNotFoundError) as err:
        raise UserError(f"{prefix}{err}") from err
    if not kept:
        raise UserError(f"{prefix}{path}: no prompt is within --max-prompt-length {max_prompt_length} tokens and "
                        f"--max-prompt-chars {limits.max_chars} ({report.over_tokens} over the tokens, "
                        f"{report.over_chars} over the characters)")
    if report.over_chars or report.over_tokens:
        print(f"[megatron-dapo] {path}: skipped {report.over_tokens} prompts longer than {max_prompt_length} "
              f"tokens and {report.over_chars} longer than {limits.max_chars} characters (--on-long-prompt skip)")
    return [Prompt(prompt_ids=ids, ground_truth=r.ground_truth, index=r.index) for r, ids in kept]


def load_hf_into_actor(actor, hf_dir: str) -> None:
    """Copy HF safetensors weights into this rank's Megatron shards through the mapping table.

    The shards carry local-spec names; `MegatronActor.load_shards` matches them to the model's own
    parameter names (local or Transformer Engine spec) through `weights.mapping.canonical_mcore_name`.
    """
    from megatron.core import parallel_state

    from megatron_dapo.weights import iter_mcore_shards
    from megatron_dapo.weights.hf_format import HFCheckpointReader
    from megatron_dapo.weights.plan import virtual_stage
    from megatron_dapo.weights.safetensors_io import CheckpointError

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dtype = actor.config.torch_params_dtype
    try:
        reader = HFCheckpointReader(hf_dir)
    except CheckpointError as err:  # a damaged file: every rank parses the same headers, rank 0 prints
        raise UserError(f"--hf-checkpoint: {err}", echo=os.environ.get("RANK", "0") == "0") from err
    with reader:
        for chunk in range(len(actor.chunks)):  # several under --num-layers-per-virtual-pipeline-stage
            layout, stage = virtual_stage(actor.layout, actor.arch.num_layers, pp_rank, chunk)
            try:
                shards = {name: per_tp[tp_rank].to(dtype)
                          for name, per_tp in iter_mcore_shards(reader.get, actor.arch, layout, stage)}
            except CheckpointError as err:  # a tensor this rank reads is missing or unreadable
                raise UserError(f"--hf-checkpoint: {err}") from err
            actor.load_shards(shards, chunk, reload=False)
    actor.optimizer.reload_model_params()


def rollout_engine_kind(args: argparse.Namespace) -> str:
    """--rollout-engine, default sglang when CUDA is available, else embedded."""
    return args.rollout_engine or ("sglang" if torch.cuda.is_available() else "embedded")


def memory_server_args(args: argparse.Namespace, *, cuda: bool) -> tuple[str, ...]:
    """SGLang flags for the memory of launched CUDA servers: --mem-fraction-static (given, or with --colocate the
    planner's, megatron_dapo/planner.py) and, colocated, --enable-memory-saver (without it
    release_memory_occupation frees nothing). CPU servers size their KV cache by tokens (sglang_server.py)."""
    if not cuda:
        return ()
    frac = args.mem_fraction_static
    if frac is None and args.colocate:
        from megatron_dapo.planner import plan_from_args, plan_stages, sglang_share

        arch, layout, inputs, spec = plan_from_args(args)
        frac = sglang_share(arch, plan_stages(arch, layout, inputs, spec), inputs,
                            spec.bytes_per_element).mem_fraction_static
    out = ("--mem-fraction-static", f"{frac:g}") if frac is not None else ()
    return out + (("--enable-memory-saver",) if args.colocate else ())


def make_rollout_engine(args: argparse.Namespace, tokenizer):
    """The engine of global rank 0: embedded on CPU, else SGLang servers (launched or attached)."""
    from megatron_dapo.rollout import make_engine

    kind = rollout_engine_kind(args)
    if kind == "embedded":
        kwargs = dict(tokenizer=tokenizer, seed=args.seed,
                      max_batch_size=args.rollout_batch_size * args.n_samples_per_prompt)
        if args.async_rollout:  # generation must run beside training: its own process (and interpreter lock)
            from megatron_dapo.rollout.process_engine import ProcessEngine

            return ProcessEngine(args.hf_checkpoint, **(kwargs | {"tokenizer": args.tokenizer or args.hf_checkpoint}))
        return make_engine("embedded", args.hf_checkpoint, **kwargs)
    from megatron_dapo.rollout.sglang import setup as server_setup
    from megatron_dapo.rollout.sglang.engine import ClientConfig
    from megatron_dapo.rollout.sglang.server import ServerConfig

    attach = bool(args.sglang_server_urls)
    if args.sglang_router_url and not attach:
        raise ValueError("--sglang-router-url is for attach mode: give the servers behind it with "
                         "--sglang-server-urls (launched servers get their own router)")
    cuda = torch.cuda.is_available()
    seeded = args.seed is not None  # the rollouts carry per-request sampling seeds
    server_env = {} if attach else server_setup.launched_server_gpus(cuda=cuda, sglang_gpus=args.sglang_gpus,
                                                                     colocate=args.colocate)
    trainer_gpu = (server_setup.physical_gpu(torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES"))
                   if cuda else None)
    api_key = args.sglang_api_key  # resolved by check_flags: --sglang-api-key-file, the flag, then SGLANG_API_KEY
    client = ClientConfig(
        max_concurrency=args.sglang_max_concurrency, api_key=api_key, server_wait_s=args.sglang_server_wait_s,
        http_timeout_s=args.sglang_http_timeout, min_tokens_per_s=args.sglang_min_tokens_per_s,
        update_mode=server_setup.weight_sync_mode(requested=args.weight_sync_mode, attach=attach, cuda=cuda,
                                                  colocate=args.colocate, trainer_gpu=trainer_gpu,
                                                  server_gpus=None if attach else args.sglang_gpus),
        bucket_bytes=args.weight_sync_bucket_mb << 20,
        sync_backend="nccl" if cuda else "gloo",
        sync_master_address=args.weight_sync_master_addr, sync_master_port=args.weight_sync_master_port,
    )
    if client.update_mode == "tensor" and not cuda:
        from megatron_dapo.weight_sync.tensor_ipc import check_shm_space

        check_shm_space(client.bucket_bytes)  # before minutes of server start-up
    if attach:  # the engine first checks that every URL is SGLang (UserError naming the one that is not)
        engine = make_engine("sglang", client=client, server_urls=args.sglang_server_urls,
                             router_url=args.sglang_router_url)
        for line in server_setup.attached_determinism_warnings(
                args.sglang_server_urls, seeded=seeded, timeout_s=client.http_timeout_s,
                headers={"Authorization": f"Bearer {api_key}"} if api_key else None):
            print(line)
        return engine
    python = args.sglang_python or sys.executable
    if not cuda and args.sglang_python is None and Path(".venv-sglang/bin/python").exists():
        python = ".venv-sglang/bin/python"  # the CPU SGLang environment of `make sglang-env`
    extra_args = tuple(args.sglang_extra_args.split()) + memory_server_args(args, cuda=cuda)
    deterministic, note = server_setup.deterministic_server_args(
        seeded=seeded, wanted=args.sglang_deterministic_inference, device="cuda" if cuda else "cpu",
        extra_args=extra_args)
    if note:
        print(note)
    server = ServerConfig(model_path=args.hf_checkpoint, num_servers=args.sglang_num_servers,
                          tp_per_server=args.sglang_tp_size, base_port=args.sglang_base_port,
                          host=args.sglang_host, extra_args=extra_args + deterministic,
                          device="cuda" if cuda else "cpu", python=python,
                          log_dir=str(Path(args.log_dir) / "sglang"), env=server_env,
                          api_key=api_key, allow_no_api_key=args.sglang_allow_no_api_key)
    return make_engine("sglang", server, client=client)


QUIET_EXIT_DELAY_S = 2.0
"""How much later than the rank that prints an input error the ranks that stay quiet exit."""


@dataclass
class Inputs:
    """What the run reads before any model exists; the prompt lists are filled on global rank 0 only."""

    arch: ModelArch
    tokenizer: Any
    train_prompts: list[Prompt] = field(default_factory=list)
    eval_prompts: list[Prompt] = field(default_factory=list)


def check_flags(args: argparse.Namespace) -> RewardFn:
    """The flags alone (same verdict on every rank): config dataclasses, batch arithmetic, prompt limits.

    Returns the --reward-fn function (a dotted path is imported here, so a typo fails before the model).
    """
    from megatron_dapo.data import PromptLengthLimit, default_max_prompt_chars
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.rollout.sglang.api_key import resolve_api_key
    from megatron_dapo.rollout.sglang.server import check_bind

    try:
        build_configs(args)
        args.sglang_api_key = resolve_api_key(args.sglang_api_key, args.sglang_api_key_file, os.environ)
        if rollout_engine_kind(args) == "sglang" and not args.sglang_server_urls:  # before minutes of model build
            check_bind(args.sglang_host, args.sglang_api_key, allow_no_api_key=args.sglang_allow_no_api_key)
        PromptLengthLimit(max_tokens=args.max_prompt_length, on_long=args.on_long_prompt,
                          max_chars=args.max_prompt_chars or default_max_prompt_chars(args.max_prompt_length))
        reward_fn = get_reward_fn(args.reward_fn)
    except UserError:
        raise
    except ValueError as err:  # the config dataclasses name the flag
        raise UserError(str(err)) from err
    dp = data_parallel_size(int(os.environ.get("WORLD_SIZE", "1")), tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size, cp=getattr(args, "context_parallel_size", 1))
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
    return reward_fn


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


def main(argv: list[str] | None = None) -> None:
    """Run; an input error prints one line `error: ...` on stderr and exits 2 (`--debug`: the traceback)."""
    args = build_parser().parse_args(argv)
    if args.dry_run:  # memory plan only: no process group, no model (megatron_dapo/planner.py)
        from megatron_dapo.planner import print_plan

        sys.exit(print_plan(args))
    try:
        train(args)
    except UserError as err:
        if args.debug:
            raise
        if err.echo:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun names the first rank to exit as the root cause and SIGTERMs the rest: let the printer go first
            time.sleep(QUIET_EXIT_DELAY_S)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def train(args: argparse.Namespace) -> None:
    """validate flags -> read inputs (rank 0) -> build -> generate/reward/filter/train/sync/eval/save (Trainer)."""
    from megatron_dapo.actor import init_parallel
    from megatron_dapo.checkpoint.dist_load import initial_checkpoint
    from megatron_dapo.checkpoint.save_dir import prepare_run_dirs
    from megatron_dapo.checkpoint.training import CheckpointSaver
    from megatron_dapo.data import ResumableSampler
    from megatron_dapo.rollout.sglang.fd_limit import ensure_fd_limit
    from megatron_dapo.trainer.loop import Trainer

    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        reward_fn = check_flags(args)
    except UserError as err:
        err.echo = rank0  # every rank reaches the same verdict; one prints it
        raise
    engine, inputs, verdict = None, None, None
    if rank0:  # only rank 0 checks --load and --save (and locks --save for the run) and reads the prompt files
        try:
            # milliseconds, before anything is started or built (megatron_dapo/checkpoint/save_dir.py)
            prepare_run_dirs(args)
            if rollout_engine_kind(args) == "sglang":  # rank 0 holds the HTTP connections to the servers
                ensure_fd_limit(args.sglang_max_concurrency, int(os.environ.get("WORLD_SIZE", "1")))
            if args.async_rollout and rollout_engine_kind(args) == "embedded":
                # its process boots (~25 s of imports on a busy 2-core machine) while this one reads the data and
                # builds the actor; it loads the tokenizer itself
                engine = make_rollout_engine(args, None)
            inputs = load_inputs(args, with_data=True)
        except UserError as err:
            verdict = err
    # process groups only: the verdict travels over them
    # an interleaved pipeline sizes parallel_state by the layer count (every rank reads config.json)
    num_layers = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        try:
            arch = ModelArch.from_hf(args.hf_checkpoint)
        except FileNotFoundError as err:
            raise UserError(f"--hf-checkpoint: {err}") from err
        try:  # init_parallel cuts the layers into virtual stages: the same verdict on every rank, one prints it
            check_model_layout(arch, ParallelLayout.from_args(args, int(os.environ.get("WORLD_SIZE", "1"))),
                               hf_checkpoint=args.hf_checkpoint)
        except UserError as err:
            err.echo = rank0
            raise
        num_layers = arch.num_layers
    layout = init_parallel(seed=args.seed, num_layers=num_layers, **ParallelLayout.options_from_args(args))
    share_verdict(verdict)
    inputs = inputs or load_inputs(args, with_data=False)
    tokenizer, train_prompts = inputs.tokenizer, inputs.train_prompts
    eos = tuple(sorted({t for t in (tokenizer.eos_token_id,) if t is not None}))
    actor_cfg, collect_cfg, trainer_cfg = build_configs(args, eos)
    init_ckpt = initial_checkpoint(args.load, args.mcore_checkpoint)  # hf-to-mcore output, if given
    if args.colocate:  # the engines free their GPU memory before the actor allocates any (colocate.py)
        engine = start_colocated_engines(args, tokenizer, rank0)
    actor = build_actor(args, inputs.arch, actor_cfg, layout, init_ckpt)
    sampler = ResumableSampler(max(len(train_prompts), 1), seed=args.seed)
    if rank0 and engine is None:
        engine = make_rollout_engine(args, tokenizer)
    logger = make_logger(args) if rank0 else None

    def next_prompts(k: int) -> list[Prompt]:
        return [train_prompts[i] for i in sampler.next_batch(k)]

    saver = CheckpointSaver(args.save, fully_parallel=args.ckpt_fully_parallel_save,
                            async_save=args.async_save) if args.save else None

    def save(step: int) -> None:
        from megatron_dapo.distributed import comm
        from megatron_dapo.rollout import partial_rollout

        with trainer.section("while preparing the checkpoint's sampler state"):  # rank 0's; a failure reaches all
            state = {"sampler": sampler.state_dict()}
            if args.partial_rollout:  # the groups the next step resumes (rank 0's; 12 B per carried token)
                state["carried"] = partial_rollout.state(trainer.carried)
            ahead = trainer.checkpoint_state()  # rank 0's batch generated ahead (--async-rollout), {} elsewhere
        if trainer.wait_group is not None:  # identical common state on every rank; gloo, rank 0 may be late
            state = comm.broadcast_object(state, 0, group=trainer.wait_group)
        saver.save(step, actor, extra=state | ahead)

    phases, weight_sync = make_colocated(args, actor, engine) if args.colocate else (None, None)
    trainer = Trainer(config=trainer_cfg, collect=collect_cfg, actor=actor, engine=engine,
                      next_prompts=next_prompts if rank0 else None, eval_prompts=inputs.eval_prompts,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      reward_fn=reward_fn, logger=logger, save_fn=save if args.save else None,
                      phases=phases, weight_sync=weight_sync)  # weight_sync None: built from the engine, once
    if phases is not None:
        phases.section = trainer.section  # the phase switches' status barrier: the trainer's wait group
    try:
        if init_ckpt is not None:  # torch_dist weights at iteration 0: the engine was started from --hf-checkpoint
            if trainer.phases is None:  # --colocate: Trainer.run pushes as the released engines resume
                trainer.sync_weights(0)
        else:
            resume(args, trainer, sampler)
        trainer.run()
        if saver is not None:
            saver.close()  # an --async-save in flight is finished and renamed here
        if args.export_hf:
            from megatron_dapo.checkpoint.hf_export import export_hf

            path = export_hf(actor, args.export_hf, args.hf_checkpoint)
            if path is not None:
                print(f"[megatron-dapo] exported step {trainer.step} as an HF checkpoint: {path}")
    finally:
        if logger is not None:
            logger.close()
            _write_report(Path(args.log_dir))
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():
            from megatron_dapo.distributed import comm

            comm.barrier()
            dist.destroy_process_group()


def start_colocated_engines(args: argparse.Namespace, tokenizer, rank0: bool):
    """--colocate, before any rank builds its actor: rank 0 starts (or attaches to) the engines and every engine
    releases its weights, KV cache and CUDA graphs; the other ranks wait in the start-up section (a failure on
    rank 0 reaches them there). Returns rank 0's engine, None elsewhere.

    Why first: an engine holds --mem-fraction-static x GPU memory plus its runtime (0.77 x 80 GB + ~4 GiB at the
    32B launcher) until released, and the actor's build peaks at twice its bf16 weights plus the fp32 grad buffer
    (planner.startup_lines); together that was 83 GiB per 80 GB GPU (89 resuming), or, had the actor allocated
    first, SGLang would have sized its KV pool from less free memory than planned."""
    from megatron_dapo.trainer.colocate import release_engines, start_up_section

    engine, sync = None, start_up_section(args.rollout_timeout)
    what = "while rank 0 started the colocated engines and released their GPU memory"
    with sync(what) if sync is not None else nullcontext():
        if rank0:
            engine = make_rollout_engine(args, tokenizer)
            release_engines(engine)
    return engine


def make_colocated(args: argparse.Namespace, actor, engine):
    """--colocate: this rank's PhaseSwitcher (its `section` is set once the Trainer exists) and its weight sync,
    ColocatedSync (build_weight_sync with this rank's ColocatedPusher; a collective: every rank makes every
    engine's group). Engine URLs: --sglang-server-urls, else the launched servers' (--sglang-host,
    --sglang-base-port)."""
    from megatron_dapo.trainer.colocate import ActorOffloader, PhaseSwitcher
    from megatron_dapo.weight_sync.build import build_weight_sync
    from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, make_engine_groups

    urls = args.sglang_server_urls or [f"http://{args.sglang_host}:{args.sglang_base_port + i}"
                                       for i in range(args.sglang_num_servers)]
    groups = make_engine_groups(urls, args.sglang_tp_size)
    pusher = ColocatedPusher(groups, bucket_bytes=args.weight_sync_bucket_mb << 20,
                             api_key=args.sglang_api_key, http_timeout_s=args.sglang_http_timeout)
    return (PhaseSwitcher(offloader=ActorOffloader(actor.chunks, actor.optimizer), engine=engine),
            build_weight_sync(engine, wait_group=None, colocated=pusher))


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


def make_logger(args: argparse.Namespace):
    """Rank 0's metrics logger; args.json records the run's flags next to metrics.jsonl, secrets redacted."""
    from megatron_dapo.trainer.metrics_log import MetricsLogger
    from megatron_dapo.trainer.run_record import argv_has_secret, run_record

    record = run_record(args)  # the one record of the run: no API key in args.json or wandb's config
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.log_dir) / "args.json").write_text(json.dumps(record, indent=2))
    return MetricsLogger(args.log_dir, total_steps=args.num_steps, wandb_project=args.wandb_project,
                         run_name=args.wandb_run_name, config=record, use_wandb=not args.no_wandb,
                         progress=not args.no_progress, private_argv=argv_has_secret(args))


def resume(args: argparse.Namespace, trainer, sampler) -> None:
    """With --load and a checkpoint in it: actor state, rank 0's sampler, the step; the engine gets the weights."""
    from megatron_dapo.checkpoint.training import load_checkpoint
    from megatron_dapo.rollout import partial_rollout

    if not args.load:
        return
    extra = load_checkpoint(args.load, trainer.actor)
    if extra is None:
        return
    rank0 = dist.get_rank() == 0
    with trainer.section("while restoring the sampler state from the checkpoint"):  # the others wait in the sync
        if rank0:  # only rank 0 draws prompts; the other ranks' samplers are placeholders
            sampler.load_state_dict(extra["sampler"])
            if args.partial_rollout:  # a checkpoint written without --partial-rollout carries nothing
                trainer.carried = partial_rollout.from_state(extra.get("carried"), Prompt)
            elif (extra.get("carried") or {}).get("groups"):
                print(f"[megatron-dapo] warning: the checkpoint carries {len(extra['carried']['groups'])} "
                      f"partial-rollout groups; without --partial-rollout they are dropped", file=sys.stderr)
        trainer.step = int(extra["step"])
        trainer.restore_state(extra)  # --async-rollout: the batch of step + 1, generated before the save
    if trainer.phases is None:  # --colocate: Trainer.run pushes as the released engines resume, the actor offloaded
        trainer.sync_weights(trainer.step)  # the engine still holds the initial weights
    if rank0:
        print(f"[megatron-dapo] resumed from {args.load} at step {trainer.step}")


def _write_report(log_dir: Path) -> None:
    from megatron_dapo.trainer.metrics_log import read_metrics
    from megatron_dapo.trainer.report import plot

    records = read_metrics(log_dir / "metrics.jsonl")
    if records:
        plot(records, log_dir / "report.png", title=str(log_dir))
        print(f"[megatron-dapo] report: {log_dir / 'report.png'}")


if __name__ == "__main__":  # the guard matters: dist_checkpointing's spawn Manager re-imports __main__
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
