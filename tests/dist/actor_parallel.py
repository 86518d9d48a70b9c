"""torchrun worker (4 ranks): run the actor of every model family at TP=2 (x DP=2), PP=2 (x DP=2),
TP=2 x PP=2 and (the first family only) DP=4 and the uneven PP=2 splits 1/3 and 3/1 of a 4-layer model
(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers), and a mixture-of-experts family at its
expert-parallel layouts (EP=2 and EP=4 over DP=4, TP=2 x EP=2 + SP with expert-TP 1 and 2, PP=2 x EP=2), on one
world; save the results.

argv: <input .pt from tests/multiprocess/test_actor_parallel.py> <output dir>. The input holds, per model key, the arch,
the HF state dict and the layouts to run. For each (model, layout) every rank saves its log-probs, entropies,
the log-probs of a frozen copy (the reference model, MegatronActor(frozen=True)), the metrics of two train steps,
its ranks (TP, PP, DP, EP, expert-TP, expert-DP) and its weight shards to
<out>/<model>_<layout>_rank<r>.pt; under an uneven split also the weight plan's shards for its rank (what
--hf-checkpoint loads: weights.plan.iter_rank_shards) and the HF export after the steps (weights.export.iter_hf_weights,
what weight sync and --export-hf send).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.export import iter_hf_weights
from megatron_dapo.weights.plan import iter_rank_shards
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank, reset_moe_tracker

NPROC = 4
LAYOUTS = {"tp2": ParallelLayout(tp=2, pp=1, dp=2), "pp2": ParallelLayout(tp=1, pp=2, dp=2),
           "tp2pp2": ParallelLayout(tp=2, pp=2, dp=1), "dp4": ParallelLayout(tp=1, pp=1, dp=4),
           # mixture of experts: EP spans DP ranks (expert-DP = DP x TP / (EP x expert-TP)); MoE with TP needs SP
           "ep2": ParallelLayout(dp=4, ep=2), "ep4": ParallelLayout(dp=4, ep=4),
           "tp2ep2": ParallelLayout(tp=2, dp=2, ep=2, etp=1, sp=True),
           "tp2ep2etp2": ParallelLayout(tp=2, dp=2, ep=2, etp=2, sp=True),
           "pp2ep2": ParallelLayout(pp=2, dp=2, ep=2),
           # uneven pipelines of a 4-layer model: 1 + 3 and 3 + 1 layers
           "pp2first1": ParallelLayout(pp=2, dp=2, layers_in_first_stage=1),
           "pp2last1": ParallelLayout(pp=2, dp=2, layers_in_last_stage=1)}
STAGE_LAYERS = {"pp2first1": (1, 3), "pp2last1": (3, 1)}
"""Each PP stage's layer count of the uneven layouts, written out (the independent weight copy of actor_common places
layers by these, not by distributed.parallel.layer_range)."""


def run_layout(model_key: str, name: str, data: dict, family: dict, out_dir: str) -> None:
    layout = LAYOUTS[name]
    arch = ModelArch(**family["arch"])
    init_parallel(layout, seed=data["seed"])
    reset_moe_tracker()
    config: ActorConfig = family.get("config", data["config"])
    if layout.dp > 1:  # the distributed optimizer only shards anything with DP > 1
        config = replace(config, use_distributed_optimizer=True)
    actor = MegatronActor(arch, config, layout)
    ranks = {"tp_rank": parallel_state.get_tensor_model_parallel_rank(),
             "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
             "dp_rank": parallel_state.get_data_parallel_rank(),
             "ep_rank": parallel_state.get_expert_model_parallel_rank(),
             "etp_rank": parallel_state.get_expert_tensor_parallel_rank(),
             "edp_rank": parallel_state.get_expert_data_parallel_rank()}
    full = hf_to_full_mcore(family["hf_state_dict"], arch)
    shards = mcore_shards_for_rank(
        full, arch, tp=layout.tp, tp_rank=ranks["tp_rank"], pp=layout.pp, pp_rank=ranks["pp_rank"],
        padded_vocab=padded_vocab_size(arch.vocab_size, layout.tp), ep=layout.ep, ep_rank=ranks["ep_rank"],
        etp=layout.expert_tp, etp_rank=ranks["etp_rank"], stage_layers=STAGE_LAYERS.get(name))
    actor.load_shards(shards)
    frozen = MegatronActor(arch, config, layout, frozen=True)  # the reference model (--ref-load) on this layout
    frozen.load_shards(shards)
    uneven = {}
    if name in STAGE_LAYERS:  # the weight plan's load of this rank, compared with the independent copy by the test
        uneven["plan_shards"] = dict(iter_rank_shards(
            family["hf_state_dict"].__getitem__, arch, layout, pp_rank=ranks["pp_rank"], tp_rank=ranks["tp_rank"],
            ep_rank=ranks["ep_rank"], etp_rank=ranks["etp_rank"]))
    indices = list(range(ranks["dp_rank"], len(data["samples"]), layout.dp))
    samples = [data["samples"][i] for i in indices]
    logps, ents = actor.compute_log_probs(samples, with_entropy=True)
    frozen_logps = frozen.compute_log_probs(samples)
    del frozen
    metrics = [actor.train_step(samples) for _ in range(data["steps"])]
    if name in STAGE_LAYERS:  # a collective: every rank yields the whole HF model
        uneven["hf_export"] = {n: t.clone() for n, t in iter_hf_weights(actor.chunks, arch)}
    torch.save({"indices": indices, "logps": logps, "frozen_logps": frozen_logps, "entropies": ents, "metrics": metrics,
                **ranks, **uneven,
                "weights": {k: v.clone() for k, v in actor.state_dict_for_export().items()}},
               f"{out_dir}/{model_key}_{name}_rank{dist.get_rank()}.pt")
    destroy_parallel(keep_process_group=True)


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    for model_key, family in data["families"].items():
        for name in family["layouts"]:
            run_layout(model_key, name, data, family, sys.argv[2])
    destroy_parallel()


if __name__ == "__main__":
    main()
