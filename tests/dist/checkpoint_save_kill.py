"""Worker of tests/unit/checkpoint/test_checkpoint_procs.py: one process saving a tiny actor's checkpoint.

argv: OUT_DIR MODE(sync|async) SLOW(0|1). With SLOW=1 the process that forks the checkpoint writers first writes
their number to OUT_DIR/writers.count, and every writer process creates OUT_DIR/writer_<pid> and then sleeps, so
the test can SIGKILL this process mid-save once every writer is inside its write. Before exiting normally it prints
'DESCENDANTS <json>' (pid, start time) of every process it started.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from megatron_dapo.actor import ActorConfig, MegatronActor, init_parallel
from megatron_dapo.checkpoint.training import CheckpointSaver
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import hf_to_full_mcore, make_samples, mcore_shards_for_rank, tiny_hf_model


def descendants(root: int) -> list[tuple[int, int]]:
    """(pid, start time in clock ticks) of every live process below `root`."""
    parent_of: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            parent_of[int(entry.name)] = (int(fields[1]), int(fields[19]))
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        for child, (ppid, start) in parent_of.items():
            if ppid == pid:
                found.append((child, start))
                frontier.append(child)
    return found


def main(out: Path, mode: str, slow: bool) -> None:
    if slow:
        original = FileSystemWriterAsync.write_preloaded_data

        def slow_write(*args, **kwargs):
            (out / f"writer_{os.getpid()}").touch()
            time.sleep(120)
            return original(*args, **kwargs)

        FileSystemWriterAsync.write_preloaded_data = staticmethod(slow_write)
        forking = FileSystemWriterAsync.write_preloaded_data_multiproc

        def counted_fork(*args, **kwargs):
            buckets = inspect.signature(forking).bind(*args, **kwargs).arguments["write_buckets"]
            (out / "writers.tmp").write_text(str(len(buckets)))
            (out / "writers.tmp").rename(out / "writers.count")  # whole or absent for the test's reads
            return forking(*args, **kwargs)

        FileSystemWriterAsync.write_preloaded_data_multiproc = staticmethod(counted_fork)
    layout = init_parallel(seed=0)
    hf = tiny_hf_model(seed=1)
    arch = ModelArch.from_hf(hf.config)
    actor = MegatronActor(arch, ActorConfig(lr=1e-3), layout)
    actor.load_shards(mcore_shards_for_rank(hf_to_full_mcore(hf.state_dict(), arch), arch, tp=1, tp_rank=0, pp=1,
                                            pp_rank=0, padded_vocab=padded_vocab_size(arch.vocab_size, 1)))
    actor.train_step(make_samples(2, seed=0))
    saver = CheckpointSaver(out / "ckpt", async_save=mode == "async")
    saver.save(1, actor, extra={})
    print("DESCENDANTS " + json.dumps(descendants(os.getpid())), flush=True)
    saver.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1")
