"""--colocate: what an SGLang engine takes of every GPU, and the actor's phases next to it.

Every GPU holds an actor rank and a shard of an SGLang engine of
--rollout-num-gpus-per-engine GPUs, in two phases per step (megatron_dapo/trainer/colocate.py):
  - training: the actor's plan (stages.py), plus what SGLang keeps after /release_memory_occupation of its
    weights, KV cache and CUDA graphs (its CUDA context and allocator slack: SGLANG_RELEASED_GIB, assumed);
  - generation: the actor's leftovers after it offloaded grads and optimizer state (its bf16 weights, the
    source of the next weight push, and its CUDA context), SGLang's static pool (weights + KV cache =
    --mem-fraction-static x GPU memory) and its runtime outside that pool (SGLANG_RUNTIME_GIB, assumed).
  - start-up (startup_lines): the engines come up and release everything before the actor is built
    (colocate.py), so the worst start-up moment is the actor's build (bf16 weights plus a transient second
    copy while DDP fills its param buffer, the fp32 grad buffer) or its resume (Adam state and the load's
    buffers) next to the released engines. The old order built the actor next to resident engines: SGLang's
    static pool and runtime on top: at the 32B colocated launcher 82.9 GiB per 80 GB GPU while building,
    88.6 GiB while resuming, against 19.3 / 25.0 GiB now.
  - save (save_lines): a checkpoint is written in the training phase after the step's update, before the push
    (trainer/loop.py Trainer.save): weights, grads and the optimizer shard next to the released engine, the
    activations freed; the tensors are staged to host memory (megatron-core's D2H preload), no GPU buffers. The
    old save ran in the generation phase and onloaded grads and optimizer state next to SGLang's static pool and
    runtime: at the 32B colocated launcher 81.9 GiB per 80 GB GPU, against 18.3 GiB now.
SGLang 0.5.23 sizes its KV pool as (free memory at start) x mem_fraction_static - its weights
(mem_cache/kv_cache_configurator._profile_available_bytes); free <= GPU memory, so frac x GPU memory bounds it.
The computed --mem-fraction-static is the largest (in 0.01 steps) that keeps the generation phase under
(1 - HEADROOM) x --gpu-memory-gib.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.planner.activations import ActivationSpec
from megatron_dapo.planner.stages import (
    FRAMEWORK_OVERHEAD_GIB,
    GIB,
    HEADROOM,
    PlanInputs,
    StagePlan,
    frozen_bytes,
    peak_gib,
    plan_stages,
    stage_parameters,
    static_bytes,
)

SGLANG_RUNTIME_GIB = 4.0
"""Assumed, not modelled: a colocated SGLang process's memory outside its static pool while generating
(CUDA context, CUDA graphs, decode activations, sampling buffers)."""
SGLANG_RELEASED_GIB = 2.0
"""Assumed: what a colocated SGLang process keeps after releasing weights, KV cache and CUDA graphs (CUDA
context ~0.5 GiB, NCCL buffers, allocator slack); slime reports 3-5 GB for Megatron's side in the other phase."""


def sglang_weight_bytes(arch: ModelArch, gpus_per_engine: int, bytes_per_element: int = 2) -> float:
    """Bytes of one SGLang TP rank's weights (bf16): the TP shard of every layer plus the vocab-padded
    embedding and head (32B at TP8: 8.2 GB)."""
    return stage_parameters(arch, ParallelLayout(tp=gpus_per_engine), 0) * bytes_per_element


def kv_bytes_per_token(arch: ModelArch, gpus_per_engine: int, bytes_per_element: int = 2) -> float:
    """KV-cache bytes one token takes on one SGLang TP rank: K and V of every layer for its kv heads (SGLang
    replicates kv heads when TP > kv heads), or what the family says its cache holds (`kv_cache_elements`: MLA's
    latent). 32B (8 kv heads x 128) at TP8: 2 x 64 x 1 x 128 x 2 = 32 KiB."""
    cache = arch.family.kv_cache_elements
    if cache is not None:
        return arch.num_layers * cache(arch, gpus_per_engine) * bytes_per_element
    heads = max(1, arch.num_kv_heads // gpus_per_engine)
    return 2 * arch.num_layers * heads * arch.head_dim * bytes_per_element


@dataclass(frozen=True)
class SGLangShare:
    """What a colocated SGLang engine takes of each GPU, by phase, and the --mem-fraction-static behind it."""

    mem_fraction_static: float
    computed: bool
    """True when derived from the plan, False when given with --mem-fraction-static (validated)."""
    weights: float
    """Bytes of this GPU's weight shard."""
    kv_cache: float
    """Bytes of this GPU's KV pool: frac x GPU memory - weights."""
    kv_tokens: int
    """Tokens the engine's KV pool holds (every rank holds its heads' share of each token)."""
    actor_generation: dict[str, float]
    """The actor's resident bytes while generating, on its fullest pipeline stage (actor_generation_lines)."""

    @property
    def static(self) -> float:
        return self.weights + self.kv_cache


def actor_generation_lines(plan: StagePlan) -> dict[str, float]:
    """The actor's resident bytes during generation: its weights (the source of the next weight push) and
    CUDA context; grads, optimizer state and the frozen models' weights are offloaded to host and activations
    freed."""
    weights = static_bytes(plan, "weights")
    return {"actor weights (resident)": weights,
            "actor CUDA context, NCCL (assumed)": FRAMEWORK_OVERHEAD_GIB * GIB}


def sglang_share(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, bytes_per_element: int = 2
                 ) -> SGLangShare:
    """The SGLang share of each GPU for --colocate: --mem-fraction-static computed as the largest multiple of
    0.01 that keeps (actor leftovers + frac x GPU + SGLANG_RUNTIME_GIB) under (1 - HEADROOM) x GPU memory, or
    the given one. Raises ValueError (naming the flag) when the pool cannot hold the weights and one
    --max-prompt-length + --max-response-length sequence."""
    gpu = inputs.gpu_memory_gib * GIB
    actor = max((actor_generation_lines(p) for p in plans), key=lambda d: sum(d.values()))
    weights = sglang_weight_bytes(arch, inputs.rollout_gpus_per_engine, bytes_per_element)
    computed = inputs.mem_fraction_static is None
    if computed:
        room = (1 - HEADROOM) * gpu - sum(actor.values()) - SGLANG_RUNTIME_GIB * GIB
        frac = int(room / gpu * 100) / 100
    else:
        frac = inputs.mem_fraction_static
    kv = frac * gpu - weights
    per_token = kv_bytes_per_token(arch, inputs.rollout_gpus_per_engine, bytes_per_element)
    tokens = int(kv // per_token) if kv > 0 else 0
    if tokens < inputs.max_seq_len:
        need = (weights + inputs.max_seq_len * per_token) / gpu
        what = "computed" if computed else "given"
        raise ValueError(
            f"--mem-fraction-static {frac:.2f} ({what}) leaves SGLang {max(kv, 0) / GIB:.2f} GiB of KV cache per GPU "
            f"({tokens} tokens) next to {weights / GIB:.2f} GiB of weights at --rollout-num-gpus-per-engine "
            f"{inputs.rollout_gpus_per_engine}: one {inputs.max_seq_len}-token sequence needs a fraction >= "
            f"{need:.3f}; raise --rollout-num-gpus-per-engine or --gpu-memory-gib, or shrink the actor")
    return SGLangShare(mem_fraction_static=frac, computed=computed, weights=weights, kv_cache=kv,
                       kv_tokens=tokens, actor_generation=actor)


def generation_lines(share: SGLangShare) -> dict[str, float]:
    """Component -> bytes of one GPU while generating (colocated)."""
    return {**share.actor_generation,
            "SGLang weights (TP shard)": share.weights,
            f"SGLang KV cache ({share.kv_tokens:,} tokens)": share.kv_cache,
            "SGLang runtime: CUDA graphs, activations (assumed)": SGLANG_RUNTIME_GIB * GIB}


def _frozen_row(plan: StagePlan, columns: int) -> dict:
    """The frozen models' weights (--ref-load, --teacher-load: built after the actor, resident in the training phase,
    offloaded while generating) as one row of `columns` values, or no row without them."""
    held = frozen_bytes(plan)
    if not held:
        return {}
    value = (held,) * columns if columns > 1 else held
    return {"frozen models' weights (reference, teacher)": value}


def startup_lines(plan: StagePlan, inputs: PlanInputs, use_distributed_optimizer: bool | None = None
                  ) -> dict[str, tuple[float, float]]:
    """Component -> (bytes at the actor's build, bytes at a resume) on one GPU during a colocated start-up, the
    engines released first (SGLANG_RELEASED_GIB each).

    Build: megatron-core DDP allocates its bf16 param buffer and fp32 grad buffer, then copies every parameter
    in and frees the original, so it briefly holds 2 x weights + grads; the optimizer's fp32 main-param shards
    (4 B/param / DP shards, bf16 only) come after that copy is freed: the larger of the two moments. Resume: weights,
    grads, the whole optimizer shard (main params + Adam moments) and the load's buffers (assumed: the tensors
    read from the checkpoint before they are copied in, one copy of the weights and optimizer shard)."""
    weights, grads, optimizer = (static_bytes(plan, kind) for kind in ("weights", "grads", "optimizer"))
    main = optimizer / 3 if weights * 2 == grads else 0.0  # bf16: 4 of the 12 B/param are main params
    copy, build_opt = (weights, 0.0) if weights >= main else (0.0, main)
    return {"SGLang (colocated, released)": (inputs.sglang_gib * GIB,) * 2,
            f"weights ({inputs.params_dtype})": (weights, weights),
            "DDP param buffer's transient copy of the weights": (copy, 0.0),
            "grads (fp32 DDP buffer)": (grads, grads),
            "optimizer (main params; + Adam on resume)": (build_opt, optimizer),
            "checkpoint load buffers (assumed)": (0.0, weights + optimizer),
            "CUDA context, NCCL, workspaces (assumed)": (FRAMEWORK_OVERHEAD_GIB * GIB,) * 2} | _frozen_row(plan, 2)


def startup_peaks(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, bytes_per_element: int = 2
                  ) -> tuple[float, float]:
    """(new order, old order) bytes of the fullest GPU at its worst start-up moment: the engines released before
    the actor allocates, against the actor built and loaded next to engines holding their static pool
    (--mem-fraction-static x GPU memory) and runtime (SGLANG_RUNTIME_GIB) in place of the released share."""
    share = sglang_share(arch, plans, inputs, bytes_per_element)
    new = max(sum(col) for p in plans for col in zip(*startup_lines(p, inputs).values(), strict=True))
    resident = share.static + SGLANG_RUNTIME_GIB * GIB - inputs.sglang_gib * GIB
    return new, new + resident


def save_lines(plan: StagePlan, inputs: PlanInputs) -> dict[str, float]:
    """Component -> bytes on one GPU while a colocated run writes a checkpoint: in the training phase, after the
    step's update (the activations freed) and before the push, next to the released engine. The save reads the
    weights and the optimizer shard (fp32 main params + Adam moments: megatron-core's dp_reshardable state reads
    only the grad buffers' sizes); the grads stay allocated, as the training phase left them."""
    return {"SGLang (colocated, released)": inputs.sglang_gib * GIB,
            f"weights ({inputs.params_dtype})": static_bytes(plan, "weights"),
            "grads (fp32 DDP buffer)": static_bytes(plan, "grads"),
            "optimizer (main params + Adam, read by the save)": static_bytes(plan, "optimizer"),
            "CUDA context, NCCL, workspaces (assumed)": FRAMEWORK_OVERHEAD_GIB * GIB} | _frozen_row(plan, 1)


def save_peaks(arch: ModelArch, plans: list[StagePlan], inputs: PlanInputs, bytes_per_element: int = 2
               ) -> tuple[float, float]:
    """(now, old) bytes of the fullest GPU while a colocated run saves: in the training phase (save_lines), against
    the old save in the generation phase, which onloaded grads and optimizer state next to everything the
    generation phase holds (generation_lines)."""
    share = sglang_share(arch, plans, inputs, bytes_per_element)
    engine = sum(generation_lines(share).values()) - sum(share.actor_generation.values())
    new = max(sum(save_lines(p, inputs).values()) for p in plans)
    old = max(engine + sum(actor_generation_lines(p).values()) + static_bytes(p, "grads")
              + static_bytes(p, "optimizer") for p in plans)
    return new, old


def phase_peaks_gib(arch: ModelArch, layout: ParallelLayout, inputs: PlanInputs, spec: ActivationSpec
                    ) -> dict[str, float]:
    """{'training': GiB, 'generation': GiB} of the fullest GPU (generation only with --colocate)."""
    plans = plan_stages(arch, layout, inputs, spec)
    out = {"training": peak_gib(plans)}
    if inputs.colocate:
        out["generation"] = sum(generation_lines(sglang_share(arch, plans, inputs, spec.bytes_per_element))
                                .values()) / GIB
    return out

