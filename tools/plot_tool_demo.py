"""The tool demo's two runs side by side (examples/run_tool_demo.sh): held-out accuracy and tool-call rate per step.

    python tools/plot_tool_demo.py runs/tool-demo/tool/metrics.jsonl runs/tool-demo/no-tool/metrics.jsonl \
        -o runs/tool-demo/tool_demo.png

Prints a table of the evaluations (step, avg@k and tool-call rate of each run) and writes one PNG with two panels:
eval/avg@k and rollout/accuracy; eval/tool_call_rate and rollout/tool_call_rate (a run without the tool has none:
its calls are never run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.trainer.metrics_log import read_metrics  # noqa: E402


def eval_key(records: list[dict]) -> str:
    """The run's eval/avg@k key (k from --n-samples-per-eval-prompt); SystemExit when it never evaluated."""
    keys = sorted({k for r in records for k in r if k.startswith("eval/avg@")})
    if not keys:
        raise SystemExit("the run has no eval/avg@k: give it --eval-prompt-data and --eval-interval")
    return keys[0]


def table(runs: dict[str, list[dict]]) -> str:
    """Markdown: one row per evaluated step, each run's avg@k and eval tool-call rate ('-' where it has none)."""
    key = eval_key(next(iter(runs.values())))
    steps = sorted({r["step"] for recs in runs.values() for r in recs if key in r})
    head = "| step | " + " | ".join(f"{name} {key.split('/')[1]} | {name} tool calls" for name in runs) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(runs))]
    for step in steps:
        cells = []
        for recs in runs.values():
            rec = next((r for r in recs if r["step"] == step and key in r), {})
            cells += [f"{rec[key]:.3f}" if key in rec else "-",
                      f"{rec['eval/tool_call_rate']:.2f}" if "eval/tool_call_rate" in rec else "-"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = eval_key(next(iter(runs.values())))
    fig, (acc, calls) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, recs in runs.items():
        for ax, metric, style in ((acc, key, "-o"), (acc, "rollout/accuracy", ":"),
                                  (calls, "eval/tool_call_rate", "-o"), (calls, "rollout/tool_call_rate", ":")):
            points = [(r["step"], r[metric]) for r in recs if metric in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, style, markersize=3, label=f"{name}: {metric}")
    acc.set_title("accuracy (held-out: solid; rollout: dotted)")
    calls.set_title("share of responses that called the tool")
    for ax in (acc, calls):
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tool", help="metrics.jsonl of the run with --tool-template")
    ap.add_argument("no_tool", help="metrics.jsonl of the same run without it")
    ap.add_argument("-o", "--output", required=True, help="PNG path")
    args = ap.parse_args(argv)
    runs = {}
    for name, path in (("tool", args.tool), ("no tool", args.no_tool)):
        if not Path(path).is_file():
            raise SystemExit(f"no metrics file at {path}")
        runs[name] = read_metrics(path)
    print(table(runs))
    plot(runs, Path(args.output))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
