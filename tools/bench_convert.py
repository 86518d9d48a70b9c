"""Benchmark checkpoint_convert on a synthetic bf16 Qwen2 checkpoint: time vs a byte copy, peak RSS.

    python tools/bench_convert.py --size-gb 2 [--shard-gb 0.5] [--repeat 7] [--warmup 1] [--fsync] [--cold]
                                  [--threads 4] [--workdir DIR]
    python tools/bench_convert.py --plan qwen3-30b-a3b   # or --plan path/to/config.json: sizes only, no weights

--plan prints, from config.json alone, what a conversion of that model moves and holds (`plan_numbers`): HF
tensors and bytes, stored keys, chunks and ShardedObjects, the largest stored tensor and the converter's resident
memory; Qwen3-30B-A3B's config is built in.

Writes a random HF checkpoint of about --size-gb in shards of --shard-gb (streamed, never in memory) and
converts it once to torch_dist (the fixed input of mcore-to-hf). Then --warmup rounds that are not
counted, and --repeat rounds of two triples, each step in a fresh process (imports before the clock):

    copies of the HF files          vs  hf-to-mcore (HF files -> torch_dist)
    copies of the torch_dist files  vs  mcore-to-hf (torch_dist files -> HF shards of --shard-gb)

Each conversion is compared with two kernel copies of its own input files, so all read and write the
same number of bytes through the same page cache: "copy" is the goal's plain byte copy (sendfile of
the whole file, what `cp` and shutil.copyfile do); "piece copy" is copy_file_range in --chunk-mb
pieces, the call size the converters use, a stricter baseline where whole-file calls are slow. All get
the same treatment: output directory removed and os.sync() before the step (no step pays for an
earlier one's writeback); with --cold every input file is dropped from the page cache
(posix_fadvise DONTNEED, our files only) so all read from disk; with --fsync the clock includes
fsync of every output file, so all pay for the disk write. Within a triple the order rotates by
round. The machine is shared, so the bench prints the load average, min and median of each step,
and the median of the per-round ratios conversion / copy (a slow round slows its whole triple).

Why warm-up rounds: on the VM this was written on, the first 2 GB written after the setup took 3-8x the
time of later rounds for every step, copies included (new guest memory under the page cache); and any
one kernel copy of the same files varies 0.6-16 s (system time follows wall time). Hence the rounds
and the medians; --shard-gb 5 makes the 2 GB HF side one file (mcore-to-hf's threads then take turns on
it), the default 0.5 gives 5 shards, as Qwen2.5-32B's 65.5 GB comes in 17 on the hub (13 of 5 GiB here).

RSS: the bench reads the child's /proc/<pid>/status every 2 ms; growth = peak VmRSS minus
VmRSS before the step (mapped file pages count: a memory-mapped chunk is resident while mapped).
Bound (the goal): one decoder layer plus the writer's buffers (--threads chunks of --chunk-mb).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

import torch

from megatron_dapo.models.hf_config import ModelArch
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

QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1,
    mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
"""Qwen3-30B-A3B's config.json (the model card's shapes), for --plan qwen3-30b-a3b."""
PLANS = {"qwen3-30b-a3b": QWEN3_30B_A3B}


def plan_numbers(arch: ModelArch, *, threads: int, chunk_mb: int, itemsize: int = 2) -> dict[str, int]:
    """What converting `arch` (bf16 by default) moves and holds, from the config alone (the converters' own tables).

    hf_tensors / hf_bytes: the HF checkpoint; stored_keys: torch_dist tensor keys (`stored_tensors`); chunks: stored
    records at --chunk-mb (hf-to-mcore's `_row_chunks`: each HF row range cut at chunk_mb; its .metadata entries);
    objects: the `_extra_state` ShardedObjects; largest_tensor / largest_slice: bytes of the biggest stored tensor
    and of its biggest per-layer slice (what a writer that assembled one would hold; these converters never do);
    resident_copy / resident_cast: hf-to-mcore's chunk memory without / with a --dtype cast (kernel copies: none;
    a cast: `threads` mapped chunks plus their serialized records), and mcore-to-hf's (`threads` row blocks when a
    block is assembled or cast; converter output is copied in the kernel).
    """
    from checkpoint_convert.hf_to_mcore import extra_state_objects
    from megatron_dapo.checkpoint.ckpt_config import stored_tensors
    from megatron_dapo.distributed.parallel import padded_vocab_size
    from megatron_dapo.weights.layout import global_shape, hf_row_segments, hf_shapes

    chunk_bytes = chunk_mb << 20
    specs = hf_tensor_specs(arch, torch.bfloat16)
    padded = padded_vocab_size(arch.vocab_size, 1)
    chunks = largest_tensor = largest_slice = 0
    stored = stored_tensors(arch)
    for t in stored:
        shape = global_shape(t.entry, arch, padded)
        size = torch.Size(shape).numel() * itemsize
        largest_tensor = max(largest_tensor, size)
        largest_slice = max(largest_slice, size // (arch.num_layers if t.stacked else 1))
        rows = [torch.Size(s[1:]).numel() * itemsize for s in hf_shapes(t.entry, arch)]
        per_source = sum(-(-seg.rows // max(1, chunk_bytes // rows[seg.hf_index]))
                         for seg in hf_row_segments(t.entry, arch))
        sources = len(t.layers) * (arch.num_experts if t.entry.per_expert else 1)
        chunks += per_source * sources + (t.entry.kind == "vocab" and padded > arch.vocab_size)
    return dict(hf_tensors=len(specs), hf_bytes=sum(s.nbytes for s in specs), stored_keys=len(stored), chunks=chunks,
                objects=len(extra_state_objects(arch)), largest_tensor=largest_tensor, largest_slice=largest_slice,
                resident_copy=0, resident_cast=2 * threads * chunk_bytes, resident_m2h=threads * chunk_bytes)


def print_plan(name: str, threads: int, chunk_mb: int) -> None:
    config = PLANS.get(name.lower())
    if config is None:
        with open(name) as f:
            config = json.load(f)
    arch = ModelArch.from_hf(config)
    n = plan_numbers(arch, threads=threads, chunk_mb=chunk_mb)
    experts = (f"; {len(arch.moe_layers)} MoE layers x {arch.num_experts} experts x 3 = "
               f"{len(arch.moe_layers) * arch.num_experts * 3} expert tensors" if arch.is_moe else "")
    print(f"{name}: {arch.num_parameters() / 1e9:.1f}B parameters, bf16{experts}")
    print(f"  HF checkpoint: {n['hf_tensors']} tensors, {n['hf_bytes'] / 1e9:.1f} GB")
    print(f"  torch_dist: {n['stored_keys']} tensor keys in {n['chunks']} chunks of <= {chunk_mb} MiB, "
          f"{n['objects']} _extra_state objects; largest tensor {n['largest_tensor'] / 1e9:.1f} GB "
          f"(one layer of it {n['largest_slice'] / 1e6:.0f} MB, never assembled)")
    print(f"  converter memory (chunks; --threads {threads} --chunk-mb {chunk_mb}): hf-to-mcore "
          f"{n['resident_copy']} B without a cast (kernel copies), {n['resident_cast'] / 2**20:.0f} MiB with "
          f"--dtype; mcore-to-hf 0 on converter output, <= {n['resident_m2h'] / 2**20:.0f} MiB on training "
          "checkpoints (blocks assembled from TP / expert-TP shards)")


# Imports happen before the clock and the RSS reference. {prepare} (drop inputs from the page cache)
# runs before the clock too; {finish} (fsync of the outputs) inside it.
CHILD = """
import os, resource, shutil, sys, time
import torch
import torch.distributed.checkpoint
from checkpoint_convert.cli import main

def files(d):
    return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]

for p in files({src!r}) if {cold} else []:
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
print("READY", flush=True)
sys.stdin.readline()  # the parent has read the RSS before the step
cpu0 = resource.getrusage(resource.RUSAGE_SELF)
t = time.perf_counter()
{body}
for p in files({out!r}) if {fsync} else []:
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
seconds = time.perf_counter() - t
cpu1 = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT", seconds, cpu1.ru_utime - cpu0.ru_utime + cpu1.ru_stime - cpu0.ru_stime, flush=True)
sys.stdin.readline()  # exit only once the parent stopped sampling
"""
COPY = """os.makedirs({out!r})
for p in files({src!r}):
    q = os.path.join({out!r}, os.path.relpath(p, {src!r}))
    os.makedirs(os.path.dirname(q), exist_ok=True)
    shutil.copyfile(p, q)"""
# The same copy in --chunk-mb pieces (the converters' call size), which this VM did faster than whole-file calls.
PIECE_COPY = """os.makedirs({out!r})
for p in files({src!r}):
    q = os.path.join({out!r}, os.path.relpath(p, {src!r}))
    os.makedirs(os.path.dirname(q), exist_ok=True)
    n, i, o, d = os.path.getsize(p), os.open(p, os.O_RDONLY), os.open(q, os.O_WRONLY | os.O_CREAT, 0o644), 0
    while d < n:
        d += os.copy_file_range(i, o, min({piece}, n - d), d, d)
    os.close(i)
    os.close(o)"""
H2M = ("assert main(['hf-to-mcore', '--hf-path', {src!r}, '--save', {out!r}, '--tp', '{tp}', '--pp', '{pp}', "
       "'--threads', '{threads}', '--chunk-mb', '{chunk_mb}']) == 0")
M2H = ("assert main(['mcore-to-hf', '--load', {src!r}, '--save', {out!r}, '--threads', '{threads}', "
       "'--chunk-mb', '{chunk_mb}', '--max-shard-size', '{shard_bytes}']) == 0")


def layer_bytes(arch: ModelArch) -> int:
    """bf16 bytes of one decoder layer (everything but embedding, head and final norm, per layer)."""
    outer = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size
    return (arch.num_parameters() - outer) * 2 // arch.num_layers


def synthetic_config(size_gb: float, pp: int) -> dict:
    """BASE with as many layers (a multiple of pp) as make about size_gb of bf16 weights."""
    arch = ModelArch.from_hf({**BASE, "num_hidden_layers": 1})
    outer = arch.num_parameters() * 2 - layer_bytes(arch)
    stages = max(1, round((size_gb * 1e9 - outer) / layer_bytes(arch) / pp))
    return {**BASE, "num_hidden_layers": stages * pp}


def write_synthetic_hf(out_dir: str, config: dict, shard_bytes: int) -> int:
    """Stream random bf16 tensors into HF shards; returns total bytes."""
    os.makedirs(out_dir)
    arch = ModelArch.from_hf(config)
    specs = hf_tensor_specs(arch, torch.bfloat16)
    writer = HFShardedWriter(out_dir, specs, shard_bytes)
    gen = torch.Generator().manual_seed(0)
    for spec in specs:
        writer.write(spec.name, (torch.randn(spec.shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.close()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return writer.total_bytes


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f)
                if k in ("VmRSS", "RssAnon", "RssFile")}


def run_child(body: str, src: str, out: str, *, cold: bool, fsync: bool) -> tuple[float, float, int, int, int]:
    """(seconds, CPU seconds, RSS growth, RssAnon growth, RssFile growth at the peak) of `body` in a fresh
    process, reading `src` and writing `out` (removed first). RSS is sampled from this process every 2 ms
    (/proc/<pid>/status), so the measured process runs no sampler of its own."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()  # start from no dirty pages: writeback of an earlier step must not be billed to this one
    code = CHILD.format(body=body.format(src=src, out=out), src=src, out=out, cold=cold, fsync=fsync)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "READY":
            raise RuntimeError(f"bench step failed before starting:\n{proc.communicate()[1][-3000:]}")
        before = peak = _status(proc.pid)
        stop = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not stop.is_set():
                now = _status(proc.pid)
                if now["VmRSS"] > peak["VmRSS"]:
                    peak = now
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        stop.set()
        sampler.join()
        proc.stdin.write("\n")
        proc.stdin.flush()
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode or not line.startswith("RESULT"):
        raise RuntimeError(f"bench step failed:\n{err[-3000:]}")
    seconds, cpu = map(float, line.split()[1:])
    return seconds, cpu, *(peak[k] - before[k] for k in ("VmRSS", "RssAnon", "RssFile"))


def load_average() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=2.0, help="synthetic checkpoint size (default 2)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--shard-gb", type=float, default=0.5,
                        help="HF shard size, of the input and of mcore-to-hf's output (default 0.5)")
    parser.add_argument("--repeat", type=int, default=7, help="rounds counted; each runs both pairs (default 7)")
    parser.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    parser.add_argument("--threads", type=int, default=4, help="--threads of both conversions (default 4)")
    parser.add_argument("--chunk-mb", type=int, default=16, help="--chunk-mb of both conversions (default 16)")
    parser.add_argument("--fsync", action="store_true", help="time includes fsync of every output file (both)")
    parser.add_argument("--cold", action="store_true", help="drop the input files from the page cache first (both)")
    parser.add_argument("--workdir", default="/tmp/bench_convert", help="scratch dir (removed first and after)")
    parser.add_argument("--plan", help=f"print the sizes of converting this model and exit: {sorted(PLANS)} or a "
                        "config.json path (no weights needed)")
    ns = parser.parse_args()
    if ns.plan:
        print_plan(ns.plan, ns.threads, ns.chunk_mb)
        return
    if ns.repeat < 1 or ns.warmup < 0:
        parser.error(f"--repeat must be >= 1 and --warmup >= 0, got {ns.repeat} and {ns.warmup}")
    shutil.rmtree(ns.workdir, ignore_errors=True)
    paths = {k: os.path.join(ns.workdir, k) for k in ("hf", "mc", "mc_out", "hf_out", "copy")}
    config = synthetic_config(ns.size_gb, ns.pp)
    arch = ModelArch.from_hf(config)
    shard_bytes = int(ns.shard_gb * 1e9)
    opts = dict(tp=ns.tp, pp=ns.pp, threads=ns.threads, chunk_mb=ns.chunk_mb, shard_bytes=shard_bytes)
    io = dict(cold=ns.cold, fsync=ns.fsync)
    try:
        total = write_synthetic_hf(paths["hf"], config, shard_bytes)
        run_child(H2M.format(src="{src}", out="{out}", **opts), paths["hf"], paths["mc"], cold=False, fsync=False)
        layer = layer_bytes(arch)
        shards = sum(f.endswith(".safetensors") for f in os.listdir(paths["hf"]))
        print(f"synthetic checkpoint: {arch.num_layers} layers, {total / 1e9:.2f} GB bf16 in {shards} HF shard(s), "
              f"one layer {layer / 1e6:.0f} MB; tp={ns.tp} pp={ns.pp} threads={ns.threads} chunk={ns.chunk_mb} MiB; "
              f"{'cold' if ns.cold else 'warm'} page cache, {'with' if ns.fsync else 'no'} fsync; {ns.warmup} "
              f"warm-up + {ns.repeat} rounds")
        print(f"load average before: {load_average()}")
        pairs = {
            "hf-to-mcore": (H2M.format(src="{src}", out="{out}", **opts), paths["hf"], paths["mc_out"]),
            "mcore-to-hf": (M2H.format(src="{src}", out="{out}", **opts), paths["mc"], paths["hf_out"]),
        }
        piece_copy = PIECE_COPY.replace("{piece}", str(ns.chunk_mb << 20))
        runs: dict[str, list[tuple[float, float, int, int, int]]] = {
            step: [] for name in pairs for step in (f"copy for {name}", f"piece copy for {name}", name)
        }
        for r in range(ns.warmup + ns.repeat):
            for name, (body, src, out) in pairs.items():
                steps = [(f"copy for {name}", COPY, paths["copy"]),
                         (f"piece copy for {name}", piece_copy, paths["copy"]), (name, body, out)]
                for step, step_body, step_out in steps[r % 3:] + steps[:r % 3]:
                    result = run_child(step_body, src, step_out, **io)
                    if r >= ns.warmup:
                        runs[step].append(result)
        print(f"load average after:  {load_average()}")
        print(f"{'step':<32}{'min s':>8}{'median s':>10}{'cpu s':>8}{'RSS+ MB':>9}{'anon':>6}{'file':>6}  all runs (s)")
        for step, rs in runs.items():
            secs = [x[0] for x in rs]
            top = max(rs, key=lambda x: x[2])
            print(f"{step:<32}{min(secs):>8.2f}{statistics.median(secs):>10.2f}"
                  f"{statistics.median(x[1] for x in rs):>8.2f}{top[2] / 1e6:>9.0f}{top[3] / 1e6:>6.0f}"
                  f"{top[4] / 1e6:>6.0f}  " + " ".join(f"{s:.2f}" for s in secs))
        buffers = ns.threads * (ns.chunk_mb << 20)
        bound = layer + buffers
        print(f"{'direction':<14}{'x copy (median of rounds)':>27}{'x copy (min/min)':>18}{'x copy (cpu)':>14}"
              f"{'x piece copy (median)':>23}{'RSS growth MB':>15}{'bound MB':>10}")
        for name in pairs:
            conv, copy, piece = runs[name], runs[f"copy for {name}"], runs[f"piece copy for {name}"]
            paired = statistics.median(a[0] / b[0] for a, b in zip(conv, copy, strict=True))
            mins = min(x[0] for x in conv) / min(x[0] for x in copy)
            cpu = statistics.median(x[1] for x in conv) / max(1e-9, statistics.median(x[1] for x in copy))
            by_piece = statistics.median(a[0] / b[0] for a, b in zip(conv, piece, strict=True))
            grown = max(x[2] for x in conv)
            print(f"{name:<14}{paired:>27.2f}{mins:>18.2f}{cpu:>14.2f}{by_piece:>23.2f}{grown / 1e6:>15.0f}"
                  f"{bound / 1e6:>10.0f}")
        print(f"goal: <= 1.4x copy both ways; RSS growth <= one layer ({layer / 1e6:.0f} MB) + write buffers "
              f"({ns.threads} threads x {ns.chunk_mb} MiB = {buffers / 1e6:.0f} MB) = {bound / 1e6:.0f} MB; "
              f"checkpoint {total / 1e6:.0f} MB")
    finally:
        shutil.rmtree(ns.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
