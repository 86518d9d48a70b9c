"""Issue 38 probes of the tools around the trainer: huge answers through tools/eval.py (item 7), the Slurm job
scripts' NODES and interpreter paths (item 13), a killed tools/ablation.py and its rerun (item 14)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.probes.case import PY, Case, Outcome, one_line_error
from tests.torchrun import REPO, subprocess_env

# ---- 38.7: answers longer than Python's int-string limit ---------------------------------------------------

HUGE_JSON_INT = "8" + "1234567890" * 500  # 5,001 digits, a JSON number
HUGE_STRING = "7" * 100_000  # 100,000 digits, a JSON string


def _tiny_base(workdir: Path) -> None:
    """A tiny Qwen2 and its character tokenizer (tools/make_tiny_base.py, one warm-up step: seconds)."""
    subprocess.run([PY, "tools/make_tiny_base.py", "--out", str(workdir / "base"), "--sft-steps", "1", "--num-train",
                    "4", "--num-eval", "2", "--hidden-size", "16", "--ffn-hidden-size", "32", "--num-heads", "2",
                    "--num-kv-heads", "1", "--num-layers", "1", "--sft-batch-size", "2"],
                   cwd=REPO, env=subprocess_env(), check=True, capture_output=True, timeout=300)


def _huge_answer_data(answer_json: str):
    def setup(workdir: Path) -> None:
        _tiny_base(workdir)
        # the answer's JSON text spliced in as is: json.dumps cannot write an int this long either
        row = '{"prompt": [{"role": "user", "content": "49+22="}], "reward_model": {"ground_truth": ' + answer_json
        (workdir / "huge.jsonl").write_text(row + "}}\n")
    return setup


def _eval(reward_fn: str):
    def argv(workdir: Path) -> list[str]:
        return [PY, "tools/eval.py", "--model", str(workdir / "base" / "model"), "--data", str(workdir / "huge.jsonl"),
                "--k", "1", "--max-new-tokens", "4", "--reward-fn", reward_fn, "--output", str(workdir / "eval.json")]
    return argv


def _scored(out: Outcome) -> str | None:
    """Exit 0, no traceback, and the one prompt evaluated (avg@1 of 0 or 1)."""
    if "Traceback (most recent call last)" in out.stderr or out.returncode != 0:
        lines = out.stderr.strip().splitlines() or ["no output"]
        return f"exit {out.returncode}: {lines[-1][:200]}"
    result = json.loads((out.workdir / "eval.json").read_text())
    if result.get("prompts") != 1 or result.get("avg@1") not in (0.0, 1.0):
        return f"unexpected result {result}"
    return None


# ---- 38.13: the Slurm job's node count and interpreter paths -----------------------------------------------

SRUN_RUNS_THE_STEP = """#!/usr/bin/env bash
# srun stand-in: runs the step's script here as its task 0, with a recording $PY
while [[ $# -gt 0 && "$1" != bash ]]; do shift; done
PY={recorder} SLURM_PROCID=0 SLURM_STEP_NUM_NODES=1 exec "$@"
"""
SCONTROL = '#!/bin/sh\n[ "$1" = show ] && [ "$2" = hostnames ] && echo "$3" | tr "," "\\n"\n'
RECORDER = """#!{python}
import json, sys
json.dump(sys.argv[1:], open({out!r}, "w"))
"""


def _spaced(workdir: Path) -> Path:
    return workdir / "with space" / "venv" / "bin" / Path(sys.executable).name


def _slurm_stand_ins(workdir: Path) -> None:
    """bin/srun (runs the step here), bin/scontrol, a recording $PY at a path with a space, and the trainer's own
    venv under a directory with a space."""
    recorder = workdir / "rec py" / "py"
    recorder.parent.mkdir()
    recorder.write_text(RECORDER.format(python=sys.executable, out=str(workdir / "rollout-node-argv.json")))
    (workdir / "bin").mkdir()
    (workdir / "bin" / "srun").write_text(SRUN_RUNS_THE_STEP.format(recorder=_quoted(recorder)))
    (workdir / "bin" / "scontrol").write_text(SCONTROL)
    for f in (recorder, workdir / "bin" / "srun", workdir / "bin" / "scontrol"):
        f.chmod(0o755)
    (workdir / "with space").mkdir()
    (workdir / "with space" / "venv").symlink_to(Path(sys.executable).parent.parent)


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def _split_job(workdir: Path) -> list[str]:
    nodes = ",".join(f"gpu{i:03d}" for i in range(16))
    return ["env", f"PATH={workdir / 'bin'}{os.pathsep}{os.environ['PATH']}", f"PY={_spaced(workdir)}",
            "SLURM_JOB_ID=4242", f"SLURM_JOB_NODELIST={nodes}", "SLURM_GPUS_ON_NODE=8", "MASTER_ADDR=127.0.0.1",
            "SERVER_WAIT_S=30", "bash", "examples/slurm/split.sbatch", "qwen2.5-32b", "/models/fake",
            str(workdir / "run")]


def _python_reached_whole(out: Outcome) -> str | None:
    """The rollout step's supervisor got --sglang-python as the one path, and its arguments parse."""
    from megatron_dapo.launch.rollout_node import build_parser

    path = out.workdir / "rollout-node-argv.json"
    if not path.is_file():
        return f"the rollout step never ran the supervisor (exit {out.returncode}: {out.stderr.strip()[-200:]})"
    argv = json.loads(path.read_text())
    if argv[:2] != ["-m", "megatron_dapo.launch.rollout_node"]:
        return f"unexpected command {argv[:4]}"
    try:
        args, extra = build_parser().parse_known_args(argv[2:])
    except SystemExit:
        return f"the supervisor's arguments do not parse: {argv[2:]}"
    if extra or args.sglang_python != str(_spaced(out.workdir)):
        return f"--sglang-python {args.sglang_python!r} and stray words {extra} (the path was split)"
    return None


# ---- 38.14: tools/ablation.py SIGKILLed, then run again ------------------------------------------------------

KILL_AND_RERUN = r'''
"""Start tools/ablation.py (24 steps, a checkpoint every 10), SIGKILL it once its trainer logged step 11, check
that the trainer is gone and logged nothing more, run the same command again."""
import json, os, signal, subprocess, sys, time
from pathlib import Path

repo, out = Path(sys.argv[1]), Path(sys.argv[2])
cmd = [sys.executable, "tools/ablation.py", "--arms", "naive", "--seeds", "1", "--steps", "24", "--eval-prompts",
       "4", "--out", str(out)]


def trainers_of(ppid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if int(stat[1]) == ppid and stat[0] != "Z" and b"megatron_dapo.train" in cmdline:
            found.append(int(entry))
    return found


def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


tool = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
metrics = out / "naive-seed1" / "metrics.jsonl"
deadline = time.monotonic() + 400
while not (metrics.is_file() and metrics.read_text().count("\n") >= 11):
    if tool.poll() is not None or time.monotonic() > deadline:
        print(f"BAD the first run ended (exit {tool.returncode}) before its trainer logged step 11")
        sys.exit(1)
    time.sleep(0.05)
trainers = trainers_of(tool.pid)
tool.send_signal(signal.SIGKILL)
tool.wait()
logged = metrics.read_bytes()
deadline = time.monotonic() + 15
while any(map(alive, trainers)) and time.monotonic() < deadline:
    time.sleep(0.05)
orphans = [p for p in trainers if alive(p)]
grew = metrics.read_bytes() != logged
for p in orphans:  # clean up by pid
    os.kill(p, signal.SIGKILL)
if orphans or grew:
    print(f"BAD the trainer {trainers} outlived its SIGKILLed tools/ablation.py (still running after 15 s: "
          f"{orphans}; logged more steps: {grew})")
    sys.exit(1)
rerun = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=500)
print(json.dumps({"trainers": trainers, "rc": rerun.returncode, "stderr": rerun.stderr[-3000:]}))
'''


def _write_driver(workdir: Path) -> None:
    (workdir / "kill_and_rerun.py").write_text(KILL_AND_RERUN)


def _rerun_is_one_clean_run(out: Outcome) -> str | None:
    """The killed tool's trainer died with it; the rerun finished (exit 0, no traceback), resumed from step 10: its
    metrics.jsonl holds steps 1-24 once, the killed attempt's step 11 apart, and its wall time is the rerun's plus
    the trainer's own time of steps 1-10."""
    lines = out.stdout.strip().splitlines()
    if not lines or lines[-1].startswith("BAD") or out.returncode != 0:
        return (lines[-1] if lines else f"no output (exit {out.returncode}: {out.stderr.strip()[-200:]})")[:300]
    rerun = json.loads(lines[-1])
    if not rerun["trainers"]:
        return "no trainer found under the first tools/ablation.py"
    if rerun["rc"] != 0 or "Traceback" in rerun["stderr"]:
        return f"the rerun exited {rerun['rc']}: {rerun['stderr'].strip().splitlines()[-1:]}"
    run = out.workdir / "ablation" / "naive-seed1"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if [r["step"] for r in records] != list(range(1, 25)):
        return f"metrics.jsonl holds steps {[r['step'] for r in records]}, not 1-24 once"
    aborted = [json.loads(line) for line in (run / "metrics.aborted.jsonl").read_text().splitlines()
               if line.startswith('{"step": 11,') and line.endswith("}")]
    if not aborted:
        return "the killed attempt's step 11 is not in metrics.aborted.jsonl"
    timing = json.loads((run / "timing.json").read_text())
    first_ten = sum(r["time/step_s"] for r in records[:10])
    if timing["attempts"] != 2 or abs(timing["train_s"] - timing["spent_s"] - first_ten) > 1e-6 * timing["train_s"]:
        return f"timing.json {timing}: not 2 attempts, or train_s is not the rerun's {timing.get('spent_s')} s plus " \
               f"steps 1-10's {first_ten:.3f} s"
    return None


CASES = [
    Case(name="38.7 a 5,001-digit JSON number as the answer loads and is scored (tools/eval.py)",
         setup=_huge_answer_data(HUGE_JSON_INT), argv=_eval("math_dapo"), check=_scored, timeout_s=300),
    Case(name="38.7 a 100,000-digit answer under --reward-fn last_number is scored (tools/eval.py)",
         setup=_huge_answer_data(json.dumps(HUGE_STRING)), argv=_eval("last_number"), check=_scored, timeout_s=300),
    Case(name="38.13 DRY_RUN=1 NODES=0 bash examples/slurm/split.sbatch is refused naming NODES",
         argv=lambda w: ["bash", "examples/slurm/split.sbatch", "qwen2.5-32b"], env={"DRY_RUN": "1", "NODES": "0"},
         check=one_line_error(r"NODES='0' must be a whole number from 1 to 99999"), timeout_s=120),
    Case(name="38.13 DRY_RUN=1 NODES=abc bash examples/slurm/colocated.sbatch is refused naming NODES",
         argv=lambda w: ["bash", "examples/slurm/colocated.sbatch", "qwen2.5-32b-colocated"],
         env={"DRY_RUN": "1", "NODES": "abc"},
         check=one_line_error(r"NODES='abc' must be a whole number from 1 to 99999"), timeout_s=120),
    Case(name="38.13 a PY path with a space reaches the rollout node's supervisor whole (split.sbatch, srun stand-in)",
         setup=_slurm_stand_ins, argv=_split_job, check=_python_reached_whole, timeout_s=300),
    Case(name="38.14 a SIGKILLed tools/ablation.py takes its trainer along; the rerun is one clean run",
         setup=_write_driver, argv=lambda w: [PY, str(w / "kill_and_rerun.py"), str(REPO), str(w / "ablation")],
         check=_rerun_is_one_clean_run, timeout_s=900),
]
