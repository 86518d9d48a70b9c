"""The per-step rollout batch as tensors, sent from global rank 0 to each data-parallel rank's share.

Global rank 0 collects the step's groups, computes advantages, loss masks and the DP partition, packs
each DP rank's rows into four CPU tensors (five or six with the options below) and sends them over gloo groups
made once at start with a `--rollout-timeout` (hours) timeout:

    header    int64   [6]                      status, minibatches, rows, token ids, N (the step table's responses),
                                               1 if `generated` follows
    ints      int32   [3 * rows + ids]         per row (minibatch, prompt_len, response_len), then ids
    row_vals  float64 [2 * rows]               per row (advantage, loss-mask value)
    logp      float32 [sum(response_len)]      rollout engine log-probs of the response tokens
    table     float64 [rows + 2 * N]           --kl-in-reward only (N > 0): each row's index in the step's batch,
                                               then the step's N rewards and their N prompt groups (`StepRewards`,
                                               every response of the step, those without tokens too); absent when
                                               N = 0
    generated uint8   [sum(response_len)]      multi-turn rollouts only (header[5] = 1): 1 on a response token the
                                               policy generated, 0 on a tool's output (rollout/multi_turn.py), out
                                               of the loss, its denominator and the mismatch metrics; absent when
                                               every token was generated
    routes    uint8   [sum(len(tokens) - 1) * L * K]   --moe-routing-replay only: the experts the rollout routed
                                               each fed-in token to (TrainSample.routed_experts; int32 above 256
                                               experts); absent otherwise (chosen once, when the DataPlane is made)

Route: rank 0 -> the lowest global rank of each DP replica (`send`/`recv` on the world gloo group), then
that leader -> the replica's other ranks (TP/PP/CP peers need the same rows; `broadcast` on the
replica's gloo group). The loss mask of a row is its overlong-filter value (1, or 0 for a filtered row), one value
per row, times `generated` where a conversation had tool calls (1 byte a token more: at the production setting
below, 44.8 MB more over all shares beside 0.35 GB; the share says whether it follows, so single-turn shares carry
nothing more).

The step table is what each DP rank needs to recompute every advantage from the rewards less the KL penalty
(trainer/loop.py `Trainer._kl_reward`): at 512 prompts x 16 responses it is 128 KiB (+ 8 bytes a row) per DP leader,
0.9 MiB more from rank 0 at DP 8 beside the shares' 0.31 GB.

Cost at the production setting (Qwen2.5-32B, 16 nodes x 8 GPUs, TP8 x PP2 -> DP 8, 512 prompts x 16
responses, response lengths lognormal, median 4000, capped at 20480: 44.8 M tokens; tools/bench_dataplane.py):
before, the pickled groups went to all 128 ranks, 0.566 GB received by each (12.6 bytes per token) and
3.15 GB of Python heap once unpickled. Now each rank receives only its DP share, 0.047 GB (7.9 bytes per
token of the share), 0.29 GB of host memory as TrainSamples; rank 0 sends 0.31 GB in all to the 7 other
leaders, and each leader broadcasts its share to its 15 peers. Every rank but 0 waits in `exchange` for
the whole rollout (20-45 minutes per generation round) on gloo with the --rollout-timeout, not on an
NCCL watchdog.

With --moe-routing-replay at Qwen3-30B-A3B (48 layers x top-8 = 384 B a token as uint8; the same 44.8 M tokens,
DP 8): 17.2 GB of routes per step, held by rank 0 from the end of the rollout (as Sample.routed_experts, then
TrainSample.routed_experts) until `exchange` has sent them (rank 0 keeps its own share, 2.2 GB, through the
step); each DP leader receives its 2.2 GB share and broadcasts it to its replica's peers, which hold it for the
step's training. On the wire from SGLang the same routes were 2,048 B a token (base64 of int32) per response.

Failures: a wait of hours must not outlive a failure on the rank it waits for. Rank 0 that fails before a batch
sends `abort(what)` through the same exchange (a header and the UTF-8 text of `what`, ~60 bytes per leader), and
one that abandons its rollout on a stop signal sends `stop()` (a header: the others raise StopRequested and save
with it, trainer/stop.py);
every other wait for rank-0-only work (its evaluation, the checkpoint's sampler state, the colocated engine's
memory calls) is a `section`: a barrier that carries one int64 status, so a rank whose part failed tells the
others, which raise "global rank r failed <what>; see its log" at once instead of after the --rollout-timeout.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_dapo.actor import TrainSample
from megatron_dapo.distributed import comm
from megatron_dapo.rollout.types import RoutingShape
from megatron_dapo.trainer.stop import StopRequested

OK, ABORT, STOP = 0, 1, 2
HEADER = 6
"""int64 entries of a share's header: status, minibatches, rows, token ids, N (the step table's responses), whether
the `generated` masks follow."""


@dataclass(frozen=True, eq=False)
class StepRewards:
    """Every response of a step in rank 0's flat order (its groups in turn, each group's responses in turn; those
    without tokens, which no DP rank trains on, included): the rewards (verifier + overlong shaping) and prompt
    groups the advantage estimator takes. --kl-in-reward sends it with every DP share (the wire's `table`); each rank
    recomputes every advantage from it (trainer/loop.py `Trainer._kl_reward`). One object per step, shared by the
    step's rows (`Rollout.step_rewards`)."""

    rewards: torch.Tensor = field(repr=False)
    """[N] float64."""
    group_ids: torch.Tensor = field(repr=False)
    """[N] int64: the index of each response's group in the step."""

    def __post_init__(self) -> None:
        if self.rewards.dim() != 1 or self.rewards.shape != self.group_ids.shape:
            raise ValueError(f"StepRewards: rewards {tuple(self.rewards.shape)} and group_ids "
                             f"{tuple(self.group_ids.shape)} must both be [N]")

    def __len__(self) -> int:
        return self.rewards.numel()


@dataclass
class PackedShare:
    """One DP rank's rows of every mini-batch, as the four tensors on the wire (CPU)."""

    header: torch.Tensor
    ints: torch.Tensor
    row_vals: torch.Tensor
    logp: torch.Tensor
    routes: torch.Tensor | None = None
    """--moe-routing-replay: every row's routed_experts, flattened in row order; None otherwise."""
    table: torch.Tensor | None = None
    """--kl-in-reward: float64 [rows + 2 N], each row's index in the step, then the StepRewards' rewards and group
    ids (N = header[4]); None otherwise."""
    generated: torch.Tensor | None = None
    """uint8 [sum(response_len)]: 1 on the tokens the policy generated, 0 on tool outputs (header[5] = 1); None:
    every token was generated."""

    @property
    def nbytes(self) -> int:
        tensors = (self.header, self.ints, self.row_vals, self.logp, self.routes, self.table, self.generated)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _routes_numel(ints: torch.Tensor, n_rows: int, routing: RoutingShape) -> int:
    """Ids in a share's routes tensor: sum over rows of (prompt_len + response_len - 1) x L x K."""
    meta = ints[:3 * n_rows].reshape(n_rows, 3)
    return int((meta[:, 1] + meta[:, 2] - 1).sum()) * routing.num_layers * routing.top_k


def pack(minibatches: Sequence[Sequence], routing: RoutingShape | None = None) -> PackedShare:
    """Rows (trainer `Rollout`s: .sample, .rollout_log_probs, .index, .step_rewards) of each mini-batch -> the wire
    tensors; with `routing` (--moe-routing-replay) each row's sample.routed_experts too, which every row must then
    have; when the rows carry their step's StepRewards (--kl-in-reward: all of them the same one, each with its
    index), the step table too; when a row has a `generated` mask (a multi-turn conversation), every row's mask.
    """
    rows = [(m, r) for m, mb in enumerate(minibatches) for r in mb]
    meta = torch.tensor([(m, r.sample.prompt_len, r.sample.response_len) for m, r in rows],
                        dtype=torch.int32).reshape(-1)
    ids = [torch.tensor(r.sample.tokens, dtype=torch.int32) for _, r in rows]
    ints = torch.cat([meta, *ids])
    row_vals = torch.tensor([(r.sample.advantage, _mask_value(r)) for _, r in rows],
                            dtype=torch.float64).reshape(-1)
    logp = torch.cat([torch.zeros(0), *(r.rollout_log_probs.float() for _, r in rows)])
    table = _table([r for _, r in rows])
    n_step = 0 if table is None else (table.numel() - len(rows)) // 2
    generated = None
    if any(r.generated is not None for _, r in rows):
        generated = torch.cat([torch.ones(r.sample.response_len, dtype=torch.uint8) if r.generated is None
                               else r.generated.to(torch.uint8) for _, r in rows])
    header = torch.tensor([OK, len(minibatches), len(rows), ints.numel() - meta.numel(), n_step,
                           int(generated is not None)], dtype=torch.int64)
    routes = None
    if routing is not None:
        want = (routing.num_layers, routing.top_k)
        for _, r in rows:
            got = r.sample.routed_experts
            if got is None or tuple(got.shape[1:]) != want:
                raise ValueError(f"--moe-routing-replay: a row's routed experts are "
                                 f"{None if got is None else tuple(got.shape)}, expected [len(tokens) - 1, *{want}] "
                                 f"(the rollout engine must return them: Sample.routed_experts)")
        routes = torch.cat([torch.zeros(0, dtype=routing.dtype),
                            *(r.sample.routed_experts.to(routing.dtype).reshape(-1) for _, r in rows)])
    return PackedShare(header, ints, row_vals, logp, routes, table, generated)


def _table(rows: Sequence) -> torch.Tensor | None:
    """The wire's step table of `rows` (float64 [rows + 2 N]: indices, rewards, group ids), None when they carry no
    StepRewards."""
    steps = {id(r.step_rewards): r.step_rewards for r in rows}
    if not rows or list(steps) == [id(None)]:
        return None
    if len(steps) != 1 or any(r.index is None for r in rows):
        raise ValueError("the rows of a share must all carry the same StepRewards and each its index in it, or none")
    step = next(iter(steps.values()))
    return torch.cat([torch.tensor([r.index for r in rows], dtype=torch.float64), step.rewards.double(),
                      step.group_ids.double()])


def abort_share(what: str) -> PackedShare:
    """The share rank 0 sends instead of a batch: status ABORT, no rows, `what` (UTF-8 bytes) in place of the ids."""
    text = torch.tensor(list(what.encode()), dtype=torch.int32)
    return PackedShare(torch.tensor([ABORT, 0, 0, text.numel(), 0, 0], dtype=torch.int64), text,
                       torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float32))


def stop_share() -> PackedShare:
    """The share rank 0 sends when it abandoned the rollout on a stop signal: status STOP, no rows."""
    return PackedShare(torch.tensor([STOP, 0, 0, 0, 0, 0], dtype=torch.int64), torch.zeros(0, dtype=torch.int32),
                       torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float32))


def abort_reason(share: PackedShare) -> str:
    """What failed on rank 0, from an ABORT share (`abort_share`)."""
    return bytes(share.ints.tolist()).decode(errors="replace")


def _mask_value(row) -> float:
    """A row's one loss-mask value on the wire: that of its generated tokens, the same on each (the overlong filter's;
    a tool's tokens are 0 through `generated`)."""
    mask = row.sample.loss_mask
    if mask is None:
        return 1.0
    if row.generated is not None:
        mask = mask[row.generated.bool()]
        if mask.numel() == 0:
            return 0.0
    value = float(mask[0])
    if not bool((mask == value).all()):
        raise ValueError("the data plane carries one loss-mask value per row; this row's mask varies")
    return value


def unpack(share: PackedShare, rollout_cls, routing: RoutingShape | None = None) -> list[list]:
    """The wire tensors -> mini-batches of `rollout_cls(sample, rollout_log_probs)`, in the sent order; with
    `routing` the samples get their routed_experts (views of share.routes); with a step table (--kl-in-reward) each
    row gets its `index` and the step's one StepRewards (`step_rewards`); with `generated` masks each row gets its own
    (`generated`) and a loss mask of its row value times it."""
    _, n_mb, n_rows, _, n_step, _ = share.header.tolist()
    meta = share.ints[:3 * n_rows].reshape(n_rows, 3).tolist()
    ids = share.ints[3 * n_rows:]
    vals = share.row_vals.reshape(n_rows, 2).tolist()
    out: list[list] = [[] for _ in range(n_mb)]
    step, indices = None, [None] * n_rows
    if n_step:
        table = share.table
        step = StepRewards(rewards=table[n_rows:n_rows + n_step].clone(),
                           group_ids=table[n_rows + n_step:].to(torch.int64))
        indices = [int(i) for i in table[:n_rows].tolist()]
    tok = lp = rt = 0
    row = routing.num_layers * routing.top_k if routing is not None else 0
    for (m, p, r), (adv, keep), index in zip(meta, vals, indices, strict=True):
        routed = None
        if routing is not None:
            routed = share.routes[rt:rt + (p + r - 1) * row].view(p + r - 1, routing.num_layers, routing.top_k)
            rt += (p + r - 1) * row
        mask, generated = torch.full((r,), keep), None
        if share.generated is not None:
            generated = share.generated[lp:lp + r].clone()
            mask = mask * generated
        sample = TrainSample(tokens=ids[tok:tok + p + r].tolist(), prompt_len=p, advantage=adv, loss_mask=mask,
                             routed_experts=routed)
        extra = {} if step is None else {"index": index, "step_rewards": step}
        if generated is not None:
            extra["generated"] = generated
        out[m].append(rollout_cls(sample, share.logp[lp:lp + r].clone(), **extra))
        tok, lp = tok + p + r, lp + r
    return out


class DataPlane:
    """Gloo groups (made once, collectively) that carry each step's rows from rank 0 to every DP rank.

    `wait_group` spans the world with `timeout`: ranks that wait for rank 0 (the rollout, rank-0 eval, the
    sampler state at save) wait on it, never on an NCCL group with its 30-minute watchdog. A failure on rank 0
    reaches them as an error within a round trip (`abort`, `section`), not after `timeout`.
    `routing` (--moe-routing-replay, the same on every rank): shares carry the routed experts too."""

    def __init__(self, dp_rank: int, *, timeout: timedelta, routing: RoutingShape | None = None):
        self.rank = dist.get_rank()
        self.routing = routing
        self.wait_group = comm.gloo_group(None, timeout=timeout)
        dp_of = [int(t) for t in comm.all_gather(torch.tensor([dp_rank], dtype=torch.int64), group=self.wait_group)]
        self.dp_size = max(dp_of) + 1
        replicas = [[r for r, d in enumerate(dp_of) if d == k] for k in range(self.dp_size)]
        if any(not members for members in replicas):
            raise ValueError(f"data-parallel ranks {dp_of} (one per global rank) do not cover 0..{self.dp_size - 1}")
        if dp_of[0] != 0:
            raise ValueError("global rank 0 (the rollout rank) must be data-parallel rank 0")
        self.leaders = [members[0] for members in replicas]
        self.dp_rank = dp_rank
        self.replica_ranks = replicas[dp_rank]
        self.replica_group = None
        for members in replicas:  # new_group is collective over the world: every rank makes every group
            group = comm.gloo_group(members, timeout=timeout) if len(members) > 1 else None
            if members is self.replica_ranks:
                self.replica_group = group
        self.bytes_received = 0
        """Bytes this rank received in the last exchange (0 on rank 0)."""

    def exchange(self, shares: Sequence[PackedShare] | None) -> PackedShare:
        """Rank 0 passes one PackedShare per DP rank; every rank returns its own DP rank's share.

        Blocks (up to the wait group's timeout) until rank 0 sends. Raises RuntimeError on every rank but 0
        when rank 0 sent `abort(what)` instead of a batch: "global rank 0 failed <what>; see its log", and
        StopRequested when it sent `stop()`."""
        if self.rank == 0:
            if shares is None or len(shares) != self.dp_size:
                raise ValueError(f"rank 0 must pass {self.dp_size} shares (one per DP rank)")
            for d, leader in enumerate(self.leaders):
                if leader != 0:
                    self._send(shares[d], leader)
            mine = shares[0]
        elif self.rank == self.leaders[self.dp_rank]:
            mine = self._recv(0, group=self.wait_group)
        else:
            mine = None
        if self.replica_group is not None:
            mine = self._broadcast(mine)
        self.bytes_received = 0 if self.rank == 0 else mine.nbytes
        if int(mine.header[0]) == ABORT and self.rank != 0:
            raise RuntimeError(f"global rank 0 failed {abort_reason(mine)}; see its log")
        if int(mine.header[0]) == STOP and self.rank != 0:
            raise StopRequested(128 + signal.SIGTERM, "global rank 0 abandoned the rollout on a stop signal")
        return mine

    def abort(self, what: str = "while collecting the rollout batch") -> None:
        """Rank 0, after a failure before `exchange`: make every rank waiting there raise, naming `what` failed,
        instead of timing out. Only where the others are (or will next be) in `exchange`."""
        self.exchange([abort_share(what)] * self.dp_size)

    def stop(self) -> None:
        """Rank 0, having abandoned the rollout on a stop signal: every rank waiting in `exchange` raises
        StopRequested (a 40-byte header to each DP leader, broadcast in its replica)."""
        self.exchange([stop_share()] * self.dp_size)

    def wait(self, what: str, *, failed: bool = False) -> None:
        """Every rank: a barrier on the long-timeout gloo group that carries a status (comm.status_barrier, one
        int64 all-reduce). Everybody waits for the slowest rank (rank 0 after its evaluation: 10+ min for AIME
        avg@32 at 20k tokens, 127 ranks waiting). When a rank failed, every other rank raises RuntimeError
        "global rank <lowest failed> failed <what>; see its log"; the failed rank returns, to re-raise its own."""
        comm.status_barrier(what, failed=failed, group=self.wait_group)

    def section(self, what: str) -> AbstractContextManager[None]:
        """Every rank runs the body (rank-0-only work such as the evaluation; empty elsewhere), then `wait`s. A rank
        whose body raises reports it in that wait and re-raises, so the others raise at once (comm.section)."""
        return comm.section(what, self.wait_group)

    # ---- wire ---------------------------------------------------------------------------------------
    def _send(self, share: PackedShare, dst: int) -> None:
        for t in (share.header, share.ints, share.row_vals, share.logp):
            comm.send(t, dst, group=self.wait_group)
        if int(share.header[4]):
            comm.send(share.table, dst, group=self.wait_group)
        if int(share.header[5]):
            comm.send(share.generated, dst, group=self.wait_group)
        if self.routing is not None:
            comm.send(self._routes_of(share), dst, group=self.wait_group)

    def _routes_of(self, share: PackedShare) -> torch.Tensor:
        """The share's routes (an abort share has none: empty)."""
        return share.routes if share.routes is not None else torch.zeros(0, dtype=self.routing.dtype)

    def _routes_buffer(self, header: torch.Tensor, ints: torch.Tensor) -> torch.Tensor:
        return torch.empty(_routes_numel(ints, int(header[2]), self.routing), dtype=self.routing.dtype)

    def _recv(self, src: int, *, group) -> PackedShare:
        header = comm.recv(torch.empty(HEADER, dtype=torch.int64), src, group=group)
        ints, row_vals, logp = _empty_body(header)
        comm.recv(ints, src, group=group)
        comm.recv(row_vals, src, group=group)
        n_rows = int(header[2])
        logp = torch.empty(int(ints[:3 * n_rows].reshape(n_rows, 3)[:, 2].sum()), dtype=torch.float32)
        comm.recv(logp, src, group=group)
        table = comm.recv(_table_buffer(header), src, group=group) if int(header[4]) else None
        generated = None
        if int(header[5]):
            generated = comm.recv(torch.empty(logp.numel(), dtype=torch.uint8), src, group=group)
        routes = None
        if self.routing is not None:
            routes = comm.recv(self._routes_buffer(header, ints), src, group=group)
        return PackedShare(header, ints, row_vals, logp, routes, table, generated)

    def _broadcast(self, share: PackedShare | None) -> PackedShare:
        src = self.replica_ranks[0]
        group = self.replica_group
        header = share.header if share is not None else torch.empty(HEADER, dtype=torch.int64)
        comm.broadcast(header, src, group=group)
        if share is None:
            ints, row_vals, _ = _empty_body(header)
        else:
            ints, row_vals = share.ints, share.row_vals
        comm.broadcast(ints, src, group=group)
        comm.broadcast(row_vals, src, group=group)
        n_rows = int(header[2])
        logp = share.logp if share is not None else torch.empty(
            int(ints[:3 * n_rows].reshape(n_rows, 3)[:, 2].sum()), dtype=torch.float32)
        comm.broadcast(logp, src, group=group)
        table = None
        if int(header[4]):
            table = share.table if share is not None else _table_buffer(header)
            comm.broadcast(table, src, group=group)
        generated = None
        if int(header[5]):
            generated = share.generated if share is not None else torch.empty(logp.numel(), dtype=torch.uint8)
            comm.broadcast(generated, src, group=group)
        routes = None
        if self.routing is not None:
            routes = self._routes_of(share) if share is not None else self._routes_buffer(header, ints)
            comm.broadcast(routes, src, group=group)
        return PackedShare(header, ints, row_vals, logp, routes, table, generated)


def _table_buffer(header: torch.Tensor) -> torch.Tensor:
    """The receive buffer of a share's step table: rows + 2 N float64."""
    return torch.empty(int(header[2]) + 2 * int(header[4]), dtype=torch.float64)


def _empty_body(header: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    n_rows, n_ids = int(header[2]), int(header[3])
    return torch.empty(3 * n_rows + n_ids, dtype=torch.int32), torch.empty(2 * n_rows, dtype=torch.float64), None
