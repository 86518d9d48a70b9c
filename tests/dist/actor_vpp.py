"""torchrun worker (2 ranks): the actor at TP1 x PP2 x VPP2 (--num-layers-per-virtual-pipeline-stage 1 on
4 layers), then its checkpoint loaded at plain PP2.

argv: <input .pt from tests/multiprocess/test_actor_vpp.py> <output dir>. The actor loads the HF directory through
train.load_hf_into_actor and checks each chunk against an independent copy (tests/dist/actor_common.py).
Rank r saves <out>/vpp_rank<r>.pt with:
log-probs, entropies, the metrics of the train steps, the HF export after them, the metrics of one more
step taken after a --save (`after_save`) and again after loading that save back (`after_load`), the HF
export right after the load, and the HF export of a non-interleaved PP2 actor loaded from the same save.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.training import load_checkpoint, save_checkpoint
from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.trainer.build import load_hf_into_actor
from megatron_dapo.weights.export import iter_hf_weights
from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank

VPP = ParallelLayout(tp=1, pp=2, dp=1, layers_per_virtual_stage=1)


def export(actor: MegatronActor) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in iter_hf_weights(actor.chunks, actor.arch)}


def main() -> None:
    data = torch.load(sys.argv[1], weights_only=False)
    out_dir = sys.argv[2]
    arch = ModelArch(**data["arch"])
    init_parallel(VPP, seed=data["seed"], num_layers=arch.num_layers)
    actor = MegatronActor(arch, data["config"], VPP)
    assert len(actor.chunks) == 2
    pp, pp_rank = VPP.pp, parallel_state.get_pipeline_model_parallel_rank()
    load_hf_into_actor(actor, data["hf_dir"])  # the --hf-checkpoint path: stage_tensors(..., chunk=c)
    full = hf_to_full_mcore(data["hf_state_dict"], arch)
    for chunk in range(2):  # chunk c of PP rank r = stage c * pp + r of a 4-stage non-interleaved layout
        want = mcore_shards_for_rank(full, arch, tp=1, tp_rank=0, pp=pp * 2, pp_rank=chunk * pp + pp_rank,
                                     padded_vocab=padded_vocab_size(arch.vocab_size, 1))
        got = actor.state_dict_for_export(chunk)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    samples = data["samples"]
    logps, ents = actor.compute_log_probs(samples, with_entropy=True)
    # 2 samples fit one micro-batch: split to 2 (one group of PP) for the interleaved schedule
    logps_two = actor.compute_log_probs(samples[:2])
    try:  # one sample cannot be split: the error names the flag
        actor.compute_log_probs(samples[:1])
        raise AssertionError("one sample at PP2 x VPP2 did not raise")
    except ValueError as err:
        assert "--num-layers-per-virtual-pipeline-stage needs 2 micro-batches" in str(err), err
    metrics = [actor.train_step(samples) for _ in range(data["steps"])]
    exported = export(actor)
    ckpt = f"{out_dir}/ckpt"
    save_checkpoint(ckpt, data["steps"], actor, {"note": "vpp"})
    after_save = actor.train_step(samples)
    load_checkpoint(ckpt, actor)
    loaded_export = export(actor)
    after_load = actor.train_step(samples)
    destroy_parallel(keep_process_group=True)

    plain = ParallelLayout(tp=1, pp=2, dp=1)
    init_parallel(plain, seed=data["seed"])
    other = MegatronActor(arch, data["config"], plain)
    load_checkpoint(ckpt, other)
    plain_export = export(other)
    torch.save({"logps": logps, "logps_two": logps_two, "entropies": ents, "metrics": metrics, "export": exported,
                "after_save": after_save, "after_load": after_load, "loaded_export": loaded_export,
                "plain_export": plain_export}, f"{out_dir}/vpp_rank{dist.get_rank()}.pt")
    destroy_parallel()


if __name__ == "__main__":
    main()
