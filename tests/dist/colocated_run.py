"""torchrun worker (2 ranks, gloo): the same DAPO updates pushed to one SGLang server at TP 2 in colocated
mode and in separate-server mode, and what the server generates after each.

argv: <input .pt from tests/sglang/test_colocate_dist.py> <output dir> <server url>. The input holds the HF state
dict, the arch, the samples of each step and the prompts. Both runs train a TP 2 actor from the same weights
on the same samples:
- separate: rank 0's ServerPush.update (tensor mode: rank 0's bucket, one copy per server TP rank);
- colocated: PhaseSwitcher (release -> onload -> train -> offload -> resume weights -> push -> resume KV) and
  ColocatedPusher (each rank hands its own bucket to the server TP rank of its index; rank 0 posts the list).
Rank 0 saves, per run and step, the greedy samples of the prompts, the actor's weights and the phase-switch
metrics to <out>/result.pt.
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from megatron_dapo.trainer.colocate import ActorOffloader, PhaseSwitcher, process_rss_bytes
from megatron_dapo.trainer.dataplane import DataPlane
from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, make_engine_groups
from megatron_dapo.weights.export import iter_hf_weights
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank
from tests.sglang import full_push

BUCKET = 40_000  # bytes: several buckets for the tiny model, so the per-bucket hand-over runs many times


def make_actor(arch: ModelArch, state_dict, layout: ParallelLayout) -> MegatronActor:
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, max_tokens_per_micro_batch=64), layout)
    full = hf_to_full_mcore(state_dict, arch)
    actor.load_shards(mcore_shards_for_rank(full, arch, tp=2, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                                            pp=1, pp_rank=0, padded_vocab=padded_vocab_size(arch.vocab_size, 2)))
    return actor


def generate(engine, prompts) -> list:
    sp = SamplingParams(max_new_tokens=6, temperature=0.0)
    reqs = [RolloutRequest(prompt_ids=p, n=1, sampling=sp, request_id=f"p{i}") for i, p in enumerate(prompts)]
    return [(s.response_ids, s.logprobs, s.weight_version) for g in engine.generate(reqs) for s in g]


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    out_dir, url = sys.argv[2], sys.argv[3]
    arch = ModelArch(**data["arch"])
    layout = init_parallel(ParallelLayout(tp=2), seed=0)
    rank = dist.get_rank()
    engine = SGLangEngine(server_urls=[url], client=ClientConfig(bucket_bytes=BUCKET,
                                                                 control_timeout_s=300)) if rank == 0 else None
    result: dict = {"separate": [], "colocated": [], "switch": []}

    # separate-server mode: rank 0 pushes
    ref = make_actor(arch, data["hf_state_dict"], layout)
    for step, samples in enumerate(data["steps"], start=1):
        ref.train_step(samples, rollout_step=step)
        named = iter_hf_weights(ref.chunks, arch)
        if engine is not None:
            full_push(engine, "tensor").update(named, version=step)
            result["separate"].append(generate(engine, data["prompts"]))
        else:
            for _ in named:
                pass
        dist.barrier()

    # colocated mode: every rank pushes its own bucket; the engine releases memory while the actor trains
    actor = make_actor(arch, data["hf_state_dict"], layout)
    pusher = ColocatedPusher(make_engine_groups([url], 2), bucket_bytes=BUCKET)
    pusher.push(iter_hf_weights(actor.chunks, arch), version=0)  # the run starts from the actor's weights
    if engine is not None:
        engine.set_weight_version(0)
    plane = DataPlane(parallel_state.get_data_parallel_rank(), timeout=timedelta(minutes=5))  # as Trainer.section
    switch = PhaseSwitcher(offloader=ActorOffloader(actor.chunks, actor.optimizer), engine=engine,
                           section=plane.section)
    switch.start()
    for step, samples in enumerate(data["steps"], start=1):
        rss_generation = process_rss_bytes()
        metrics = switch.to_training()
        metrics["rss_gib_training"] = process_rss_bytes() / 2**30
        actor.train_step(samples, rollout_step=step)
        metrics |= switch.to_generation(lambda v=step: pusher.push(iter_hf_weights(actor.chunks, arch), version=v))
        metrics["rss_gib_generation"] = rss_generation / 2**30
        metrics["offloaded_bytes"] = switch.offloader.state_bytes + switch.offloader.grad_bytes
        result["switch"].append(metrics)
        if engine is not None:
            engine.set_weight_version(step)
            result["colocated"].append(generate(engine, data["prompts"]))
        dist.barrier()
    result["weights_equal"] = all(torch.equal(a, b) for a, b in zip(
        [p for c in actor.chunks for p in c.parameters()], [p for c in ref.chunks for p in c.parameters()],
        strict=True))
    flags = [None, None]
    dist.all_gather_object(flags, result["weights_equal"])
    result["weights_equal"] = all(flags)
    if rank == 0:
        torch.save(result, f"{out_dir}/result.pt")
        engine.shutdown()
    destroy_parallel()


if __name__ == "__main__":
    main()
