"""The golden curve: the embedded demo's first steps of metrics at a fixed seed, stored and compared.

A refactor that changes what the trainer computes (a different prompt order, advantage, loss, update or
sampled token) changes these numbers; one that only moves code does not. The run is the demo's
(examples/run_embedded_demo.sh: its rollout, DAPO and optimizer flags, read from the script itself, seed 1234) on
the demo's base policy (tools/make_tiny_base.py, defaults), for 10 steps, without evaluation, checkpoints or export.

    python tools/golden_curve.py --write   # record tests/golden/demo_curve_<machine>-<vendor>.json
    python tools/golden_curve.py           # compare a fresh run with it

Compared: every metric the trainer logs except wall-clock times (`time/*`, throughput) and the progress
bar's rates. Integer-valued metrics (counts) must be equal; the others equal within `RTOL` (1e-5) relative.

Pinned kernels (PINNED_ENV), for the base build and the run, on every machine: float kernels differ in their last
bits between CPUs (AVX512 or AVX2 in ATen, MKL's per-CPU GEMM paths), Adam and sampling amplify those bits into
another trajectory within a step (the base alone ends up to 0.4 apart), so an unpinned curve holds on the machine
that recorded it only. ATen's `default` kernels exist on every x86_64 CPU and MKL's conditional-reproducibility
branch COMPATIBLE (SSE2) gives the same results at a fixed thread count on every CPU of one vendor, but not across
vendors: on an AMD EPYC (Zen 4) the pinned base differs from the one an Intel Xeon builds (MKL runs other code for
a non-Intel CPU; its branch reaches the bits there, its other branches build a third base, while glibc's libm variant
changes nothing; docs/TESTING.md). So a recording is per architecture and CPU vendor (`golden_path`: Intel's
GenuineIntel, AMD's AuthenticAMD), and names the vendor, the torch build, the capability and MKL's CNR branch the
run reported; a check under others fails naming them. A machine with no recording of its own (aarch64: no MKL,
other BLAS kernels; another vendor) fails, saying how to record one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_SCRIPT = REPO / "examples" / "run_embedded_demo.sh"
DEMO_ARRAYS = ("ROLLOUT_ARGS", "DAPO_ARGS", "OPTIM_ARGS")
"""The demo script's flag arrays the golden run passes as they are (the script's DATA_ARGS add evaluation and its
RUN_ARGS checkpoints and export, which the golden run leaves out)."""
NUM_STEPS = 10
RTOL = 1e-5
"""Relative tolerance of float metrics. With PINNED_ENV a run computes the same sums in the same order on any x86_64
machine: the values are bit-equal in practice; 1e-5 leaves room for a summation reordered on purpose (which then
must not change a sampled token)."""
IGNORED_PREFIXES = ("time/", "perf/", "throughput/")
PINNED_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}
"""The environment of the golden runs (base build and training), over the caller's: ATen's portable kernels, MKL's
SSE2 CNR branch (reproducible across x86_64 CPUs at a fixed thread count: one). Costs ~3x the CPU time of the
native kernels (~4 min on one core, most of it the base's warm-up)."""


def demo_flags(script: Path = DEMO_SCRIPT) -> list[str]:
    """The demo's rollout, DAPO and optimizer flags (DEMO_ARRAYS) as bash expands them: the script, sourced, defines
    its flag arrays and returns before doing anything."""
    listing = " ".join(f'"${{{name}[@]}}"' for name in DEMO_ARRAYS)
    done = subprocess.run(["bash", "-c", f'source "$1" && printf "%s\\0" {listing}', "bash", str(script)],
                          capture_output=True, text=True, check=True)
    return done.stdout.split("\0")[:-1]


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's vendor as the kernel reports it (`vendor_id`: GenuineIntel, AuthenticAMD; "unknown" where the
    file or field is absent, as on aarch64, whose BLAS is not MKL anyway)."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "unknown"
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return "unknown"


def golden_path(machine: str | None = None, vendor: str | None = None) -> Path:
    """The golden curve of `machine` and CPU `vendor` (this machine's `platform.machine()` and `cpu_vendor()` by
    default): one file per architecture and vendor."""
    return REPO / "tests" / "golden" / f"demo_curve_{machine or platform.machine()}-{vendor or cpu_vendor()}.json"


def _env() -> dict[str, str]:
    return os.environ | {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)} | PINNED_ENV


_KERNELS_PROBE = """
import json, platform, torch
torch.mm(torch.ones(4, 4), torch.ones(4, 4))  # MKL_VERBOSE prints the GEMM's CNR branch
print(json.dumps({"machine": platform.machine(), "torch": torch.__version__,
                  "cpu_capability": torch.backends.cpu.get_cpu_capability()}))
"""


def kernels() -> dict[str, str | None]:
    """What a process under PINNED_ENV runs on: machine, CPU vendor, torch build, ATen's CPU capability, MKL's CNR
    branch (None without MKL), as that process reports them."""
    done = subprocess.run([sys.executable, "-c", _KERNELS_PROBE], env=_env() | {"MKL_VERBOSE": "1"},
                          capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    cnr = [w.removeprefix("CNR:") for line in lines if line.startswith("MKL_VERBOSE SGEMM")
           for w in line.split() if w.startswith("CNR:")]
    return json.loads(lines[-1]) | {"cpu_vendor": cpu_vendor(), "mkl_cnr": cnr[0] if cnr else None}


def kernel_differences(golden: dict, now: dict) -> list[str]:
    """One line per way the kernels of this run differ from the recording's (empty when they agree)."""
    return [f"kernels: {key} = {now.get(key)!r}, the golden curve's {want!r} (another torch build or unpinned "
            f"kernels compute other last bits: re-record with tools/golden_curve.py --write only for a deliberate "
            f"upgrade, and say so in its commit)"
            for key, want in golden.items() if now.get(key) != want]


def build_base(out: Path) -> None:
    """The demo's base policy (tools/make_tiny_base.py with its defaults) in `out`, under PINNED_ENV."""
    subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_base.py"), "--out", str(out)],
                   cwd=REPO, env=_env(), check=True, stdout=subprocess.DEVNULL)


def base_digest(base: Path) -> str:
    """sha256 of the base policy's weights file: a curve from another base is not comparable."""
    return hashlib.sha256((base / "model" / "model.safetensors").read_bytes()).hexdigest()


def train_command(base: Path, log_dir: Path, num_steps: int = NUM_STEPS) -> list[str]:
    """The golden run's command line: the demo's training on `base` without evaluation, checkpoints or export."""
    return [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
            "--prompt-data", str(base / "train.jsonl"), *demo_flags(), "--num-steps", str(num_steps),
            "--log-dir", str(log_dir), "--no-progress", "--no-wandb"]


def run_curve(base: Path, log_dir: Path, num_steps: int = NUM_STEPS) -> list[dict[str, float]]:
    """Run the demo's training for `num_steps` under PINNED_ENV and return the compared metrics of each step."""
    done = subprocess.run(train_command(base, log_dir, num_steps), cwd=REPO, env=_env(), capture_output=True,
                          text=True)
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
    for want, got in zip(golden, fresh, strict=False):  # not strict: a length difference is reported above
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


def record(base: Path, log_dir: Path) -> dict:
    """A golden recording: the kernels, the base's digest and the curve of a run on `base`."""
    return {"kernels": kernels(), "base_sha256": base_digest(base), "num_steps": NUM_STEPS,
            "steps": run_curve(base, log_dir)}


def check(golden_file: Path, base: Path, log_dir: Path) -> list[str]:
    """Every way a fresh run on `base` departs from `golden_file`'s recording (empty when it holds): its kernels,
    its base policy, then the curve's `differences`. A missing file is one line saying how to record it."""
    if not golden_file.exists():
        return [f"no golden curve for {platform.machine()} {cpu_vendor()} ({golden_file.relative_to(REPO)} is "
                "missing): the recorded ones hold other architectures' or vendors' kernels; record one on this "
                "machine with `python tools/golden_curve.py --write` and commit it"]
    golden = json.loads(golden_file.read_text())
    out = kernel_differences(golden["kernels"], kernels())
    if (digest := base_digest(base)) != golden["base_sha256"]:
        out.append(f"base policy: sha256 {digest}, the golden curve's {golden['base_sha256']} (tools/make_tiny_base.py "
                   "computes another base, or --base was not built under the pinned kernels)")
    return out + differences(golden["steps"], run_curve(base, log_dir))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", type=Path, default=None,
                    help="the demo's base policy directory, built under the pinned kernels (built here, ~4 min, "
                         "when not given)")
    ap.add_argument("--write", action="store_true",
                    help="record the curve in tests/golden/demo_curve_<machine>-<vendor>.json")
    ap.add_argument("--golden", type=Path, default=golden_path())
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = args.base
        if base is None:
            base = Path(tmp) / "base"
            build_base(base)
        if args.write:
            recording = record(base, Path(tmp) / "log")
            args.golden.parent.mkdir(parents=True, exist_ok=True)
            args.golden.write_text(json.dumps(recording, indent=1) + "\n")
            print(f"wrote {len(recording['steps'])} steps to {args.golden}")
            return 0
        diffs = check(args.golden, base, Path(tmp) / "log")
    for line in diffs:
        print(line)
    print("the golden curve holds" if not diffs else f"{len(diffs)} differences from {args.golden}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
