"""The golden curve: the demo's first 10 steps of metrics at seed 1234 equal the stored ones within 1e-5 relative
(counts exactly), on any x86_64 machine.

tests/golden/demo_curve_<machine>-<vendor>.json is recorded by `tools/golden_curve.py --write` under pinned kernels
(golden_curve.PINNED_ENV: ATen's `default` capability, MKL's CNR branch COMPATIBLE), the same for the recording and
every check whatever the CPU dispatches natively or the caller sets (one recording per CPU vendor: MKL's branch
gives Intel and AMD CPUs different bits); a change that alters what the trainer computes
fails here, naming each metric that moved. Rewrite the file only for a change meant to alter behaviour (or a
deliberate torch upgrade), and say so in its commit. The run's flags are the demo script's own
(examples/run_embedded_demo.sh), read from it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from megatron_dapo.arguments import build_parser
from tests.torchrun import REPO

sys.path.insert(0, str(REPO / "tools"))

import golden_curve  # noqa: E402

FAKE_PY = """#!/usr/bin/env python3
import json, sys
sys.stdin.read()  # the script's last call reads a program from its here-document
with open({out!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""

DEMO_ONLY = {"eval_prompt_data", "eval_interval", "n_samples_per_eval_prompt", "eval_max_prompts", "num_steps",
             "log_dir", "save", "save_interval", "export_hf", "no_wandb", "no_progress"}
"""The parsed options the golden run leaves out or sets otherwise than the demo: evaluation, checkpoints, export,
the step count and the logging."""


def test_differences_name_each_departure():
    golden = [{"step": 1, "rollout/responses": 160.0, "train/pg_loss": -0.0012, "train/lr": 1e-4}]
    same = [dict(golden[0])]
    assert golden_curve.differences(golden, same) == []
    moved = [{"step": 1, "rollout/responses": 161.0, "train/pg_loss": -0.0012 * (1 + 1e-3), "train/extra": 1.0}]
    assert golden_curve.differences(golden, moved) == [
        "step 1: metrics missing: ['train/lr']",
        "step 1: metrics not in the golden curve: ['train/extra']",
        "step 1: rollout/responses = 161.0, golden 160.0",
        f"step 1: train/pg_loss = {moved[0]['train/pg_loss']!r}, golden -0.0012",
    ]
    assert golden_curve.differences(golden, []) == ["0 steps logged, the golden curve has 1"]


def test_the_golden_run_trains_as_the_demo_script(tmp_path):
    """examples/run_embedded_demo.sh, run with a stand-in $PY that records each call: its trainer command line and
    the golden run's parse to the same options but for evaluation, checkpoints, export, steps and logging."""
    calls, fake = tmp_path / "calls.jsonl", tmp_path / "python"
    fake.write_text(FAKE_PY.format(out=str(calls)))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    base = tmp_path / "base"
    (base / "model").mkdir(parents=True)
    (base / "model" / "config.json").write_text("{}")  # the script builds no base where one exists
    subprocess.run(["bash", "examples/run_embedded_demo.sh", str(tmp_path / "run"), str(base), "7"],
                   cwd=golden_curve.REPO, env=os.environ | {"PY": str(fake)}, check=True, capture_output=True,
                   stdin=subprocess.DEVNULL, timeout=60)
    trains = [c for c in map(json.loads, calls.read_text().splitlines()) if c[:2] == ["-m", "megatron_dapo.train"]]
    assert len(trains) == 1, trains
    demo = vars(build_parser().parse_args(trains[0][2:]))
    golden = vars(build_parser().parse_args(golden_curve.train_command(base, tmp_path / "log")[3:]))
    assert set(demo) == set(golden)
    differing = {k for k in demo if demo[k] != golden[k]}
    assert differing <= DEMO_ONLY, differing - DEMO_ONLY
    assert {"eval_prompt_data", "save", "export_hf", "num_steps"} <= differing  # the demo's own part is seen
    assert golden["seed"] == 1234 and golden["num_steps"] == golden_curve.NUM_STEPS
    flags = golden_curve.demo_flags()
    i = trains[0].index(flags[0])
    assert trains[0][i:i + len(flags)] == flags  # the arrays as the executed script passes them


def test_pinned_kernels_override_the_callers(monkeypatch):
    """A caller's ATEN_CPU_CAPABILITY / MKL_CBWR / thread count do not reach the golden runs: the process reports
    ATen's DEFAULT kernels and MKL's COMPATIBLE branch (MKL_VERBOSE), as on the recording."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    now = golden_curve.kernels()
    assert (now["cpu_capability"], now["mkl_cnr"]) == ("DEFAULT", "COMPATIBLE"), \
        f"{now}: the pinned kernels did not take (a torch without MKL, as on aarch64, has no CNR branch)"
    recorded = json.loads(golden_curve.golden_path("x86_64", "GenuineIntel").read_text())["kernels"]
    assert set(recorded) == set(now) and recorded["cpu_capability"] == "DEFAULT"
    assert golden_curve.kernel_differences(now, now) == []
    assert golden_curve.kernel_differences(now, now | {"torch": "9.9"}) == [
        "kernels: torch = '9.9', the golden curve's " f"{now['torch']!r} (another torch build or unpinned kernels "
        "compute other last bits: re-record with tools/golden_curve.py --write only for a deliberate upgrade, and "
        "say so in its commit)"]


def test_an_architecture_without_a_recording_fails_saying_how_to_record(tmp_path, monkeypatch):
    """On aarch64 (no MKL, other kernels: no x86_64 recording applies), or any machine with no file of its own, the
    check is one line saying how to record one, not a skip."""
    monkeypatch.setattr(golden_curve.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(golden_curve, "cpu_vendor", lambda: "unknown")
    assert not golden_curve.golden_path().exists()
    assert golden_curve.check(golden_curve.golden_path(), tmp_path, tmp_path) == [
        "no golden curve for aarch64 unknown (tests/golden/demo_curve_aarch64-unknown.json is missing): the recorded "
        "ones hold other architectures' or vendors' kernels; record one on this machine with `python "
        "tools/golden_curve.py --write` and commit it"]


def test_the_cpu_vendor_is_the_kernels_vendor_id(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n\nprocessor\t: 1\n"
                       "vendor_id\t: AuthenticAMD\n")
    assert golden_curve.cpu_vendor(cpuinfo) == "AuthenticAMD"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # aarch64 names no vendor_id
    assert golden_curve.cpu_vendor(cpuinfo) == "unknown"
    assert golden_curve.cpu_vendor(tmp_path / "absent") == "unknown"


def test_each_recording_is_filed_under_its_own_machine_and_vendor():
    """A recording's file name is the machine and vendor its kernels report: a file copied to another vendor's name
    would compare a run with kernels that never produced it."""
    recordings = sorted((REPO / "tests" / "golden").glob("demo_curve_*.json"))
    assert recordings
    for path in recordings:
        kernels = json.loads(path.read_text())["kernels"]
        assert path == golden_curve.golden_path(kernels["machine"], kernels["cpu_vendor"]), path.name


@pytest.mark.slow
def test_the_demo_reproduces_its_golden_curve(tmp_path):
    """Fails (never skips) where no curve is recorded for this architecture, and names the kernels where the torch
    build differs from the recording's."""
    golden_curve.build_base(tmp_path / "base")
    assert golden_curve.check(golden_curve.golden_path(), tmp_path / "base", tmp_path / "log") == []
