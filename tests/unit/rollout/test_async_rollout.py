"""--async-rollout: the trainer's schedule against a scripted engine that records what happened when.

The real loop (Trainer.run, a one-process Megatron actor) with an engine that stamps every sample with its
weight version and logs stream / push events. Synchronous: step k trains on a batch of version k-1. With
--async-rollout 1: step k's batch is version k-2 (step 1: 0), generated while step k-1 trained, and the
push of version k waits until batch k+1 is complete. Plus the staleness guard, the checkpoint codec of the
batch generated ahead, and the --use-tis default."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterable, Iterator, Sequence

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor
from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig
from megatron_dapo.arguments import build_parser
from megatron_dapo.rollout.async_rollout import AheadBatch, batch_from_state, batch_state, check_staleness
from megatron_dapo.rollout.collect import CollectConfig, Prompt, ScoredGroup
from megatron_dapo.rollout.engine import RolloutEngine, check_unique_ids
from megatron_dapo.rollout.types import RolloutRequest, Sample, SamplingParams
from megatron_dapo.startup import build_configs
from megatron_dapo.trainer.loop import Trainer, TrainerConfig
from tests.dist.actor_common import load_hf_weights, single_process_world
from tests.sim_engine import decode, reward

STEPS = 5
GATE_S = 30.0
"""How long a gate waits for the other thread's event before it logs "gate_timeout" and goes on (later gates then
do not wait): only reached when the trainer's schedule is broken and the event never comes; the events are thread
hand-offs of milliseconds, so this bounds a hang, not a speed."""


class ScriptedEngine(RolloutEngine):
    """Two responses per request, one right, one wrong (every group informative); each sample is stamped with
    the version of the weights the engine holds; `events` logs (what, step or version) in the order they happened.

    With `overlap` (--async-rollout 1), whatever the load on the machine, the batch of step k+1 (generated during
    step k) ends only once the trainer waits for it ("wait_ahead", logged by RecordingTrainer) or pushes version k:
    so a push that does not wait for the batch is seen to come before its end, instead of losing a race to it."""

    def __init__(self, overlap: bool = False) -> None:
        self.version, self.events, self.overlap = 0, [], overlap
        self._changed = threading.Condition()

    def _log(self, what: str, value: int) -> None:
        with self._changed:
            self.events.append((what, value))
            self._changed.notify_all()

    def wait_for(self, *wanted: tuple[str, int]) -> None:
        """Block until one of the `wanted` (what, value) events was logged; after GATE_S log a "gate_timeout"."""
        with self._changed:
            timeout = 0.0 if any(kind == "gate_timeout" for kind, _ in self.events) else GATE_S
            if not self._changed.wait_for(lambda: any(w in self.events for w in wanted), timeout=timeout):
                self.events.append(("gate_timeout", wanted[0][1]))

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        check_unique_ids(requests)
        step = int(requests[0].request_id.split("-")[0][1:])  # collect's ids: s<step>-r<round>-<i>-p<index>
        self._log("stream_start", step)
        for req in requests:
            yield [Sample(request_id=req.request_id, index=i, prompt_ids=list(req.prompt_ids),
                          response_ids=[1 - i % 2, 2, 2], logprobs=[-0.5, -0.7, -0.9], finish_reason="stop",
                          weight_version=self.version) for i in range(req.n)]
        if self.overlap and step > 1:
            self.wait_for(("wait_ahead", step), ("push", step - 1))
        self._log("stream_end", step)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        count = sum(1 for _ in named_tensors)
        assert count > 0
        self._log("push", version)
        self.version = version

    def abort(self, request_ids=None) -> list[str]:
        return []

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def health(self) -> bool:
        return True

    def shutdown(self) -> None: ...

    @property
    def weight_version(self) -> int:
        return self.version


class RecordingTrainer(Trainer):
    """Records which weight versions each step trained on, and when training ran. With the engine's `overlap`,
    step k (< STEPS) starts training only once batch k+1 has started generating (so the overlap happens whatever
    the load), and the trainer's wait for batch k+1 (AheadBatch.wait, in finish_ahead) is logged as "wait_ahead"."""

    def next_batch(self, step):
        groups, metrics = super().next_batch(step)
        self.trained_versions[step] = {s.weight_version for g in groups for s in g.samples}
        self.metrics_of[step] = metrics
        return groups, metrics

    def train(self, minibatches, step):
        if self.engine.overlap and step < STEPS:
            self.engine.wait_for(("stream_start", step + 1))
        self.engine._log("train_start", step)
        out = super().train(minibatches, step)
        self.engine._log("train_end", step)
        return out

    def finish_ahead(self):
        job = self.ahead.job
        if job is not None:
            wait = job.wait

            def logged_wait() -> float:
                self.engine._log("wait_ahead", job.step)
                return wait()

            job.wait = logged_wait
        out = super().finish_ahead()
        self.metrics_of[self.step + 1] |= out
        return out


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=6)


def _run(world, depth: int) -> RecordingTrainer:
    layout, hf, arch = world
    actor = MegatronActor(arch, ActorConfig(lr=1e-4, clip_grad=0.0, max_tokens_per_micro_batch=64), layout)
    load_hf_weights(actor, hf)
    collect = CollectConfig(n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=3),
                            dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=3, enabled=False),
                            overlong=OverlongConfig(max_response_length=3), seed=1)
    prompts = [Prompt(prompt_ids=[3, 4 + i], ground_truth="1", index=i) for i in range(100)]
    cursor = iter(prompts)
    engine = ScriptedEngine(overlap=depth > 0)
    trainer = RecordingTrainer(config=TrainerConfig(num_steps=STEPS, async_rollout=depth), collect=collect,
                               actor=actor, engine=engine, next_prompts=lambda k: [next(cursor) for _ in range(k)],
                               eval_prompts=[], decode=decode, reward_fn=reward, logger=None)
    trainer.trained_versions, trainer.metrics_of = {}, {}
    trainer.run()
    return trainer


def _order(events, what: str) -> dict[int, int]:
    """Step or version -> the position of its `what` event in the log (events are logged under one lock)."""
    return {value: i for i, (kind, value) in enumerate(events) if kind == what}


def test_synchronous_steps_train_on_the_newest_weights_and_never_overlap(world):
    trainer = _run(world, depth=0)
    assert trainer.trained_versions == {k: {k - 1} for k in range(1, STEPS + 1)}
    assert [trainer.metrics_of[k]["async/staleness"] for k in range(1, STEPS + 1)] == [0.0] * STEPS
    ev = trainer.engine.events
    start, end, train0, train1, push = (_order(ev, w) for w in
                                        ("stream_start", "stream_end", "train_start", "train_end", "push"))
    for k in range(1, STEPS + 1):
        assert end[k] <= train0[k] < train1[k] <= push[k]
        if k < STEPS:
            assert push[k] <= start[k + 1]


def test_one_step_off_policy_generates_the_next_batch_while_training(world):
    trainer = _run(world, depth=1)
    # step k trains on a batch of version k-2 (step 1: the initial weights), staleness 1 from step 2 on
    assert trainer.trained_versions == {k: {max(k - 2, 0)} for k in range(1, STEPS + 1)}
    assert [trainer.metrics_of[k]["async/staleness"] for k in range(1, STEPS + 1)] == [0.0] + [1.0] * (STEPS - 1)
    ev = trainer.engine.events
    assert not [e for e in ev if e[0] == "gate_timeout"], ev  # every awaited event came
    start, end, train0, train1, push = (_order(ev, w) for w in
                                        ("stream_start", "stream_end", "train_start", "train_end", "push"))
    assert sorted(start) == list(range(1, STEPS + 1))  # one batch per step, the last step generates none ahead
    for k in range(1, STEPS):
        assert start[k + 1] < train1[k]   # batch k+1 was generating while step k trained
        assert start[k + 1] < push[k]     # ... on the weights from before step k's push
        assert end[k + 1] <= push[k]      # the push waited for it: no batch mixes versions
        assert train1[k] <= push[k]
        assert trainer.metrics_of[k]["time/overlap_s"] > 0
    assert push[STEPS] >= train1[STEPS]
    pushes = [value for kind, value in ev if kind == "push"]
    assert pushes == list(range(1, STEPS + 1))


def _group(index: int, version: int) -> ScoredGroup:
    prompt = Prompt(prompt_ids=[5, index, 7], ground_truth=f"{index}", index=index)
    samples = [Sample(request_id=f"s2-r0-{index}-p{index}", index=i, prompt_ids=[5, index, 7],
                      response_ids=[9, 10 + i, 70000 + i], logprobs=[-0.25, -1 / 3, -2.0 + i],
                      finish_reason=("stop", "length", "abort")[i], weight_version=version) for i in range(3)]
    return ScoredGroup(prompt=prompt, samples=samples, accs=[True, False, True], rewards=[1.0, -1.0 / 3, 0.1])


def test_the_batch_ahead_round_trips_through_a_weights_only_checkpoint_exactly():
    groups = [_group(i, version=4) for i in range(3)]
    job = AheadBatch.from_checkpoint(6, 4, groups, {"rollout/reward": 0.25})
    buf = io.BytesIO()
    torch.save(batch_state(job), buf)
    buf.seek(0)
    back = batch_from_state(torch.load(buf, weights_only=True))
    assert (back.step, back.version, back.restored) == (6, 4, True)
    got, metrics = back.result()
    assert got == groups and metrics == {"rollout/reward": 0.25}  # rewards exact (fp64), log-probs exact
    data = batch_state(job)
    assert data["samples"]["response_ids"]["data"].dtype == torch.int32
    assert data["samples"]["logprobs"]["data"].dtype == torch.float64  # -1/3 as a Python float is not fp32
    fp32 = [_group(0, 4)]
    fp32[0].samples[0].logprobs = [float(torch.tensor(-1 / 3))] * 3
    for s in fp32[0].samples:
        s.logprobs = [float(torch.tensor(x)) for x in s.logprobs]
    packed = batch_state(AheadBatch.from_checkpoint(2, 1, fp32, {}))
    assert packed["samples"]["logprobs"]["data"].dtype == torch.float32  # engine values: 4 B each, still exact
    assert batch_from_state(packed).result()[0] == fp32


def test_staleness_guard():
    groups = [_group(0, version=0)]
    assert check_staleness(AheadBatch.from_checkpoint(3, 1, groups, {}), train_step=3, depth=1) == 1
    with pytest.raises(RuntimeError, match="staleness 2, the bound is 1"):
        check_staleness(AheadBatch.from_checkpoint(3, 0, groups, {}), train_step=3, depth=1)
    fresh = AheadBatch.start(3, lambda step: (groups, {}), lambda: 1)
    fresh.wait()
    with pytest.raises(RuntimeError, match="bound is 0"):
        check_staleness(fresh, train_step=3, depth=0)
    versions = iter([1, 2])
    moved = AheadBatch.start(3, lambda step: (groups, {}), lambda: next(versions))
    with pytest.raises(RuntimeError, match="weight push overlapped generation"):
        check_staleness(moved, train_step=3, depth=1)
    # a batch restored from an async checkpoint may be trained by a synchronous resume, once
    assert check_staleness(AheadBatch.from_checkpoint(3, 1, groups, {}), train_step=3, depth=0) == 1
    with pytest.raises(ValueError, match="--async-rollout must be 0"):
        TrainerConfig(num_steps=1, async_rollout=2)


def _flags(*extra: str):
    return build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--num-steps", "3",
                                      "--max-response-length", "16", "--overlong-buffer-length", "4", *extra])


@pytest.mark.parametrize("extra, expected", [
    ((), False), (("--async-rollout", "1"), True), (("--async-rollout", "1", "--no-use-tis"), False),
    (("--use-tis",), True), (("--async-rollout", "0", "--use-tis"), True),
])
def test_tis_is_on_by_default_only_under_async_rollout(extra, expected):
    _, _, trainer = build_configs(_flags(*extra))
    assert trainer.off_policy.use_tis is expected
    assert trainer.async_rollout == (1 if "1" in extra else 0)


@pytest.mark.parametrize("depth, num_steps, says", [
    pytest.param(0, 5, "the checkpoint holds the batch of step 3 (2 groups generated ahead by weight version 1): this "
                       "run (--async-rollout 0) trains it as is at step 3, one step off-policy (staleness 1), and "
                       "generates every later batch in its own step", id="toggled-to-sync"),
    pytest.param(1, 5, None, id="async-again"),
    pytest.param(0, 2, "the checkpoint holds the batch of step 3 (2 groups generated ahead by weight version 1): "
                       "dropped, --num-steps 2 ends the run before it", id="past-num-steps"),
])
def test_resume_says_what_happens_to_the_batch_generated_ahead(capsys, depth, num_steps, says):
    """A checkpoint of an --async-rollout 1 run holds the next step's batch; a resume with --async-rollout 0 trains
    it unchanged (generating nothing for that step) and says so in one line; an async resume prints nothing."""
    groups = [_group(i, version=1) for i in range(2)]
    engine = ScriptedEngine()
    trainer = Trainer(config=TrainerConfig(num_steps=num_steps, async_rollout=depth), collect=None, actor=None,
                      engine=engine, next_prompts=lambda k: [], eval_prompts=[], decode=decode, reward_fn=reward,
                      logger=None, step=2)
    trainer.ahead.load_state_dict(batch_state(AheadBatch.from_checkpoint(3, 1, groups, {"rollout/x": 1.0})))
    printed = capsys.readouterr().out.strip()
    assert printed == (f"[megatron-dapo] {says}" if says else "")
    if num_steps >= 3 and depth == 0:
        got, metrics = trainer.next_batch(3)
        assert got == groups and metrics["async/staleness"] == 1.0 and engine.events == []
