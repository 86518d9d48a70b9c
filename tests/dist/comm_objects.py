"""torchrun worker (3 gloo ranks) for tests/unit/distributed/test_comm.py: comm's object collectives against
torch's own.

Each rank pickles an object of a different size (so the padding to the longest pickle is exercised), then:
  all_gather_object / gather_object on the world (dst 2) and on subgroups whose group ranks differ from the
  global ones ([1, 2] gathering to global rank 2; [0, 2] all-gathering), each next to the same call of
  torch.distributed's all_gather_object / gather_object; gather of tensors; barrier; and
  validation.share_verdict with and without an error on rank 0; comm.section with a body that fails on rank 1;
  CheckpointSaver.save whose rank-0 step (making <save>/step_1.tmp) fails because <save> is a file: the
  other ranks must raise naming rank 0 at once (rank 0 raises its own OSError); a colocated push of one
  3-rank engine whose poster (rank 0) cannot reach its server: the other ranks raise naming rank 0.
Writes each rank's results to <out_dir>/rank<r>.json (argv[1]).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def theirs_all_gather(obj, group=None) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def theirs_gather(obj, dst: int, group=None) -> list | None:
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def verdict(error) -> str | None:
    from megatron_dapo.errors import UserError
    from megatron_dapo.trainer.validation import share_verdict

    try:
        share_verdict(error)
    except UserError as e:
        return f"{e} echo={e.echo}"
    return None


def outcome(fn) -> str:
    """'ok', or the type and message of what `fn` raised."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(e).__name__}: {e}"
    return "ok"


def failing_section(rank: int) -> None:
    from megatron_dapo.distributed import comm

    with comm.section("while testing"):
        if rank == 1:
            raise ValueError("rank 1's part failed")


def failing_save(rank: int, out_dir: str) -> None:
    from megatron_dapo.checkpoint.training import CheckpointSaver

    blocker = Path(out_dir, "not_a_dir")
    if rank == 0:
        blocker.write_text("a file where the save directory should be")
    CheckpointSaver(blocker).save(1, None, {})  # rank 0's mkdir fails before the actor is touched


def failing_push(rank: int, url: str) -> None:
    from megatron_dapo.weight_sync.colocated_push import ColocatedPusher, make_engine_groups

    pusher = ColocatedPusher(make_engine_groups([url], 3), bucket_bytes=1 << 10, timeout_s=5)
    pusher.push([("w", torch.ones(4))], version=1)  # rank 0 posts /begin_weight_update to a port nobody holds


def main() -> None:
    from megatron_dapo.distributed import comm
    from megatron_dapo.errors import UserError

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    obj = {"rank": rank, "payload": "x" * (100 * rank), "list": list(range(rank))}
    sub_12 = dist.new_group([1, 2], backend="gloo")  # collective: every rank makes every group
    sub_02 = dist.new_group([0, 2], backend="gloo")
    out: dict = {
        "all_gather": comm.all_gather_object(obj),
        "all_gather_torch": theirs_all_gather(obj),
        "gather_2": comm.gather_object(obj, 2),
        "gather_2_torch": theirs_gather(obj, 2),
        "tensor_gather_0": (lambda g: None if g is None else [t.tolist() for t in g])(
            comm.gather(torch.full((2,), float(rank)), 0)),
    }
    if rank in (1, 2):
        out["sub_12_gather_2"] = comm.gather_object(obj, 2, group=sub_12)
        out["sub_12_gather_2_torch"] = theirs_gather(obj, 2, group=sub_12)
    if rank in (0, 2):
        out["sub_02_all_gather"] = comm.all_gather_object(obj, group=sub_02)
        out["sub_02_all_gather_torch"] = theirs_all_gather(obj, group=sub_02)
    comm.barrier()
    out["verdict_ok"] = verdict(None)
    out["verdict_error"] = verdict(UserError("--max-prompt-length 9 is too long") if rank == 0 else None)
    out["section"] = outcome(lambda: failing_section(rank))
    out["save"] = outcome(lambda: failing_save(rank, sys.argv[1]))
    out["push"] = outcome(lambda: failing_push(rank, sys.argv[2]))
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
