"""The DAPO training loop: generate -> reward -> filter -> old log-probs -> train -> sync -> eval -> save
(--colocate: save before the sync, while SGLang's memory is released; `Trainer.save`). On SIGTERM or SIGINT the loop
stops at its next safe point and saves the last finished step within --exit-save-timeout-s (`Trainer._stop`,
trainer/stop.py).

Every rank of the torchrun world runs this loop (SPMD). Global rank 0 owns the rollout engine and
the prompt sampler; it collects each step's batch, computes advantages, loss masks and the DP partition,
and sends each data-parallel rank only its rows as tensors (megatron_dapo/trainer/dataplane.py); the other ranks
wait for it on a gloo group with the --rollout-timeout, not on an NCCL watchdog. Each DP rank then
trains on its share, Megatron reduces gradients, and the new weights flow back to the engine through the
run's WeightSync (megatron_dapo/weight_sync/, chosen once when the run is built: the whole-model export pushed
by rank 0, each pipeline stage from its own source, or every GPU to its colocated engine). Every collective here
goes through megatron_dapo/distributed/comm.py, which puts tensors on the device of the group's backend.
With --async-rollout 1 rank 0 generates the next step's batch on a background thread while this step
trains, and the push waits for it (next_batch / finish_ahead; megatron_dapo/rollout/async_rollout.py).

Where the other ranks wait for rank-0-only work (on the DataPlane's gloo group, up to --rollout-timeout hours),
a failure of that work on rank 0 reaches them as an error at once: the rollout batch, its packing and the step's
metrics log abort the next `exchange`; the weight sync and the evaluation are `section`s (a status barrier, one
int64), as are rank 0's parts of a save and a resume (checkpoint/checkpointer.py) and the colocated phase
switches. See `DataPlane`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_dapo.actor import MegatronActor, TrainSample
from megatron_dapo.actor.batching import attention_cost_coefficient, partition_for_dp
from megatron_dapo.algorithm import grpo_advantages, overlong_keep_mask
from megatron_dapo.algorithm.advantages import AdvantageFn
from megatron_dapo.algorithm.distill import DISTILL_SUM_KEYS, DistillConfig, distill_advantages, distill_sums
from megatron_dapo.algorithm.kl import KLConfig, kl_penalized_advantages, kl_response_sum
from megatron_dapo.algorithm.mismatch import (
    MAX_KEYS,
    SUM_KEYS,
    OffPolicyConfig,
    mismatch_sums,
    off_policy_correction,
    reduce_mismatch,
)
from megatron_dapo.checkpoint.state import CommonState
from megatron_dapo.distributed import comm
from megatron_dapo.rollout.async_rollout import AheadBatch, BatchAhead, check_depth, check_staleness
from megatron_dapo.rollout.collect import CollectConfig, Prompt, RewardFn, ScoredGroup, collect_batch
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.evaluation import evaluate
from megatron_dapo.rollout.partial_rollout import CarriedGroups
from megatron_dapo.rollout.stream import STALE_POLICIES
from megatron_dapo.rollout.streaming import StreamingConfig, StreamingRollout, in_flight_cap
from megatron_dapo.rollout.types import RoutingShape, SamplingParams, routing_of
from megatron_dapo.trainer.dataplane import DataPlane, StepRewards, pack, unpack
from megatron_dapo.trainer.metrics_log import MetricsLogger, SavedRecord
from megatron_dapo.trainer.stop import StopRequested, StopSignal, remove_unfinished
from megatron_dapo.weight_sync.base import WeightSync
from megatron_dapo.weight_sync.build import build_weight_sync

if TYPE_CHECKING:
    from megatron_dapo.checkpoint.checkpointer import Checkpointer
    from megatron_dapo.trainer.colocate import PhaseSwitcher


@dataclass
class Rollout:
    """A training sample and the log-probs the rollout engine reported for its response tokens."""

    sample: TrainSample
    rollout_log_probs: torch.Tensor
    """[response_len], for the rollout-vs-actor mismatch metric."""
    index: int | None = None
    """Its row in the step's batch (`step_rewards`' order, responses without tokens counted); None: not carried."""
    step_rewards: StepRewards | None = None
    """--kl-in-reward: every response's reward and group of the step, one object shared by the step's rows, from
    which `Trainer._kl_reward` recomputes the advantages; None otherwise."""
    generated: torch.Tensor | None = None
    """[response_len] uint8, multi-turn rollouts: 1 on the tokens the policy generated, 0 on a tool's output (out of
    the loss through sample.loss_mask, out of the mismatch metrics through this); None: every token was generated."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    num_steps: int
    """Training steps, one rollout batch each (--num-steps)."""
    global_batch_size: int = 0
    """Responses per optimizer step (--global-batch-size); 0 = the whole rollout batch."""
    eval_interval: int = 0
    """Evaluate every N steps and before the first (--eval-interval); 0 = never."""
    eval_n_samples: int = 4
    """k of avg@k (--n-samples-per-eval-prompt)."""
    eval_sampling: SamplingParams | None = None
    save_dir: str | None = None
    save_interval: int = 0
    """Checkpoint every N steps (--save-interval); the last step is always saved when save_dir is set."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Rollout-vs-actor correction (--use-tis, --tis-cap, --mis-mode, --mis-threshold)."""
    distill: DistillConfig | None = None
    """On-policy distillation (--teacher-load, --distill-coef, --distill-only; algorithm/distill.py); None: none."""
    kl_reward: KLConfig | None = None
    """The KL to the reference model as a reward penalty (--kl-in-reward with --kl-coef beta > 0 and --kl-estimator;
    algorithm/kl.py): r_i - beta sum_t k_t, then the advantages again (`Trainer._kl_reward`); the actor's own KL
    term then has coef 0 (train/kl only). None: off."""
    rollout_timeout_h: float = 12.0
    """How long ranks wait for rank 0's rollout or eval, in hours (--rollout-timeout)."""
    async_rollout: int = 0
    """1: generate step k+1's batch while step k trains (--async-rollout; megatron_dapo/rollout/async_rollout.py)."""
    advantage_estimator: AdvantageFn = grpo_advantages
    """Per-response advantages from rewards and group ids (--advantage-estimator; algorithm/registry.py)."""
    max_staleness: int = 0
    """K >= 1: fully async rollout, every trained token at most K weight versions behind the actor (--max-staleness;
    megatron_dapo/rollout/streaming.py); 0: off."""
    stale_policy: str = "drop"
    """--stale-policy: a group with a token staler than K is dropped or its stale samples regenerated."""
    max_in_flight_groups: int = 0
    """--max-in-flight-groups: the fully async rollout's cap on groups in flight; 0: IN_FLIGHT_SLACK x the engine's
    capacity in groups (`in_flight_cap`)."""
    exit_save_timeout_s: float = 25.0
    """On SIGTERM / a first SIGINT: the save of the last finished step and the exit happen within this many seconds
    of the signal (--exit-save-timeout-s; trainer/stop.py)."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"--num-steps must be >= 1, got {self.num_steps}")
        if not self.rollout_timeout_h > 0:
            raise ValueError(f"--rollout-timeout must be > 0 hours, got {self.rollout_timeout_h}")
        if not self.exit_save_timeout_s >= 0:
            raise ValueError(f"--exit-save-timeout-s must be >= 0 seconds, got {self.exit_save_timeout_s}")
        if self.global_batch_size < 0 or self.eval_interval < 0 or self.save_interval < 0:
            raise ValueError("--global-batch-size, --eval-interval and --save-interval must be >= 0")
        if self.eval_interval and self.eval_sampling is None:
            raise ValueError("eval_interval > 0 needs eval_sampling")
        check_depth(self.async_rollout)
        if self.max_staleness < 0:
            raise ValueError(f"--max-staleness must be >= 0 (0: off), got {self.max_staleness}")
        if self.max_staleness and self.async_rollout:
            raise ValueError(f"--max-staleness {self.max_staleness} and --async-rollout {self.async_rollout} exclude "
                             "each other: the fully async rollout already generates ahead of training (K = 1 is "
                             "one step ahead); pass one of them")
        if self.stale_policy not in STALE_POLICIES:
            raise ValueError(f"--stale-policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        if self.max_in_flight_groups < 0:
            raise ValueError(f"--max-in-flight-groups must be >= 0 (0: from the engine's capacity), got "
                             f"{self.max_in_flight_groups}")
        if self.kl_reward is not None and not self.kl_reward.coef > 0:
            raise ValueError(f"--kl-in-reward subtracts --kl-coef x each response's KL from its reward: --kl-coef must "
                             f"be > 0, got {self.kl_reward.coef}")
        if self.kl_reward is not None and self.distill is not None and self.distill.only:
            raise ValueError("--kl-in-reward penalises the verifier's reward, whose advantage --distill-only sets to 0 "
                             "(the penalty would train nothing): drop --kl-in-reward and keep the KL in the loss "
                             "(--kl-coef), which --distill-only trains with")
        if self.max_in_flight_groups and not self.max_staleness:
            raise ValueError(f"--max-in-flight-groups {self.max_in_flight_groups} caps the fully async rollout: it "
                             "needs --max-staleness K >= 1")


@dataclass
class Trainer:
    checkpoint_state: ClassVar[CommonState] = CommonState(key="step", flat=True)
    """Checkpointed as extra["step"], the last completed step (every rank holds the same)."""

    config: TrainerConfig
    collect: CollectConfig
    actor: MegatronActor
    engine: RolloutEngine | None
    """The rollout engine on global rank 0, None elsewhere."""
    next_prompts: Callable[[int], list[Prompt]] | None
    """Rank 0: the next k training prompts from the resumable sampler."""
    eval_prompts: Sequence[Prompt]
    decode: Callable[[list[int]], str]
    reward_fn: RewardFn
    logger: MetricsLogger | None
    checkpointer: Checkpointer | None = None
    """Saves this trainer's step with the other components (--save; megatron_dapo/checkpoint/checkpointer.py)."""
    step: int = 0
    """Last completed step (restored by `load_state_dict`)."""
    phases: PhaseSwitcher | None = None
    """--colocate: the PhaseSwitcher (megatron_dapo/trainer/colocate.py) of this rank; None on separate GPUs."""
    weight_sync: WeightSync | None = None
    """This rank's weight sync (megatron_dapo/weight_sync/), chosen once: given (--colocate: ColocatedSync, made
    by train.py), else built in __post_init__ by build_weight_sync from rank 0's engine, its transport and the PP
    size."""
    weight_sync_mode: str | None = None
    """Rank 0 with an SGLang engine: the transport its weights go by (rollout/build.py weight_sync_mode, the
    resolved --weight-sync-mode), for build_weight_sync; None elsewhere (the other ranks get rank 0's)."""
    ref: MegatronActor | None = None
    """The frozen reference model (--ref-load; actor/reference.py) on this rank's layout: its log-probs of every
    trained sample feed the KL term (ActorConfig.kl); None: none."""
    teacher: Any = None
    """The distillation teacher: a frozen MegatronActor on this rank's layout, its own architecture (--teacher-load),
    or an SGLangTeacher (--teacher-url; rollout/sglang/teacher.py). Its log-probs of every trained sample give the
    per-token advantages of algorithm/distill.py; None: none."""
    stop: StopSignal | None = None
    """This process's SIGTERM / SIGINT handler (train.py installs it): `run` stops at its next safe point once it
    fired on any rank. None: no stop handling (every rank alike)."""
    _is_rank0: bool = field(init=False)
    _plane: DataPlane | None = field(init=False, default=None)
    _saved_step: int = field(init=False, default=0)
    """The newest step this run checkpointed (or resumed from): a stop has nothing newer to save at it."""
    _save_s: float = field(init=False, default=0.0)
    """The slowest save of this run, seconds (this rank's): a stop starts a save only with that much time left."""

    def __post_init__(self) -> None:
        self._is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
        if self._is_rank0 and (self.engine is None or self.next_prompts is None):
            raise ValueError("global rank 0 needs the rollout engine and the prompt sampler")
        if self.config.kl_reward is not None and self.ref is None:
            raise ValueError("--kl-in-reward needs the reference model (--ref-load)")
        if dist.is_initialized() and dist.get_world_size() > 1:  # collective: every rank makes the groups
            self._plane = DataPlane(parallel_state.get_data_parallel_rank(),
                                    timeout=timedelta(hours=self.config.rollout_timeout_h), routing=self.routing)
        if self.weight_sync is None:  # collective when world > 1: rank 0 tells the others its engine's kind, once
            engine = getattr(self.engine, "base", self.engine)  # the one holding the model (a wrapper's inner)
            self.weight_sync = build_weight_sync(engine, transport=self.weight_sync_mode, wait_group=self.wait_group)

    @cached_property
    def routing(self) -> RoutingShape | None:
        """--moe-routing-replay: the shape of the rollout's routed experts, which TrainSamples then carry (rank 0 ->
        the DP ranks in the data plane); None otherwise: nothing recorded, nothing moved."""
        replay = getattr(getattr(self.actor, "config", None), "moe_routing_replay", False)
        return routing_of(self.actor.arch, replay) if replay else None

    @cached_property
    def carried(self) -> CarriedGroups:
        """Rank 0, --partial-rollout: the groups cut at the end of the last step, resumed first by the next one."""
        return CarriedGroups(enabled=self.collect.partial_rollout)

    @cached_property
    def record(self) -> SavedRecord:
        """Rank 0: the metrics record of the step the newest save holds, logged by a resumed run that lacks it."""
        return SavedRecord()

    @cached_property
    def ahead(self) -> BatchAhead:
        """Rank 0, --async-rollout 1: the next step's batch (generating, finished, or restored from a checkpoint)."""
        return BatchAhead(depth=self.config.async_rollout, num_steps=self.config.num_steps)

    @cached_property
    def stream(self) -> StreamingRollout:
        """--max-staleness K: the fully async rollout (rank 0 runs it; every rank holds the component, which refuses a
        fully async checkpoint in a run that is not)."""
        cfg = self.config
        config = StreamingConfig(max_staleness=cfg.max_staleness, num_steps=cfg.num_steps,
                                 stale_policy=cfg.stale_policy,
                                 max_in_flight=cfg.max_in_flight_groups or in_flight_cap(
                                     self.engine.capacity if self.engine is not None else None,
                                     self.collect.n_samples_per_prompt)) if cfg.max_staleness else None
        return StreamingRollout(config, self.collect, engine=self.engine, next_prompts=self.next_prompts,
                                decode=self.decode, reward_fn=self.reward_fn)

    def state_dict(self) -> dict[str, Any]:
        """The trainer's progress: the last completed step (every rank holds the same)."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])

    @property
    def wait_group(self):
        """The world gloo group with the --rollout-timeout (None in a world of one)."""
        return self._plane.wait_group if self._plane is not None else None

    def section(self, what: str) -> AbstractContextManager[None]:
        """Work some ranks do while the others wait (rank 0's evaluation, its part of a save or resume): every rank
        runs the body, then all meet on the wait group; a failure in any rank's body makes the others raise
        "global rank r failed <what>; see its log" there (DataPlane.section). No-op in a world of one."""
        return self._plane.section(what) if self._plane is not None else nullcontext()

    # ---- the loop ----------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        finally:
            if self.config.max_staleness and self._is_rank0:
                self.stream.close()  # the rollout thread aborts what is in flight and ends

    def _run(self) -> None:
        cfg = self.config
        job = self.ahead.job
        if job is not None and job.step != self.step + 1:  # restored with the step by the checkpointer
            raise ValueError(f"the checkpoint of step {self.step} holds a batch for step {job.step}, expected "
                             f"{self.step + 1}")
        if self.phases is not None and self.phases.phase == "training":  # colocated, engines released at start-up:
            self.phases.to_generation(lambda: self.sync_weights(self.step))  # they resume, get the actor's weights
        self._saved_step = self.step                               # resumed from it, or nothing trained yet
        if self.step and self.logger is not None and self.record.recover(self.logger, self.step):
            print(f"[megatron-dapo] the metrics record of step {self.step} was not logged before the run ended: "
                  f"logged it from the checkpoint (without time/step_s and what followed the save)", flush=True)
        if cfg.eval_interval and self.step == 0:
            self._log_step(0, self.evaluate())
        for step in range(self.step + 1, cfg.num_steps + 1):
            self._stop_if_requested()                              # a signal on any rank: save step - 1, exit
            t0 = time.perf_counter()
            if self.checkpointer is not None and self.stop is not None and not (cfg.async_rollout or
                                                                                cfg.max_staleness):
                self.checkpointer.mark()                           # rank 0: what an abandoned rollout rewinds
            try:
                metrics, shares = self.rank0_batch(step)           # rank 0: rollout, advantages, DP split
                samples = self.distribute(shares)                  # my DP share (others wait here, gloo)
            except StopRequested:                                  # rank 0 abandoned the rollout on a signal
                self._stop(self._first_stop() or time.time(), abandoned=step)
            if self.phases is not None:
                metrics |= self.phases.to_training()               # SGLang releases, the actor onloads
            metrics |= self.train(samples, step)                   # old log-probs -> mini-batch updates
            metrics |= self.finish_ahead()                         # async: the push waits for batch step+1
            self._stop_if_requested(updated=step, metrics=metrics)  # a signal: save this step, skip push and eval
            with self.push_window(step) as waited:                 # fully async: the rollout parks for it
                if self.phases is not None:                        # colocated: save while SGLang is released,
                    self._finish_step(step, metrics)               # then offload, resume SGLang, push
                    metrics |= self.phases.to_generation(lambda v=step: self.sync_weights(v))
                else:
                    metrics |= self.sync_weights(step)             # actor -> rollout engine
                if cfg.eval_interval and step % cfg.eval_interval == 0:
                    metrics |= self.evaluate()                     # avg@k on held-out prompts
                if self.phases is None:
                    self._finish_step(step, metrics | waited)      # step done; checkpoint when due
            metrics |= waited
            metrics["time/step_s"] = time.perf_counter() - t0
            self._log_step(step, metrics)
        self._stop_if_requested()                                  # a signal in the last step: exit as stopped

    def _log_step(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0 logs; if that fails before the last step, the others (waiting for step+1's batch) are told."""
        try:
            self.log(step, metrics)
        except BaseException:
            if self._is_rank0 and self._plane is not None and step < self.config.num_steps:
                self._plane.abort(f"while logging the metrics of step {step}")
            raise

    def _finish_step(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` is done (its update applied): record it, and checkpoint it when --save-interval says so, with
        its metrics record so far (`metrics`, SavedRecord)."""
        self.step = step
        if self._save_due(step):
            self.save(step, record=metrics)

    # ---- stopping on a signal (trainer/stop.py) -----------------------------------------------------------
    def _first_stop(self) -> float | None:
        """When the first stop signal reached any rank (time.time()), None when none did: one float64 MIN all-reduce
        on the wait group (gloo, 8 bytes: latency-bound, milliseconds to tens of milliseconds at 128 ranks, twice a
        step of ~40 minutes at 32B). The ranks learn of a signal at different moments (Slurm signals each node,
        torchrun its workers, and may reach only some), so they agree here, at the same point of the same step.
        Collective (world > 1)."""
        if self.stop is None:
            return None
        mine = torch.tensor([self.stop.received if self.stop.received is not None else math.inf],
                            dtype=torch.float64)
        if self._plane is not None:
            mine = comm.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.wait_group)
        first = float(mine[0])
        return None if math.isinf(first) else first

    def _stop_if_requested(self, *, updated: int | None = None, metrics: dict[str, float] | None = None) -> None:
        """Every rank, at a step boundary or once step `updated`'s update is applied (before its push and
        evaluation, which the checkpoint does not need; --colocate: still in the training phase, where a save
        runs): stop (`_stop`, logging `metrics`) once a signal reached any rank."""
        first = self._first_stop()
        if first is not None:
            if updated is not None:
                self.step = updated
            self._stop(first, metrics=metrics)

    def _agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (one int64 MIN all-reduce on the wait group; `ok` in a world of one)."""
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        if self._plane is not None:
            flag = comm.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.wait_group)
        return bool(flag[0])

    def _stop(self, first: float, *, abandoned: int | None = None,
              metrics: dict[str, float] | None = None) -> NoReturn:
        """Every rank, once a stop signal reached any rank (its time `first`): save the last finished step,
        `self.step`, unless this run saved it already (or resumed from it), then raise StopRequested (train.py exits
        with 128 + the signal). The save is started only when this run's slowest save fits in what is left of
        --exit-save-timeout-s (the ranks agree; a run that has not saved yet tries): at 32B a save takes ~29 s
        with the distributed optimizer and ~14 s with --ckpt-fully-parallel-save (checkpoint/training.py). Past
        the bound the StopSignal's watchdog ends the process and rank 0 removes the unfinished step_N.tmp.

        `abandoned`: the step whose rollout rank 0 gave up. The actor is as the last finished step left it (a
        rollout changes no weight, optimizer or scheduler state); rank 0 rewinds what the rollout had changed (the
        sampler's draws, the RNG: Checkpointer.rewind) and aborts the engine's requests, so the checkpoint is the
        one the end of step `self.step` would have written and a resumed run repeats the abandoned step exactly.
        --colocate: the engines release their memory first (PhaseSwitcher.to_training; a save runs in the
        training phase, see `save`). `metrics`: the step's record so far, logged by rank 0 after the save (a step
        stopped after its update has no push or evaluation metrics)."""
        stop = self.stop
        say = partial(print, flush=True) if self._is_rank0 else (lambda *args, **kwargs: None)  # before any exit
        if abandoned is not None and self._is_rank0:
            if self.checkpointer is not None:
                self.checkpointer.rewind()
            try:
                self.engine.abort()  # an SGLang server would go on generating the abandoned requests
            except Exception as err:  # the server may be stopping with the job: the save does not need it
                say(f"[megatron-dapo] {stop.name}: aborting the abandoned requests failed: {err}")
            say(f"[megatron-dapo] {stop.name}: abandoned the rollout of step {abandoned}")
        unsaved = self.checkpointer is not None and bool(self.config.save_dir) and self.step > self._saved_step
        if unsaved and self._agree(stop.left_s(first) >= self._save_s):
            try:
                if self.phases is not None and self.phases.phase == "generation":
                    self.phases.to_training()
                t0 = time.perf_counter()
                self.save(self.step, record=metrics)
                self.checkpointer.close()  # an --async-save is written and renamed here
            except Exception as err:  # e.g. colocated engines stopping with the job: the previous checkpoint stays
                if stop.save_dir is not None:  # rank 0, the --save lock holder
                    remove_unfinished(stop.save_dir)
                say(f"[megatron-dapo] {stop.name}: step {self.step} not saved ({type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); the newest checkpoint is "
                    f"step {self._saved_step}")
                raise StopRequested(stop.status, f"stopped on {stop.name}, the save failed") from err
            say(f"[megatron-dapo] {stop.name}: saved step {self.step} to {self.config.save_dir} in "
                f"{time.perf_counter() - t0:.1f} s")
        elif unsaved:
            say(f"[megatron-dapo] {stop.name}: step {self.step} not saved: {max(0.0, stop.left_s(first)):.1f} s left "
                f"of --exit-save-timeout-s {stop.timeout_s:g}, a save of this run took {self._save_s:.1f} s; the "
                f"newest checkpoint is step {self._saved_step}")
        elif self.checkpointer is not None:
            self.checkpointer.close()  # an --async-save of this step still being written
        if metrics is not None and self._is_rank0:
            try:
                self.log(self.step, metrics)
            except Exception as err:  # the checkpoint is written; a failed log must not keep the run from exiting
                say(f"[megatron-dapo] {stop.name}: the metrics of step {self.step} were not logged: {err}")
        raise StopRequested(stop.status, f"stopped on {stop.name} after step {self.step}")

    def _save_due(self, step: int) -> bool:
        cfg = self.config
        return bool(cfg.save_dir) and (step == cfg.num_steps or bool(cfg.save_interval
                                                                     and step % cfg.save_interval == 0))

    # ---- stages ------------------------------------------------------------------------------------
    def rank0_batch(self, step: int) -> tuple[dict[str, float], list[list[list[Rollout]]] | None]:
        """Rank 0: rollout metrics and every DP rank's share [dp][minibatch][row]; ({}, None) elsewhere.

        A failure on rank 0 is sent to the waiting ranks (they raise too) before it propagates."""
        if not self._is_rank0:
            return {}, None
        try:
            groups, metrics = self.next_batch(step)                    # generate -> reward -> filter
            shares, group_metrics = self.build_samples(groups)        # advantages, masks, DP partition
        except StopRequested:  # a signal: the waiting ranks stop with rank 0 (DataPlane.stop)
            if self._plane is not None:
                self._plane.stop()
            raise
        except BaseException:
            if self._plane is not None:
                self._plane.abort()
            raise
        return metrics | group_metrics, shares

    def distribute(self, shares: list[list[list[Rollout]]] | None) -> list[list[Rollout]]:
        """This DP rank's rows of each mini-batch: rank 0 sends each DP rank its share as tensors.

        Every rank but 0 waits here for the whole rollout, on the --rollout-timeout gloo group."""
        if self._plane is None:
            return shares[0]
        packed = None
        if shares is not None:
            try:
                packed = [pack(share, self.routing) for share in shares]
            except BaseException:
                self._plane.abort("while packing the rollout batch")
                raise
        return unpack(self._plane.exchange(packed), Rollout, self.routing)

    def next_batch(self, step: int) -> tuple[list[ScoredGroup], dict[str, float]]:
        """Rank 0: the step's kept groups and rollout metrics, with `time/rollout_wait_s` (how long training
        waited for them) and `async/staleness` (see megatron_dapo/rollout/async_rollout.py).

        Synchronous: generated now. --async-rollout 1: the batch generated during the previous step (at step 1 or
        after a resume without one: generated now), and batch step+1 starts on a background thread, on the
        weights the engine holds now, before this returns. --max-staleness K: the batch the fully async rollout
        handed over for this step (rollout/streaming.py)."""
        depth, job = self.config.async_rollout, self.ahead.job
        if self.config.max_staleness:  # a stop signal abandons the wait; the rollout thread goes on to its cut
            with self.stop.abandonable() if self.stop is not None else nullcontext():
                groups, metrics, requested = self.stream.take(step)
            if self.logger is not None:
                self.logger.log_record("prompts", {"step": step, "requested": requested,
                                                   "kept": [g.prompt.index for g in groups]})
            return groups, metrics
        if job is None and depth == 0:
            t0 = time.perf_counter()
            groups, metrics = self.rollout(step, abandonable=True)  # a stop signal abandons it
            return groups, metrics | {"time/rollout_wait_s": time.perf_counter() - t0, "async/staleness": 0.0}
        if job is None:
            job = AheadBatch.start(step, self.rollout, lambda: self.engine.weight_version)
        if job.step != step:
            raise RuntimeError(f"the batch generated ahead is for step {job.step}, the trainer is at step {step}")
        t0 = time.perf_counter()
        self.ahead.job = None
        groups, metrics = job.result()
        waited = time.perf_counter() - t0
        staleness = check_staleness(job, train_step=step, depth=depth)
        if depth and step < self.config.num_steps:
            self.ahead.job = AheadBatch.start(step + 1, self.rollout, lambda: self.engine.weight_version)
        return groups, metrics | {"time/rollout_wait_s": waited, "async/staleness": float(staleness)}

    @contextmanager
    def push_window(self, step: int) -> Iterator[dict[str, float]]:
        """Rank 0 with --max-staleness: around step `step`'s push, evaluation and save, the fully async rollout is
        parked at the cut where version `step` is due (StreamingRollout.window: time/push_wait_s); elsewhere a
        no-op yielding {}."""
        if not (self.config.max_staleness and self._is_rank0):
            yield {}
            return
        with self.stream.window(step) as metrics:
            yield metrics

    def finish_ahead(self) -> dict[str, float]:
        """Rank 0, --async-rollout 1: wait until the batch generated during this step's training is complete, so
        the weight push that follows never overlaps generation. `time/push_wait_s`: how long the trained weights
        waited for it; `time/overlap_s`: generation time that ran while this step trained. A failed batch raises
        at the next step's rollout (rank0_batch), where the other ranks are told."""
        job = self.ahead.job
        if job is None:
            return {}
        trained = time.perf_counter()
        waited = job.wait()
        return {"time/push_wait_s": waited, "time/overlap_s": max(0.0, min(job.finished, trained) - job.started)}

    def rollout(self, step: int, *, abandonable: bool = False) -> tuple[list[ScoredGroup], dict[str, float]]:
        """Rank 0 collects the step's kept groups. `abandonable` (the synchronous rollout, on the main thread): a
        stop signal raises StopRequested inside the collection (StopSignal.abandonable), before the carried
        groups or the prompts record change; only the sampler has drawn by then (Checkpointer.rewind)."""
        region = self.stop.abandonable() if abandonable and self.stop is not None else nullcontext()
        with region:
            result = collect_batch(self.engine, self.next_prompts, self.decode, self.reward_fn, self.collect,
                                   step=step, carried=self.carried.groups)
        self.carried.groups = result.carried
        if self.logger is not None:  # which prompts each step saw: audit trail and resume check
            record = {"step": step, "requested": result.requested, "kept": [g.prompt.index for g in result.groups]}
            if self.collect.partial_rollout:
                record |= {"resumed": result.resumed, "stale_dropped": result.stale_dropped,
                           "carried": [g.prompt.index for g in result.carried]}
            self.logger.log_record("prompts", record)
        return result.groups, result.metrics

    def build_samples(self, groups: list[ScoredGroup]) -> tuple[list[list[list[Rollout]]], dict[str, float]]:
        """Rank 0: group-normalised advantages -> TrainSamples, split into mini-batches, then each mini-batch
        into the DP ranks' shares: [dp][minibatch][row]."""
        flat = [(g_idx, s, r) for g_idx, g in enumerate(groups) for s, r in zip(g.samples, g.rewards, strict=True)]
        adv = self.config.advantage_estimator(torch.tensor([r for _, _, r in flat], dtype=torch.float64),
                                              [g for g, _, _ in flat])
        keep = overlong_keep_mask([s.truncated for _, s, _ in flat], self.collect.overlong)
        step = None  # --kl-in-reward: every rank recomputes the advantages from the whole step's rewards
        if self.config.kl_reward is not None:
            step = StepRewards(rewards=torch.tensor([r for _, _, r in flat], dtype=torch.float64),
                               group_ids=torch.tensor([g for g, _, _ in flat], dtype=torch.int64))
        rollouts = [
            Rollout(
                TrainSample(tokens=list(s.prompt_ids) + list(s.response_ids), prompt_len=len(s.prompt_ids),
                            advantage=float(a), loss_mask=float(k) * torch.tensor(s.generated(), dtype=torch.float32),
                            routed_experts=s.routed_experts if self.routing is not None else None),
                torch.tensor(s.logprobs, dtype=torch.float32), index=i, step_rewards=step,
                generated=torch.tensor(s.loss_mask, dtype=torch.uint8) if s.loss_mask else None,
            )
            for i, ((_, s, _), a, k) in enumerate(zip(flat, adv.tolist(), keep.tolist(), strict=True))
            if len(s.response_ids) > 0
        ]
        gbs = self.config.global_batch_size or max(1, len(rollouts))
        minibatches = [rollouts[i:i + gbs] for i in range(0, len(rollouts), gbs)]
        dp = parallel_state.get_data_parallel_world_size()
        if any(len(mb) < dp for mb in minibatches):
            raise ValueError(
                f"a mini-batch has fewer responses than the {dp} data-parallel ranks; raise "
                f"--global-batch-size or --rollout-batch-size x --n-samples-per-prompt"
            )
        metrics = {"train/advantage_abs_mean": float(adv.abs().mean()) if adv.numel() else 0.0,
                   "train/minibatches": len(minibatches),
                   "train/responses": float(len(rollouts))}
        splits = [self.dp_split(mb, dp) for mb in minibatches]  # [minibatch][dp][row index]
        shares = [[[mb[i] for i in split[d]] for mb, split in zip(minibatches, splits, strict=True)] for d in range(dp)]
        return shares, metrics

    def dp_split(self, minibatch: list[Rollout], dp: int) -> list[list[int]]:
        """Row indices of `minibatch` that each of the `dp` ranks trains on: balanced by token cost (quadratic
        attention term included), not strided; see actor/batching.partition_for_dp."""
        arch = self.actor.arch
        coef = attention_cost_coefficient(arch.hidden_size, arch.intermediate_size, arch.num_heads,
                                          arch.num_kv_heads, arch.head_dim)
        return partition_for_dp([len(r.sample.tokens) for r in minibatch], dp, attn_coef=coef)

    def train(self, minibatches: list[list[Rollout]], step: int) -> dict[str, float]:
        """Old log-probs on the pre-update policy (+ rollout mismatch; with --ref-load the reference model's, and
        with --kl-in-reward every advantage recomputed from the penalised rewards; with --teacher-load the
        distillation term, whose --distill-only zeroes the verifier's advantage after that), then one step per
        mini-batch, all at the LR of rollout step `step`. No mini-batch (--on-gen-exhausted partial kept no group,
        every rank alike): no update, `train/empty_batch` 1 (every advantage would have been 0)."""
        if not minibatches:
            return {"train/empty_batch": 1.0}
        t0 = time.perf_counter()
        local = [r for mb in minibatches for r in mb]
        old = self.actor.compute_log_probs([r.sample for r in local])
        metrics = self._mismatch(local, old)
        if self.ref is not None:  # the frozen reference's log-probs of the same tokens: the KL term's pi_ref
            t_ref = time.perf_counter()
            for r, lp in zip(local, self.ref.compute_log_probs([r.sample for r in local]), strict=True):
                r.sample.ref_log_probs = lp
            metrics["time/ref_logprob_s"] = time.perf_counter() - t_ref
        if self.config.kl_reward is not None:  # before any update: every mini-batch trains on these advantages
            metrics |= self._kl_reward(local, old)
        if self.teacher is not None:
            metrics |= self._distill(local, old)
        if len(minibatches) > 1:  # off-policy after the first update: ratio against the recorded policy
            for r, lp in zip(local, old, strict=True):
                r.sample.old_log_probs = lp
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}  # a metric some mini-batches lack (moe/routing_agreement: the first only)
        for mb in minibatches:
            step_metrics = self.actor.train_step([r.sample for r in mb], rollout_step=step)
            for k, v in step_metrics.items():
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
        metrics |= {f"train/{k}": v / counts[k] for k, v in sums.items()}
        metrics["time/train_s"] = time.perf_counter() - t0
        return metrics

    def sync_weights(self, version: int) -> dict[str, float]:
        """Push the updated policy to the engine: `weight_sync.push` on every rank (a collective; which path it
        takes was decided when the run was built, weight_sync/build.py).

        A section: the ranks meet after the push (one int64 all-reduce; they would wait for rank 0 at the next
        wait anyway), so an engine error on rank 0 (e.g. every server lost past --sglang-server-wait-s) makes them
        raise here, not wait for a batch rank 0 will never send. Rank 0 whose engine raised still runs its part
        of the export's collectives to the end first (the sync drains it), so its TP/PP peers are not left in a
        gather."""
        with self.section("during the weight sync"):
            return self.weight_sync.push(self.actor, version)

    def evaluate(self) -> dict[str, float]:
        """Rank 0 evaluates; the other ranks wait for it on the --rollout-timeout gloo group (10+ min for AIME avg@32
        at 20k tokens: 127 ranks waiting), and raise at once if its evaluation fails (one int64 all-reduce)."""
        metrics: dict[str, float] = {}
        with self.section("during evaluation"):
            if self._is_rank0 and self.eval_prompts:
                t0 = time.perf_counter()
                metrics = evaluate(self.engine, self.eval_prompts, self.decode, self.reward_fn,
                                   n_samples=self.config.eval_n_samples, sampling=self.config.eval_sampling,
                                   pass_ks=(1, self.config.eval_n_samples), seed=self.collect.seed)
                metrics["time/eval_s"] = time.perf_counter() - t0
        return metrics

    def save(self, step: int, *, record: dict[str, float] | None = None) -> None:
        """Checkpoint step `step` through the checkpointer (every rank), with rank 0's metrics record of the step so
        far (`record`; None: logged already) for a resumed run to log if this one dies before it does (SavedRecord).

        --colocate: only in the training phase, after the step's update and before to_generation (`run`), where
        SGLang has released its weights, KV cache and CUDA graphs and the actor holds what the save reads (bf16
        weights; fp32 main params and Adam moments) with nothing to onload. At 32B (TP8 x PP2, DP 8) that is 18.3
        GiB per GPU (the planner's save row: weights 3.8 + grads 7.6 + optimizer shard 2.9 + released engine and
        context 4; what a save in the generation phase would hold: docs/BENCHMARKS.md, "Colocated mode"). The
        save's own cost: checkpoint/training.py. The checkpoint is the state at the end of the step: nothing
        between this point and the end of the step changes model, optimizer, scheduler, sampler or carried
        groups, and nothing in this process draws from the RNGs (the push hands buffers, the evaluation's
        sampling is seeded per request inside the SGLang servers). A run that dies after this save
        but before the step's push, evaluation or metrics log resumes at step + 1 without that step's evaluation;
        its metrics record is logged from the checkpoint (`record`), without what was measured after the save."""
        if self.checkpointer is None:
            return
        if self.phases is not None and self.phases.phase != "training":
            raise RuntimeError(f"Trainer.save of step {step} in the colocated {self.phases.phase!r} phase: a save "
                               f"runs in the training phase, SGLang's memory released (see Trainer.save)")
        t0 = time.perf_counter()
        if self._is_rank0:
            self.record.hold(step, record)
        self.checkpointer.save(step)
        self._saved_step, self._save_s = step, max(self._save_s, time.perf_counter() - t0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(step, metrics)

    def _kl_reward(self, local: list[Rollout], old: list[torch.Tensor]) -> dict[str, float]:
        """--kl-in-reward (algorithm/kl.py): each local response's KL sum over its loss tokens, sum_t m_t k(log pi_old -
        log pi_ref) with the mask as it enters the loss (after --overlong-filter and --mis-mode), combined over the
        DP group into the step's [N] vector; every rank then runs the --advantage-estimator on the penalised
        rewards r_i - beta x KL_i of all N responses (StepRewards: those without tokens keep r_i) and sets its own
        rows' advantages. Logs kl/reward_penalty (beta x KL_i, mean over the N responses) and replaces
        train/advantage_abs_mean (rank 0's, from the unpenalised rewards) with that of the advantages trained on.

        Cost: one all-reduce of N float64 over the DP group (on its backend's device): 64 KiB at 512 prompts x 16
        responses; each slot has one rank's value and zeros, so the sum is exact and the same on every rank (and
        every TP/PP peer, whose DP groups reduce the same values). Host, per rank: one estimator pass over its
        response tokens, then the estimator over N (grpo: a Python loop over the groups, milliseconds at 8192)."""
        cfg = self.config.kl_reward
        steps = {id(r.step_rewards): r.step_rewards for r in local}
        if len(steps) != 1 or None in steps.values() or any(r.index is None for r in local):
            raise RuntimeError("--kl-in-reward: every local row must carry its step's StepRewards and its index in "
                               "it (set by build_samples on rank 0, carried by the data plane)")
        table = next(iter(steps.values()))
        sums = torch.zeros(len(table), dtype=torch.float64)
        for r, old_lp in zip(local, old, strict=True):
            sample = r.sample
            mask = torch.ones(sample.response_len) if sample.loss_mask is None else sample.loss_mask
            sums[r.index] = kl_response_sum(old_lp.cpu(), sample.ref_log_probs.cpu(), mask, cfg.estimator)
        if parallel_state.get_data_parallel_world_size() > 1:
            comm.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        adv = kl_penalized_advantages(table.rewards, table.group_ids.tolist(), sums, cfg.coef,
                                      self.config.advantage_estimator)
        for r in local:
            r.sample.advantage = float(adv[r.index])
        return {"kl/reward_penalty": float(cfg.coef * sums.mean()), "train/advantage_abs_mean": float(adv.abs().mean())}

    def _distill(self, local: list[Rollout], old: list[torch.Tensor]) -> dict[str, float]:
        """On-policy distillation (algorithm/distill.py): the teacher's log-probs of every local sample in one
        forward-only pass, each sample's per-token advantages coef * (log pi_T - log pi_old) (--distill-only: its
        verifier advantage set to 0), and the distill/* token means over every DP rank (one all-reduce of 32 B)."""
        cfg = self.config.distill
        t0 = time.perf_counter()
        teacher = self.teacher.compute_log_probs([r.sample for r in local])
        sums = torch.zeros(len(DISTILL_SUM_KEYS), dtype=torch.float64)
        for r, old_lp, teacher_lp in zip(local, old, teacher, strict=True):
            sample, old_lp = r.sample, old_lp.detach().float().cpu()
            sample.token_advantages = distill_advantages(old_lp, teacher_lp, cfg.coef)
            if cfg.only:
                sample.advantage = 0.0
            mask = torch.ones_like(old_lp) if sample.loss_mask is None else sample.loss_mask.float()
            part = distill_sums(old_lp, teacher_lp, mask, cfg.coef)
            sums += torch.tensor([part[k] for k in DISTILL_SUM_KEYS], dtype=torch.float64)
        if parallel_state.get_data_parallel_world_size() > 1:
            comm.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        totals = dict(zip(DISTILL_SUM_KEYS, sums.tolist(), strict=True))
        tokens = totals.pop("tokens")
        return {f"distill/{k}": (v / tokens if tokens else 0.0) for k, v in totals.items()} | {
            "time/teacher_logprob_s": time.perf_counter() - t0}

    # ---- metrics -----------------------------------------------------------------------------------
    def _mismatch(self, local: list[Rollout], actor_logp: list[torch.Tensor]) -> dict[str, float]:
        """Rollout-vs-actor correction and `mismatch/*` metrics (algorithm/mismatch.py) over every response
        token, reduced over DP ranks (CPU values moved to the DP group's device by comm). With --use-tis /
        --mis-mode, sets each sample's is_weights / loss_mask.

        Host cost, per DP rank: about 30 vector ops per response on one CPU thread (their time at the 32B worst
        case: docs/BENCHMARKS.md, "Off-policy metrics"); one all-reduce of 96 B."""
        cfg = self.config.off_policy
        stats = torch.zeros(len(SUM_KEYS), dtype=torch.float64)
        peak = torch.zeros(len(MAX_KEYS), dtype=torch.float64)
        for r, old in zip(local, actor_logp, strict=True):
            old, rollout = old.detach().float().cpu().unsqueeze(0), r.rollout_log_probs.unsqueeze(0)
            generated = torch.ones_like(old) if r.generated is None else r.generated.float().unsqueeze(0)
            sums = mismatch_sums(old, rollout, generated, cfg)  # a tool's tokens have no rollout log-prob
            stats += torch.tensor([float(sums[k]) for k in SUM_KEYS], dtype=torch.float64)
            peak = torch.maximum(peak, torch.tensor([float(sums[k]) for k in MAX_KEYS], dtype=torch.float64))
            if cfg.enabled:
                sample = r.sample
                mask = torch.ones_like(old) if sample.loss_mask is None else sample.loss_mask.float().unsqueeze(0)
                corr = off_policy_correction(old, rollout, mask, cfg)
                sample.loss_mask = corr.loss_mask[0]
                sample.is_weights = None if corr.is_weights is None else corr.is_weights[0]
        if parallel_state.get_data_parallel_world_size() > 1:
            group = parallel_state.get_data_parallel_group()
            comm.all_reduce(stats, group=group)
            comm.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        return reduce_mismatch(dict(zip(SUM_KEYS, stats.tolist(), strict=True))
                               | dict(zip(MAX_KEYS, peak.tolist(), strict=True)))
