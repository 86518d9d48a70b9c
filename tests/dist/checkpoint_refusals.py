"""Worker of tests/multiprocess/test_checkpoint_refusals.py: 2 ranks (DP=2); what reaches each rank when rank 1
alone meets it.

1. A crafted checkpoint: the RNG state object of rank 1 (`rng_state/shard_1_2`, read by rank 1 alone) runs code when
   unpickled. Each rank records what load_checkpoint raised (type, echo, the message's start) and whether the payload's
   marker file exists.
2. A full disk on rank 1 alone (its writer's files fill up after 2,000 bytes, inside its 14 KB RNG state record; rank
   0's do not), sync and --async-save: each rank records what the save raised; rank 0 what is left in --save.
Rank 0 writes results.json to argv[1].
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.training import CheckpointSaver, load_checkpoint, save_checkpoint, step_dir
from megatron_dapo.errors import UserError
from tests.crafted_checkpoint import plant_in_object
from tests.disk_full import fill_disk_after
from tests.dist.actor_common import hf_actor, make_samples, tiny_hf_model


def _outcome(run) -> dict:
    """What `run()` raised on this rank: {"type", "echo", "message"} (None fields when it returned)."""
    try:
        run()
    except BaseException as err:  # torch's CheckpointException is a BaseException
        return {"type": type(err).__name__, "echo": getattr(err, "echo", None), "message": str(err)[:400],
                "user_error": isinstance(err, UserError)}
    return {"type": None, "echo": None, "message": None, "user_error": False}


def main(out_dir: Path) -> None:
    layout = init_parallel(seed=0)
    rank = dist.get_rank()
    hf = tiny_hf_model(seed=4)

    def make_actor() -> MegatronActor:
        return hf_actor(hf, layout)

    actor = make_actor()
    actor.train_step(make_samples(4, seed=rank))
    results: dict = {}

    root, marker = out_dir / "crafted", out_dir / "marker"
    save_checkpoint(root, 1, actor, extra={})
    if rank == 0:
        results["planted"] = plant_in_object(step_dir(root, 1), "rng_state/shard_1_2", marker)
    dist.barrier()
    results["crafted"] = _gathered(_outcome(lambda: load_checkpoint(root, make_actor())))
    results["marker"] = marker.exists()

    for mode, async_save in (("sync", False), ("async", True)):
        save = out_dir / f"full-{mode}"
        patch = pytest.MonkeyPatch()
        if rank == 1:
            from megatron.core.dist_checkpointing.strategies import filesystem_async

            fill_disk_after(patch, filesystem_async, 2_000)  # rank 1 writes only its RNG state (14 KB)
        saver = CheckpointSaver(save, async_save=async_save)

        def save_and_close(saver=saver) -> None:
            saver.save(1, actor, extra={})
            saver.close()

        outcome = _outcome(save_and_close)
        patch.undo()
        dist.barrier()
        results[mode] = _gathered(outcome)
        if rank == 0:
            results[f"{mode}_left"] = sorted(p.name for p in save.iterdir())
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    destroy_parallel()


def _gathered(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


if __name__ == "__main__":
    main(Path(sys.argv[1]))
