"""torchrun worker (4 ranks): per-stage weight sync to fake SGLang servers at TP1 x PP2 x DP2 and TP2 x PP2.

argv: <input .pt from tests/unit/weight_sync/test_stage_sync.py> <output dir>. For each layout: the actor is
loaded with the same HF weights, then rank 0's SGLangEngine (attached to the fake servers the test runs) takes one
per-stage update (StagePush from build_weight_sync, version = layout number), then every rank iterates the old
whole-model export (iter_hf_weights), which rank 0 saves as the reference. Every rank saves its role and what it moved
(StagePush.stats) and how many Python objects it broadcast or received during the push to
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

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed import comm
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.weight_sync.build import build_weight_sync
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
    rank = dist.get_rank()
    engine = None
    if rank == 0:
        engine = SGLangEngine(server_urls=data["urls"], client=ClientConfig(
            bucket_bytes=data["bucket_bytes"], sync_backend="gloo", sync_master_port=data["ports"][version - 1],
            control_timeout_s=data.get("control_timeout_s", 60), server_wait_s=60))
    # The lock's holder may wait out a killed server's control (60 s) and HTTP (60 s) timeouts, longer on a loaded
    # machine: the other stage's wait for the lock must outlast that (120 s did not, once, in a full `make test`).
    sync = build_weight_sync(engine, transport="distributed", wait_group=wait_group,
                             lock_timeout_s=400)  # rank 0's facts, sent once
    pushed, broadcasts = _counting_broadcasts(lambda: sync.push(actor, version), wait_group)
    metrics = {k: v for k, v in pushed.items() if k.startswith("sync/stage")}  # the stages' own seconds
    assert pushed["time/sync_s"] > 0
    out = {"stage": pp_rank, "tp_rank": tp_rank, "dp_rank": parallel_state.get_data_parallel_rank(),
           "source": is_stage_source(), "stats": sync.stats, "metrics": metrics, "sync": type(sync).__name__,
           "broadcasts": broadcasts}
    if version == 1 and not data.get("kill"):  # the same PP 2 run in disk mode: the full push, chosen at build;
        # no object broadcast per push
        full_engine = None
        if rank == 0:  # (not tensor mode: torch's shm manager would outlive this launch, holding its stdout)
            full_engine = SGLangEngine(server_urls=data["urls"], client=ClientConfig(
                disk_dir=f"{out_dir}/disk", bucket_bytes=data["bucket_bytes"], control_timeout_s=60))
        full_sync = build_weight_sync(full_engine, transport="disk", wait_group=wait_group)
        _, full_broadcasts = _counting_broadcasts(lambda: [full_sync.push(actor, 100 + k) for k in range(2)],
                                                  wait_group)
        out |= {"full_sync": type(full_sync).__name__, "full_broadcasts": full_broadcasts}
        if full_engine is not None:
            full_engine.shutdown()
    reference = {n: t.clone() for n, t in iter_hf_weights(actor.chunks, arch)}  # the old path, every rank
    if rank == 0:
        if data.get("kill"):  # wait for the lost server's re-sync from the host copy
            deadline = time.monotonic() + 120
            while engine._stale and time.monotonic() < deadline:
                time.sleep(0.2)
        out |= {"reference": reference, "kept": [m.name for b in sync.coordinator.full.kept
                                                  for m in b.metas],
                "engine_metrics": _summed(pushed, engine.take_metrics()), "stale": sorted(engine._stale)}
        engine.shutdown()
    torch.save(out, f"{out_dir}/{name}_rank{rank}.pt")
    comm.barrier(wait_group)
    destroy_parallel(keep_process_group=True)


def _counting_broadcasts(run, wait_group):
    """run()'s result and the Python objects broadcast over the trainer's wait group (the group rank 0 decided the
    path on, before) through comm.broadcast_object meanwhile: sent or received, a tuple's first item, else its
    type name. (The export's own manifest broadcasts over the pipeline group are not counted.)"""
    seen = []
    real = comm.broadcast_object

    def counting(obj, src, group=None):
        got = real(obj, src, group)
        if group is wait_group:
            seen.append(got[0] if isinstance(got, tuple) else type(got).__name__)
        return got

    comm.broadcast_object = counting
    try:
        return run(), seen
    finally:
        comm.broadcast_object = real


def _summed(pushed: dict[str, float], later: dict[str, float]) -> dict[str, float]:
    """The engine's counters over the push (returned by it) and since (the lost server's re-sync)."""
    return {k: pushed.get(k, 0.0) + v for k, v in later.items()}


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    for version, name in enumerate(data["layouts"], start=1):
        run_layout(version, name, data, sys.argv[2])
    destroy_parallel()


if __name__ == "__main__":
    main()
