"""torchrun worker (2 gloo ranks, DP=2) for tests/test_dataplane_dist.py.

The default process group is made with a DEFAULT_TIMEOUT_S timeout. Checks, one launch:
  A. DataPlane with two replicas (rank 0 -> rank 1 by send/recv) and with one replica of both ranks
     (the leader's broadcast to its TP/PP peers): every rank gets exactly its share; again with routed experts
     (--moe-routing-replay: a plane made with a RoutingShape carries TrainSample.routed_experts, uint8).
  B. abort(): the waiting rank raises instead of waiting.
  C. A Trainer step whose rollout engine takes SLOW_S > DEFAULT_TIMEOUT_S: rank 1 waits that long in
     `distribute` and the step completes (train + weight sync). Meanwhile a control thread on rank 1
     waits on a gloo group with the default group's timeout for a message that never comes: it fires.
  D. Rank 0 evaluates for SLOW_S; rank 1 waits in `evaluate` and returns.
  E. Rank 0's evaluation raises after FAIL_AFTER_S; rank 1, waiting in `evaluate` on the 1-hour wait group, must
     raise the error naming it at once. Its wait runs on a thread given STUCK_S; a wait still blocked then is
     recorded as stuck and released by rank 0 (so that only this check fails).
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

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 8
SLOW_S = 11.0
FAIL_AFTER_S, STUCK_S = 1.0, 30.0


CHECKS: dict = {}


def check(name: str, value) -> None:
    CHECKS[name] = value


def digest(minibatches) -> list:
    return [[(r.sample.tokens, r.sample.prompt_len, r.sample.advantage, r.sample.loss_mask.tolist(),
              r.rollout_log_probs.tolist(),
              None if r.sample.routed_experts is None else (str(r.sample.routed_experts.dtype),
                                                            r.sample.routed_experts.tolist()))
             for r in mb] for mb in minibatches]


def with_routes(minibatches, shape, seed: int) -> list:
    """The same rows with random routed experts [len(tokens) - 1, L, K] of `shape`'s dtype."""
    import dataclasses

    g = torch.Generator().manual_seed(seed)
    return [[type(r)(dataclasses.replace(r.sample, routed_experts=torch.randint(
        0, shape.num_experts, (len(r.sample.tokens) - 1, shape.num_layers, shape.top_k), generator=g).to(shape.dtype)),
        r.rollout_log_probs) for r in mb] for mb in minibatches]


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    rank = dist.get_rank()
    from megatron.core import parallel_state

    from megatron_dapo.distributed import comm
    from megatron_dapo.actor import MegatronActor, init_parallel
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.trainer.dataplane import DataPlane, pack, unpack
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.distributed.parallel import padded_vocab_size
    from megatron_dapo.trainer.run_config import build_configs
    from megatron_dapo.trainer.loop import Rollout, Trainer
    from tests import sim_engine as sim
    from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank, tiny_hf_model
    from tests.test_dataplane import _rows

    layout = init_parallel(seed=0, timeout_minutes=1)
    hour = timedelta(hours=1)

    # A. two replicas (dp rank = parallel_state's), then one replica holding both ranks
    from megatron_dapo.rollout.types import RoutingShape

    shares = [[_rows(3, 10 + d), _rows(2, 20 + d)] for d in range(2)]
    routing = RoutingShape(num_layers=3, top_k=2, num_experts=8)
    routed = [with_routes(s, routing, seed=d) for d, s in enumerate(shares)]
    for name, dp_rank, expect, route in (("two_replicas", parallel_state.get_data_parallel_rank(), rank, None),
                                         ("one_replica", 0, 0, None),
                                         ("two_replicas_routes", parallel_state.get_data_parallel_rank(), rank,
                                          routing),
                                         ("one_replica_routes", 0, 0, routing)):
        plane = DataPlane(dp_rank, timeout=hour, routing=route)
        dp = plane.dp_size
        sent = routed if route is not None else shares
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
        fail: str | None = None

        def stream(self, requests):
            if self.fail is not None:
                time.sleep(FAIL_AFTER_S)
                raise RuntimeError(self.fail)
            time.sleep(SLOW_S)
            return super().stream(requests)

        def update_weights(self, named_tensors, *, version: int) -> None:
            if self.fail is not None:
                raise RuntimeError(self.fail)
            self.synced = sum(t.numel() for _, t in named_tensors)  # the export is a collective: consume it

    engine = SlowEngine(keep_rate=1.0, truncate_prob=0.0, seed=1) if rank == 0 else None
    trainer = Trainer(config=trainer_cfg, collect=collect_cfg, actor=actor, engine=engine,
                      next_prompts=sim.cycling(sim.prompts(8)) if rank == 0 else None, eval_prompts=[],
                      decode=sim.decode, reward_fn=sim.reward, logger=None)
    control = {}
    if rank == 1:
        short = dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))

        def wait_on_short_group() -> None:  # what waiting on a group with the default timeout does
            t0 = time.perf_counter()
            try:
                dist.recv(torch.zeros(1), src=0, group=short)
                control["outcome"] = "received"
            except RuntimeError as e:
                control["outcome"] = f"{type(e).__name__}: {str(e)[:80]}"
            control["after_s"] = time.perf_counter() - t0

        thread = threading.Thread(target=wait_on_short_group, daemon=True)
    else:
        dist.new_group([0, 1], backend="gloo", timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    distribute, waited = trainer.distribute, {}

    def timed_distribute(shares):
        t0 = time.perf_counter()
        out = distribute(shares)
        waited["s"] = time.perf_counter() - t0
        waited["rows"] = sum(len(mb) for mb in out)
        return out

    trainer.distribute = timed_distribute
    if rank == 1:
        thread.start()
    logged = {}
    trainer.log = lambda step, metrics: logged.update(metrics)
    trainer.run()
    check("step", {"step": trainer.step, "waited_s": waited["s"], "rows": waited["rows"],
                   "pg_loss": logged.get("train/pg_loss"), "mismatch": logged.get("mismatch/logprob_abs_diff_mean"),
                   "synced": getattr(engine, "synced", None)})
    if rank == 1:
        thread.join(timeout=60)
        check("control", control)

    # D. rank 0's evaluation outlasts the default timeout; rank 1 waits for it on the rollout-timeout group
    t0 = time.perf_counter()
    if rank == 0:
        time.sleep(SLOW_S)
    trainer.evaluate()
    check("eval_wait", {"waited_s": time.perf_counter() - t0})

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
            t0 = time.perf_counter()
            try:
                trainer.evaluate()
                outcome["error"] = None
            except RuntimeError as e:
                outcome["error"] = str(e)
            outcome["after_s"] = time.perf_counter() - t0

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
    dist.barrier()
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(CHECKS, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
