"""In-process save -> load into a fresh actor: the optimizer's per-param state (fp32 main param, Adam
m, v, step) comes back bit-exact, and the next update equals the one of the actor that never stopped.

Covers both resume bugs: bf16 params (main params must not be re-derived from the bf16 weights) and
the distributed optimizer without TE/Apex (torch Adam's 'step' must be the saved one, per param).
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
from megatron_dapo.checkpoint.state import CommonState, Holder
from megatron_dapo.checkpoint.training import load_checkpoint, save_checkpoint
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from tests.checkpoint_helpers import optimizer_state
from tests.dist.actor_common import hf_to_full_mcore, make_samples, mcore_shards_for_rank, tiny_hf_model


@pytest.fixture(scope="module")
def world():
    layout = init_parallel(seed=0)
    hf = tiny_hf_model(seed=6)
    arch = ModelArch.from_hf(hf.config)
    shards = mcore_shards_for_rank(hf_to_full_mcore(hf.state_dict(), arch), arch, tp=1, tp_rank=0, pp=1, pp_rank=0,
                                   padded_vocab=padded_vocab_size(arch.vocab_size, 1))
    yield layout, arch, shards
    destroy_parallel()


@pytest.mark.parametrize(("dtype", "distributed"), [("bfloat16", False), ("float32", True), ("bfloat16", True)],
                         ids=["bf16", "distopt", "bf16-distopt"])
def test_resume_restores_optimizer_state_exactly(world, tmp_path, dtype, distributed):
    layout, arch, shards = world

    def fresh() -> MegatronActor:
        actor = MegatronActor(arch, ActorConfig(lr=1e-3, params_dtype=dtype, use_distributed_optimizer=distributed),
                              layout)
        actor.load_shards(shards)
        return actor

    ran = fresh()
    for k in range(2):
        ran.train_step(make_samples(4, seed=k))
    save_checkpoint(tmp_path, 2, ran, extra={})
    resumed = fresh()
    assert load_checkpoint(tmp_path, resumed)["step"] == 2
    want, got = optimizer_state(ran), optimizer_state(resumed)
    assert set(got) == set(want) and any(k.endswith(".step") for k in want)
    for key in want:
        assert want[key].dtype == got[key].dtype and torch.equal(want[key], got[key]), key
    samples = make_samples(4, seed=9)
    assert resumed.train_step(samples) == ran.train_step(samples)
    want, got = optimizer_state(ran), optimizer_state(resumed)
    for key in want:
        assert torch.equal(want[key], got[key]), key


class _Progress:
    """A stateful component defined here, not in the package: its class declares its state, and the checkpointer
    (checkpoint/checkpointer.py, unedited) saves and restores it with the actor's."""

    checkpoint_state = CommonState(key="progress", holder=Holder.RANK0_SHARED)

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens

    def state_dict(self) -> dict[str, int]:
        return {"tokens": self.tokens}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.tokens = int(state["tokens"])


def test_a_new_component_and_the_actor_go_through_one_checkpointer(world, tmp_path):
    """The actor is one more named component (its class declares the sharded state): a save through the
    Checkpointer writes it and the new component's state at its declared key, and a load restores both exactly."""
    from megatron_dapo.checkpoint import safe_read
    from megatron_dapo.checkpoint.checkpointer import Checkpointer
    from megatron_dapo.checkpoint.training import step_dir

    layout, arch, shards = world

    def fresh() -> MegatronActor:
        actor = MegatronActor(arch, ActorConfig(lr=1e-3), layout)
        actor.load_shards(shards)
        return actor

    ran = fresh()
    ran.train_step(make_samples(4, seed=0))
    saving = Checkpointer({"actor": ran, "progress": _Progress(1234)}, save_dir=str(tmp_path), load_dir=None)
    saving.save(1)
    saving.close()
    assert safe_read.load_common(step_dir(tmp_path, 1))["extra"] == {"step": 1, "progress": {"tokens": 1234}}
    resumed, progress = fresh(), _Progress()
    loading = Checkpointer({"actor": resumed, "progress": progress}, save_dir=None, load_dir=str(tmp_path))
    assert loading.load() == 1 and (progress.tokens, resumed.steps) == (1234, 1)
    want, got = optimizer_state(ran), optimizer_state(resumed)
    assert set(got) == set(want)
    for key in want:
        assert torch.equal(want[key], got[key]), key
