"""The LR schedule counts rollout steps (DAPO, arXiv 2503.14476 Sec. 4.1: linear warm-up over 20 rollout
steps, 16 optimizer updates each): the flags go through build_configs into the actor, the trainer tells
the actor the rollout step, and every optimizer step of rollout step k trains at the formula's LR."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import MegatronActor
from megatron_dapo.arguments import build_parser
from megatron_dapo.startup import build_configs
from megatron_dapo.trainer.loop import Rollout, Trainer, TrainerConfig
from tests.dist.actor_common import (
    load_hf_weights,
    make_samples,
    single_process_world,
)

ROLLOUT_STEPS = 25
MINIBATCHES = 3
LR, MIN_LR = 1e-3, 1e-4


def expected_lr(k: int, *, warmup: int, style: str, decay_steps: int | None) -> float:
    """LR of rollout step k (1-based), written out: lr * k / W while k <= W; then constant, or linear
    from lr at W to min_lr at decay_steps D, and min_lr after D."""
    if k <= warmup:
        return LR * k / warmup
    if style == "constant":
        return LR
    if k > decay_steps:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * (1.0 - (k - warmup) / (decay_steps - warmup))


@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=3)


def _trainer(world, flags: list[str]) -> Trainer:
    layout, hf, arch = world
    args = build_parser().parse_args(["--hf-checkpoint", "unused", "--prompt-data", "unused",
                                      "--num-steps", str(ROLLOUT_STEPS), "--lr", str(LR), "--min-lr", str(MIN_LR),
                                      "--max-response-length", "16", "--overlong-buffer-length", "4", *flags])
    actor_cfg, collect_cfg, _ = build_configs(args)
    actor = MegatronActor(arch, actor_cfg, layout)
    load_hf_weights(actor, hf)
    return Trainer(config=TrainerConfig(num_steps=ROLLOUT_STEPS), collect=collect_cfg, actor=actor,
                   engine=object(), next_prompts=lambda k: [], eval_prompts=[], decode=str, reward_fn=None,
                   logger=None)


@pytest.mark.parametrize("flags, warmup, style, decay_steps", [
    (["--lr-warmup-steps", "20"], 20, "constant", None),  # DAPO
    (["--lr-warmup-steps", "5", "--lr-decay-style", "linear", "--lr-decay-steps", "20"], 5, "linear", 20),
], ids=["dapo-warmup20-constant", "warmup5-linear-decay20"])
def test_every_optimizer_step_of_a_rollout_step_trains_at_the_formula_lr(world, flags, warmup, style,
                                                                          decay_steps):
    trainer = _trainer(world, flags)
    seen: list[tuple[int, float]] = []
    train_step = trainer.actor.train_step

    def recording_train_step(samples, *, rollout_step=None):
        metrics = train_step(samples, rollout_step=rollout_step)
        seen.append((rollout_step, metrics["lr"]))
        return metrics

    trainer.actor.train_step = recording_train_step
    for k in range(1, ROLLOUT_STEPS + 1):
        samples = make_samples(2 * MINIBATCHES, seed=k, with_old=False)
        rollouts = [Rollout(s, torch.zeros(s.response_len)) for s in samples]
        trainer.train([rollouts[i::MINIBATCHES] for i in range(MINIBATCHES)], k)
    assert len(seen) == ROLLOUT_STEPS * MINIBATCHES
    want = [(k, expected_lr(k, warmup=warmup, style=style, decay_steps=decay_steps))
            for k in range(1, ROLLOUT_STEPS + 1) for _ in range(MINIBATCHES)]
    assert [k for k, _ in seen] == [k for k, _ in want]
    assert [lr for _, lr in seen] == pytest.approx([lr for _, lr in want], rel=1e-12)
    assert seen[0][1] == pytest.approx(LR / warmup, rel=1e-12)  # rollout step 1 trains at lr x 1/W
    assert trainer.actor.scheduler.num_steps == ROLLOUT_STEPS  # what a checkpoint stores and a resume restores


def test_rollout_step_never_goes_back_and_none_is_a_step_of_its_own(world):
    actor = _trainer(world, ["--lr-warmup-steps", "4"]).actor
    samples = make_samples(2, seed=1, with_old=False)
    assert actor.train_step(samples)["lr"] == pytest.approx(LR / 4)           # None: rollout step 1
    assert actor.train_step(samples, rollout_step=3)["lr"] == pytest.approx(3 * LR / 4)
    assert actor.train_step(samples, rollout_step=3)["lr"] == pytest.approx(3 * LR / 4)
    with pytest.raises(ValueError, match="never go back"):
        actor.train_step(samples, rollout_step=2)


def test_decay_steps_must_exceed_warmup_and_errors_name_the_flags():
    base = ["--hf-checkpoint", "x", "--prompt-data", "x", "--max-response-length", "16",
            "--overlong-buffer-length", "4"]
    args = build_parser().parse_args([*base, "--num-steps", "10", "--lr-warmup-steps", "10",
                                      "--lr-decay-style", "cosine"])
    with pytest.raises(ValueError, match="--lr-decay-steps.*--num-steps.*--lr-warmup-steps"):
        build_configs(args)
    args = build_parser().parse_args([*base, "--num-steps", "10", "--lr-warmup-steps", "2",
                                      "--lr-decay-style", "linear"])
    assert build_configs(args)[0].lr_decay_steps == 10  # default: --num-steps
