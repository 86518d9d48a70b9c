"""torchrun worker (2 ranks): packed micro-batches and the fused linear head at TP=2 (also with sequence
parallelism) and PP=2, each against the padded logits path of the same layout on the same world.

argv: <input .pt from tests/multiprocess/test_packing_parallel.py> <output dir> -> <out>/<variant>_rank<r>.pt holding
log-probs, entropies, the metrics of one train step and this rank's gradient (megatron's main_grad).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank

TP2, TP2_SP, PP2 = ParallelLayout(tp=2), ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)
PACK, LINEAR = dict(pack_sequences=True), dict(fused_linear_logprob=True)
# name -> (layout, config overrides, the padded variant it must equal); one process-group set per world
WORLDS = {
    "tp2": {"tp2": (TP2, {}, None), "tp2_packed": (TP2, PACK, "tp2"), "tp2_fused_linear": (TP2, LINEAR, "tp2"),
            "tp2_packed_fused_linear": (TP2, PACK | LINEAR, "tp2"), "tp2_sp_packed": (TP2_SP, PACK, "tp2"),
            "tp2_sp_packed_fused_linear": (TP2_SP, PACK | LINEAR, "tp2")},
    "pp2": {"pp2": (PP2, {}, None), "pp2_packed": (PP2, PACK, "pp2"),
            "pp2_packed_fused_linear": (PP2, PACK | LINEAR, "pp2")},
}


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    arch = ModelArch(**data["arch"])
    full = hf_to_full_mcore(data["hf_state_dict"], arch)
    for variants in WORLDS.values():
        first = next(iter(variants.values()))[0]
        init_parallel(first, seed=data["seed"])
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        shards = mcore_shards_for_rank(full, arch, tp=first.tp, tp_rank=tp_rank, pp=first.pp, pp_rank=pp_rank,
                                       padded_vocab=padded_vocab_size(arch.vocab_size, first.tp))
        for name, (layout, overrides, _) in variants.items():
            actor = MegatronActor(arch, replace(data["config"], **overrides), layout)
            actor.load_shards(shards)
            logps, ents = actor.compute_log_probs(data["samples"], with_entropy=True)
            metrics = actor.train_step(data["samples"])
            grads = {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()}
            torch.save({"logps": logps, "entropies": ents, "metrics": metrics, "grads": grads},
                       f"{sys.argv[2]}/{name}_rank{dist.get_rank()}.pt")
        destroy_parallel(keep_process_group=True)
    destroy_parallel()


if __name__ == "__main__":
    main()
