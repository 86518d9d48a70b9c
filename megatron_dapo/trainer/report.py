"""A run's metrics drawn as one PNG: accuracy, reward, lengths, entropy, clipping, timing."""

from __future__ import annotations

from pathlib import Path

PANELS: list[tuple[str, list[str]]] = [
    ("accuracy", ["rollout/accuracy", "eval/avg@4", "eval/avg@8", "eval/avg@16", "eval/avg@32",
                  "eval/pass@1"]),
    ("reward", ["rollout/reward"]),
    ("response length (tokens)", ["rollout/response_len_mean", "rollout/response_len_max"]),
    ("entropy", ["train/entropy"]),
    ("clipping / KL", ["train/clipfrac_high", "train/clipfrac_low", "train/approx_kl", "rollout/clip_ratio"]),
    ("dynamic sampling", ["dynamic_sampling/keep_ratio", "dynamic_sampling/rounds"]),
    ("grad norm", ["train/grad_norm"]),
    ("rollout vs actor log-prob", ["mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max"]),
    ("time per step (s)", ["time/rollout_s", "time/train_s", "time/sync_s", "time/step_s"]),
]


def plot(records: list[dict[str, float]], out: Path, title: str) -> list[str]:
    """Write the report; return the metric names that were drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(15, 11))
    drawn = []
    for ax, (name, keys) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3, label=key)
                drawn.append(key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return drawn
