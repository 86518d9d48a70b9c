"""The rollout engine of global rank 0, built once from its config (RolloutEngineConfig, parsed from the flags by
megatron_dapo/startup.py): the embedded engine (in this process, or in its own with --async-rollout 1 on CPU), or
SGLang servers, launched (with their router) or attached by URL.

Cost at the production setting (the 32B split launcher: 16 servers x TP4 attached): one /server_info round trip
per server at attach, in parallel; launched servers take minutes to load the weights, which is why every flag
they need is checked before (RolloutEngineConfig's construction, then startup.check_flags for what needs the world)
and the colocated engines start before any actor is built (trainer/colocate.py: start_colocated_engines).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_dapo.models.hf_config import ModelArch, require_arch

if TYPE_CHECKING:
    from megatron_dapo.planner.report import Plan
    from megatron_dapo.rollout.multi_turn import ToolUseConfig


def rollout_engine_kind(requested: str | None) -> str:
    """--rollout-engine, default sglang when CUDA is available, else embedded."""
    return requested or ("sglang" if torch.cuda.is_available() else "embedded")


@dataclass(frozen=True, kw_only=True)
class RolloutEngineConfig:
    """Rank 0's rollout engine and its weight-sync transport, as the "rollout" flags ask (each field: its flag)."""

    kind: str
    """--rollout-engine, resolved (rollout_engine_kind)."""
    hf_checkpoint: str
    """--hf-checkpoint: the model the engine serves."""
    arch: ModelArch | None
    """--hf-checkpoint's architecture, parsed once at start-up; None: it has no config.json (load_inputs' error)."""
    tokenizer: str | None
    """--tokenizer."""
    seed: int | None
    """--seed: per-request sampling seeds."""
    max_batch_size: int
    """--rollout-batch-size x --n-samples-per-prompt: the embedded engine's batch."""
    async_rollout: int
    """--async-rollout."""
    max_staleness: int = 0
    """--max-staleness (the fully async rollout, K >= 1; 0: off)."""
    colocate: bool
    """--colocate."""
    log_dir: str
    """--log-dir: launched servers log under its sglang/."""
    moe_routing_replay: bool
    """--moe-routing-replay."""
    rollout_timeout_h: float
    """--rollout-timeout: the colocated start-up's wait."""
    mem_fraction_static: float | None
    """--mem-fraction-static."""
    colocated_plan: Plan | None = None
    """--colocate on CUDA without --mem-fraction-static: the memory plan that sizes SGLang's share."""
    sglang_num_servers: int
    """--sglang-num-servers"""
    sglang_tp_size: int
    """--sglang-tp-size / --rollout-num-gpus-per-engine"""
    sglang_base_port: int
    """--sglang-base-port"""
    sglang_host: str
    """--sglang-host"""
    sglang_extra_args: tuple[str, ...]
    """--sglang-extra-args, split"""
    sglang_python: str | None
    """--sglang-python"""
    sglang_gpus: str | None
    """--sglang-gpus"""
    sglang_server_urls: tuple[str, ...] | None
    """--sglang-server-urls: attach mode"""
    tools: ToolUseConfig | None = None
    """The "tool use" flags (--tool-template ...): rollouts become conversations with a code tool
    (rollout/multi_turn.py, `with_tools`); None: single-turn. Launched SGLang servers then load the tokenizer (the
    templates' stop strings are matched on decoded text)."""
    sglang_router_url: str | None
    """--sglang-router-url"""
    sglang_max_concurrency: int
    """--sglang-max-concurrency"""
    sglang_api_key: str | None = field(repr=False)  # out of tracebacks and logs
    """The API key, resolved: --sglang-api-key-file, --sglang-api-key, then $SGLANG_API_KEY."""
    sglang_allow_no_api_key: bool
    """--sglang-allow-no-api-key"""
    sglang_server_wait_s: float
    """--sglang-server-wait-s"""
    sglang_http_timeout: float
    """--sglang-http-timeout"""
    sglang_min_tokens_per_s: float
    """--sglang-min-tokens-per-s"""
    sglang_deterministic_inference: bool
    """--sglang-deterministic-inference"""
    weight_sync_mode: str | None
    """--weight-sync-mode as given (None: the default for the placement, sglang/setup.py weight_sync_mode)."""
    weight_sync_bucket_mb: int
    """--weight-sync-bucket-mb"""
    weight_sync_master_addr: str
    """--weight-sync-master-addr"""
    weight_sync_master_port: int
    """--weight-sync-master-port"""

    def __post_init__(self) -> None:
        """ValueError naming the flag of the first value that cannot work, judged on these values alone, before
        anything is built or launched. What needs more is checked where it is known: the world size and GPUs per node
        (trainer/colocate.py check_colocate_flags), rank 0's GPU and the servers' placement (make_rollout_engine)."""
        from megatron_dapo.rollout import ENGINE_KINDS
        from megatron_dapo.rollout.async_rollout import check_depth

        if self.kind not in ENGINE_KINDS:
            raise ValueError(f"--rollout-engine must be one of {ENGINE_KINDS}, got {self.kind!r}")
        if not self.hf_checkpoint:
            raise ValueError("--hf-checkpoint is empty: give the HF model directory")
        if self.weight_sync_mode is not None:
            from megatron_dapo.weight_sync.transports import transport

            transport(self.weight_sync_mode)  # ValueError naming --weight-sync-mode and its choices
        check_depth(self.async_rollout)
        if self.max_batch_size < 1:
            raise ValueError(f"--rollout-batch-size x --n-samples-per-prompt (the embedded engine's batch) must be "
                             f">= 1, got {self.max_batch_size}")
        if not self.rollout_timeout_h > 0:
            raise ValueError(f"--rollout-timeout must be > 0 hours, got {self.rollout_timeout_h}")
        self._check_sizes()
        self._check_exclusive()
        if self.kind == "sglang" and not self.sglang_server_urls:
            self._check_launch()
        check_rollout_model(self)

    def _check_sizes(self) -> None:
        """Counts >= 1, waits and rates > 0, ports in range (ValueError naming the flag)."""
        for flag, count in (("--sglang-num-servers", self.sglang_num_servers),
                            ("--sglang-tp-size (--rollout-num-gpus-per-engine)", self.sglang_tp_size),
                            ("--sglang-max-concurrency", self.sglang_max_concurrency),
                            ("--weight-sync-bucket-mb", self.weight_sync_bucket_mb)):
            if count < 1:
                raise ValueError(f"{flag} must be >= 1, got {count}")
        for flag, value in (("--sglang-server-wait-s", self.sglang_server_wait_s),
                            ("--sglang-http-timeout", self.sglang_http_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {value}")
        if not self.sglang_min_tokens_per_s > 0:
            raise ValueError(f"--sglang-min-tokens-per-s must be > 0, got {self.sglang_min_tokens_per_s}")
        if not 1024 <= self.sglang_base_port <= 65535 - self.sglang_num_servers:
            raise ValueError(f"--sglang-base-port {self.sglang_base_port} leaves no room for the ports of "
                             f"--sglang-num-servers {self.sglang_num_servers} servers and their router "
                             f"(1024..65535)")
        if not 1 <= self.weight_sync_master_port <= 65535:
            raise ValueError(f"--weight-sync-master-port must be a port in 1..65535, got "
                             f"{self.weight_sync_master_port}")

    def _check_exclusive(self) -> None:
        """Options that exclude each other, SGLang's memory share and the attach-only router (ValueError naming
        the flags)."""
        if "--mem-fraction-static" in self.sglang_extra_args and (self.colocate or
                                                                 self.mem_fraction_static is not None):
            raise ValueError("--mem-fraction-static is given in --sglang-extra-args: use the --mem-fraction-static "
                             "flag instead (with --colocate the planner computes or validates it)")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.colocate:
            if self.max_staleness:
                raise ValueError(f"--colocate and --max-staleness {self.max_staleness} exclude each other: colocated "
                                 "engines release their GPU memory while the actor trains, so nothing can generate "
                                 "meanwhile; run the servers on their own GPUs (--sglang-gpus) to train fully async")
            if self.async_rollout:
                raise ValueError("--colocate and --async-rollout 1 exclude each other: a colocated engine releases "
                                 "its GPU memory while the actor trains, so it cannot generate the next batch "
                                 "meanwhile")
            if self.sglang_gpus is not None:
                raise ValueError("--colocate and --sglang-gpus exclude each other: colocated engines use the actor's "
                                 "GPUs")
            if self.weight_sync_mode not in (None, "tensor"):
                raise ValueError(f"--colocate pushes weights by handle on each GPU: --weight-sync-mode must be tensor "
                                 f"(or unset), got {self.weight_sync_mode}")
        elif self.colocated_plan is not None:
            raise ValueError("colocated_plan sizes SGLang's share under --colocate: it needs --colocate")
        if self.sglang_router_url and not self.sglang_server_urls:
            raise ValueError("--sglang-router-url is for attach mode: give the servers behind it with "
                             "--sglang-server-urls (launched servers get their own router)")

    def _check_launch(self) -> None:
        """Launched SGLang servers: --sglang-gpus names GPUs, the bind is safe (check_bind), no API key would reach
        their command line (check_key_args)."""
        from megatron_dapo.rollout.sglang.server import check_bind, check_key_args
        from megatron_dapo.rollout.sglang.setup import gpu_list

        if self.sglang_gpus is not None and not gpu_list(self.sglang_gpus):
            raise ValueError(f"--sglang-gpus must list GPUs, e.g. 4,5,6,7; got {self.sglang_gpus!r}")
        check_bind(self.sglang_host, self.sglang_api_key, allow_no_api_key=self.sglang_allow_no_api_key)
        check_key_args(self.sglang_extra_args, self.sglang_api_key)


def check_rollout_model(cfg: RolloutEngineConfig) -> None:
    """Refuses a --hf-checkpoint the chosen engine would serve wrong (ValueError naming the config.json fields): SGLang
    and an MoE model with dense layers (sglang/setup.py check_sglang_serves); --moe-routing-replay with a model
    without experts. Uses the architecture parsed at start-up; part of RolloutEngineConfig's construction, so it runs
    before anything is built or launched."""
    if cfg.arch is None:
        return  # a missing config.json is load_inputs' error
    _routing(cfg)
    if cfg.kind != "sglang":
        return
    from megatron_dapo.rollout.sglang.setup import check_sglang_serves

    check_sglang_serves(cfg.arch, str(Path(cfg.hf_checkpoint) / "config.json"))


def _routing(cfg: RolloutEngineConfig):
    """RoutingShape of --hf-checkpoint's model with --moe-routing-replay, else None."""
    if not cfg.moe_routing_replay or cfg.arch is None:
        return None
    from megatron_dapo.rollout.types import routing_of

    return routing_of(cfg.arch, True)


def memory_server_args(cfg: RolloutEngineConfig, *, cuda: bool) -> tuple[str, ...]:
    """SGLang flags for the memory of launched CUDA servers: --mem-fraction-static (given, or with --colocate the
    planner's, megatron_dapo/planner/colocated.py) and, colocated, --enable-memory-saver (without it
    release_memory_occupation frees nothing). CPU servers size their KV cache by tokens (sglang_server.py)."""
    if not cuda:
        return ()
    frac = cfg.mem_fraction_static
    if frac is None and cfg.colocate:
        from megatron_dapo.planner.colocated import sglang_share
        from megatron_dapo.planner.stages import plan_stages

        plan = cfg.colocated_plan
        frac = sglang_share(plan.arch, plan_stages(plan.arch, plan.layout, plan.inputs, plan.spec), plan.inputs,
                            plan.spec.bytes_per_element).mem_fraction_static
    out = ("--mem-fraction-static", f"{frac:g}") if frac is not None else ()
    return out + (("--enable-memory-saver",) if cfg.colocate else ())


def weight_sync_mode(cfg: RolloutEngineConfig) -> str | None:
    """The run's weight-sync transport (a name of weight_sync/transports/), None for the embedded engine: the
    flag, defaulted and checked against where the servers run and global rank 0's GPU
    (transports.weight_sync_mode). Rank 0's answer: make_rollout_engine checks it before any server starts, and
    the trainer's build_weight_sync makes its transport from it. Pure and cheap (no server asked)."""
    if cfg.kind != "sglang":
        return None
    from megatron_dapo.rollout.sglang.setup import physical_gpu
    from megatron_dapo.weight_sync.transports import weight_sync_mode as resolve

    cuda = torch.cuda.is_available()
    attach = bool(cfg.sglang_server_urls)
    trainer_gpu = physical_gpu(torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES")) if cuda else None
    return resolve(requested=cfg.weight_sync_mode, attach=attach, cuda=cuda, colocate=cfg.colocate,
                   trainer_gpu=trainer_gpu, server_gpus=None if attach else cfg.sglang_gpus)


def make_rollout_engine(cfg: RolloutEngineConfig, tokenizer):
    """The engine of global rank 0: embedded on CPU, else SGLang servers (launched or attached)."""
    from megatron_dapo.rollout import make_engine

    routing = _routing(cfg)  # --moe-routing-replay: the engine returns each token's experts
    if cfg.kind == "embedded":  # it loads --hf-checkpoint as the family of the architecture parsed at start-up
        kwargs = dict(arch=require_arch(cfg.arch, cfg.hf_checkpoint), tokenizer=tokenizer, seed=cfg.seed,
                      max_batch_size=cfg.max_batch_size, record_routing=routing is not None)
        if cfg.async_rollout or cfg.max_staleness:  # generation beside training: its own process (and GIL)
            from megatron_dapo.rollout.process_engine import ProcessEngine

            return ProcessEngine(cfg.hf_checkpoint, **(kwargs | {"tokenizer": cfg.tokenizer or cfg.hf_checkpoint}))
        return make_engine("embedded", cfg.hf_checkpoint, **kwargs)
    from megatron_dapo.rollout.sglang import setup as server_setup
    from megatron_dapo.rollout.sglang.engine import ClientConfig
    from megatron_dapo.rollout.sglang.server import ServerConfig
    from megatron_dapo.weight_sync.transports import transport

    attach = bool(cfg.sglang_server_urls)
    urls = list(cfg.sglang_server_urls or ())
    cuda = torch.cuda.is_available()
    seeded = cfg.seed is not None  # the rollouts carry per-request sampling seeds
    server_env = {} if attach else server_setup.launched_server_gpus(cuda=cuda, sglang_gpus=cfg.sglang_gpus,
                                                                     colocate=cfg.colocate)
    mode = weight_sync_mode(cfg)  # the transport checks the servers' placement: before any server starts
    api_key = cfg.sglang_api_key  # resolved at start-up: --sglang-api-key-file, the flag, then SGLANG_API_KEY
    client = ClientConfig(
        max_concurrency=cfg.sglang_max_concurrency, api_key=api_key, server_wait_s=cfg.sglang_server_wait_s,
        http_timeout_s=cfg.sglang_http_timeout, min_tokens_per_s=cfg.sglang_min_tokens_per_s,
        bucket_bytes=cfg.weight_sync_bucket_mb << 20,
        sync_backend="nccl" if cuda else "gloo",
        sync_master_address=cfg.weight_sync_master_addr, sync_master_port=cfg.weight_sync_master_port,
        routing=routing,
    )
    transport(mode).check_host(cuda=cuda, bucket_bytes=client.bucket_bytes)  # before minutes of server start-up
    if attach:  # the engine first checks that every URL is SGLang (UserError naming the one that is not)
        engine = make_engine("sglang", client=client, server_urls=urls, router_url=cfg.sglang_router_url)
        if routing is not None:  # before the start-up's weight push, not at the first response
            try:
                server_setup.check_attached_routes(urls, timeout_s=client.http_timeout_s,
                                                   headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
            except BaseException:
                engine.shutdown()
                raise
        for line in server_setup.attached_determinism_warnings(
                urls, seeded=seeded, timeout_s=client.http_timeout_s,
                headers={"Authorization": f"Bearer {api_key}"} if api_key else None):
            print(line)
        return engine
    python = cfg.sglang_python or sys.executable
    if not cuda and cfg.sglang_python is None and Path(".venv-sglang/bin/python").exists():
        python = ".venv-sglang/bin/python"  # the CPU SGLang environment of `make sglang-env`
    extra_args = cfg.sglang_extra_args + memory_server_args(cfg, cuda=cuda)
    deterministic, note = server_setup.deterministic_server_args(
        seeded=seeded, wanted=cfg.sglang_deterministic_inference, device="cuda" if cuda else "cpu",
        extra_args=extra_args)
    if note:
        print(note)
    server = ServerConfig(model_path=cfg.hf_checkpoint, num_servers=cfg.sglang_num_servers,
                          tp_per_server=cfg.sglang_tp_size, base_port=cfg.sglang_base_port,
                          host=cfg.sglang_host, extra_args=extra_args + deterministic,
                          device="cuda" if cuda else "cpu", python=python,
                          log_dir=str(Path(cfg.log_dir) / "sglang"), env=server_env,
                          api_key=api_key, allow_no_api_key=cfg.sglang_allow_no_api_key,
                          return_routed_experts=routing is not None,
                          skip_tokenizer_init=cfg.tools is None)  # stop strings need the servers' tokenizer
    return make_engine("sglang", server, client=client)


def with_tools(engine: Any, cfg: ToolUseConfig | None, tokenizer: Any) -> Any:
    """Rank 0's engine for rollouts and evaluation: `engine` itself without tool use, else a ToolRolloutEngine over it
    with the --tool-template built for `tokenizer` and a SandboxPool of --tool-workers. The sandbox is tried first
    (tool_use/sandbox.py check_sandbox): a host that cannot jail a program refuses the run here, naming why, before
    any step (never a program run unjailed)."""
    if cfg is None:
        return engine
    from megatron_dapo.rollout.multi_turn import ToolRolloutEngine
    from megatron_dapo.tool_use.pool import SandboxPool
    from megatron_dapo.tool_use.sandbox import check_sandbox
    from megatron_dapo.tool_use.templates import tool_template

    template = tool_template(cfg.template, tokenizer)
    check_sandbox()
    return ToolRolloutEngine(engine, template=template, tokenizer=tokenizer, tools=SandboxPool(cfg.workers, cfg.limits),
                             config=cfg.turns)
