"""On-policy distillation on a laptop: does a teacher get the demo's student to its accuracy in fewer samples?

    python tools/distill_demo.py                    # teacher (60 demo steps), then 4 arms x 30 steps, ~8 min
    python tools/distill_demo.py --steps 20 --out runs/distill --arms dapo,distill

1. The teacher: the embedded demo's own run (examples/run_embedded_demo.sh's flags, `--num-steps 60`) from the demo's
   tiny base, exported to HF (held-out avg@4 0.18 -> 0.98 in the demo's recorded run).
2. Three students from the same base (the same tokenizer), each `python -m megatron_dapo.train` with the demo's flags
   plus: `dapo` nothing; `distill` --teacher-load TEACHER --distill-coef 1 --distill-only --no-dynamic-sampling
   (the teacher's per-token reverse KL alone, no verifier); `dapo+distill` --teacher-load TEACHER --distill-coef 1;
   `distill@sglang` as `distill` with the teacher on a real CPU SGLang server (fp32, its tokenizer loaded for the
   trainer's check) that this tool starts: --teacher-url URL (needs .venv-sglang: `make sglang-env`).
   Held-out avg@4 every --eval-interval steps (200 prompts x 4 samples at temperature 1).
3. `distillation.png`: held-out avg@4 against responses generated (cumulative rollout/responses) and against steps;
   `summary.json`: per arm the curve, the responses generated to reach --target, and the last accuracy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO))

import golden_curve  # noqa: E402

from megatron_dapo.trainer.metrics_log import read_metrics  # noqa: E402

DISTILL_ONLY = ("--distill-coef", "1", "--distill-only", "--no-dynamic-sampling")
ARMS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "dapo": (None, ()),
    "distill": ("load", DISTILL_ONLY),
    "dapo+distill": ("load", ("--distill-coef", "1")),
    "distill@sglang": ("url", DISTILL_ONLY),
}
"""Each arm's teacher (None, "load": --teacher-load, "url": --teacher-url of the served teacher) and flags beyond the
demo's."""
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"


def teacher_flags(kind: str | None, hf_dir: Path, url: str | None) -> list[str]:
    """The flags that give an arm its teacher."""
    if kind is None:
        return []
    return ["--teacher-load", str(hf_dir)] if kind == "load" else ["--teacher-url", str(url)]


def serve_teacher(hf_dir: Path, log_dir: Path):
    """The teacher on one CPU SGLang server (fp32, tokenizer loaded): the SGLangEngine that launched it."""
    import socket

    from megatron_dapo.rollout.sglang.engine import SGLangEngine
    from megatron_dapo.rollout.sglang.server import ServerConfig

    if not SGLANG_PY.exists():
        raise SystemExit(f"the distill@sglang arm needs {SGLANG_PY}: run `make sglang-env`, or leave it out (--arms)")
    with socket.socket() as s:  # a free port for the server and one above it (the router's, unused)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ServerConfig(model_path=str(hf_dir), base_port=min(port, 60000), device="cpu", python=str(SGLANG_PY),
                       extra_args=("--dtype", "float32"), log_dir=str(log_dir), skip_tokenizer_init=False,
                       env={"OMP_NUM_THREADS": "1"}, startup_timeout_s=600)
    return SGLangEngine(cfg)


def train(base: Path, run: Path, steps: int, extra: list[str], eval_interval: int) -> float:
    """One `python -m megatron_dapo.train` run with the demo's flags and `extra`; its wall seconds."""
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
           "--prompt-data", str(base / "train.jsonl"), "--eval-prompt-data", str(base / "eval.jsonl"),
           "--eval-interval", str(eval_interval), "--n-samples-per-eval-prompt", "4", "--eval-max-prompts", "200",
           *golden_curve.demo_flags(), "--num-steps", str(steps), "--log-dir", str(run), "--no-progress",
           "--no-wandb", *extra]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"})
    if done.returncode != 0:
        raise SystemExit(f"{run}: the run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def curve(run: Path) -> list[dict[str, float]]:
    """(step, responses generated so far, held-out avg@4) at each evaluation, the step-0 one included."""
    out, responses = [], 0.0
    for r in read_metrics(run / "metrics.jsonl"):
        responses += r.get("rollout/responses", 0.0)
        if "eval/avg@4" in r:
            out.append({"step": r["step"], "responses": responses, "avg@4": r["eval/avg@4"]})
    return out


def to_target(points: list[dict[str, float]], target: float) -> float | None:
    """Responses generated when held-out avg@4 first reached `target`; None if it never did."""
    return next((p["responses"] for p in points if p["avg@4"] >= target), None)


def plot(curves: dict[str, list[dict[str, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, points in curves.items():
        axes[0].plot([p["responses"] for p in points], [p["avg@4"] for p in points], marker="o", label=name)
        axes[1].plot([p["step"] for p in points], [p["avg@4"] for p in points], marker="o", label=name)
    axes[0].set_xlabel("responses generated")
    axes[1].set_xlabel("step")
    for ax in axes:
        ax.set_ylabel("held-out avg@4")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("on-policy distillation from the demo's trained policy vs DAPO alone (tiny base, CPU)")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "distill_demo")
    ap.add_argument("--base", type=Path, default=REPO / "runs" / "tiny-base",
                    help="the demo's tiny base (built by tools/make_tiny_base.py when missing)")
    ap.add_argument("--teacher-steps", type=int, default=60)
    ap.add_argument("--steps", type=int, default=30, help="steps of each student arm")
    ap.add_argument("--eval-interval", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.9, help="held-out avg@4 whose cost in responses is compared")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    if not (args.base / "model" / "config.json").is_file():
        subprocess.run([sys.executable, "tools/make_tiny_base.py", "--out", str(args.base)], cwd=REPO, check=True)
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = args.out / "teacher"
    wall = {}
    if not (teacher / "hf" / "config.json").is_file():
        print(f"== teacher: the demo's {args.teacher_steps} DAPO steps", flush=True)
        wall["teacher"] = train(args.base, teacher, args.teacher_steps, ["--export-hf", str(teacher / "hf")],
                                args.eval_interval)
    curves = {}
    server = serve_teacher(teacher / "hf", args.out / "teacher_server") \
        if any(ARMS[a][0] == "url" for a in arms) else None
    try:
        for name in arms:
            kind, extra = ARMS[name]
            print(f"== {name}: {args.steps} steps", flush=True)
            run = args.out / name.replace("+", "_").replace("@", "_")
            flags = [*teacher_flags(kind, teacher / "hf", server.urls[0] if server else None), *extra]
            wall[name] = train(args.base, run, args.steps, flags, args.eval_interval)
            curves[name] = curve(run)
    finally:
        if server is not None:
            server.shutdown()
    summary = {name: {"curve": points, f"responses_to_{args.target}": to_target(points, args.target),
                      "last_avg@4": points[-1]["avg@4"], "wall_s": wall[name]} for name, points in curves.items()}
    summary["teacher_avg@4"] = curve(teacher)[-1]["avg@4"] if (teacher / "metrics.jsonl").is_file() else None
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(curves, args.out / "distillation.png")
    for name in arms:
        s = summary[name]
        print(f"{name:>13}: held-out avg@4 {s['curve'][0]['avg@4']:.3f} -> {s['last_avg@4']:.3f}; responses to "
              f"{args.target}: {s[f'responses_to_{args.target}']}; {s['wall_s']:.0f} s")
    print(f"wrote {args.out / 'distillation.png'}, {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
