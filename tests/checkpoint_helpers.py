"""Test helpers for checkpoints: read every tensor of a dist checkpoint, start a run from one of its steps."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch


def read_checkpoint_tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist step directory by key, through torch.distributed.checkpoint's own reader.

    Leaves out the distributed optimizer's flat bucket tensors: their padding is torch.empty memory
    (differs between runs by design); that optimizer's state is compared per param in-process instead.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(step_dir, Path(tmp) / "all.pt")
        flat = torch.load(Path(tmp) / "all.pt", weights_only=False)
    return {k: v for k, v in flat.items()
            if isinstance(v, torch.Tensor) and not k.startswith("optimizer.distributed.")}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max |a - b| / max |a| over the tensors of `a` (which `b` must all have), and the worst key."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    worst = (0.0, "")
    for key, x in a.items():
        x, y = x.double(), b[key].double()
        rel = ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item() if x.numel() else 0.0
        worst = max(worst, (rel, key))
    return worst


def start_from_step(src_ckpt: Path, step: int, dst_ckpt: Path) -> None:
    """dst_ckpt holds only src's step `step` (as the newest): a --load of it resumes there."""
    name = f"step_{step:07d}"
    dst_ckpt.mkdir(parents=True)
    shutil.copytree(src_ckpt / name, dst_ckpt / name)
    (dst_ckpt / "latest").write_text(name)


def metrics(log_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r for r in records}


def optimizer_state(actor) -> dict[str, torch.Tensor]:
    """Copies of the model params and the per-param torch optimizer state (main param, exp_avg, exp_avg_sq, step)."""
    out = {f"model.{n}": p.detach().clone() for n, p in actor.module.named_parameters()}
    for k, opt in enumerate(getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])):
        for i, (param, state) in enumerate(opt.optimizer.state.items()):
            out[f"{k}.{i}.main"] = param.detach().clone()
            out.update({f"{k}.{i}.{name}": t.detach().clone() for name, t in state.items()})
    return out
