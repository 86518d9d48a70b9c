"""torchrun worker (2 gloo ranks, DP=2) for tests/multiprocess/test_dataplane_dist.py.

The default process group is made with a DEFAULT_TIMEOUT_S timeout. Checks, one launch:
  A. DataPlane with two replicas (rank 0 -> rank 1 by send/recv) and with one replica of both ranks
     (the leader's broadcast to its TP/PP peers): every rank gets exactly its share; again with routed experts
     (--moe-routing-replay: a plane made with a RoutingShape carries TrainSample.routed_experts, uint8).
  B. abort(): the waiting rank raises instead of waiting.
  C. A Trainer step whose rollout outlasts the default group's timeout: as rank 1 enters `distribute`, a clock
     thread of it waits on two gloo groups with the default timeout in turn for a message that never comes (each
     must fire); rank 0's engine answers only once the clock has fired (a marker file), so rank 1 waits in
     `distribute` past two default timeouts, and the step completes (train + weight sync). No wall clock: the
     clock is the default timeout itself, and rank 1 logs the order of what happened (ORDER).
  D. The same around `evaluate`: rank 0 evaluates only once rank 1's clock, started as it enters `evaluate`,
     fired; rank 1 waits in `evaluate` and returns.
  E. Rank 0's evaluation raises once rank 1 is about to wait for it; rank 1, waiting in `evaluate` on the
     1-hour wait group, must raise the error naming it at once. Its wait runs on a thread given STUCK_S (a
     bound on a hang: the alternative is the hour); a wait still blocked then is recorded as stuck and released
     by rank 0 (so that only this check fails).
  F. A section whose body fails on rank 1: rank 0 raises naming global rank 1; rank 1 re-raises its own error.
  G. Rank 0's metrics log fails after step 0 of 1: rank 1, waiting for the next batch in `distribute`, raises
     naming it.
  H. Rank 0's engine refuses the weight update: rank 1 raises at the end of `sync_weights`.
Writes each rank's checks to <out_dir>/rank<r>.json (argv[1]) for the test to read.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 8
STUCK_S = 60.0
GATE_S = 120.0
"""How long rank 0 waits for a marker of rank 1 before it goes on without it (recorded: the check fails); a bound on
a hang, never reached when rank 1 behaves (a clock fires after 2 x DEFAULT_TIMEOUT_S)."""


CHECKS: dict = {}
ORDER: list[str] = []
"""Rank 1: what happened, in order (clock threads and the main thread append; list.append is atomic)."""


def clock_groups() -> list:
    """Two gloo groups with the default timeout (collective: every rank makes them, in the same order). A group
    whose wait timed out is closed for good, hence one group per wait."""
    return [dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S)) for _ in range(2)]


def start_clock(name: str, groups: list) -> list[str]:
    """Rank 1, just before a wait for rank 0: a thread that waits on each of `groups` in turn for a message rank 0
    never sends, then logs "<name> clock fired" and writes the marker rank 0 answers after. Returns how each
    wait ended (filled by the thread): each must be the default timeout firing."""
    fired: list[str] = []

    def run() -> None:
        for group in groups:
            try:
                dist.recv(torch.zeros(1), src=0, group=group)
                fired.append("received")
            except RuntimeError as e:
                fired.append(str(e).split("] ", 1)[-1][:120])
        ORDER.append(f"{name} clock fired")
        Path(sys.argv[1], name).touch()

    threading.Thread(target=run, name=f"clock-{name}", daemon=True).start()
    return fired


def await_marker(name: str) -> bool:
    """Rank 0: wait until rank 1 wrote the marker `name`; False after GATE_S."""
    deadline = time.monotonic() + GATE_S
    while not Path(sys.argv[1], name).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def check(name: str, value) -> None:
    CHECKS[name] = value


def digest(minibatches) -> list:
    return [[(r.sample.tokens, r.sample.prompt_len, r.sample.advantage, r.sample.loss_mask.tolist(),
              r.rollout_log_probs.tolist(),
              None if r.sample.routed_experts is None else (str(r.sample.routed_experts.dtype),
                                                            r.sample.routed_experts.tolist()),
              r.index, None if r.step_rewards is None else (r.step_rewards.rewards.tolist(),
                                                            r.step_rewards.group_ids.tolist()),
              None if r.generated is None else r.generated.tolist())
             for r in mb] for mb in minibatches]


def with_table(shares, seed: int) -> list:
    """The same rows with --kl-in-reward's step table: each row its index, every row one StepRewards of 13 responses."""
    import dataclasses

    from megatron_dapo.trainer.dataplane import StepRewards

    g = torch.Generator().manual_seed(seed)
    step = StepRewards(rewards=torch.randn(13, dtype=torch.float64, generator=g),
                       group_ids=torch.arange(13, dtype=torch.int64) // 4)
    rows = iter(torch.randperm(13, generator=g).tolist())
    return [[[dataclasses.replace(r, index=next(rows), step_rewards=step) for r in mb] for mb in share]
            for share in shares]


def with_routes(minibatches, shape, seed: int) -> list:
    """The same rows with random routed experts [len(tokens) - 1, L, K] of `shape`'s dtype."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)
    return [[type(r)(dataclasses.replace(r.sample, routed_experts=torch.randint(
        0, shape.num_experts, (len(r.sample.tokens) - 1, shape.num_layers, shape.top_k), generator=g).to(shape.dtype)),
        r.rollout_log_probs) for r in mb] for mb in minibatches]


def with_tool_tokens(shares, seed: int) -> list:
    """The same rows as multi-turn conversations: a random run of each longer response's tokens a tool's output
    (`generated` 0 there, the loss mask 0 there too), the rest generated."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)
    out = []
    for share in shares:
        out.append([])
        for mb in share:
            rows = []
            for r in mb:
                n = r.sample.response_len
                gen = torch.ones(n, dtype=torch.uint8)
                if n > 2:
                    start = int(torch.randint(1, n - 1, (1,), generator=g))
                    gen[start:start + int(torch.randint(1, n - start, (1,), generator=g))] = 0
                sample = dataclasses.replace(r.sample, loss_mask=r.sample.loss_mask * gen)
                rows.append(dataclasses.replace(r, sample=sample, generated=gen))
            out[-1].append(rows)
    return out


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    rank = dist.get_rank()
    from megatron.core import parallel_state

    from megatron_dapo.actor import MegatronActor, init_parallel
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.distributed import comm
    from megatron_dapo.distributed.parallel import padded_vocab_size
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.startup import build_configs
    from megatron_dapo.trainer.dataplane import DataPlane, pack, unpack
    from megatron_dapo.trainer.loop import Rollout, Trainer
    from tests import sim_engine as sim
    from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank, tiny_hf_model
    from tests.unit.trainer.test_dataplane import _rows

    layout = init_parallel(seed=0, timeout_minutes=1)
    hour = timedelta(hours=1)

    # A. two replicas (dp rank = parallel_state's), then one replica holding both ranks
    from megatron_dapo.rollout.types import RoutingShape

    shares = [[_rows(3, 10 + d), _rows(2, 20 + d)] for d in range(2)]
    routing = RoutingShape(num_layers=3, top_k=2, num_experts=8)
    routed = [with_routes(s, routing, seed=d) for d, s in enumerate(shares)]
    tabled = with_table(shares, seed=5)
    tooled = with_tool_tokens(shares, seed=6)
    for name, dp_rank, expect, route, sent in (
            ("two_replicas", parallel_state.get_data_parallel_rank(), rank, None, shares),
            ("one_replica", 0, 0, None, shares),
            ("two_replicas_routes", parallel_state.get_data_parallel_rank(), rank, routing, routed),
            ("one_replica_routes", 0, 0, routing, routed),
            ("two_replicas_table", parallel_state.get_data_parallel_rank(), rank, None, tabled),
            ("one_replica_table", 0, 0, None, tabled),
            ("two_replicas_tools", parallel_state.get_data_parallel_rank(), rank, None, tooled),
            ("one_replica_tools", 0, 0, None, tooled)):
        plane = DataPlane(dp_rank, timeout=hour, routing=route)
        dp = plane.dp_size
        got = unpack(plane.exchange([pack(s, route) for s in sent[:dp]] if rank == 0 else None), Rollout, route)
        check(name, {"dp": dp, "equal": digest(got) == digest(sent[expect]), "bytes": plane.bytes_received,
                     "expected_bytes": pack(sent[expect], route).nbytes})

    # B. abort reaches the waiting rank
    if rank == 0:
        plane.abort()
        check("abort", "sent")
    else:
        try:
            plane.exchange(None)
            check("abort", "no error")
        except RuntimeError as e:
            check("abort", str(e))

    # C. a trainer step whose generation outlasts the default group's timeout
    hf = tiny_hf_model(seed=3)
    arch = ModelArch.from_hf(hf.config)
    args = build_parser().parse_args([
        "--hf-checkpoint", "unused", "--prompt-data", "unused", "--num-steps", "1", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "4", "--no-dynamic-sampling", "--max-response-length", "8",
        "--overlong-buffer-length", "2", "--lr", "1e-3", "--rollout-timeout", "1"])
    actor_cfg, collect_cfg, trainer_cfg = build_configs(args)
    actor = MegatronActor(arch, actor_cfg, layout)
    actor.load_shards(mcore_shards_for_rank(hf_to_full_mcore(hf.state_dict(), arch), arch, tp=1, tp_rank=0,
                                            pp=1, pp_rank=0, padded_vocab=padded_vocab_size(arch.vocab_size, 1)))

    class SlowEngine(sim.LengthLatencyEngine):
        """Answers only once rank 1's marker `gate` exists; with `fail`, raises it once rank 1 waits."""

        fail: str | None = None
        gate: str | None = None
        gates: dict | None = None

        def stream(self, requests):
            name = "eval_waiting" if self.fail is not None else self.gate
            if name is not None:
                self.gates[name] = await_marker(name)
            if self.fail is not None:
                raise RuntimeError(self.fail)
            return super().stream(requests)

        def update_weights(self, named_tensors, *, version: int) -> None:
            if self.fail is not None:
                raise RuntimeError(self.fail)
            self.synced = sum(t.numel() for _, t in named_tensors)  # the export is a collective: consume it

    engine = SlowEngine(keep_rate=1.0, truncate_prob=0.0, seed=1) if rank == 0 else None
    if engine is not None:
        engine.gate, engine.gates = "rollout", {}
    trainer = Trainer(config=trainer_cfg, collect=collect_cfg, actor=actor, engine=engine,
                      next_prompts=sim.cycling(sim.prompts(8)) if rank == 0 else None, eval_prompts=[],
                      decode=sim.decode, reward_fn=sim.reward, logger=None)
    rollout_clock = clock_groups()
    distribute, got = trainer.distribute, {}

    def watched_distribute(shares):
        fired = start_clock("rollout", rollout_clock) if rank == 1 else None
        out = distribute(shares)
        ORDER.append("distribute returned")
        got.update(rows=sum(len(mb) for mb in out), fired=fired)
        return out

    trainer.distribute = watched_distribute
    logged = {}
    trainer.log = lambda step, metrics: logged.update(metrics)
    trainer.run()
    del trainer.distribute  # G calls the trainer's own
    check("step", {"step": trainer.step, "rows": got["rows"], "pg_loss": logged.get("train/pg_loss"),
                   "mismatch": logged.get("mismatch/logprob_abs_diff_mean"), "synced": getattr(engine, "synced", None),
                   "fired": got["fired"]})

    # D. rank 0's evaluation outlasts the default timeout; rank 1 waits for it on the rollout-timeout group
    eval_clock = clock_groups()
    if rank == 0:
        engine.gates["eval"] = await_marker("eval")
        fired = None
    else:
        fired = start_clock("eval", eval_clock)
    trainer.evaluate()
    ORDER.append("evaluate returned")
    check("eval_wait", {"fired": fired})

    # E. rank 0's evaluation fails: rank 1 must raise at once, not wait out the 1-hour wait group
    handshake = dist.new_group(backend="gloo", timeout=timedelta(seconds=4 * STUCK_S))
    if rank == 0:
        trainer.eval_prompts, engine.fail = sim.prompts(2), "the eval server died"
        try:
            trainer.evaluate()
            check("eval_failure", "no error")
        except RuntimeError as e:
            check("eval_failure", str(e))
        stuck = None
    else:
        outcome: dict = {}

        def wait_for_eval() -> None:
            Path(sys.argv[1], "eval_waiting").touch()  # rank 0's evaluation fails now
            try:
                trainer.evaluate()
                outcome["error"] = None
            except RuntimeError as e:
                outcome["error"] = str(e)

        waiter = threading.Thread(target=wait_for_eval, daemon=True)
        waiter.start()
        waiter.join(timeout=STUCK_S)
        stuck = waiter.is_alive()
    flags = [None, None]
    dist.all_gather_object(flags, stuck, group=handshake)
    if flags[1]:  # rank 1 still waits: rank 0 releases it with the wait it expects (one on the wait group)
        if rank == 0:
            comm.barrier(trainer.wait_group)
        else:
            waiter.join(timeout=60)
    if rank == 1:
        check("eval_failure", {"stuck": stuck, **outcome})

    # F. any rank's failure in a section reaches the others, naming that rank
    try:
        with trainer.section("while testing a failure on rank 1"):
            if rank == 1:
                raise ValueError("rank 1's part failed")
        check("section_failure", "no error")
    except (RuntimeError, ValueError) as e:
        check("section_failure", f"{type(e).__name__}: {e}")

    # G. rank 0's metrics log fails before the last step: the rank waiting for the next batch is told
    class BrokenLogger:
        def log(self, step, metrics):
            raise OSError("No space left on device: metrics.jsonl")

    try:
        if rank == 0:
            del trainer.log  # C's stand-in: Trainer.log again, which calls the logger
            trainer.logger = BrokenLogger()
            trainer._log_step(0, {"eval/avg@4": 0.5})
        else:
            trainer.distribute(None)
        check("log_failure", "no error")
    except (OSError, RuntimeError) as e:
        check("log_failure", f"{type(e).__name__}: {e}")

    # H. the weight push fails on rank 0
    if rank == 0:
        engine.fail = "the servers refused the update"
    try:
        trainer.sync_weights(2)
        check("sync_failure", "no error")
    except RuntimeError as e:
        check("sync_failure", str(e))
    check("order" if rank == 1 else "gates", ORDER if rank == 1 else engine.gates)
    dist.barrier()
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(CHECKS, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
