"""The cost of reading a checkpoint's `.metadata` through checkpoint/safe_read.py, against torch's `pickle.load`.

    python tools/bench_safe_read.py [--repeat 7] [--tp 8] [--pp 2] [--dp 8]

Builds the `.metadata` that megatron-core 0.16.1 writes for a Qwen2.5-32B training checkpoint (bf16 params, the
regular optimizer: fp32 main params and Adam m, v per parameter; TransformerEngine layers; default save, so each
of the TP x PP model-parallel shards is written by its DP rank 0) from the layout alone, with torch's own classes:

- one TensorStorageMetadata per stored key, one chunk per (layer, TP shard) of a TP-split layer tensor (linear_fc1
  two: megatron's SwiGLU factory stores the gate and up halves as separate chunks), one per layer of a norm, per TP
  shard of the embedding and output layer; the optimizer's exp_avg, exp_avg_sq and fp32_param of each key alike;
- one storage record (_StorageInfo) per chunk, in `__<rank>_<i>.distcp` of its writer;
- BytesStorageMetadata for every ShardedObject: one RNG state per rank, one TE `_extra_state` per layer of
  each of the four TE linears, the layer implementation;
- `all_local_plans`: every rank's SavePlan of WriteItems (megatron-core keeps them for its cached plans).

Then it times, over --repeat rounds (fresh reads of a page-cached file, CPU seconds of this process),
`pickle.load` (what torch's FileSystemReader does) and `safe_read.read_metadata` (the restricted unpickler plus the
record-name check), and prints the file size and both medians. Numbers: docs/CHECKPOINTS.md, "Checkpoints from
elsewhere".
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.checkpoint import safe_read  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 5120, 27648, 40, 8, 152064  # Qwen2.5-32B (padded vocab: 152064)
TE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def model_keys(tp: int) -> dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]]:
    """key -> (global shape, [(chunk offset, chunk size)]) of the model tensors, TP-split as megatron-core does."""
    qkv = (HEADS + 2 * KV_HEADS) * HIDDEN // HEADS
    out: dict[str, tuple[tuple[int, ...], list]] = {}

    def split(key: str, shape: tuple[int, ...], axis: int | None, pieces: int = 1) -> None:
        chunks = []
        for layer in range(shape[0]) if key.startswith("decoder.layers.") else [None]:
            inner = shape[1:] if layer is not None else shape
            lead = (layer,) if layer is not None else ()
            ax = None if axis is None else axis - (1 if layer is not None else 0)
            parts = 1 if ax is None else tp * pieces
            for p in range(parts):
                size = list(inner)
                off = [0] * len(inner)
                if ax is not None:
                    size[ax] = inner[ax] // parts
                    off[ax] = p * size[ax]
                chunks.append(((*lead, *off), ((1,) if lead else ()) + tuple(size)))
        out[key] = (shape, chunks)

    L = "decoder.layers."
    split(f"{L}self_attention.linear_qkv.weight", (LAYERS, qkv, HIDDEN), 1)
    split(f"{L}self_attention.linear_qkv.bias", (LAYERS, qkv), 1)
    split(f"{L}self_attention.linear_qkv.layer_norm_weight", (LAYERS, HIDDEN), None)
    split(f"{L}self_attention.linear_proj.weight", (LAYERS, HIDDEN, HIDDEN), 2)
    split(f"{L}mlp.linear_fc1.weight", (LAYERS, 2 * FFN, HIDDEN), 1, pieces=2)
    split(f"{L}mlp.linear_fc1.layer_norm_weight", (LAYERS, HIDDEN), None)
    split(f"{L}mlp.linear_fc2.weight", (LAYERS, HIDDEN, FFN), 2)
    split("embedding.word_embeddings.weight", (VOCAB, HIDDEN), 0)
    split("output_layer.weight", (VOCAB, HIDDEN), 0)
    split("decoder.final_layernorm.weight", (HIDDEN,), None)
    return out


def build_metadata(tp: int, pp: int, dp: int):
    """torch's Metadata of the checkpoint described in the module docstring."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    world = tp * pp * dp
    model = model_keys(tp)
    keys = {k: (k, v) for k, v in model.items()} | {
        f"optimizer.state.{s}.{k}": (k, v) for k, v in model.items() for s in ("exp_avg", "exp_avg_sq", "fp32_param")}
    sd, storage = {}, {}
    plans: list[list] = [[] for _ in range(world)]
    for key, (param, (shape, chunks)) in keys.items():
        dtype = torch.bfloat16 if key == param else torch.float32
        sd[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(shape),
                                        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
        for i, (offset, size) in enumerate(chunks):
            stage = offset[0] * pp // LAYERS if param.startswith("decoder.layers.") else 0
            tp_rank = i % tp
            writer = stage * tp + tp_rank  # DP rank 0 of the (TP, PP) shard: global rank in TP-fastest order
            storage[MetadataIndex(key, torch.Size(offset))] = _StorageInfo(f"__{writer}_{i % 2}.distcp",
                                                                          i * 4096, 4096)
            plans[writer].append(WriteItem(index=MetadataIndex(key, torch.Size(offset), i), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(
                                               chunk=ChunkStorageMetadata(torch.Size(offset), torch.Size(size)),
                                               properties=TensorProperties(dtype=dtype), size=torch.Size(shape))))
    objects = [f"rng_state/shard_{r}_{world}" for r in range(world)] + [
        f"decoder.layers.{m}._extra_state/shard_{layer}_{LAYERS}" for m in TE_LINEARS for layer in range(LAYERS)
    ] + ["layer_impl.transformer_engine/shard_0_1"]
    for n, key in enumerate(objects):
        sd[key] = BytesStorageMetadata()
        rank = n % world
        storage[MetadataIndex(key)] = _StorageInfo(f"__{rank}_0.distcp", 0, 5000)
        plans[rank].append(WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO))
    md = Metadata(state_dict_metadata=sd, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id="/ckpt/run/step_0000100.tmp"))
    md.all_local_plans = [SavePlan(items=items) for items in plans]
    return md


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args(argv)
    md = build_metadata(a.tp, a.pp, a.dp)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ".metadata"
        with open(path, "wb") as f:
            pickle.dump(md, f)
        times: dict[str, list[float]] = {"pickle.load": [], "safe_read.read_metadata": []}
        for _ in range(a.repeat):
            for name, read in (("pickle.load", lambda: pickle.load(open(path, "rb"))),  # noqa: SIM115
                               ("safe_read.read_metadata", lambda: safe_read.read_metadata(tmp))):
                t0 = time.process_time()  # CPU seconds of this process: the VM it was written on is shared
                read()
                times[name].append(time.process_time() - t0)
        assert safe_read.read_metadata(tmp) == pickle.load(open(path, "rb"))  # noqa: SIM115
        print(f".metadata of Qwen2.5-32B TP{a.tp} x PP{a.pp} x DP{a.dp} (regular optimizer, TE): "
              f"{path.stat().st_size / 2**20:.1f} MiB, {len(md.state_dict_metadata)} keys, "
              f"{len(md.storage_data)} records, {sum(len(p.items) for p in md.all_local_plans)} planned writes")
        for name, ts in times.items():
            print(f"  {name:<26} median {statistics.median(ts) * 1e3:8.1f} ms CPU  (min {min(ts) * 1e3:.1f}, "
                  f"{a.repeat} reads)")


if __name__ == "__main__":
    main()
