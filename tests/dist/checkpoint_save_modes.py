"""Worker of tests/multiprocess/test_checkpoint_save_modes.py: 2 ranks (DP=2), one save per mode, each loaded back.

Modes: default, --ckpt-fully-parallel-save, --async-save, both. Rank 0 writes results.json to argv[1]:
per mode whether every rank's reloaded state equals the saved one bit for bit, the .distcp bytes each
rank wrote, whether the async step was still unrenamed (.tmp, no `latest`) before finalisation, and the
child processes left once the saver was closed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.actor import MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.training import CheckpointSaver, load_checkpoint
from tests.checkpoint_helpers import optimizer_state
from tests.dist.actor_common import hf_actor, make_samples, tiny_hf_model

MODES = {"default": (False, False), "fully-parallel": (True, False), "async": (False, True),
         "fully-parallel+async": (True, True)}


def live_children() -> list[str]:
    """Non-zombie processes whose parent is this one, as 'pid cmdline'."""
    me, out = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == me and fields[0] != "Z":
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
                out.append(f"{entry.name} {cmdline}")
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return out


def main(out_dir: Path) -> None:
    layout = init_parallel(seed=0)
    rank = dist.get_rank()
    hf = tiny_hf_model(seed=2)

    def make_actor() -> MegatronActor:
        return hf_actor(hf, layout)

    actor = make_actor()
    for k in range(2):
        actor.train_step(make_samples(4, seed=10 * k + rank))
    want = optimizer_state(actor)
    results = {}
    for name, (fully_parallel, async_save) in MODES.items():
        root = out_dir / name
        saver = CheckpointSaver(root, fully_parallel=fully_parallel, async_save=async_save)
        final = saver.save(3, actor, extra={"mode": name})
        unrenamed = Path(f"{final}.tmp").is_dir() and not final.exists() and not (root / "latest").exists()
        dist.barrier()
        saver.close()
        children = live_children()
        fresh = make_actor()
        extra = load_checkpoint(root, fresh)
        got = optimizer_state(fresh)
        equal = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, {"equal": equal, "children": children})
        results[name] = {
            "all_ranks_equal": all(f["equal"] for f in flags), "extra": extra,
            "latest": (root / "latest").read_text(), "unrenamed_before_finalize": unrenamed,
            "children_after_close": [c for f in flags for c in f["children"]],
            "distcp_bytes_per_rank": [sum(p.stat().st_size for p in final.glob(f"__{r}_*.distcp")) for r in (0, 1)],
        }
    if rank == 0:
        (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    destroy_parallel()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
