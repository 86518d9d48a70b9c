"""Draw a run's metrics.jsonl as one PNG report: accuracy, reward, lengths, entropy, clipping, timing.

    python tools/plot_run.py runs/demo/metrics.jsonl -o runs/demo/report.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.trainer.metrics_log import read_metrics  # noqa: E402
from megatron_dapo.trainer.report import plot  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", help="metrics.jsonl written by the trainer")
    ap.add_argument("-o", "--output", default=None, help="PNG path (default: report.png beside the metrics)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    path = Path(args.metrics)
    if not path.is_file():
        raise SystemExit(f"no metrics file at {path}: pass a run's metrics.jsonl (runs/<name>/metrics.jsonl)")
    records = read_metrics(path)
    if not records:
        raise SystemExit(f"{path} holds no records yet")
    out = Path(args.output) if args.output else path.with_name("report.png")
    drawn = plot(records, out, args.title or str(path.parent))
    print(f"wrote {out} ({len(records)} steps, {len(drawn)} curves)")


if __name__ == "__main__":
    main()
