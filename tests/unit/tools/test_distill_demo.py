"""tools/distill_demo.py: each arm's flags are the demo's plus its own, accepted by the trainer's start-up checks; the
curve and the responses-to-target read a metrics.jsonl as written."""

from __future__ import annotations

import json
import sys

from megatron_dapo.arguments import build_parser
from megatron_dapo.startup import build_configs
from tests.torchrun import REPO

sys.path.insert(0, str(REPO / "tools"))

import distill_demo  # noqa: E402
import golden_curve  # noqa: E402


def test_every_arm_is_the_demo_plus_its_own_flags_and_the_trainer_accepts_it():
    base = ["--hf-checkpoint", "b", "--prompt-data", "p", *golden_curve.demo_flags(), "--num-steps", "3"]
    demo = vars(build_parser().parse_args(base))
    for name, (kind, extra) in distill_demo.ARMS.items():
        teacher = distill_demo.teacher_flags(kind, REPO / "t", "http://127.0.0.1:1")
        args = build_parser().parse_args([*base, *teacher, *extra])
        _, _, trainer = build_configs(args)
        differ = {k for k, v in vars(args).items() if v != demo[k]}
        only = {"distill_coef", "distill_only", "dynamic_sampling"}
        expected = {"dapo": set(), "distill": {"teacher_load", *only}, "dapo+distill": {"teacher_load", "distill_coef"},
                    "distill@sglang": {"teacher_url", *only}}[name]
        assert differ == expected, name
        assert (trainer.distill is None) == (name == "dapo")
        assert trainer.distill is None or trainer.distill.only == (name in ("distill", "distill@sglang"))


def test_the_curve_counts_responses_up_to_each_evaluation(tmp_path):
    records = [{"step": 0, "eval/avg@4": 0.2}, {"step": 1, "rollout/responses": 128.0},
               {"step": 2, "rollout/responses": 160.0, "eval/avg@4": 0.5},
               {"step": 3, "rollout/responses": 128.0, "eval/avg@4": 0.95}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    points = distill_demo.curve(tmp_path)
    assert points == [{"step": 0, "responses": 0.0, "avg@4": 0.2}, {"step": 2, "responses": 288.0, "avg@4": 0.5},
                      {"step": 3, "responses": 416.0, "avg@4": 0.95}]
    assert distill_demo.to_target(points, 0.9) == 416.0
    assert distill_demo.to_target(points, 0.99) is None
