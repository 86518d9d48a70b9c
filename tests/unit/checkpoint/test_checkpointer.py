"""The checkpointed components' state_dict round-trips, and the Checkpointer's layout of their states.

The reference for the layout is the `extra` dict every checkpoint so far holds, written out here: {"step": N,
"sampler": ..., "carried": ... (--partial-rollout), "async_batch": ... (--async-rollout 1, rank 0 only)}; the
actor's tensors go through dist_checkpointing (tests/*/test_checkpoint_*.py, the SIGKILL resumes of
tests/e2e/test_trainer_e2e.py and tests/e2e/test_trainer_async_resume.py)."""

from __future__ import annotations

import io

import pytest
import torch

from megatron_dapo.checkpoint.checkpointer import Checkpointer, MissingStateError
from megatron_dapo.checkpoint.state import CommonState, Holder, ShardedState
from megatron_dapo.data import ResumableSampler
from megatron_dapo.rollout.async_rollout import AheadBatch, BatchAhead, batch_state
from megatron_dapo.rollout.partial_rollout import CarriedGroup, CarriedGroups
from megatron_dapo.rollout.types import Prompt, Sample
from megatron_dapo.trainer.loop import Trainer, TrainerConfig
from tests.unit.rollout.test_async_rollout import _group


def _carried(index: int) -> CarriedGroup:
    prompt = Prompt(prompt_ids=[3, index], ground_truth="1", index=index)
    samples = [Sample(request_id=f"r{index}-{i}", index=i, prompt_ids=[3, index], response_ids=[5, 6 + i][: i + 1],
                      logprobs=[-0.5, -0.25][: i + 1], finish_reason=("stop", "abort")[i], weight_version=2,
                      token_versions=[] if i == 0 else [2, 3][: i + 1]) for i in range(2)]
    return CarriedGroup(prompt=prompt, samples=samples, seed=11 + index, first_step=4)


def _trainer(step: int = 0, *, num_steps: int = 5, depth: int = 0, partial: bool = False) -> Trainer:
    from types import SimpleNamespace

    return Trainer(config=TrainerConfig(num_steps=num_steps, async_rollout=depth),
                   collect=SimpleNamespace(partial_rollout=partial), actor=None, engine=object(),
                   next_prompts=lambda k: [], eval_prompts=[], decode=str, reward_fn=None, logger=None, step=step)


def _same(a, b) -> bool:
    """Equal nested states (tensors compared by dtype and value)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _through_torch_save(state):
    """What a checkpoint's common state goes through: torch.save, then a weights_only load."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_trainer_state_round_trips():
    assert _trainer(7).state_dict() == {"step": 7}
    fresh = _trainer()
    fresh.load_state_dict(_through_torch_save(_trainer(7).state_dict()))
    assert fresh.step == 7


def test_sampler_state_round_trips():
    a = ResumableSampler(10, seed=3)
    a.next_batch(7), a.next_batch(6)
    b = ResumableSampler(10, seed=3)
    b.load_state_dict(_through_torch_save(a.state_dict()))
    assert b.next_batch(9) == a.next_batch(9)


def test_carried_groups_round_trip_exactly():
    groups = [_carried(i) for i in range(3)]
    back = CarriedGroups(enabled=True)
    back.load_state_dict(_through_torch_save(CarriedGroups(enabled=True, groups=groups).state_dict()))
    assert back.groups == groups


def test_carried_groups_without_partial_rollout_save_nothing_and_drop_with_a_warning(capsys):
    assert CarriedGroups(enabled=False, groups=[_carried(0)]).state_dict() == {}
    off = CarriedGroups(enabled=False)
    off.load_state_dict(CarriedGroups(enabled=True, groups=[_carried(0), _carried(1)]).state_dict())
    assert off.groups == []
    assert "carries 2 partial-rollout groups; without --partial-rollout they are dropped" in capsys.readouterr().err


def test_batch_ahead_round_trips_and_saves_only_a_finished_batch():
    groups = [_group(i, version=1) for i in range(2)]
    ahead = BatchAhead(depth=1, num_steps=5)
    assert ahead.state_dict() == {}  # nothing ahead
    ahead.job = AheadBatch.from_checkpoint(3, 1, groups, {"rollout/x": 1.0})
    back = BatchAhead(depth=1, num_steps=5)
    back.load_state_dict(_through_torch_save(ahead.state_dict()))
    assert (back.job.step, back.job.version, back.job.result()) == (3, 1, (groups, {"rollout/x": 1.0}))
    failed = AheadBatch(4, 2)
    failed._error = RuntimeError("engine lost")
    failed._done.set()
    ahead.job = failed
    assert ahead.state_dict() == {}  # a failed batch: the resumed run generates that step itself


def _components(step=3, *, partial=True, ahead_step=None):
    trainer = _trainer(step, depth=1, partial=partial)
    sampler = ResumableSampler(6, seed=1)
    sampler.next_batch(4)
    trainer.carried.groups = [_carried(0)] if partial else []
    if ahead_step is not None:
        trainer.ahead.job = AheadBatch.from_checkpoint(ahead_step, step - 1, [_group(0, version=step - 1)], {})
    return {"trainer": trainer, "sampler": sampler, "carried": trainer.carried, "ahead": trainer.ahead}


def test_the_checkpointer_writes_each_state_where_every_checkpoint_so_far_has_it():
    states = _components(3, ahead_step=4)
    checkpointer = Checkpointer(states, save_dir=None, load_dir=None)
    shared, own = checkpointer.extra()
    rank0_only = {slot.key for slot in checkpointer.slots.values() if slot.holder is Holder.RANK0_ONLY}
    assert _same(shared, {"step": 3, "sampler": states["sampler"].state_dict(),
                          "carried": states["carried"].state_dict()})
    assert _same(own, {"async_batch": batch_state(states["ahead"].job)}) and set(own) == rank0_only
    assert {name: component.checkpoint_state.key for name, component in states.items()} == {
        "trainer": "step", "sampler": "sampler", "carried": "carried", "ahead": "async_batch"}
    without = _components(3, partial=False)  # no --partial-rollout, nothing ahead: neither key is written
    assert Checkpointer(without, save_dir=None, load_dir=None).extra() == (
        {"step": 3, "sampler": without["sampler"].state_dict()}, {})


def test_the_checkpointer_restores_every_component_by_name():
    saved = _components(3, ahead_step=4)
    shared, own = Checkpointer(saved, save_dir=None, load_dir=None).extra()
    extra = _through_torch_save(shared | own)
    fresh = _components(0, ahead_step=None)
    fresh["carried"].groups = []
    fresh["sampler"] = ResumableSampler(6, seed=1)
    Checkpointer(fresh, save_dir=None, load_dir=None).load_extra(extra)
    assert fresh["trainer"].step == 3
    assert fresh["sampler"].next_batch(5) == saved["sampler"].next_batch(5)
    assert fresh["carried"].groups == saved["carried"].groups
    assert fresh["ahead"].job.step == 4 and fresh["ahead"].job.result() == saved["ahead"].job.result()


@pytest.mark.parametrize("missing, key", [("trainer", "step"), ("sampler", "sampler")])
def test_a_checkpoint_without_a_required_state_is_rejected_naming_the_component(missing, key):
    states = _components(3)
    shared, own = Checkpointer(states, save_dir=None, load_dir=None).extra()
    extra = {k: v for k, v in (shared | own).items() if k != key}
    with pytest.raises(MissingStateError, match=f"no state for '{missing}'"):
        Checkpointer(_components(0), save_dir=None, load_dir="ckpt").load_extra(extra)


def test_a_resume_under_another_seed_is_refused_on_every_rank_before_anything_is_restored():
    """check_extra runs on every rank (a placeholder sampler off rank 0 holds the flags' seed) before the rank-0
    section: all ranks reach the verdict together, none restores a component first."""
    from megatron_dapo.errors import UserError

    extra = {"step": 2, "sampler": ResumableSampler(6, seed=1).state_dict()}
    states = _components(0)
    states["sampler"] = ResumableSampler(6, seed=2)
    with pytest.raises(UserError, match="saved with --seed 1, this run has --seed 2"):
        Checkpointer(states, save_dir=None, load_dir="ckpt").check_extra(extra)
    assert states["trainer"].step == 0
    states["sampler"] = ResumableSampler(6, seed=1)
    Checkpointer(states, save_dir=None, load_dir="ckpt").check_extra(extra)


def test_optional_states_may_be_absent_and_unknown_names_are_refused():
    states = _components(0, partial=True)
    states["carried"].groups = []  # as built
    Checkpointer(states, save_dir=None, load_dir=None).load_extra(
        {"step": 2, "sampler": ResumableSampler(6, seed=1).state_dict()})  # written without --partial-rollout
    assert states["trainer"].step == 2 and states["carried"].groups == [] and states["ahead"].job is None
    with pytest.raises(ValueError, match="no slot for component"):
        Checkpointer({"optimiser": object()}, save_dir=None, load_dir=None)


def test_the_trainer_refuses_a_batch_ahead_for_another_step():
    trainer = _trainer(3, depth=1)
    trainer.ahead.job = AheadBatch.from_checkpoint(6, 2, [_group(0, version=2)], {})
    with pytest.raises(ValueError, match="the checkpoint of step 3 holds a batch for step 6, expected 4"):
        trainer.run()


class _Counter:
    """A component this test adds: its state is declared here, in its own class, and nowhere in checkpoint/."""

    checkpoint_state = CommonState(key="counter", holder=Holder.RANK0_SHARED, drawn=True)

    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = int(state["value"])


class _Trace(_Counter):
    checkpoint_state = CommonState(key="trace", holder=Holder.RANK0_ONLY, optional=True)


def test_a_new_component_is_saved_and_restored_by_its_own_declaration():
    """A component the checkpointer has never heard of: its state goes to the key its class declares, with the
    holder, optionality and `drawn` it declares, next to the run's components (whose keys do not move)."""
    states = _components(3) | {"counter": _Counter(5), "trace": _Trace(9)}
    shared, own = Checkpointer(states, save_dir=None, load_dir=None).extra()
    assert shared["counter"] == {"value": 5} and own == {"trace": {"value": 9}}
    assert set(shared) == {"step", "sampler", "carried", "counter"}
    fresh = _components(0) | {"counter": _Counter(), "trace": _Trace()}
    Checkpointer(fresh, save_dir=None, load_dir=None).load_extra(_through_torch_save(shared | own))
    assert (fresh["counter"].value, fresh["trace"].value, fresh["trace"].checkpoint_state.optional) == (5, 9, True)
    without_trace = _components(0) | {"counter": _Counter(), "trace": _Trace(1)}
    Checkpointer(without_trace, save_dir=None, load_dir=None).load_extra(shared)  # optional: stays as built
    assert (without_trace["counter"].value, without_trace["trace"].value) == (5, 1)
    # drawn: a stop's rewind puts it back; a rank-0-only key is kept out of megatron's cross-rank check
    marked = Checkpointer(states, save_dir=None, load_dir=None)
    marked.mark()
    states["counter"].value, states["trace"].value = 6, 10
    marked.rewind()
    assert (states["counter"].value, states["trace"].value) == (5, 10)


def test_the_saver_leaves_the_declared_rank0_only_keys_out_of_the_cross_rank_check(tmp_path):
    states = _components(3) | {"trace": _Trace()}
    assert Checkpointer(states, save_dir=str(tmp_path), load_dir=None).saver.rank0_extra == ("async_batch", "trace")


def test_a_checkpoint_without_a_new_components_state_is_rejected_naming_it():
    shared, own = Checkpointer(_components(3), save_dir=None, load_dir=None).extra()
    with pytest.raises(MissingStateError, match=r"no state for 'counter' \(extra\['counter'\]\)"):
        Checkpointer(_components(0) | {"counter": _Counter()}, save_dir=None, load_dir="ckpt").load_extra(shared | own)


def test_two_components_at_one_key_are_refused_naming_both():
    class Sampler2(_Counter):
        checkpoint_state = CommonState(key="sampler")

    with pytest.raises(ValueError, match=r"the same checkpoint key: \['sampler', 'mine'\] at extra\['sampler'\]"):
        Checkpointer(_components(0) | {"mine": Sampler2()}, save_dir=None, load_dir=None)


def test_the_sharded_state_has_one_owner_and_save_and_load_need_it(tmp_path):
    class Sharded:
        checkpoint_state = ShardedState()

    with pytest.raises(ValueError, match=r"components \['a', 'b'\] each declare the checkpoint's sharded state"):
        Checkpointer({"a": Sharded(), "b": Sharded()}, save_dir=None, load_dir=None)
    without = Checkpointer(_components(1), save_dir=str(tmp_path), load_dir=str(tmp_path))
    for call in (lambda: without.save(1), without.load):
        with pytest.raises(ValueError, match="no component declares the checkpoint's sharded state"):
            call()
