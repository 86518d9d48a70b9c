"""The golden curve: the embedded demo's first steps of metrics at a fixed seed, stored and compared.

A refactor that changes what the trainer computes (a different prompt order, advantage, loss, update or
sampled token) changes these numbers; one that only moves code does not. The run is the demo's
(examples/run_embedded_demo.sh: the same rollout, DAPO and optimizer flags, seed 1234) on the demo's base
policy (tools/make_tiny_base.py, defaults), for 10 steps, without evaluation, checkpoints or export.

    python tools/golden_curve.py --base runs/tiny-base --write   # record tests/golden/demo_curve.json
    python tools/golden_curve.py --base runs/tiny-base           # compare a fresh run with it

Compared: every metric the trainer logs except wall-clock times (`time/*`, throughput) and the progress
bar's rates. Integer-valued metrics (counts) must be equal; the others within `RTOL` relative. The file
records the CPU capability it was written on (torch's dispatch level, e.g. AVX2): float kernels differ in
their last bits across capabilities, and a sampled token that flips changes the trajectory after it, so a
comparison on another capability is reported as such, not as a regression.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "tests" / "golden" / "demo_curve.json"
NUM_STEPS = 10
RTOL = 1e-5
"""Relative tolerance of float metrics: same machine, same kernels: the values are bit-equal in practice;
1e-5 leaves room for a summation reordered on purpose (which then must not change a sampled token)."""
IGNORED_PREFIXES = ("time/", "perf/", "throughput/")

DEMO_FLAGS = [  # examples/run_embedded_demo.sh's ROLLOUT, DAPO and OPTIM arrays
    "--rollout-engine", "embedded", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
    "--over-sample-factor", "1.5", "--rollout-temperature", "1.0", "--max-response-length", "40",
    "--max-num-gen-batches", "16", "--on-gen-exhausted", "partial", "--max-prompt-length", "16",
    "--clip-ratio-low", "0.2", "--clip-ratio-high", "0.28", "--loss-agg-mode", "token-mean", "--dynamic-sampling",
    "--overlong-buffer-length", "8", "--overlong-penalty-factor", "1.0", "--reward-fn", "math_dapo",
    "--lr", "5e-4", "--lr-warmup-steps", "3", "--weight-decay", "0.0", "--clip-grad", "1.0",
    "--global-batch-size", "64", "--seed", "1234",
]


def cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def build_base(out: Path) -> None:
    """The demo's base policy (tools/make_tiny_base.py with its defaults) in `out`."""
    subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_base.py"), "--out", str(out)],
                   cwd=REPO, env=_env(), check=True, stdout=subprocess.DEVNULL)


def _env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                         "PYTHONPATH": str(REPO)}


def run_curve(base: Path, log_dir: Path, num_steps: int = NUM_STEPS) -> list[dict[str, float]]:
    """Run the demo's training for `num_steps` and return the compared metrics of each step, in order."""
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
           "--prompt-data", str(base / "train.jsonl"), *DEMO_FLAGS, "--num-steps", str(num_steps),
           "--log-dir", str(log_dir), "--no-progress", "--no-wandb"]
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the demo run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [compared(r) for r in records if r.get("step", 0) >= 1]


def compared(record: dict) -> dict[str, float]:
    """The metrics of one step that the golden curve holds: numbers, wall-clock times left out."""
    return {k: v for k, v in sorted(record.items())
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.startswith(IGNORED_PREFIXES)}


def differences(golden: list[dict[str, float]], fresh: list[dict[str, float]], rtol: float = RTOL) -> list[str]:
    """Every way `fresh` departs from `golden`: a step or metric missing or added, a count not equal, a float
    outside `rtol` (relative to the golden value; absolute 1e-12 near zero). Empty when they agree."""
    out = []
    if len(golden) != len(fresh):
        out.append(f"{len(fresh)} steps logged, the golden curve has {len(golden)}")
    for want, got in zip(golden, fresh):
        step = int(want.get("step", -1))
        if missing := sorted(set(want) - set(got)):
            out.append(f"step {step}: metrics missing: {missing}")
        if added := sorted(set(got) - set(want)):
            out.append(f"step {step}: metrics not in the golden curve: {added}")
        for key in sorted(set(want) & set(got)):
            a, b = want[key], got[key]
            exact = float(a).is_integer() and float(b).is_integer() and abs(a) >= 1
            ok = a == b if exact else math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12)
            if not ok:
                out.append(f"step {step}: {key} = {b!r}, golden {a!r}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=None,
                    help="the demo's base policy directory (built here, ~1 min, when not given)")
    ap.add_argument("--write", action="store_true", help=f"record the curve in {GOLDEN.relative_to(REPO)}")
    ap.add_argument("--golden", type=Path, default=GOLDEN)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.base
        if base is None:
            base = Path(tmp) / "base"
            build_base(base)
        curve = run_curve(base, Path(tmp) / "log")
    if args.write:
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps({"cpu_capability": cpu_capability(), "num_steps": NUM_STEPS,
                                           "steps": curve}, indent=1) + "\n")
        print(f"wrote {len(curve)} steps to {args.golden}")
        return 0
    golden = json.loads(args.golden.read_text())
    diffs = differences(golden["steps"], curve)
    for line in diffs:
        print(line)
    print("the golden curve holds" if not diffs else f"{len(diffs)} differences from {args.golden}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
