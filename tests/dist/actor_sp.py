"""torchrun worker (2 ranks): the actor at TP=2 without and with sequence parallelism (and SP + full
recompute) on one world, for each model family in the input; saves each layout's log-probs, entropies, step
metrics, weight shards and the activation bytes one [2, 24] micro-batch saves for backward. A mixture-of-experts
family runs the SP layouts only (megatron-core's MoE layer needs SP with TP > 1).

argv: <input .pt from tests/multiprocess/test_actor_sp.py> <output dir> -> <out>/<model_type>_<layout>_rank<r>.pt.
The input holds, per model_type, the arch, the HF state dict and the ActorConfig; the samples, seed and step count.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank, reset_moe_tracker
from tests.unit.planner.test_planner import saved_activation_bytes

LAYOUTS = {
    "tp2": ParallelLayout(tp=2),
    "tp2_sp": ParallelLayout(tp=2, sp=True),
    "tp2_sp_recompute": ParallelLayout(tp=2, sp=True, recompute_granularity="full", recompute_method="uniform",
                                       recompute_num_layers=1),
}


def layouts(arch: ModelArch) -> dict[str, ParallelLayout]:
    """The layouts `arch` runs: all, or the SP ones for an MoE model."""
    return {n: lay for n, lay in LAYOUTS.items() if lay.sp or not arch.is_moe}


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    init_parallel(LAYOUTS["tp2"], seed=data["seed"])
    for model_type, family in data["families"].items():
        run_family(model_type, ModelArch(**family["arch"]), family["hf_state_dict"], family["config"], data)
    destroy_parallel()


def run_family(model_type: str, arch: ModelArch, hf_state_dict: dict, config: ActorConfig, data: dict) -> None:
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    full = hf_to_full_mcore(hf_state_dict, arch)
    shards = mcore_shards_for_rank(full, arch, tp=2, tp_rank=tp_rank, pp=1, pp_rank=0,
                                   padded_vocab=padded_vocab_size(arch.vocab_size, 2))
    for name, layout in layouts(arch).items():  # same process groups: only the model config differs
        reset_moe_tracker()
        actor = MegatronActor(arch, config, layout)
        assert actor.module.config.sequence_parallel == layout.sp
        actor.load_shards(shards)
        saved = saved_activation_bytes(actor.module, torch.arange(2 * 24).reshape(2, 24) % arch.vocab_size)
        logps, ents = actor.compute_log_probs(data["samples"], with_entropy=True)
        metrics = [actor.train_step(data["samples"]) for _ in range(data["steps"])]
        norm_tagged = sorted(n for n, p in actor.module.named_parameters() if getattr(p, "sequence_parallel", False))
        torch.save({"saved_bytes": saved, "logps": logps, "entropies": ents, "metrics": metrics,
                    "norm_tagged": norm_tagged,
                    "weights": {k: v.clone() for k, v in actor.state_dict_for_export().items()}},
                   f"{sys.argv[2]}/{model_type}_{name}_rank{dist.get_rank()}.pt")


if __name__ == "__main__":
    main()
