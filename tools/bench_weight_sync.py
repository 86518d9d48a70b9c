"""Distributed weight sync at PP2: the whole-model path (before) vs every stage sending its own (after).

One torchrun launch (gloo, CPU) of a random tiny Qwen2 at TP --tp x PP2 pushes the same weights to --servers
fake SGLang servers (tests/sglang/fake_server.py, in this process: real gloo groups, one collective request at
a time per server as SGLang's scheduler) through both paths, alternating, --repeats times each:
- before: every rank iterates iter_hf_weights (TP gather, then every tensor broadcast over PP) and global rank 0
  alone buckets and broadcasts the whole model to the servers (ServerPush.update, weight_sync/server_push.py);
- after: weight_sync/stage_push.py: each stage's (DP 0, TP 0) rank gathers and sends its own stage over its own
  group; stage 1's source then sends its host copy to rank 0 over PP.
It prints the median seconds of each (rank 0's wall time of the whole update, servers' replies included) and
the bytes each rank sent to the servers and over PP, then the same arithmetic at the production setting.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tools/bench_weight_sync.py

On this 2-core CPU host the fake servers and the ranks share the cores, so the seconds say little about a GPU
cluster; the bytes are exact.

    PYTHONPATH=. .venv/bin/python tools/bench_weight_sync.py --sizing-only

prints only the per-sync sizing at the production settings, from config.json shapes (no weights, no launch):
Qwen3-30B-A3B next to the dense Qwen2.5-32B: tensors, bytes (bf16), requests per server at the bucket size
(weight_sync/buckets.py plan_buckets: the bucketing rule of every push), rank 0's host copy, and the tensor-mode
handle bytes (each tensor of a bucket travels as a pickled view of the bucket's one shared buffer).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GB = 1e9


def _worker(path: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
    from megatron_dapo.distributed import comm
    from megatron_dapo.distributed.parallel import ParallelLayout, padded_vocab_size
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
    from megatron_dapo.weight_sync.build import build_weight_sync
    from megatron_dapo.weights.export import iter_hf_weights, iter_stage_hf_weights
    from tests.dist.actor_common import hf_to_full_mcore, mcore_shards_for_rank

    data = torch.load(path, weights_only=False)
    arch = ModelArch(**data["arch"])
    layout = ParallelLayout(tp=data["tp"], pp=2, dp=1)
    init_parallel(layout, seed=0)
    actor = MegatronActor(arch, ActorConfig(lr=1e-3, use_fused_logprob=False), layout)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    full = hf_to_full_mcore(data["hf_state_dict"], arch)
    actor.load_shards(mcore_shards_for_rank(full, arch, tp=layout.tp, tp_rank=tp_rank, pp=2, pp_rank=pp_rank,
                                            padded_vocab=padded_vocab_size(arch.vocab_size, layout.tp)))
    wait = comm.gloo_group(None, timeout=timedelta(minutes=10))
    rank = dist.get_rank()
    engine = None
    if rank == 0:
        engine = SGLangEngine(server_urls=data["urls"], client=ClientConfig(
            bucket_bytes=data["bucket_bytes"], sync_backend="gloo", sync_master_port=data["port"],
            control_timeout_s=120))
    # StagePush (distributed, PP 2); rank 0's full push inside
    sync = build_weight_sync(engine, transport="distributed", wait_group=wait)
    own = sum(t.numel() * t.element_size() for _, t in iter_stage_hf_weights(actor.chunks, arch))
    total = int(comm.all_reduce(torch.tensor([own if tp_rank == 0 else 0], dtype=torch.int64), group=wait))
    times: dict[str, list[float]] = {"before": [], "after": []}
    after_stats = None
    version = 0
    for _ in range(data["repeats"]):
        for path_name in ("before", "after"):
            version += 1
            comm.barrier(wait)
            t0 = time.perf_counter()
            if path_name == "before":
                named = iter_hf_weights(actor.chunks, arch)
                if engine is not None:
                    sync.coordinator.full.update(named, version=version)
                else:
                    for _ in named:
                        pass
            else:
                sync.push(actor, version)
                after_stats = sync.stats
            comm.barrier(wait)
            times[path_name].append(time.perf_counter() - t0)
    # before: each rank's PP group broadcasts every tensor from its stage: it sends its stage, receives the other
    before = {"to_servers": total if rank == 0 else 0, "pp_received": total - own, "pp_sent": own}
    row = {"rank": rank, "stage": pp_rank, "tp_rank": tp_rank, "own": own, "total": total, "times": times,
           "before": before, "after": vars(after_stats)}
    torch.save(row, f"{data['out']}/row{rank}.pt")
    if engine is not None:
        engine.shutdown()
    comm.barrier(wait)
    destroy_parallel()


def production(model_gb: float = 65.0, tp: int = 8, pp: int = 2, nodes: int = 16, servers: int = 16,
               server_tp: int = 4) -> list[str]:
    """The same bytes at Qwen2.5-32B bf16 (model_gb), TP8 x PP2 on 16 x 8 GPUs, 16 servers at TP4."""
    ranks = nodes * 8
    dp = ranks // (tp * pp)
    stage = model_gb / pp
    return [
        f"production: {model_gb:.0f} GB bf16 model, TP{tp} x PP{pp} x DP{dp} ({ranks} ranks), {servers} servers at "
        f"TP{server_tp} (sync group 1 + {servers * server_tp} ranks per stage)",
        f"  before: every rank receives the other stage over PP: {stage:.1f} GB x {ranks} = "
        f"{stage * ranks / 1000:.2f} TB per sync; every rank TP-gathers its stage ({stage * (tp - 1) / tp:.1f} GB "
        f"received each); rank 0 alone sends {model_gb:.0f} GB to the servers",
        f"  after:  PP traffic is stage 1's host copy to rank 0, {stage * (pp - 1):.1f} GB once; "
        f"{tp * pp} ranks (DP replica 0) gather, {ranks - tp * pp} move nothing; each of the {pp} stage sources "
        f"sends {stage:.1f} GB to the servers (one bucket on the wire at a time; gathers overlap)",
        f"  rank 0 host copy: {model_gb:.0f} GB (unchanged); stage 1 source: {stage:.1f} GB until sent to rank 0",
    ]


SIZING_MODELS = {
    "qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False,
                          rms_norm_eps=1e-6),
    "qwen2.5-32B": dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                        num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
                        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-5),
}
"""config.json fields of the production models (the shapes only; no weights are read)."""


def handle_bytes_per_tensor(count: int = 256) -> float:
    """Base64 bytes per tensor of a tensor-mode /update_weights_from_tensor body, measured: `count` views of one
    shared-memory bucket serialized as the push does (weight_sync/tensor_ipc.py); per-expert-like names."""
    from megatron_dapo.weight_sync.buckets import iter_buckets
    from megatron_dapo.weight_sync.tensor_ipc import serialize_named_tensors

    named = [(f"model.layers.47.mlp.experts.{e}.gate_proj.weight", torch.zeros(4, 4, dtype=torch.bfloat16))
             for e in range(count)]
    bucket = next(iter_buckets(named, 1 << 30))
    bucket.flat.share_memory_()
    return len(serialize_named_tensors(bucket.named_tensors())) / count


def sizing(bucket_bytes: int) -> list[str]:
    """Per-sync sizing of each SIZING_MODELS model in bf16 at `bucket_bytes`, side by side."""
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.weight_sync.buckets import plan_buckets
    from megatron_dapo.weights.plan import hf_tensor_specs

    per_tensor = handle_bytes_per_tensor()
    cols = {}
    for name, fields in SIZING_MODELS.items():
        arch = ModelArch.from_hf(fields)
        specs = hf_tensor_specs(arch, torch.bfloat16)
        plan = plan_buckets(((t.nbytes, t.dtype) for t in specs), bucket_bytes)
        experts = [t for t in specs if ".experts." in t.name]
        cols[name] = [
            f"{arch.num_parameters() / 1e9:.1f}B ({arch.num_parameters(active=True) / 1e9:.1f}B active)",
            f"{plan.tensors:,}", f"{len(experts):,}",
            f"{experts[0].nbytes / 2**20:.1f} MiB" if experts else "-",
            f"{plan.nbytes / GB:.2f} GB", f"{plan.buckets}", f"{plan.largest_bucket / 2**20:.0f} MiB",
            f"{(plan.nbytes + bucket_bytes) / 2**30:.1f} GiB", f"{plan.tensors * per_tensor / 2**20:.2f} MiB",
        ]
    labels = ["parameters", "tensors per sync", "of which expert tensors", "one expert tensor (bf16)",
              "bytes per sync (bf16)", f"requests per server ({bucket_bytes >> 20} MiB buckets)", "largest bucket",
              "rank 0 host copy (+ one bucket)", f"tensor-mode handles (~{per_tensor:.0f} B a tensor)"]
    names = list(cols)
    lines = [f"{'per sync, bf16':38}" + "".join(f"{n:>24}" for n in names)]
    lines += [f"{label:38}" + "".join(f"{cols[n][i]:>24}" for n in names) for i, label in enumerate(labels)]
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size of the actor (ranks = 2 x tp)")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--server-tp", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=32500, help="first master port of the sync groups")
    p.add_argument("--sizing-only", action="store_true",
                   help="print the per-sync sizing of Qwen3-30B-A3B and Qwen2.5-32B at --sizing-bucket-mb, no launch")
    p.add_argument("--sizing-bucket-mb", type=int, default=512, help="bucket size of the sizing (the default "
                   "--weight-sync-bucket-mb)")
    args = p.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    if args.sizing_only:
        for line in sizing(args.sizing_bucket_mb << 20):
            print(line)
        return
    from megatron_dapo.models.hf_config import ModelArch
    from tests.dist.actor_common import tiny_hf_model
    from tests.sglang.fake_server import serve
    from tests.torchrun import free_port, subprocess_env

    hf = tiny_hf_model(seed=0, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                       num_hidden_layers=args.num_layers, vocab_size=args.vocab_size)
    servers = [serve(tp_size=args.server_tp) for _ in range(args.servers)]
    with tempfile.TemporaryDirectory() as tmp:
        data = {"arch": vars(ModelArch.from_hf(hf.config)), "hf_state_dict": hf.state_dict(), "tp": args.tp,
                "urls": [f"http://127.0.0.1:{s.server_address[1]}" for s, _ in servers], "port": args.port,
                "bucket_bytes": int(args.bucket_mb * 2**20), "repeats": args.repeats, "out": tmp}
        torch.save(data, f"{tmp}/in.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={2 * args.tp}",
               "--master_addr=127.0.0.1", f"--master_port={free_port()}", __file__, "--worker", f"{tmp}/in.pt"]
        t0 = time.perf_counter()
        subprocess.run(cmd, cwd=REPO, env=subprocess_env(), check=True, capture_output=True)
        rows = [torch.load(f"{tmp}/row{r}.pt", weights_only=False) for r in range(2 * args.tp)]
    for server, _ in servers:
        server.shutdown()
        server.server_close()
    total = rows[0]["total"]
    tb, ta = (statistics.median(rows[0]["times"][k]) for k in ("before", "after"))
    print(f"model {total / 2**20:.1f} MiB fp32, TP{args.tp} x PP2 ({len(rows)} gloo ranks), {args.servers} fake "
          f"servers at TP{args.server_tp}, {args.bucket_mb:g} MiB buckets; median of {args.repeats} "
          f"(launch {time.perf_counter() - t0:.0f} s)")
    print(f"{'':42}{'before':>12}{'after':>12}{'after/before':>14}")
    print(f"{'sync seconds (rank 0 wall)':42}{tb:12.3f}{ta:12.3f}{ta / tb:14.2f}")
    for r in rows:
        b, a = r["before"], r["after"]
        who = f"rank {r['rank']} (stage {r['stage']}, tp {r['tp_rank']})"
        for key, label in (("to_servers", "to servers"), ("pp_received", "received over PP"),
                           ("pp_sent", "sent over PP")):
            print(f"{who + ' ' + label:42}{b[key] / 2**20:10.2f}MiB{a[key] / 2**20:10.2f}MiB")
    for line in production():
        print(line)
    for line in sizing(512 << 20):
        print(line)


if __name__ == "__main__":
    main()
