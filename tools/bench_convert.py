"""Benchmark checkpoint_convert on a synthetic bf16 Qwen2 checkpoint: time vs a byte copy, peak RSS.

    python tools/bench_convert.py --size-gb 2 [--tp 2 --pp 2] [--repeat 2] [--workdir /tmp/bench_convert]

Writes a random HF checkpoint of about --size-gb (streamed, never in memory), then runs, each in a
fresh process: a plain copy of the shard files, hf-to-mcore (HF -> torch_dist), mcore-to-hf
(torch_dist -> HF), and an import-only baseline. Each step runs --repeat times, interleaved, after an
os.sync() so no step pays for the previous one's dirty pages; the best time counts. Prints wall time
as a ratio to the copy (goal <= 1.4x) and the peak RSS growth during the step next to one decoder
layer plus the writer's buffers (goal: growth within that bound, not near the checkpoint size).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

from megatron_dapo.models.hf_config import Qwen2Arch
from megatron_dapo.weights.hf_format import HFShardedWriter
from megatron_dapo.weights.plan import hf_tensor_specs

# A Qwen2.5-1.5B-like shape; only the layer count is scaled to reach the requested size.
BASE = dict(
    model_type="qwen2",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5504,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)

# Imports happen before the clock and the RSS reference; a sampler thread records the step's peak RSS
# (ru_maxrss alone would be the import high-water mark, which hides the step).
CHILD = """
import glob, os, resource, shutil, threading, time
import psutil, torch
import torch.distributed.checkpoint
from checkpoint_convert.cli import main
proc, peak, done = psutil.Process(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)
rss0 = proc.memory_info().rss
thread = threading.Thread(target=sample, daemon=True)
thread.start()
t = time.perf_counter()
{body}
seconds = time.perf_counter() - t
done.set(); thread.join()
print("RESULT", seconds, max(peak[0], proc.memory_info().rss), rss0)
"""
BODIES = {
    "baseline (no-op)": "pass",
    "byte copy of shards": "os.makedirs({copy!r})\n"
    "for p in glob.glob({hf!r} + '/*.safetensors'):\n"
    "    shutil.copyfile(p, os.path.join({copy!r}, os.path.basename(p)))",
    "hf-to-mcore": "assert main(['hf-to-mcore', '--hf-path', {hf!r}, '--save', {mc!r}, '--tp', '{tp}', "
    "'--pp', '{pp}', '--threads', '{threads}', '--chunk-mb', '{chunk_mb}']) == 0",
    "mcore-to-hf": "assert main(['mcore-to-hf', '--load', {mc!r}, '--save', {hf2!r}, '--threads', '{threads}', "
    "'--chunk-mb', '{chunk_mb}']) == 0",
}


def layer_bytes(arch: Qwen2Arch) -> int:
    """bf16 bytes of one decoder layer (everything but embedding, head and final norm, per layer)."""
    outer = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size
    return (arch.num_parameters() - outer) * 2 // arch.num_layers


def synthetic_config(size_gb: float, pp: int) -> dict:
    """BASE with as many layers (a multiple of pp) as make about size_gb of bf16 weights."""
    arch = Qwen2Arch.from_hf({**BASE, "num_hidden_layers": 1})
    outer = arch.num_parameters() * 2 - layer_bytes(arch)
    stages = max(1, round((size_gb * 1e9 - outer) / layer_bytes(arch) / pp))
    return {**BASE, "num_hidden_layers": stages * pp}


def write_synthetic_hf(out_dir: str, config: dict, shard_bytes: int) -> int:
    """Stream random bf16 tensors into HF shards; returns total bytes."""
    os.makedirs(out_dir)
    arch = Qwen2Arch.from_hf(config)
    specs = hf_tensor_specs(arch, torch.bfloat16)
    writer = HFShardedWriter(out_dir, specs, shard_bytes)
    gen = torch.Generator().manual_seed(0)
    for spec in specs:
        writer.write(spec.name, (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return writer.total_bytes


# The directory each step writes; removed before the step (deleting GBs with `discard` is slow too).
OUTPUT = {"byte copy of shards": "copy", "hf-to-mcore": "mc", "mcore-to-hf": "hf2"}


def run_child(body: str, output: str | None = None) -> tuple[float, int, int]:
    """(seconds, peak RSS during the step, RSS before it) of `body` in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if output is not None:
        shutil.rmtree(output, ignore_errors=True)
    os.sync()  # start from no dirty pages: writeback of an earlier step must not be billed to this one
    out = subprocess.run(
        [sys.executable, "-c", CHILD.format(body=body)], env=env, capture_output=True, text=True, check=True
    ).stdout
    _, seconds, peak, before = next(line for line in out.splitlines() if line.startswith("RESULT")).split()
    return float(seconds), int(peak), int(before)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gb", type=float, default=2.0, help="synthetic checkpoint size (default 2)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=0.5, help="HF input shard size (default 0.5)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per step, interleaved; best counts")
    parser.add_argument("--threads", type=int, default=4, help="hf-to-mcore --threads (default 4)")
    parser.add_argument("--chunk-mb", type=int, default=16, help="--chunk-mb of both conversions (default 16)")
    parser.add_argument(
        "--workdir", default="/tmp/bench_convert", help="scratch dir (removed first and after)"
    )
    ns = parser.parse_args()
    shutil.rmtree(ns.workdir, ignore_errors=True)
    paths = {k: os.path.join(ns.workdir, k) for k in ("hf", "mc", "hf2", "copy")}
    config = synthetic_config(ns.size_gb, ns.pp)
    arch = Qwen2Arch.from_hf(config)
    try:
        total = write_synthetic_hf(paths["hf"], config, int(ns.shard_gb * 1e9))
        largest = arch.vocab_size * arch.hidden_size * 2
        layer = layer_bytes(arch)
        print(
            f"synthetic checkpoint: {arch.num_layers} layers, {total / 1e9:.2f} GB bf16; largest tensor "
            f"{largest / 1e6:.0f} MB, one layer {layer / 1e6:.0f} MB; tp={ns.tp} pp={ns.pp}"
        )
        runs: dict[str, list[tuple[float, int, int]]] = {name: [] for name in BODIES}
        for _ in range(ns.repeat):
            for name, body in BODIES.items():
                fmt = dict(tp=ns.tp, pp=ns.pp, threads=ns.threads, chunk_mb=ns.chunk_mb, **paths)
                out = paths[OUTPUT[name]] if name in OUTPUT else None
                runs[name].append(run_child(body.format(**fmt), out))
        results = {name: min(r, key=lambda x: x[0]) for name, r in runs.items()}
        copy_s = results["byte copy of shards"][0]
        print(f"{'step':<22}{'seconds':>9}{'x copy':>9}{'peak RSS MB':>13}{'peak - start MB':>17}  all runs (s)")
        for name, (seconds, peak, before) in results.items():
            ratio, extra = seconds / copy_s, (peak - before) / 1e6
            every = " ".join(f"{r[0]:.2f}" for r in runs[name])
            print(f"{name:<22}{seconds:>9.2f}{ratio:>9.2f}{peak / 1e6:>13.0f}{extra:>17.0f}  {every}")
        grown = max(r[1] - r[2] for n, rs in runs.items() for r in rs if n in ("hf-to-mcore", "mcore-to-hf"))
        # a writer thread holds its chunk and, while producing the next, the previous one
        bound = layer + 2 * ns.threads * (ns.chunk_mb << 20)
        print(
            f"largest RSS growth of a conversion {grown / 1e6:.0f} MB; bound: one layer + write buffers "
            f"(2 x {ns.threads} threads x {ns.chunk_mb} MiB) = {bound / 1e6:.0f} MB; checkpoint {total / 1e6:.0f} MB"
        )
    finally:
        shutil.rmtree(ns.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
