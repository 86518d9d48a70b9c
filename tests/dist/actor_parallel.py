"""torchrun worker (2 ranks): run the actor at TP=2, PP=2 and DP=2 on one world and save the results.

argv: <input .pt from tests/test_actor_parallel.py> <output dir>. For each layout every rank saves its
log-probs, entropies, the metrics of two train steps and its weight shards to <out>/<layout>_rank<r>.pt.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank

LAYOUTS = {"tp2": ParallelLayout(tp=2, pp=1, dp=1), "pp2": ParallelLayout(tp=1, pp=2, dp=1),
           "dp2": ParallelLayout(tp=1, pp=1, dp=2)}


def run_layout(name: str, layout: ParallelLayout, data: dict, out_dir: str) -> None:
    arch = ModelArch(**data["arch"])
    init_parallel(layout, seed=data["seed"])
    config: ActorConfig = data["config"]
    if layout.dp > 1:  # the distributed optimizer only shards anything with DP > 1
        config = replace(config, use_distributed_optimizer=True)
    actor = MegatronActor(arch, config, layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    full = hf_to_full_mcore(data["hf_state_dict"], arch)
    actor.load_shards(mcore_shards_for_rank(full, arch, tp=layout.tp, tp_rank=tp_rank, pp=layout.pp,
                                            pp_rank=pp_rank, padded_vocab=padded_vocab_size(arch.vocab_size,
                                                                                             layout.tp)))
    indices = list(range(dp_rank, len(data["samples"]), layout.dp))
    samples = [data["samples"][i] for i in indices]
    logps, ents = actor.compute_log_probs(samples, with_entropy=True)
    metrics = [actor.train_step(samples) for _ in range(data["steps"])]
    torch.save({"indices": indices, "logps": logps, "entropies": ents, "metrics": metrics,
                "tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": dp_rank,
                "weights": {k: v.clone() for k, v in actor.state_dict_for_export().items()}},
               f"{out_dir}/{name}_rank{dist.get_rank()}.pt")
    destroy_parallel(keep_process_group=True)


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    for name in data["layouts"]:
        run_layout(name, LAYOUTS[name], data, sys.argv[2])
    destroy_parallel()


if __name__ == "__main__":
    main()
