"""The ablation: its task (values against Python's own % and //), its held-out statistics (against the samples
counted by hand), its arms (each adds exactly one technique, and the trainer's parser takes every flag), its
summary maths, and the tool's plumbing end to end on 2 steps with the real trainer (tools/ablation.py)."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import subprocess
import sys

import pytest

from megatron_dapo.arguments import build_parser
from megatron_dapo.data.records import PromptRecord
from megatron_dapo.data.remainder import (
    ABLATION_MAX_RESPONSE_LENGTH,
    RemainderTask,
    WarmupStyle,
    make_remainder_problems,
    parse_prompt,
    solution_lines,
    solution_text,
    sound_so_far,
    warmup_response,
)
from megatron_dapo.reward import compute_score
from megatron_dapo.rollout.remainder_eval import has_repeat, remainder_sample_stats
from megatron_dapo.rollout.types import Sample
from tests.torchrun import REPO, subprocess_env

spec = importlib.util.spec_from_file_location("ablation", REPO / "tools" / "ablation.py")
ablation = importlib.util.module_from_spec(spec)
sys.modules["ablation"] = ablation  # dataclasses look their module up by name
spec.loader.exec_module(ablation)


# ---- the task ---------------------------------------------------------------------------------------------

def test_problems_answer_python_remainder_and_solutions_take_a_div_b_lines():
    for r in make_remainder_problems(300, seed=3):
        a, b = r.extra["a"], r.extra["b"]
        assert r.ground_truth == str(a % b)
        assert r.messages == [{"role": "user", "content": f"{a} mod {b}="}]
        assert parse_prompt(r.messages[0]["content"]) == (a, b)
        lines = solution_lines(a, b)
        assert len(lines) == a // b + 1
        assert lines[-1] == f"Answer: {a % b}"
        assert compute_score(solution_text(a, b), r.ground_truth).acc


def test_solution_lengths_span_the_range_the_limit_cuts():
    task = RemainderTask()
    lengths = {(a, b): len(solution_text(a, b)) for a in range(task.min_dividend, task.max_dividend + 1)
               for b in range(task.min_divisor, task.max_divisor + 1)}
    assert min(lengths.values()) < 30
    assert max(lengths.values()) > ABLATION_MAX_RESPONSE_LENGTH  # some sound solutions cannot fit
    too_long = sum(v > ABLATION_MAX_RESPONSE_LENGTH for v in lengths.values()) / len(lengths)
    assert 0.01 < too_long < 0.1


def test_clean_warmup_is_the_solution_and_slips_carry_forward():
    rng = random.Random(0)
    clean = WarmupStyle(early_stop_prob=0.0, error_prob=0.0, ramble_prob=0.0)
    assert all(warmup_response(a, b, rng, clean) == solution_text(a, b) for a, b in [(47, 6), (10, 9), (99, 4)])
    always = WarmupStyle(early_stop_prob=0.0, error_prob=1.0, ramble_prob=0.0)
    text = warmup_response(47, 6, random.Random(1), always)
    lines = text.strip().split("\n")
    for line, nxt in zip(lines, lines[1:-1]):  # each line starts from the value the one before wrote
        assert nxt.split("-")[0] == line.split("=")[1]
    assert not sound_so_far(text + "\n", 47, 6)


def test_endless_rambler_is_cut_at_the_limit_without_an_answer():
    style = WarmupStyle(early_stop_prob=0.0, error_prob=0.0, ramble_prob=1.0, endless_prob=1.0)
    text = warmup_response(47, 6, random.Random(2), style)
    assert len(text) == style.max_chars
    assert "Answer" not in text
    assert has_repeat(text)


def test_sound_so_far_allows_repeats_and_ignores_a_cut_last_line():
    lines = solution_lines(47, 6)
    assert sound_so_far("\n" + "\n".join(lines[:3]) + "\n", 47, 6)
    assert sound_so_far("\n" + lines[0] + "\n" + lines[0] + "\n" + lines[1] + "\n3", 47, 6)
    assert not sound_so_far("\n" + lines[0] + "\n41-6=34\n", 47, 6)
    assert not sound_so_far("\n" + lines[1] + "\n", 47, 6)  # skipped a step
    with pytest.raises(ValueError, match="mod"):
        parse_prompt("47+6=")


@pytest.mark.parametrize("field,value", [("error_prob", 1.5), ("ramble_prob", -0.1), ("ramble_error_factor", 0.5)])
def test_warmup_style_refuses_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        WarmupStyle(**{field: value})


def test_task_refuses_bad_ranges():
    with pytest.raises(ValueError, match="divisor"):
        RemainderTask(min_divisor=1)
    with pytest.raises(ValueError, match="dividend"):
        RemainderTask(min_dividend=50, max_dividend=20)


# ---- held-out statistics ----------------------------------------------------------------------------------

class _Tokenizer:
    """Characters as ids 100+ord; eos 0."""

    eos_token_id = 0
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [100 + ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 100) for i in ids if i >= 100)


class _ScriptedEngine:
    """Returns the given response texts (and log-probs) for each request, in order."""

    def __init__(self, texts: list[list[tuple[str, str, float]]]) -> None:
        self.texts = texts

    def generate(self, requests):
        tok = _Tokenizer()
        out = []
        for req, texts in zip(requests, self.texts):
            out.append([Sample(request_id=req.request_id, index=i, prompt_ids=req.prompt_ids,
                               response_ids=tok.encode(t), logprobs=[lp] * len(t), finish_reason=reason,
                               weight_version=0) for i, (t, reason, lp) in enumerate(texts)])
        return out


def test_sample_stats_count_what_the_samples_hold():
    right = solution_text(47, 6)
    cut = "\n" + "\n".join(solution_lines(47, 6)[:2]) + "\n35-"  # sound work, cut mid-line
    wrong_cut = "\n47-6=40\n40-6=34\n"
    rambler = "\n10-4=6\n10-4=6\n6-4=2\nAnswer: 2"
    records = [PromptRecord(messages=[{"role": "user", "content": f"{a} mod {b}="}], ground_truth=str(a % b),
                            data_source="t", index=i, extra={"a": a, "b": b})
               for i, (a, b) in enumerate([(47, 6), (10, 4)])]
    engine = _ScriptedEngine([[(right, "stop", -0.5), (cut, "length", -1.0)],
                              [(wrong_cut, "length", -2.0), (rambler, "stop", -0.1)]])
    stats = remainder_sample_stats(engine, _Tokenizer(), records, k=2, max_new_tokens=160, seed=1)
    texts = [right, cut, wrong_cut, rambler]
    assert stats["avg@2"] == pytest.approx(0.5)  # right and rambler
    assert stats["truncated"] == pytest.approx(0.5)
    assert stats["sound_truncated"] == pytest.approx(0.25)
    assert stats["repeat"] == pytest.approx(0.25)
    assert stats["len_mean"] == pytest.approx(statistics.fmean(map(len, texts)))
    assert stats["len_max"] == max(map(len, texts))
    tokens = sum(map(len, texts))
    nll = 0.5 * len(right) + 1.0 * len(cut) + 2.0 * len(wrong_cut) + 0.1 * len(rambler)
    assert stats["entropy"] == pytest.approx(nll / tokens)
    assert stats["acc_7_13"] == pytest.approx(0.5)  # 47 // 6 = 7 lines: right, cut
    assert stats["acc_1_6"] == pytest.approx(0.5)  # 10 // 4 = 2 lines: wrong_cut, rambler


# ---- the arms and the summary -----------------------------------------------------------------------------

def _parsed(arm):
    argv = ablation.train_command(arm, 1, REPO / "runs" / "x", REPO / "data" / "remainder-base", ablation.Schedule())
    return build_parser().parse_args(argv[3:])


def test_every_arm_parses_and_each_adds_exactly_its_technique():
    fields = ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "overlong_filter", "overlong_buffer_length",
              "dynamic_sampling")
    parsed = [{f: getattr(_parsed(arm), f) for f in fields} for arm in ablation.ARMS]
    assert parsed[0] == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "seq-mean-token-mean",
                         "overlong_filter": False, "overlong_buffer_length": 0, "dynamic_sampling": False}
    added = {"filter": "overlong_filter", "clip_higher": "clip_ratio_high", "soft_punish": "overlong_buffer_length",
             "token_loss": "loss_agg_mode", "dapo": "dynamic_sampling"}
    for before, after, arm in zip(parsed, parsed[1:], ablation.ARMS[1:]):
        assert {f for f in fields if before[f] != after[f]} == {added[arm.key]}
    assert parsed[-1] == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean",
                          "overlong_filter": True, "overlong_buffer_length": 32, "dynamic_sampling": True}
    assert [a.paper_aime for a in ablation.ARMS] == [30, 36, 38, 41, 42, 50]


def test_runs_resume_from_their_own_checkpoints():
    args = _parsed(ablation.ARMS[0])
    assert args.load == args.save and args.save_interval > 0 and args.export_hf


def test_summary_maths():
    assert ablation.mean_std([1.0, 2.0, 4.0]) == (statistics.fmean([1, 2, 4]), statistics.stdev([1, 2, 4]))
    assert ablation.mean_std([3.0]) == (3.0, 0.0)
    assert ablation.steps_to([0.1, 0.5, 0.9, 0.9, 0.9], 0.7) == 4  # running mean of 3: 0.5, 0.767 at step 4
    assert ablation.steps_to([0.1, 0.2], 0.9) is None
    assert ablation.late_mean([0.0, 0.0, 1.0, 3.0]) == 2.0


def test_an_early_stop_answers_a_number_not_below_b():
    style = WarmupStyle(early_stop_prob=1.0, error_prob=0.0, ramble_prob=0.0)
    for a, b in [(47, 6), (99, 4), (10, 9), (13, 7)]:
        text = warmup_response(a, b, random.Random(0), style)
        answer = int(text.rsplit("Answer: ", 1)[1])
        assert b <= answer < 2 * b and answer % b == a % b
        assert not compute_score(text, str(a % b)).acc


# ---- the tool end to end ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_tool_runs_two_arms_on_two_steps_and_resumes(tmp_path):
    """Two arms, one seed, 2 steps, 8 held-out problems: every output is there and agrees with the runs'
    own files; a second call finds the runs done; a run whose training was cut after its last checkpoint
    resumes from it (no step trained again) and gives the same held-out numbers."""
    out = tmp_path / "ablation"
    cmd = [sys.executable, "tools/ablation.py", "--arms", "naive,dapo", "--seeds", "1", "--steps", "2",
           "--eval-prompts", "8", "--out", str(out)]
    subprocess.run(cmd, cwd=REPO, env=subprocess_env(), check=True, capture_output=True, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["arms"]) == {"naive", "dapo"}
    for key in ("naive", "dapo"):
        run = out / f"{key}-seed1"
        steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [s["step"] for s in steps] == [1, 2]
        heldout = json.loads((run / "heldout.json").read_text())
        assert 0.0 <= heldout["avg@4"] <= 1.0 and heldout["len_max"] <= ABLATION_MAX_RESPONSE_LENGTH
        metrics = summary["arms"][key]["metrics"]
        assert metrics["heldout_avg@4"] == [heldout["avg@4"], 0.0]
        late = statistics.fmean(s["train/entropy"] for s in steps[1:])
        assert metrics["entropy_late"][0] == pytest.approx(late)
        assert metrics["generated"][0] == sum(s["rollout/responses"] for s in steps)
    # the arms differ where their flags say: naive trains on every group it drew, DAPO asks 1.5x and keeps 16
    assert summary["arms"]["naive"]["metrics"]["generated"][0] == 2 * 16 * 8
    dapo_steps = [json.loads(line) for line in (out / "dapo-seed1" / "metrics.jsonl").read_text().splitlines()]
    assert all(s["dynamic_sampling/kept_groups"] == 16 and s["dynamic_sampling/requested_groups"] >= 24
               for s in dapo_steps)
    table = (out / "table.md").read_text()
    assert "| naive GRPO | 30 |" in table and "| + dynamic sampling (DAPO) | 50 |" in table
    assert (out / "ablation.png").stat().st_size > 10_000

    again = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), check=True, capture_output=True, text=True,
                           timeout=300)
    assert "naive seed 1 done" in again.stdout
    assert json.loads((out / "naive-seed1" / "timing.json").read_text())["attempts"] == 1  # not run again

    run = out / "dapo-seed1"
    lines_before = (run / "metrics.jsonl").read_text()
    heldout_before = json.loads((run / "heldout.json").read_text())
    (run / "train.done").unlink()
    (run / "heldout.json").unlink()
    subprocess.run(cmd, cwd=REPO, env=subprocess_env(), check=True, capture_output=True, timeout=600)
    assert (run / "metrics.jsonl").read_text() == lines_before  # resumed at step 2: nothing trained again
    assert json.loads((run / "timing.json").read_text())["attempts"] == 2
    assert json.loads((run / "heldout.json").read_text()) == heldout_before


def test_bad_flags_name_the_flag(tmp_path):
    cmd = [sys.executable, "tools/ablation.py", "--arms", "naive,nope", "--out", str(tmp_path)]
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--arms: unknown arm(s) ['nope']" in result.stderr
    cmd = [sys.executable, "tools/ablation.py", "--base", str(tmp_path), "--out", str(tmp_path / "o")]
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--task remainder" in result.stderr
