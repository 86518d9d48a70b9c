"""Process group + megatron parallel_state setup for one process or a torchrun world.

gloo on CPU (after the CPU shims), nccl on CUDA. A process without torchrun's environment becomes
a world of one over a private TCP store, so tests and the embedded demo run without a launcher.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_dapo.compat import cpu
from megatron_dapo.distributed.parallel import ParallelLayout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_process_group(timeout_minutes: int) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(minutes=timeout_minutes)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1, timeout=timeout)


def init_parallel(
    layout: ParallelLayout | None = None, *, tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234,
    timeout_minutes: int = 30, num_layers: int | None = None, **options: Any,
) -> ParallelLayout:
    """Initialise torch.distributed and megatron parallel_state; return the layout in use.

    `layout` (or tp/pp/cp and the other ParallelLayout fields in `options`, with dp derived from the
    world size) must cover the world exactly; its cp becomes
    parallel_state's context-parallel size (DP groups then exclude the CP ranks of one sequence). Seeds
    torch with `seed` and megatron's model-parallel RNG tracker (dropout-free models only on CPU).
    An interleaved layout (--num-layers-per-virtual-pipeline-stage) needs the model's `num_layers` to
    set parallel_state's virtual pipeline size (model chunks per PP rank).
    """
    cpu.install()
    _init_process_group(timeout_minutes)
    world = dist.get_world_size()
    if layout is None:
        layout = ParallelLayout.from_world(world, tp=tp, pp=pp, cp=cp, **options)
    elif layout.world_size != world:
        raise ValueError(
            f"layout tp={layout.tp} x pp={layout.pp} x cp={layout.cp} x dp={layout.dp} = {layout.world_size} "
            "ranks, but the "
            f"world has {world}: change --nproc_per_node or the parallel flags"
        )
    vpp = None
    if layout.layers_per_virtual_stage is not None:
        if num_layers is None:
            raise ValueError("init_parallel: --num-layers-per-virtual-pipeline-stage needs num_layers= (the "
                             "model's layer count) to size the virtual pipeline")
        vpp = layout.virtual_stages(num_layers)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_context_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size())
        current_vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
        if current != (layout.tp, layout.pp, layout.cp, layout.ep, layout.expert_tp) or current_vpp != vpp:
            raise RuntimeError(f"parallel_state already initialised with (tp, pp, cp, ep, etp)={current}, "
                               f"vpp={current_vpp}: "
                               "call destroy_parallel() first")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            context_parallel_size=layout.cp, distributed_timeout_minutes=timeout_minutes,
            virtual_pipeline_model_parallel_size=vpp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp,
        )
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        # model_parallel_cuda_manual_seed touches CUDA RNG; with dropout 0 (every registered family) the tracker only
        # needs to exist, and the inference tracker ignores per-region seeds.
        tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return layout


def destroy_parallel(*, keep_process_group: bool = False) -> None:
    """Tear down megatron parallel_state and (unless kept, e.g. to re-init another layout on the same
    torchrun world) the default process group. Safe to call twice."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()
