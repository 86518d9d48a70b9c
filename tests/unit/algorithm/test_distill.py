"""On-policy distillation (algorithm/distill.py): the per-token advantage and metrics against the formula written
out, the flags' refusals, the teacher's tokenizer check, and the planner's teacher row."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_dapo.algorithm.distill import DistillConfig, distill_advantages, distill_sums
from megatron_dapo.arguments import build_parser
from megatron_dapo.data.synthetic import build_char_tokenizer
from megatron_dapo.data.tokenizer_check import check_same_tokenizer
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.planner import stages
from megatron_dapo.startup import plan_from_flags
from tests.torchrun import REPO


def test_the_advantage_is_the_negative_reverse_kl_per_token():
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    teacher = torch.tensor([-0.5, -2.5, -0.5, -1.0])
    adv = distill_advantages(old, teacher, 0.5)
    assert adv.tolist() == pytest.approx([0.5 * (t - o) for o, t in zip(old.tolist(), teacher.tolist(), strict=True)])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])
    sums = distill_sums(old, teacher, mask, 0.5)
    rkl = [(o - t) for o, t, m in zip(old.tolist(), teacher.tolist(), mask.tolist(), strict=True) if m]
    assert sums["tokens"] == 3
    assert sums["reverse_kl"] == pytest.approx(sum(rkl))
    assert sums["advantage"] == pytest.approx(-0.5 * sum(rkl))
    assert sums["teacher_logprob"] == pytest.approx(-0.5 - 2.5 - 1.0)


def _configs(*flags: str):
    from megatron_dapo.startup import build_configs

    return build_configs(build_parser().parse_args(["--hf-checkpoint", "x", "--prompt-data", "y", "--num-steps",
                                                    "2", *flags]))


def test_flags_build_the_config_and_refuse_what_cannot_run():
    _, _, trainer = _configs("--teacher-load", "t", "--distill-coef", "0.5")
    assert trainer.distill == DistillConfig(coef=0.5)
    _, _, only = _configs("--teacher-load", "t", "--distill-coef", "1", "--distill-only", "--no-dynamic-sampling")
    assert only.distill == DistillConfig(coef=1.0, only=True)
    assert _configs()[2].distill is None
    with pytest.raises(UserError, match="--distill-coef need a teacher: --teacher-load"):
        _configs("--distill-coef", "0.5")
    with pytest.raises(UserError, match="--distill-only need a teacher"):
        _configs("--distill-only")
    with pytest.raises((UserError, ValueError), match=r"--distill-coef\) must be a finite number > 0"):
        _configs("--teacher-load", "t")
    with pytest.raises(UserError, match="pass --no-dynamic-sampling"):
        _configs("--teacher-load", "t", "--distill-coef", "1", "--distill-only")


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path):
    student = build_char_tokenizer(str(tmp_path / "student"))
    build_char_tokenizer(str(tmp_path / "same"))
    check_same_tokenizer(student, str(tmp_path / "same"), flag="--teacher-load same")
    other = tmp_path / "other"
    build_char_tokenizer(str(other))
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two characters swap ids: same size, other text
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match=rf"--teacher-load o: its tokenizer \({other}: 80 tokens, eos id 0\) is not "
                                        r"the student's \(.*: 80 tokens, eos id 0; 2 tokens differ\)"):
        check_same_tokenizer(student, str(other), flag="--teacher-load o")
    with pytest.raises(UserError, match="no tokenizer could be read from"):
        check_same_tokenizer(student, str(tmp_path), flag="--teacher-load x")


def test_the_plan_gains_the_teachers_weights_on_the_students_layout():
    """Qwen2.5-32B teaching Qwen2.5-7B at TP4 x DP8: the teacher's 32.8e9 parameters split over the student's TP4
    (8.2e9 x 2 B = 15.3 GiB per GPU), beside the student's own 3.5 GiB of weights."""
    flags = ["--hf-checkpoint", str(REPO / "examples/models/qwen2.5-7B"), "--prompt-data", "p", "--num-steps", "1",
             "--world-size", "32", "--tensor-model-parallel-size", "4", "--max-tokens-per-micro-batch", "8192",
             "--teacher-load", str(REPO / "examples/models/qwen2.5-32B"), "--distill-coef", "1"]
    plan = plan_from_flags(build_parser().parse_args(flags), ModelArch.from_hf(REPO / "examples/models/qwen2.5-7B"))
    (stage,) = stages.plan_stages(plan.arch, plan.layout, plan.inputs, plan.spec)
    row = next(k for k in stage.lines if k.startswith("teacher model weights"))
    assert row == "teacher model weights (frozen, bfloat16, qwen2 64 layers)"
    teacher = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    assert stage.lines[row] == stages.stage_parameters(teacher, plan.layout, 0) * 2
    assert 15.0 < stage.lines[row] / 2**30 < 15.6, stage.lines[row] / 2**30
    # PP 7 splits the student's 28 layers, not the teacher's 64: refused, naming the teacher
    seven = plan_from_flags(build_parser().parse_args(flags + ["--pipeline-model-parallel-size", "7", "--world-size",
                                                               "7", "--tensor-model-parallel-size", "1"]),
                            ModelArch.from_hf(REPO / "examples/models/qwen2.5-7B"))
    with pytest.raises(ValueError, match="--teacher-load: its qwen2 on the actor's layout"):
        stages.plan_stages(seven.arch, seven.layout, seven.inputs, seven.spec)
