"""Worker of tests/multiprocess/test_checkpoint_ep.py: training checkpoints of a tiny Qwen3-MoE under expert
parallelism, 4 ranks.

Per optimizer (regular, distributed): an EP=2 (DP=4, expert-DP=2) actor trains two steps, saves (step 2), trains a
third step (the uninterrupted run). Then, on the same world, fresh actors load that checkpoint and train the third
step: at EP=2 (the same layout), at EP=4 (expert-DP=1: the global [E, ...] expert tensors resharded) and at EP=1
(every rank holds all experts; the regular optimizer only: that refusal does not depend on it). Each rank saves to
argv[2]/<optimizer>_<run>_rank<r>.pt the third step's metrics and its weights after it, experts under global
numbers (EP rank r's local expert j = global r * E / ep + j), or the load's error (type and first line) when the
load is refused (training.check_optimizer_layout).

argv: <input .pt: arch, HF state dict, config, samples> <output dir>.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from megatron.core import parallel_state
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.procs import install_results_queue
from megatron_dapo.checkpoint.training import _first_error, load_checkpoint, save_checkpoint
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank, reset_moe_tracker

NPROC = 4
LAYOUTS = {"ep2": ParallelLayout(dp=4, ep=2), "ep4": ParallelLayout(dp=4, ep=4), "ep1": ParallelLayout(dp=4, ep=1)}


def _actor(data: dict, name: str, distributed: bool, *, load_hf: bool) -> MegatronActor:
    layout = LAYOUTS[name]
    arch = ModelArch(**data["arch"])
    init_parallel(layout, seed=data["seed"])
    reset_moe_tracker()
    actor = MegatronActor(arch, replace(data["config"], use_distributed_optimizer=distributed), layout)
    if load_hf:
        actor.load_shards(mcore_shards_for_rank(
            hf_to_full_mcore(data["hf_state_dict"], arch), arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
            padded_vocab=padded_vocab_size(arch.vocab_size, 1), ep=layout.ep,
            ep_rank=parallel_state.get_expert_model_parallel_rank()))
    return actor


def _global_weights(actor: MegatronActor) -> dict[str, torch.Tensor]:
    per_rank = actor.arch.num_experts // parallel_state.get_expert_model_parallel_world_size()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    out = {}
    for k, v in actor.state_dict_for_export().items():
        if ".local_experts." in k:
            j = int(k.split(".local_experts.")[1].split(".")[0])
            k = k.replace(f".local_experts.{j}.", f".local_experts.{ep_rank * per_rank + j}.")
        out[k] = v.clone()
    return out


def runs(optimizer: str) -> list[str]:
    """The resumed runs of `optimizer` ("regular" / "distopt")."""
    return [f"resumed_{name}" for name in (LAYOUTS if optimizer == "regular" else ("ep2", "ep4"))]


def _samples(data: dict, step: int) -> list:
    rank, world = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    return data["samples"][step][rank::world]


def main(data: dict, out: Path) -> None:
    rank = int(os.environ["RANK"])  # torchrun's; the process group starts with the first actor
    for distributed in (False, True):
        opt = "distopt" if distributed else "regular"
        ckpt = out / f"ckpt_{opt}"
        actor = _actor(data, "ep2", distributed, load_hf=True)
        for step in range(2):
            actor.train_step(_samples(data, step))
        save_checkpoint(ckpt, 2, actor, extra={"run": "ep2"})
        metrics = actor.train_step(_samples(data, 2))
        torch.save({"metrics": metrics, "weights": _global_weights(actor)}, out / f"{opt}_straight_rank{rank}.pt")
        destroy_parallel(keep_process_group=True)
        for name in [run.removeprefix("resumed_") for run in runs(opt)]:
            actor = _actor(data, name, distributed, load_hf=False)
            try:
                extra = load_checkpoint(ckpt, actor)
            except (Exception, CheckpointException) as err:  # a refused reshard: recorded for the test to assert on
                result = {"error": _first_error(err)}
            else:
                result = {"extra": extra, "metrics": actor.train_step(_samples(data, 2)),
                          "weights": _global_weights(actor)}
            torch.save(result, out / f"{opt}_resumed_{name}_rank{rank}.pt")
            destroy_parallel(keep_process_group=True)
    destroy_parallel()


if __name__ == "__main__":
    install_results_queue(async_save=False)  # megatron's save otherwise spawns a Manager that re-imports __main__
    main(torch.load(sys.argv[1], weights_only=False), Path(sys.argv[2]))
