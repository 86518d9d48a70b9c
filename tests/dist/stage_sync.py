"""torchrun worker (4 ranks): per-stage weight sync to fake SGLang servers at TP1 x PP2 x DP2 and TP2 x PP2.

argv: <input .pt from tests/test_stage_sync.py> <output dir>. For each layout: the actor is loaded with the same
HF weights, then rank 0's SGLangEngine (attached to the fake servers the test runs) takes one per-stage update
(StageSync, version = layout number), then every rank iterates the old whole-model export (iter_hf_weights),
which rank 0 saves as the reference. Every rank saves its role and what it moved (StageSync.stats) to
<out>/<layout>_rank<r>.pt. With "kill" in the input, the test kills a fake server during the push and brings it
back; rank 0 waits for its re-sync before it saves.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.distributed import comm
from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.weight_sync.stage_sync import StageSync
from megatron_dapo.weights.export import is_stage_source, iter_hf_weights
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank

LAYOUTS = {"tp1pp2dp2": ParallelLayout(tp=1, pp=2, dp=2), "tp2pp2": ParallelLayout(tp=2, pp=2, dp=1),
           "tp1pp2": ParallelLayout(tp=1, pp=2, dp=1)}


def run_layout(version: int, name: str, data: dict, out_dir: str) -> None:
    layout = LAYOUTS[name]
    arch = ModelArch(**data["arch"])
    init_parallel(layout, seed=0)
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, use_fused_logprob=False), layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    full = hf_to_full_mcore(data["hf_state_dict"], arch)
    actor.load_shards(mcore_shards_for_rank(full, arch, tp=layout.tp, tp_rank=tp_rank, pp=layout.pp,
                                            pp_rank=pp_rank, padded_vocab=padded_vocab_size(arch.vocab_size,
                                                                                             layout.tp)))
    wait_group = comm.gloo_group(None, timeout=timedelta(minutes=5))
    sync = StageSync(wait_group, lock_timeout_s=120)
    rank = dist.get_rank()
    engine = None
    if rank == 0:
        engine = SGLangEngine(server_urls=data["urls"], client=ClientConfig(
            update_mode="distributed", bucket_bytes=data["bucket_bytes"], sync_backend="gloo",
            sync_master_port=data["ports"][version - 1], control_timeout_s=60, server_wait_s=60))
    metrics = sync.sync(actor.chunks, arch, engine, version)
    out = {"stage": pp_rank, "tp_rank": tp_rank, "dp_rank": parallel_state.get_data_parallel_rank(),
           "source": is_stage_source(), "stats": sync.stats, "metrics": metrics}
    reference = {n: t.clone() for n, t in iter_hf_weights(actor.chunks, arch)}  # the old path, every rank
    if rank == 0:
        if data.get("kill"):  # wait for the lost server's re-sync from the host copy
            deadline = time.monotonic() + 120
            while engine._stale and time.monotonic() < deadline:
                time.sleep(0.2)
        out |= {"reference": reference, "kept": [m.name for b in engine._kept for m in b.metas],
                "engine_metrics": engine.take_metrics(), "stale": sorted(engine._stale)}
        engine.shutdown()
    torch.save(out, f"{out_dir}/{name}_rank{rank}.pt")
    comm.barrier(wait_group)
    destroy_parallel(keep_process_group=True)


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    for version, name in enumerate(data["layouts"], start=1):
        run_layout(version, name, data, sys.argv[2])
    destroy_parallel()


if __name__ == "__main__":
    main()
