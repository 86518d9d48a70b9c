"""The rollout engine of global rank 0, built once from the flags: the embedded engine (in this process, or in its
own with --async-rollout 1 on CPU), or SGLang servers, launched (with their router) or attached by URL.

Cost at the production setting (the 32B split launcher: 16 servers x TP8 attached): one /server_info round trip
per server at attach, in parallel; launched servers take minutes to load the weights, which is why every flag
they need is checked before (train.check_flags) and the colocated engines start before any actor is built
(trainer/colocate.py: start_colocated_engines).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def rollout_engine_kind(args: argparse.Namespace) -> str:
    """--rollout-engine, default sglang when CUDA is available, else embedded."""
    return args.rollout_engine or ("sglang" if torch.cuda.is_available() else "embedded")


def check_rollout_model(args: argparse.Namespace) -> None:
    """Refuses, before anything is built or launched, a --hf-checkpoint the chosen engine would serve wrong (ValueError
    naming the config.json fields): SGLang and an MoE model with dense layers (sglang/setup.py check_sglang_serves);
    --moe-routing-replay with a model without experts. Reads config.json only (milliseconds)."""
    if args.hf_checkpoint is None or not (Path(args.hf_checkpoint) / "config.json").is_file():
        return  # a missing config.json is check_model_config's error
    _routing(args)
    if rollout_engine_kind(args) != "sglang":
        return
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.rollout.sglang.setup import check_sglang_serves

    config = Path(args.hf_checkpoint) / "config.json"
    check_sglang_serves(ModelArch.from_hf(args.hf_checkpoint), str(config))


def _routing(args: argparse.Namespace):
    """RoutingShape of --hf-checkpoint's model with --moe-routing-replay, else None (config.json only)."""
    if not getattr(args, "moe_routing_replay", False):
        return None
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.rollout.types import routing_of

    return routing_of(ModelArch.from_hf(args.hf_checkpoint), True)


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


def weight_sync_mode(args: argparse.Namespace) -> str | None:
    """The run's weight-sync transport (a name of weight_sync/transports/), None for the embedded engine: the
    flag, defaulted and checked against where the servers run and global rank 0's GPU
    (transports.weight_sync_mode). Rank 0's answer: make_rollout_engine checks it before any server starts, and
    the trainer's build_weight_sync makes its transport from it. Pure and cheap (no server asked)."""
    if rollout_engine_kind(args) != "sglang":
        return None
    from megatron_dapo.rollout.sglang.setup import physical_gpu
    from megatron_dapo.weight_sync.transports import weight_sync_mode as resolve

    cuda = torch.cuda.is_available()
    attach = bool(args.sglang_server_urls)
    trainer_gpu = physical_gpu(torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES")) if cuda else None
    return resolve(requested=args.weight_sync_mode, attach=attach, cuda=cuda, colocate=args.colocate,
                   trainer_gpu=trainer_gpu, server_gpus=None if attach else args.sglang_gpus)


def make_rollout_engine(args: argparse.Namespace, tokenizer):
    """The engine of global rank 0: embedded on CPU, else SGLang servers (launched or attached)."""
    from megatron_dapo.rollout import make_engine

    kind = rollout_engine_kind(args)
    routing = _routing(args)  # --moe-routing-replay: the engine returns each token's experts
    if kind == "embedded":
        kwargs = dict(tokenizer=tokenizer, seed=args.seed,
                      max_batch_size=args.rollout_batch_size * args.n_samples_per_prompt,
                      record_routing=routing is not None)
        if args.async_rollout:  # generation must run beside training: its own process (and interpreter lock)
            from megatron_dapo.rollout.process_engine import ProcessEngine

            return ProcessEngine(args.hf_checkpoint, **(kwargs | {"tokenizer": args.tokenizer or args.hf_checkpoint}))
        return make_engine("embedded", args.hf_checkpoint, **kwargs)
    from megatron_dapo.rollout.sglang import setup as server_setup
    from megatron_dapo.rollout.sglang.engine import ClientConfig
    from megatron_dapo.rollout.sglang.server import ServerConfig
    from megatron_dapo.weight_sync.transports import transport

    check_rollout_model(args)  # before any server is attached or launched

    attach = bool(args.sglang_server_urls)
    if args.sglang_router_url and not attach:
        raise ValueError("--sglang-router-url is for attach mode: give the servers behind it with "
                         "--sglang-server-urls (launched servers get their own router)")
    cuda = torch.cuda.is_available()
    seeded = args.seed is not None  # the rollouts carry per-request sampling seeds
    server_env = {} if attach else server_setup.launched_server_gpus(cuda=cuda, sglang_gpus=args.sglang_gpus,
                                                                     colocate=args.colocate)
    mode = weight_sync_mode(args)  # the transport checks the servers' placement: before any server starts
    api_key = args.sglang_api_key  # resolved by check_flags: --sglang-api-key-file, the flag, then SGLANG_API_KEY
    client = ClientConfig(
        max_concurrency=args.sglang_max_concurrency, api_key=api_key, server_wait_s=args.sglang_server_wait_s,
        http_timeout_s=args.sglang_http_timeout, min_tokens_per_s=args.sglang_min_tokens_per_s,
        bucket_bytes=args.weight_sync_bucket_mb << 20,
        sync_backend="nccl" if cuda else "gloo",
        sync_master_address=args.weight_sync_master_addr, sync_master_port=args.weight_sync_master_port,
        routing=routing,
    )
    transport(mode).check_host(cuda=cuda, bucket_bytes=client.bucket_bytes)  # before minutes of server start-up
    if attach:  # the engine first checks that every URL is SGLang (UserError naming the one that is not)
        engine = make_engine("sglang", client=client, server_urls=args.sglang_server_urls,
                             router_url=args.sglang_router_url)
        if routing is not None:  # before the start-up's weight push, not at the first response
            try:
                server_setup.check_attached_routes(args.sglang_server_urls, timeout_s=client.http_timeout_s,
                                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
            except BaseException:
                engine.shutdown()
                raise
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
                          api_key=api_key, allow_no_api_key=args.sglang_allow_no_api_key,
                          return_routed_experts=routing is not None)
    return make_engine("sglang", server, client=client)
