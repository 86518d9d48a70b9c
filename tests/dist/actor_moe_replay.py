"""torchrun worker (2 ranks): routing replay with PP=2 + --recompute-granularity full (1F1B: a stage runs
micro-batch 1's forward before micro-batch 0's recomputed backward), with EP=2 (x DP=2) and with TP=2 + sequence
parallelism (each TP rank's routers see half of every micro-batch's tokens; expert TP 1) and with PP=2 x 2
virtual stages (a chunk's routers read their global layer's column), one launch.

argv: <input .pt from tests/unit/actor/test_actor_moe_replay.py> <output dir>. The input holds the arch, the HF
state dict, the samples (with routed_experts) and the ActorConfig. Every rank saves, per layout, its samples'
log-probs, the train_step metrics and its main grads (global layer and expert names; TP shards at TP=2) to
<out>/<layout>_rank<r>.pt.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.weights.mapping import canonical_mcore_name
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank

LAYOUTS = {"pp2_recompute": dict(pp=2, recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1),
           "ep2": dict(ep=2),
           "tp2_sp": dict(tp=2, sp=True, etp=1),
           "pp2_vpp": dict(pp=2, layers_per_virtual_stage=1)}


def _global_name(name: str, arch, pp_rank: int, pp: int, ep_rank: int, ep: int) -> str:
    parts = name.split(".")
    if name.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + pp_rank * arch.num_layers // pp)
    if "local_experts" in parts:
        k = parts.index("local_experts") + 1
        parts[k] = str(int(parts[k]) + ep_rank * arch.num_experts // ep)
    return ".".join(parts)


def run_layout(name: str, data: dict, out_dir: str) -> None:
    arch = data["arch"]
    layout = init_parallel(seed=0, num_layers=arch.num_layers, **LAYOUTS[name])
    actor = MegatronActor(arch, data["config"], layout)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    full = hf_to_full_mcore(data["hf_state_dict"], arch)
    chunks = len(actor.chunks)  # VPP: chunk c holds the stage of a chunks x pp layout at c * pp + pp_rank
    for c in range(chunks):
        actor.load_shards(mcore_shards_for_rank(
            full, arch, tp=layout.tp, tp_rank=tp_rank, pp=layout.pp * chunks, pp_rank=c * layout.pp + pp_rank,
            padded_vocab=padded_vocab_size(arch.vocab_size, layout.tp), ep=layout.ep, ep_rank=ep_rank,
            etp=layout.etp, etp_rank=0 if layout.etp == 1 else None), chunk=c, reload=c == chunks - 1)
    indices = list(range(dp_rank, len(data["samples"]), layout.dp))
    samples = [data["samples"][i] for i in indices]
    logps = actor.compute_log_probs(samples)
    metrics = actor.train_step(samples)
    grads = {} if chunks > 1 else {  # VPP: log-probs and metrics only
        _global_name(canonical_mcore_name(n, arch), arch, pp_rank, layout.pp, ep_rank, layout.ep): p.main_grad.clone()
        for n, p in actor.module.named_parameters()}
    torch.save({"indices": indices, "logps": logps, "metrics": metrics, "grads": grads,
                "micro_batches": len(actor._micro_batches(samples))},
               f"{out_dir}/{name}_rank{dist.get_rank()}.pt")
    destroy_parallel(keep_process_group=True)


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    for name in LAYOUTS:
        run_layout(name, data, sys.argv[2])
    destroy_parallel()


if __name__ == "__main__":
    main()
