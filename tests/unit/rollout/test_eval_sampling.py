"""Evaluation sampling is its own setting (DAPO, arXiv 2503.14476 Sec. 4.1: AIME avg@32 at temperature 1.0,
top-p 0.7, responses up to 20480 tokens): the trainer's and tools/eval.py's eval requests carry it."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.rollout.evaluation import evaluate
from megatron_dapo.rollout.types import RolloutRequest, Sample
from megatron_dapo.startup import build_configs
from megatron_dapo.trainer.loop import Trainer
from tests import sim_engine as sim
from tests.sim_engine import LengthLatencyEngine
from tests.torchrun import REPO

REPO_FLAGS = ["--hf-checkpoint", "unused", "--prompt-data", "unused", "--num-steps", "1",
              "--max-response-length", "64", "--overlong-buffer-length", "16", "--rollout-top-p", "1.0",
              "--eval-interval", "1", "--n-samples-per-eval-prompt", "4"]


class RecordingEngine(LengthLatencyEngine):
    def __init__(self) -> None:
        super().__init__(keep_rate=0.5, truncate_prob=0.0)
        self.requests: list[RolloutRequest] = []

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        self.requests += requests
        return super().stream(requests)


def test_trainer_eval_requests_carry_the_eval_flags():
    args = build_parser().parse_args([*REPO_FLAGS, "--eval-temperature", "1.0", "--eval-top-p", "0.7",
                                      "--eval-max-response-length", "20480"])
    _, collect, trainer_cfg = build_configs(args, eos_ids=(7,))
    assert collect.sampling.top_p == 1.0 and collect.sampling.max_new_tokens == 64  # rollouts keep theirs
    engine = RecordingEngine()
    trainer = Trainer(config=trainer_cfg, collect=collect, actor=None, engine=engine, next_prompts=lambda k: [],
                      eval_prompts=sim.prompts(3), decode=sim.decode, reward_fn=sim.reward, logger=None)
    metrics = trainer.evaluate()
    assert "eval/avg@4" in metrics
    assert len(engine.requests) == 3
    for req in engine.requests:
        s = req.sampling
        assert (s.temperature, s.top_p, s.max_new_tokens, s.stop_token_ids, req.n) == (1.0, 0.7, 20480, (7,), 4)


def test_eval_max_response_length_defaults_to_max_response_length_and_is_validated():
    _, _, trainer_cfg = build_configs(build_parser().parse_args(REPO_FLAGS))
    assert (trainer_cfg.eval_sampling.max_new_tokens, trainer_cfg.eval_sampling.top_p) == (64, 1.0)
    with pytest.raises(ValueError, match="--eval-top-p"):
        build_configs(build_parser().parse_args([*REPO_FLAGS, "--eval-top-p", "0"]))
    with pytest.raises(ValueError, match="--eval-max-response-length"):
        build_configs(build_parser().parse_args([*REPO_FLAGS, "--eval-max-response-length", "0"]))


def _eval_tool():
    path = REPO / "tools" / "eval.py"
    spec = importlib.util.spec_from_file_location("tools_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flags", [
    ["--eval-temperature", "1.0", "--eval-top-p", "0.7", "--eval-max-response-length", "20480"],
    ["--temperature", "1.0", "--top-p", "0.7", "--max-new-tokens", "20480"],  # the older names
], ids=["eval-names", "older-names"])
def test_eval_tool_requests_carry_its_sampling_flags(flags):
    tool = _eval_tool()
    args = tool.build_parser().parse_args(["--model", "m", "--data", "d", "--k", "2", *flags])
    engine = RecordingEngine()
    evaluate(engine, sim.prompts(2), sim.decode, sim.reward, n_samples=args.k, sampling=tool.eval_sampling(args))
    assert [(r.sampling.temperature, r.sampling.top_p, r.sampling.max_new_tokens, r.n) for r in engine.requests] \
        == [(1.0, 0.7, 20480, 2)] * 2
    with pytest.raises(SystemExit, match="--eval-top-p"):
        tool.eval_sampling(tool.build_parser().parse_args(["--model", "m", "--data", "d", "--eval-top-p", "1.5"]))
