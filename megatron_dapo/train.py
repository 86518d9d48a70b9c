"""Entry point: `python -m megatron_dapo.train --help` (or under torchrun for TP/PP/DP).

parse -> validate (check_flags, the same verdict on every rank) -> build (megatron_dapo/trainer/build.py: inputs,
actor, logger; the rollout engine here) -> resume (Checkpointer.load + one weight push) -> `Trainer.run`
(megatron_dapo/trainer/loop.py). The run config (megatron_dapo/trainer/run_config.py) is built once from the flags
and written to --log-dir as run_config.json, the record of what ran.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.arguments import build_parser
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.collect import RewardFn
from megatron_dapo.trainer import build
from megatron_dapo.trainer.run_config import RunConfig
from megatron_dapo.trainer.validation import check_batch_arithmetic, data_parallel_size, share_verdict


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


def check_flags(args: argparse.Namespace) -> tuple[RunConfig, RewardFn]:
    """The flags alone (same verdict on every rank): config dataclasses, batch arithmetic, prompt limits.

    Returns the run config (built here, once) and the --reward-fn function (a dotted path is imported here, so a
    typo fails before the model).
    """
    from megatron_dapo.data import PromptLengthLimit, default_max_prompt_chars
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.rollout.sglang.api_key import resolve_api_key
    from megatron_dapo.rollout.sglang.server import check_bind

    try:
        run = RunConfig.from_flags(args)
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
    return run, reward_fn


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
    """validate flags -> read inputs (rank 0) -> build -> resume -> generate/reward/filter/train/sync/eval/save."""
    from megatron_dapo.actor import init_parallel
    from megatron_dapo.checkpoint.checkpointer import Checkpointer
    from megatron_dapo.checkpoint.dist_load import initial_checkpoint
    from megatron_dapo.data import ResumableSampler
    from megatron_dapo.trainer.loop import Trainer

    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        run, reward_fn = check_flags(args)
    except UserError as err:
        err.echo = rank0  # every rank reaches the same verdict; one prints it
        raise
    engine, inputs, verdict = None, None, None
    if rank0:
        try:
            engine, inputs = prepare_rank0(args)
        except UserError as err:
            verdict = err
    # process groups only: the verdict travels over them
    layout = init_parallel(seed=args.seed, num_layers=build.virtual_stage_layers(args, echo=rank0),
                           **ParallelLayout.options_from_args(args))
    share_verdict(verdict)
    inputs = inputs or build.load_inputs(args, with_data=False)
    tokenizer, prompts = inputs.tokenizer, inputs.train_prompts
    run = run.with_stop_tokens(tuple(sorted({t for t in (tokenizer.eos_token_id,) if t is not None})))
    init_ckpt = initial_checkpoint(args.load, args.mcore_checkpoint)  # hf-to-mcore output, if given
    if args.colocate:  # the engines free their GPU memory before the actor allocates any (colocate.py)
        engine = start_colocated_engines(args, tokenizer, rank0)
    actor = build.build_actor(args, inputs.arch, run.actor, layout, init_ckpt)
    sampler = ResumableSampler(max(len(prompts), 1), seed=args.seed)  # rank 0 draws; a placeholder elsewhere
    if rank0 and engine is None:
        engine = make_rollout_engine(args, tokenizer)
    logger = build.make_logger(run) if rank0 else None
    trainer = Trainer(config=run.trainer, collect=run.collect, actor=actor, engine=engine,
                      next_prompts=(lambda k: [prompts[i] for i in sampler.next_batch(k)]) if rank0 else None,
                      eval_prompts=inputs.eval_prompts, reward_fn=reward_fn, logger=logger,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    if args.colocate:
        trainer.phases, trainer.pusher = make_colocated(args, actor, engine, trainer.section)
    trainer.checkpointer = Checkpointer(
        {"trainer": trainer, "sampler": sampler, "carried": trainer.carried, "ahead": trainer.ahead}, actor=actor,
        save_dir=args.save, load_dir=None if init_ckpt else args.load, fully_parallel=args.ckpt_fully_parallel_save,
        async_save=args.async_save, section=trainer.section, group=trainer.wait_group)
    try:
        resumed = trainer.checkpointer.load() is not None
        if (resumed or init_ckpt is not None) and trainer.phases is None:  # --colocate: Trainer.run pushes
            trainer.sync_weights(trainer.step)  # the engine was started from --hf-checkpoint
        trainer.run()
        trainer.checkpointer.close()  # an --async-save in flight is finished and renamed here
        if args.export_hf:
            build.export_hf(actor, args.export_hf, args.hf_checkpoint, trainer.step)
    finally:
        if logger is not None:
            logger.close()
            build.write_report(args.log_dir)
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():
            from megatron_dapo.distributed import comm

            comm.barrier()
            dist.destroy_process_group()


def prepare_rank0(args: argparse.Namespace):
    """Rank 0 before any process group: checks --load and --save (and locks --save for the run), raises the fd
    limit for the SGLang connections, starts an --async-rollout embedded engine early, reads every input.
    Returns (engine or None, Inputs)."""
    from megatron_dapo.checkpoint.save_dir import prepare_run_dirs
    from megatron_dapo.rollout.sglang.fd_limit import ensure_fd_limit

    engine = None
    prepare_run_dirs(args)  # milliseconds, before anything is started or built (checkpoint/save_dir.py)
    if rollout_engine_kind(args) == "sglang":  # rank 0 holds the HTTP connections to the servers
        ensure_fd_limit(args.sglang_max_concurrency, int(os.environ.get("WORLD_SIZE", "1")))
    if args.async_rollout and rollout_engine_kind(args) == "embedded":
        # its process boots (~25 s of imports on a busy 2-core machine) while this one reads the data and
        # builds the actor; it loads the tokenizer itself
        engine = make_rollout_engine(args, None)
    return engine, build.load_inputs(args, with_data=True)


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


def make_colocated(args: argparse.Namespace, actor, engine, section):
    """--colocate: this rank's PhaseSwitcher and ColocatedPusher (a collective: every rank makes every engine's
    group). Engine URLs: --sglang-server-urls, else the launched servers' (--sglang-host, --sglang-base-port).
    `section`: Trainer.section, the phase switches' status barrier on the wait group."""
    from megatron_dapo.trainer.colocate import ActorOffloader, PhaseSwitcher
    from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, make_engine_groups

    urls = args.sglang_server_urls or [f"http://{args.sglang_host}:{args.sglang_base_port + i}"
                                       for i in range(args.sglang_num_servers)]
    groups = make_engine_groups(urls, args.sglang_tp_size)
    pusher = ColocatedPusher(groups, bucket_bytes=args.weight_sync_bucket_mb << 20,
                             api_key=args.sglang_api_key, http_timeout_s=args.sglang_http_timeout)
    return PhaseSwitcher(offloader=ActorOffloader(actor.chunks, actor.optimizer), engine=engine,
                         section=section), pusher


if __name__ == "__main__":  # the guard matters: dist_checkpointing's spawn Manager re-imports __main__
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
