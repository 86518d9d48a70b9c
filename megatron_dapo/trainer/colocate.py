"""Colocated (hybrid) mode, --colocate: the actor and SGLang take turns on the same GPUs every step.

    start-up: engines up, released --> actor built (+ checkpoint loaded) --(to_generation)--> generation
    generation --(to_training)--> training --(to_generation)--> generation ...
  start-up:      rank 0 starts (or attaches to) the engines and every engine releases weights, KV cache and CUDA
                 graphs (release_engines, inside start_up_section: the other ranks wait) before any rank builds its
                 actor, so the actor's build (bf16 weights, a transient second copy while DDP fills its param
                 buffer, the fp32 grad buffer, main-param shards) and a resume's load (Adam state, load buffers)
                 never sit next to a resident engine; the first to_generation pushes the actor's weights (the
                 release dropped the engines' own). The planner's "start-up" rows size this moment.
  to_training:   SGLang /release_memory_occupation (weights, KV cache, CUDA graphs); the actor onloads its
                 optimizer state (host -> device) and re-allocates its grad buffers (zeroed).
  save:          a due checkpoint (--save-interval, the last step) is written in the training phase, after the
                 step's update and before to_generation (Trainer.save): everything it reads is resident and SGLang
                 holds only its released leftovers; 18.3 GiB per GPU at 32B (the planner's save row).
  to_generation: the actor offloads optimizer state to host and frees its grad buffers, empties the CUDA
                 cache; SGLang /resume_memory_occupation of its weights, the new weights are pushed, then
                 its KV cache and CUDA graphs are resumed (the order of slime and verl: the push needs the
                 weight memory back, the KV pool would otherwise sit next to the push buffers).
  end:           after the last step the engines release everything once more (PhaseSwitcher.end) before
                 --export-hf gathers each full parameter over TP next to the actor's resident weights (up to
                 2.9 GiB at 32B: the padded embedding's 1.46 GiB of gathered shards and their merge), which
                 the generation phase's plan (71.4 GiB of 80) has no room for under its 10% headroom.

Offload moves whole tensor storages (`untyped_storage().resize_(0)` after a copy to pinned host memory; back
with resize_ and a copy), as megatron-core's DDP.offload_grad_buffers does for grads: every view (param.
main_grad into the DDP grad buffer, the optimizer's state tensors) stays the same Python object and sees the
bytes again after onload, so training continues bit-exactly (tests/unit/trainer/test_colocate.py). Grad buffers are not
copied: train_step zeroes them first anyway (zero_grad_buffer).

Cost at the production setting (Qwen2.5-32B, 16 x 8 GPUs, TP8 x PP2, DP 8, bf16, distributed optimizer):
per GPU the actor holds ~2.05 B parameters of its stage (the --dry-run plan): 7.6 GiB of fp32 grads freed (no
copy), 12 B/param / DP 8 = 2.9 GiB of fp32 Adam state and main params copied each way over PCIe from and to
pinned host memory (the 8 GPUs of a node share the host links); the bf16 weights (3.8 GiB) stay. SGLang's
release/resume of its 15.3 GiB TP4 weight shard and 46 GiB KV cache are allocator calls (torch_memory_saver); the
weight push is then local to each GPU (megatron_dapo/weight_sync/colocated_push.py). The times of a switch:
docs/BENCHMARKS.md, "Colocated mode".
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_dapo.rollout.build import RolloutEngineConfig

RELEASE_TAGS = ("weights", "kv_cache", "cuda_graph")
"""SGLang 0.5.23's memory tags (sglang/srt/constants.py GPU_MEMORY_TYPE_*)."""


# ---- flags ---------------------------------------------------------------------------------------------
def check_colocate_flags(*, colocate: bool, world_size: int, gpus_per_node: int | None, gpus_per_engine: int,
                         num_servers: int, server_urls: Sequence[str] | None, rollout_engine: str | None) -> None:
    """Raise ValueError (naming the flags) for a --colocate combination that cannot work on this world.

    Engine e runs on the GPUs of global ranks e x g ... (e + 1) x g - 1 (g = --rollout-num-gpus-per-engine):
    one engine never spans two nodes, every actor rank is on exactly one engine's GPU. The checks of the rollout
    flags alone (--async-rollout, --sglang-gpus, --weight-sync-mode, --mem-fraction-static) are
    RolloutEngineConfig's; --rollout-engine is checked here as given (the config holds it resolved, embedded by
    default on CPU)."""
    if not colocate:
        return
    if rollout_engine == "embedded":
        raise ValueError("--colocate needs --rollout-engine sglang (the embedded engine always shares the actor's "
                         "process)")
    if gpus_per_engine < 1 or world_size % gpus_per_engine:
        raise ValueError(f"--rollout-num-gpus-per-engine {gpus_per_engine} must divide the {world_size} actor "
                         f"GPUs under --colocate")
    if gpus_per_node is not None and gpus_per_node % gpus_per_engine:
        raise ValueError(f"--rollout-num-gpus-per-engine {gpus_per_engine} must divide the {gpus_per_node} GPUs "
                         f"per node under --colocate (an engine cannot span nodes)")
    engines = world_size // gpus_per_engine
    if server_urls:
        if len(server_urls) != engines:
            raise ValueError(f"--colocate with --sglang-server-urls: {world_size} GPUs / "
                             f"--rollout-num-gpus-per-engine {gpus_per_engine} = {engines} engines, but "
                             f"{len(server_urls)} URLs were given (one per engine, in global rank order)")
    elif num_servers * gpus_per_engine != world_size:
        raise ValueError(f"--colocate launches --sglang-num-servers {num_servers} engines of "
                         f"--rollout-num-gpus-per-engine {gpus_per_engine} GPUs from global rank 0, which must "
                         f"cover the {world_size} actor GPUs; across nodes start them with the launchers "
                         f"(examples/slurm/colocated.sbatch, examples/run_qwen2.5_32b_colocated.sh), which pass "
                         f"--sglang-server-urls")


def engine_of_rank(rank: int, gpus_per_engine: int) -> tuple[int, int]:
    """(engine index, SGLang TP rank within it) of the GPU that global rank `rank` runs on."""
    return rank // gpus_per_engine, rank % gpus_per_engine


# ---- the actor's side ------------------------------------------------------------------------------------
def process_rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm; else the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _leaf_optimizers(optimizer) -> list:
    """The megatron optimizers under a ChainedOptimizer (or the one given)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    return [o for c in chained for o in _leaf_optimizers(c)] if chained is not None else [optimizer]


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class _Held:
    tensor: torch.Tensor
    """One tensor on the storage (the storage is what moves; every view follows)."""
    nbytes: int
    host: torch.Tensor | None = None
    """The bytes while offloaded (None for grad buffers: they are zeroed on onload)."""


@dataclass
class ActorOffloader:
    """Offloads a megatron-core actor's DDP grad buffers and optimizer state between the training phases, and the
    weights of the frozen models beside it (the reference and the teacher: not needed while generating).

    `chunks`: the DDP-wrapped model chunks; `optimizer`: megatron's (chained) optimizer; `frozen`: the frozen
    models' modules (MegatronActor(frozen=True).modules). The actor's parameters (and the DDP param buffers they
    view) never move: they are the source of the weight push."""

    chunks: Sequence[torch.nn.Module]
    optimizer: object
    frozen: Sequence[torch.nn.Module] = ()
    offloaded: bool = field(default=False, init=False)
    _grads: list[_Held] = field(default_factory=list, init=False)
    _state: list[_Held] = field(default_factory=list, init=False)
    _frozen: list[_Held] = field(default_factory=list, init=False)

    def _collect(self) -> None:
        model = {_storage_key(p) for c in self.chunks for p in c.parameters()}
        for c in self.chunks:
            for buf in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", []):
                if buf.param_data is not None:
                    model.add(_storage_key(buf.param_data))
        seen: set[int] = set()
        self._grads = []
        for c in self.chunks:
            for buf in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", []):
                key = _storage_key(buf.grad_data)
                if key not in seen:
                    seen.add(key)
                    self._grads.append(_Held(buf.grad_data, buf.grad_data.untyped_storage().nbytes()))
        self._state = []
        for opt in _leaf_optimizers(self.optimizer):
            inner = getattr(opt, "optimizer", None)
            if inner is None:
                continue
            tensors = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            tensors += [p for g in inner.param_groups for p in g["params"]]  # fp32 main params (bf16 runs)
            for t in tensors:
                key = _storage_key(t)
                if key in model or key in seen or t.untyped_storage().nbytes() == 0:
                    continue
                seen.add(key)
                self._state.append(_Held(t, t.untyped_storage().nbytes()))
        self._frozen = []
        for module in self.frozen:
            for t in module.parameters():
                key = _storage_key(t)
                if key in model or key in seen or t.untyped_storage().nbytes() == 0:
                    continue
                seen.add(key)
                self._frozen.append(_Held(t, t.untyped_storage().nbytes()))

    def offload(self) -> dict[str, float]:
        """Frees the grad buffers and moves optimizer state to (pinned, on CUDA) host memory; empties the CUDA
        cache. Returns colocate/offload_s and the bytes moved (colocate/actor_offloaded_gib)."""
        if self.offloaded:
            raise RuntimeError("ActorOffloader.offload: already offloaded (call onload first)")
        t0 = time.perf_counter()
        self._collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for h in self._state + self._frozen:
            storage = h.tensor.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=h.tensor.device).set_(storage)
            pin = whole.is_cuda
            h.host = torch.empty(h.nbytes, dtype=torch.uint8, pin_memory=pin)
            h.host.copy_(whole)
            del whole
            storage.resize_(0)
        for h in self._grads:
            h.tensor.untyped_storage().resize_(0)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        self.offloaded = True
        return {"colocate/offload_s": time.perf_counter() - t0,
                "colocate/actor_offloaded_gib": (self.state_bytes + self.grad_bytes) / 2**30} | (
            {"colocate/frozen_offloaded_gib": self.frozen_bytes / 2**30} if self._frozen else {})

    def onload(self) -> dict[str, float]:
        """Re-allocates the grad buffers (zeroed) and copies optimizer state back to where it was."""
        if not self.offloaded:
            raise RuntimeError("ActorOffloader.onload: nothing offloaded")
        t0 = time.perf_counter()
        for h in self._grads:
            h.tensor.untyped_storage().resize_(h.nbytes)
            torch.empty(0, dtype=torch.uint8, device=h.tensor.device).set_(h.tensor.untyped_storage()).zero_()
        for h in self._state + self._frozen:
            storage = h.tensor.untyped_storage()
            storage.resize_(h.nbytes)
            torch.empty(0, dtype=torch.uint8, device=h.tensor.device).set_(storage).copy_(h.host)
            h.host = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.offloaded = False
        return {"colocate/onload_s": time.perf_counter() - t0}

    @property
    def state_bytes(self) -> int:
        return sum(h.nbytes for h in self._state)

    @property
    def grad_bytes(self) -> int:
        return sum(h.nbytes for h in self._grads)

    @property
    def frozen_bytes(self) -> int:
        """The frozen models' weights moved to host memory."""
        return sum(h.nbytes for h in self._frozen)


# ---- the phases ------------------------------------------------------------------------------------------
def release_engines(engine, sync: Callable[[str], AbstractContextManager[None]] | None = None,
                    what: str = "while SGLang released its GPU memory") -> None:
    """Every engine frees its weights, KV cache and CUDA graphs (rank 0's `engine`; None elsewhere), inside
    `sync(what)` when given: the ranks meet after it, so none allocates next to an engine still holding its share."""
    with sync(what) if sync is not None else nullcontext():
        if engine is not None:
            engine.release_memory_occupation(RELEASE_TAGS)


def start_up_section(timeout_h: float) -> Callable[[str], AbstractContextManager[None]] | None:
    """A status barrier over every rank for the start-up, before the Trainer's wait group exists (a collective:
    every rank makes the gloo group; None in a world of one). Its timeout is --rollout-timeout: rank 0 may spend
    minutes starting the engines while the others wait in it."""
    import torch.distributed as dist

    from megatron_dapo.distributed import comm

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(hours=timeout_h))
    return lambda what: comm.section(what, group)


def device_resident_bytes() -> int:
    """What this process holds now: CUDA memory allocated on its device, else (CPU) its RSS."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return process_rss_bytes()


@dataclass
class PhaseSwitcher:
    """Runs the two phase switches of a colocated step and reports their metrics.

    `engine`: the SGLang side (SGLangEngine: release_memory_occupation / resume_memory_occupation), on the
    rank that owns it (global rank 0), None elsewhere; `offloader`: this rank's ActorOffloader; `section`:
    `section(what)`, a context whose exit is a barrier over every rank that carries a failure of any rank's body
    to the others (Trainer.section: one int64 all-reduce on the wait group); the engines must be released before
    any rank onloads, and resumed only after every rank offloaded. None in a world of one. So a failed SGLang
    memory call on rank 0 (or a failed offload anywhere) makes the other 127 ranks raise at once rather than
    wait out --rollout-timeout."""

    offloader: ActorOffloader
    engine: object | None = None
    section: Callable[[str], AbstractContextManager[None]] | None = None
    phase: str = "training"

    def _sync(self, what: str) -> AbstractContextManager[None]:
        return self.section(what) if self.section is not None else nullcontext()

    def to_training(self) -> dict[str, float]:
        """SGLang releases weights, KV cache and CUDA graphs; then the actor onloads."""
        if self.phase != "generation":
            raise RuntimeError(f"PhaseSwitcher.to_training from phase {self.phase!r}")
        t0 = time.perf_counter()
        release_engines(self.engine, self.section)
        with self._sync("while the actor onloaded its optimizer state"):
            metrics = self.offloader.onload()
        self.phase = "training"
        return metrics | {"colocate/to_training_s": time.perf_counter() - t0,
                          "colocate/actor_resident_gib_training": device_resident_bytes() / 2**30}

    def to_generation(self, push: Callable[[], dict[str, float]] | None = None) -> dict[str, float]:
        """The actor offloads; SGLang resumes its weights, `push()` (a collective on every rank) sends the new
        ones, then SGLang resumes its KV cache and CUDA graphs. Returns the metrics, `push()`'s included."""
        if self.phase != "training":
            raise RuntimeError(f"PhaseSwitcher.to_generation from phase {self.phase!r}")
        t0 = time.perf_counter()
        with self._sync("while the actor offloaded its optimizer state"):
            metrics = self.offloader.offload()
            resident = device_resident_bytes()
        with self._sync("while SGLang resumed its weight memory"):
            if self.engine is not None:
                self.engine.resume_memory_occupation(("weights",))
        t_push = time.perf_counter()
        if push is not None:
            metrics |= push()
        push_s = time.perf_counter() - t_push
        with self._sync("while SGLang resumed its KV cache and CUDA graphs"):
            if self.engine is not None:
                self.engine.resume_memory_occupation(tuple(t for t in RELEASE_TAGS if t != "weights"))
        self.phase = "generation"
        return metrics | {"colocate/to_generation_s": time.perf_counter() - t0 - push_s,
                          "colocate/actor_resident_gib_generation": resident / 2**30}

    def end(self) -> None:
        """After the run's last step (train.py, before --export-hf): the engines, no longer needed, release weights,
        KV cache and CUDA graphs (a section, as in to_training); the actor stays offloaded, its weights (all the
        export reads) resident. Later phase switches are refused."""
        if self.phase == "generation":
            release_engines(self.engine, self.section, "while SGLang released its GPU memory for the HF export")
        self.phase = "ended"

    def start(self) -> dict[str, float]:
        """Engines that were never released (still holding their initial weights) and a resident actor: offload
        only. train.py does not start this way (see the module docstring: the engines are released before the
        actor is built, and the first to_generation pushes); this is for a driver that manages the engines'
        memory itself (tools/gpu_smoke.py's stand-in)."""
        with self._sync("while the actor offloaded its optimizer state"):
            metrics = self.offloader.offload()
        self.phase = "generation"
        return metrics


def start_colocated_engines(cfg: RolloutEngineConfig, tokenizer, rank0: bool):
    """--colocate, before any rank builds its actor: rank 0 starts (or attaches to) the engines and every engine
    releases its weights, KV cache and CUDA graphs; the other ranks wait in the start-up section (a failure on
    rank 0 reaches them there). Returns rank 0's engine, None elsewhere.

    Why first: an engine holds --mem-fraction-static x GPU memory plus its runtime (0.77 x 80 GB + ~4 GiB at the
    32B launcher) until released, and the actor's build peaks at twice its bf16 weights plus the fp32 grad buffer
    (planner.colocated.startup_lines): the two together do not fit a GPU at 32B (docs/BENCHMARKS.md, "Colocated
    mode"), and an actor allocated first would leave SGLang less free memory to size its KV pool from than
    planned."""
    from megatron_dapo.rollout import build as rollout_build

    engine, sync = None, start_up_section(cfg.rollout_timeout_h)
    what = "while rank 0 started the colocated engines and released their GPU memory"
    with sync(what) if sync is not None else nullcontext():
        if rank0:
            engine = rollout_build.make_rollout_engine(cfg, tokenizer)
            release_engines(engine)
    return engine


def make_colocated(cfg: RolloutEngineConfig, actor, engine, frozen: Sequence = ()):
    """--colocate: this rank's PhaseSwitcher (its `section` is set once the Trainer exists; its offloader also moves
    the `frozen` models' weights, the reference and the teacher, to host while generating) and its weight sync,
    ColocatedSync (build_weight_sync with this rank's ColocatedPusher; a collective: every rank makes every
    engine's group). Engine URLs: --sglang-server-urls, else the launched servers' (--sglang-host,
    --sglang-base-port)."""
    from megatron_dapo.weight_sync.build import build_weight_sync
    from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, make_engine_groups

    urls = list(cfg.sglang_server_urls or [f"http://{cfg.sglang_host}:{cfg.sglang_base_port + i}"
                                           for i in range(cfg.sglang_num_servers)])
    groups = make_engine_groups(urls, cfg.sglang_tp_size)
    pusher = ColocatedPusher(groups, bucket_bytes=cfg.weight_sync_bucket_mb << 20,
                             api_key=cfg.sglang_api_key, http_timeout_s=cfg.sglang_http_timeout)
    modules = [m for model in frozen for m in model.modules]
    return (PhaseSwitcher(offloader=ActorOffloader(actor.chunks, actor.optimizer, modules), engine=engine),
            build_weight_sync(engine, wait_group=None, colocated=pusher))
