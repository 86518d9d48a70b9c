"""The trainer's side of SGLang's weight-update process group (update_weights_from_distributed).

SGLang's /init_weights_update_group makes each server TP rank join a process group through a TCP
rendezvous at tcp://master_address:master_port, with its store prefixed by the group name, ranks
rank_offset + tp_rank. The trainer joins the same group as rank 0 (the TCP store master) and broadcasts
each tensor from there. It is a group of its own, outside the trainer's default (Megatron) process group.

A member lost during a broadcast. On gloo the broadcast raises on every member (the lost one's
connection closes), and the caller recovers: the survivors' receives failed too. On NCCL it never completes:
every member's kernel spins until the communicator is aborted or the watchdog kills the process at the group's
timeout (ClientConfig.control_timeout_s, 600 s), and a synchronous `dist.broadcast` (on torch >= 2.12 a kernel
on the current stream) blocks rank 0's next device-to-host copy behind it. So on NCCL `broadcast_bucket` issues
the broadcast with async_op=True (on the group's own stream, which the default stream never waits for), polls
`Work.is_completed()` (cudaEventQuery: no stream or host sync) against `broadcast_deadline_s`, and reports a
stall instead of blocking; the caller aborts the communicator (`abort_group`: ncclCommAbort stops this rank's
kernels) and names the lost server. Then (DistributedPush._stalled, weight_sync/transports/distributed.py): the
run stops with WeightSyncStalled when another server of the group still answers, since SGLang 0.5.23 cannot
abort its side of the group (its destroy_process_group finalizes, i.e. waits for the stuck receive) and that
server may be wedged in it; the checkpoint is the recovery. A group with no answering server left (a re-sync of
one server) is recovered as a loss over gloo is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.distributed import comm
from megatron_dapo.rollout.sglang.protocol import ServerDied
from megatron_dapo.weight_sync.buckets import Bucket

BROADCAST_MIN_GBPS = 1.0
"""The slowest link rate a healthy push is allowed (GB/s, 1e9 B/s): the per-byte part of the deadline (its margin
under the production network's rate: docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B")."""
POLL_S = 0.001
"""How often the host asks a pending broadcast whether it is done (seconds): a broadcast is seen done up to this
late (what that adds to a 32B push: docs/BENCHMARKS.md, "Weight sync at Qwen2.5-32B")."""


class WeightSyncStalled(RuntimeError):
    """A weight-sync broadcast that could not complete while other servers of its group answer (they may be stuck
    in the receive for good): the run stops. Not caught as a lost member (a plain RuntimeError from gloo is)."""


def broadcast_deadline_s(nbytes: int, group_timeout_s: float, *, floor_s: float,
                         min_gbps: float = BROADCAST_MIN_GBPS) -> float:
    """Seconds one broadcast of `nbytes` may take before its group counts as stalled: floor_s + nbytes at min_gbps.

    floor_s (ClientConfig.broadcast_floor_s, 30 s) covers what does not scale with the bytes: the servers entering
    their receive (an HTTP request through SGLang's tokenizer manager to its scheduler, behind the previous bucket's
    load). The deadline counts from the moment the broadcast is enqueued, after NCCL created a new group's
    communicator in its first call (broadcast_bucket waits for that call apart).
    At Qwen2.5-32B (512 MiB buckets): 30 + 0.54 = 30.5 s a bucket (31.6 s for the 1.56 GB embedding, the largest).
    Raises ValueError when the deadline is not under the group's timeout `group_timeout_s`: the NCCL watchdog would
    end the process before the stall is seen."""
    if nbytes < 0:
        raise ValueError(f"broadcast_deadline_s: nbytes must be >= 0, got {nbytes}")
    if floor_s <= 0 or min_gbps <= 0:
        raise ValueError(f"broadcast deadline: floor_s and min_gbps must be > 0, got {floor_s} and {min_gbps}")
    deadline = floor_s + nbytes / (min_gbps * 1e9)
    if deadline >= group_timeout_s:
        raise ValueError(f"a weight-sync bucket of {nbytes / 1e9:.2f} GB gets a {deadline:.1f} s deadline "
                         f"({floor_s:.0f} s floor, ClientConfig.broadcast_floor_s, + its bytes at {min_gbps:g} GB/s), "
                         f"not under its group's {group_timeout_s:.0f} s timeout (ClientConfig.control_timeout_s), "
                         f"where the NCCL watchdog ends the process first: lower --weight-sync-bucket-mb or the floor")
    return deadline


def distributed_update_body(bucket: Bucket, group_name: str, version: int) -> dict:
    """The /update_weights_from_distributed request announcing `bucket` (its tensors' names, dtypes and shapes, in
    one flattened bucket) on the weight-sync group `group_name` at weight `version`, without a cache flush."""
    return {"names": [m.name for m in bucket.metas],
            "dtypes": [str(m.dtype).removeprefix("torch.") for m in bucket.metas],
            "shapes": [list(m.shape) for m in bucket.metas], "group_name": group_name,
            "load_format": "flattened_bucket", "flush_cache": False, "weight_version": str(version)}


def bucket_on_wire(bucket: Bucket, backend: str, *, group_timeout_s: float,
                   floor_s: float) -> tuple[torch.Tensor, int, float]:
    """What broadcast_bucket sends of `bucket` over a group of `backend`: (its flat buffer, contiguous, on the current
    CUDA device for NCCL, viewed as bytes; its byte count; its deadline, broadcast_deadline_s of that count)."""
    flat = bucket.flat.contiguous()
    if backend == "nccl":
        flat = flat.cuda()
    nbytes = flat.numel() * flat.element_size()
    return flat.view(torch.uint8), nbytes, broadcast_deadline_s(nbytes, group_timeout_s, floor_s=floor_s)


def wait_until(done: Callable[[], bool], *, deadline_s: float, gone: Callable[[], bool] = lambda: False,
               poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> bool:
    """Polls `done()` every `poll_s` until it is true (returns True), or `gone()` says a member was lost, or
    `deadline_s` have passed on `clock` (returns False). Blocks only this thread, in `sleep`."""
    end = clock() + deadline_s
    while not done():
        if gone() or clock() >= end:
            return False
        sleep(poll_s)
    return True


def died(future: Future) -> bool:
    """Whether a server's call has failed with ServerDied (its connection refused or dropped)."""
    return future.done() and not future.cancelled() and isinstance(future.exception(), ServerDied)


def any_died(futures: dict[int, Future]) -> bool:
    """Whether any of these calls has failed with ServerDied: over NCCL, a member lost with the broadcast in flight."""
    return any(died(f) for f in futures.values())


def stall_message(*, version: int, lost: list[str], answering: int, bucket: int, nbytes: int, deadline_s: float,
                  call_failed: bool, stage: int | None = None) -> str:
    """The one line WeightSyncStalled carries: the lost servers' URLs, the step (= weight version), the bucket (of
    pipeline stage `stage` in a per-stage push), and what to do."""
    why = "the lost server's call failed" if call_failed else f"not done within its {deadline_s:.1f} s deadline"
    who = (f"SGLang server{'s' * (len(lost) > 1)} {', '.join(lost)} lost" if lost
           else "no server lost (all answer /health: a hung server or link)")
    where = f"bucket {bucket}" + (f" of pipeline stage {stage}" if stage is not None else "")
    return (f"weight sync of step {version}: {who} during the NCCL broadcast of {where} "
            f"({nbytes / 1e9:.2f} GB; {why}); {answering} other server(s) of the group may be stuck in that receive, "
            f"which SGLang cannot abort, so the run stops: restart the servers (launched ones stop with this run) and "
            f"resume from the last checkpoint (--load)")


def raises_on_loss(group: dist.ProcessGroup) -> bool:
    """Whether a broadcast on `group` fails on its own when a member is lost (gloo: the closed connection raises on
    every member) rather than never completing (NCCL: the kernels spin until the communicator is aborted)."""
    return "gloo" in str(dist.get_backend(group)).lower()


def _issue(group: dist.ProcessGroup, tensor: torch.Tensor) -> tuple[threading.Event, list]:
    """comm.broadcast_async(tensor, 0, group) on a helper thread (with this thread's CUDA device and stream),
    so that the call itself cannot block the caller: on NCCL a group's first broadcast creates its communicator,
    which waits for every member (SGLang's side joins in its first receive) with no timeout of its own. The event
    is set when the call returned; the list then holds its Work or the exception it raised."""
    box: list = []
    called = threading.Event()
    stream = torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None

    def call() -> None:
        try:
            if stream is None:
                box.append(comm.broadcast_async(tensor, 0, group))
            else:
                with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
                    box.append(comm.broadcast_async(tensor, 0, group))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box.append(e)
        finally:
            called.set()

    threading.Thread(target=call, name="weight-sync-broadcast", daemon=True).start()
    return called, box


def broadcast_bucket(group: dist.ProcessGroup, tensor: torch.Tensor, *, deadline_s: float, call_timeout_s: float,
                     gone: Callable[[], bool] = lambda: False) -> bool:
    """Broadcasts `tensor` from rank 0 of `group` (the bytes SGLang's receive takes); True once every member has it.

    gloo (raises_on_loss): the synchronous broadcast (comm.broadcast); a lost member raises RuntimeError.
    NCCL: issued with async_op=True on a helper thread (_issue) and polled (wait_until), first until the call returns
    (at once, but a group's first call also creates the NCCL communicator: up to `call_timeout_s`, the group's timeout,
    so a slow creation is not taken for a stall), then until the broadcast is done, up to `deadline_s`
    (broadcast_deadline_s); both give up at once when `gone()` (a member's HTTP call failed). False on a stall or a
    broadcast that failed (RuntimeError), and the caller must abort the group (abort_group). The host never waits on
    the GPU here: the default stream does not wait for the broadcast's stream until it is done (then Work.wait()
    only orders the streams)."""
    if raises_on_loss(group):
        comm.broadcast(tensor, src=0, group=group)
        return True
    called, box = _issue(group, tensor)
    if not wait_until(called.is_set, deadline_s=call_timeout_s, gone=gone) or isinstance(box[0], RuntimeError):
        return False  # a stall, or the call failed (NCCL: a member lost while the communicator was being made)
    if isinstance(box[0], BaseException):
        raise box[0]  # a bad call (a tensor on the wrong device), not a lost member
    work = box[0]
    if not wait_until(work.is_completed, deadline_s=deadline_s, gone=gone):
        return False
    try:
        work.wait()  # stream order only, and it raises if the broadcast failed
    except RuntimeError:
        return False
    return True


ABORTED: list[dist.ProcessGroup] = []
"""Groups ended by abort_group, held for the life of the process: the last reference's destructor joins the group's
worker threads, which (gloo) wait out the pending broadcast until the group's timeout; NCCL's are done after the
abort. A run keeps at most a few (a stall stops it; a stalled re-sync of one server is retried a few times)."""


def abort_group(group: dist.ProcessGroup) -> None:
    """Ends `group` here without waiting for what is in flight on it (destroy_process_group would: on NCCL its
    shutdown finalizes the communicator, i.e. waits for the stuck broadcast). NCCL: ncclCommAbort, which stops this
    rank's spinning kernels; gloo: only forgets the group (its pending work fails at the group's timeout)."""
    from torch.distributed import distributed_c10d

    ABORTED.append(group)
    abort = getattr(distributed_c10d, "_abort_process_group", None)  # torch >= 2.5; the private name may move
    if abort is not None:
        abort(group)
    else:
        group.abort()


def init_weight_sync_group(
    *, master_address: str, master_port: int, world_size: int, group_name: str, backend: str,
    timeout_s: float = 300.0,
) -> dist.ProcessGroup:
    """Joins the weight-update group as rank 0 (blocks until every server rank has joined)."""
    from torch.distributed.distributed_c10d import _new_process_group_helper, _world

    if world_size < 2:
        raise ValueError(f"weight sync group needs the trainer plus >= 1 server rank, got "
            f"world_size={world_size}")
    timeout = timedelta(seconds=timeout_s)
    rank = 0
    # This process hosts the store itself. Not dist.rendezvous: under torchrun (TORCHELASTIC_USE_AGENT_STORE=True)
    # it would only connect as a client to a store nobody hosts at this port, and wait for ever.
    store = dist.TCPStore(master_address, master_port, world_size, is_master=True, timeout=timeout)
    # The same prefix SGLang puts on its side, so both ends meet under the same keys.
    store = dist.PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def join_weight_sync_group(*, gone: Callable[[], bool], timeout_s: float, **kwargs) -> dist.ProcessGroup | None:
    """init_weight_sync_group(timeout_s=timeout_s, **kwargs) on a helper thread, given up at once when `gone()` (a
    server's /init_weights_update_group call failed: it will never join). None when given up, or when the group did
    not form within `timeout_s`. The rendezvous itself has no way out: rank 0's TCPStore waits for every
    member up to the group's timeout (300 s; a dead server held a per-stage push that long), and the abandoned
    thread ends there with its error; the next group uses another port."""
    box: list = []

    def create() -> None:
        try:
            box.append(init_weight_sync_group(timeout_s=timeout_s, **kwargs))
        except BaseException as e:  # noqa: BLE001 - the caller sees None
            box.append(e)

    threading.Thread(target=create, name="weight-sync-group", daemon=True).start()
    if not wait_until(lambda: bool(box), deadline_s=timeout_s + 5.0, gone=gone):
        return None
    return None if isinstance(box[0], BaseException) else box[0]


def broadcast_tensors(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> None:
    """Broadcasts each tensor from rank 0 of `group`, in order (the order the servers were told).

    Through comm.broadcast: a tensor already on the group's device (the CUDA bucket on an NCCL group, made
    with `.cuda()` on the current device; a CPU bucket on gloo) goes to torch.distributed.broadcast as is, the
    same call and bytes SGLang's side receives with torch.distributed directly; a tensor elsewhere is copied
    there first instead of failing. Rank 0 waits for every server rank to enter the receive (they do once their
    /update_weights_from_distributed arrives), up to the group's `timeout_s`. The pushes use broadcast_bucket,
    which does not block on a lost member over NCCL."""
    for tensor in tensors:
        comm.broadcast(tensor, src=0, group=group)
