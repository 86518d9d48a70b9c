"""A megatron-core dist checkpoint (torch_dist) -> HF safetensors shards + index + config + tokenizer files.

Reads converter output and this project's training checkpoints (`<save>/step_N/`, any TP/PP; optimizer
state is ignored) alike: every HF tensor is a set of row ranges of a stored (TP=1) tensor
(`hf_row_segments`), copied file to file at their offsets in the HF shards (headers first), in the
kernel where a range lies in one stored chunk; --threads row blocks at once, taken round-robin over the
shards so that they write different files. Memory: none for kernel copies, else --threads blocks of at
most --chunk-mb.

Cost at Qwen2.5-32B (65.5 GB bf16): converter output goes entirely through copy_file_range (RSS
growth ~0, vs the goal's bound of one 975 MB layer plus 64 MiB of write buffers). A training
checkpoint at TP8 too for its column-parallel tensors (qkv per query group, fc1, vocab), but a row
block of a row-parallel one (o_proj, fc2: stored split by columns) or one straddling two ranks' rows
is assembled in memory from the chunks: at most --threads x --chunk-mb = 64 MiB resident. The 13 HF
shards of <= 5 GiB (--max-shard-size) are written 4 at a time. The time is a byte copy of 65.5 GB times the ratio
`tools/bench_convert.py` measures at 2 GB (0.6-0.7x with 5 shards, 0.8-1.2x with one file).

Mixture of experts: every HF expert tensor is rows of index (layer, expert) of a stored expert tensor, whatever the
EP it was saved under (the axis is global); an MoE layer's pre-MLP norm is read under the key the checkpoint has it
under, a TE model's (`pre_mlp_layernorm.weight`) or a local-spec run's (`mlp.linear_fc1.layer_norm_weight`). At
Qwen3-30B-A3B: 18,432 expert jobs of 3 MiB among 18,867 tensors, 61.1 GB; converter output is copied in the kernel
(~0 resident); a training save at expert-TP > 1 assembles an expert's fc1 / fc2 rows from its shards: --threads
blocks of at most --chunk-mb (64 MiB), never a layer (805 MB).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from checkpoint_convert.atomic_dir import atomic_output_dir
from checkpoint_convert.hf_to_mcore import ASSETS_DIR, DTYPES
from megatron_dapo.checkpoint.ckpt_config import (
    StoredTensor,
    check_global_shapes,
    check_same_arch,
    checkpoint_impl,
    read_hf_config,
    stored_tensors,
)
from megatron_dapo.checkpoint.dist_ckpt import DistCheckpointReader
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.weights.hf_format import DEFAULT_SHARD_BYTES, HFShardedWriter, copy_assets
from megatron_dapo.weights.layout import hf_row_segments, hf_shapes
from megatron_dapo.weights.mapping import hf_names
from megatron_dapo.weights.plan import entry_dtype, hf_tensor_specs
from megatron_dapo.weights.safetensors_io import CheckpointError

_UNITS = {"KB": 1024, "MB": 1024**2, "GB": 1024**3, "B": 1}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '1234' -> bytes (binary units, as transformers' max_shard_size)."""
    t = text.strip().upper()
    for unit, scale in _UNITS.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size {text!r}: expected a size like 5GB, 500MB or a byte count")


@dataclass(kw_only=True)
class McoreToHfConfig:
    load: str
    """--load: converter output, a training run's --save directory, or one step_N / iteration directory."""
    save: str
    """--save: output HF model directory."""
    hf_config: str | None = None
    """--hf-config: config.json (or its dir) to write; checked against the checkpoint. Needed for training
    checkpoints, which store no HF config."""
    tokenizer_path: str | None = None
    """--tokenizer-path: copy tokenizer files from here instead of <load>/hf_assets."""
    max_shard_size: str = "5GB"
    """--max-shard-size: largest HF shard."""
    dtype: str | None = None
    """--dtype: fp32 | bf16 | fp16; default keeps the checkpoint's dtype."""
    overwrite: bool = False
    """--overwrite: replace an existing --save directory."""
    threads: int = 4
    """--threads: row blocks converted and written in parallel."""
    chunk_mb: int = 16
    """--chunk-mb: largest row block read and written at once (bounds memory per thread)."""

    def __post_init__(self) -> None:
        if self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")
        if self.chunk_mb < 1:
            raise ValueError(f"--chunk-mb must be >= 1, got {self.chunk_mb}")
        if not os.path.isdir(self.load):
            raise FileNotFoundError(f"--load {self.load} is not a directory")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        self.chunk_bytes = self.chunk_mb << 20
        self.max_shard_bytes = parse_size(self.max_shard_size) if self.max_shard_size else DEFAULT_SHARD_BYTES


def _resolve_config(cfg: McoreToHfConfig, reader: DistCheckpointReader) -> dict[str, Any]:
    """The HF config to write: --hf-config (checked against the stored one), else the stored one."""
    stored = reader.common.get("hf_config")
    if cfg.hf_config is None:
        if stored is None:
            raise CheckpointError(
                f"--load {cfg.load} stores no HF config (a training checkpoint): pass --hf-config with the "
                "config.json of the model it was trained from"
            )
        return dict(stored)
    given = read_hf_config(cfg.hf_config, flag="--hf-config")
    if stored is not None:
        check_same_arch(ModelArch.from_hf(stored), ModelArch.from_hf(given),
                        stored_from=f"--load {cfg.load}", requested_from=f"--hf-config {cfg.hf_config}")
    return given


def _stored_tensors(reader: DistCheckpointReader, arch: ModelArch) -> list[StoredTensor]:
    """The model tensors of `arch` under the keys this checkpoint holds them under: a TE model's (converter output,
    a TE run's save) or a local-spec run's (they differ in an MoE layer's pre-MLP norm; `checkpoint_impl`)."""
    return stored_tensors(arch, checkpoint_impl(reader.tensors, arch))


def _model_dtype(reader: DistCheckpointReader, arch: ModelArch) -> torch.dtype:
    dtypes = {reader.dtype(t.key) for t in _stored_tensors(reader, arch) if not t.entry.buffer}
    if len(dtypes) != 1:
        raise CheckpointError(f"{reader.dir} mixes dtypes {sorted(map(str, dtypes))} in its model; pass --dtype")
    return dtypes.pop()


@dataclass(frozen=True)
class Job:
    """HF rows lo:hi of HF tensor `hf_index` of `stored`'s entry at (`layer`, `expert`) = rows row:row + hi - lo
    of the stored tensor after its leading indices `index` (layer where stacked, expert of an expert tensor)."""

    stored: StoredTensor
    layer: int | None
    expert: int | None
    hf_index: int
    lo: int
    hi: int
    row: int

    @property
    def hf_name(self) -> str:
        return hf_names(self.stored.entry, layer=self.layer, tied=False, expert=self.expert)[self.hf_index]

    @property
    def index(self) -> tuple[int, ...]:
        return self.stored.index(self.layer, self.expert)


def _jobs(reader: DistCheckpointReader, arch: ModelArch, chunk_bytes: int) -> list[Job]:
    """Row blocks of at most chunk_bytes in HF file order (per layer: its entries in table order, an expert
    entry expert by expert), each inside one `hf_row_segments` range (so one byte range of a stored chunk in
    converter output; qkv gives three ranges per query group)."""
    by_layer: dict[int | None, list[StoredTensor]] = {}
    for t in _stored_tensors(reader, arch):
        for layer in t.layers:
            by_layer.setdefault(layer, []).append(t)
    jobs: list[Job] = []
    for stage in ("first", "layer", "last"):
        layers: list[int | None] = list(range(arch.num_layers)) if stage == "layer" else [None]
        for layer in layers:
            for t in by_layer.get(layer, []):
                if t.entry.stage != stage:
                    continue
                itemsize = reader.dtype(t.key).itemsize
                shapes = hf_shapes(t.entry, arch)
                segments = sorted(hf_row_segments(t.entry, arch), key=lambda s: (s.hf_index, s.hf_lo))
                for expert in range(arch.num_experts) if t.entry.per_expert else (None,):
                    for seg in segments:
                        step = max(1, chunk_bytes // (itemsize * torch.Size(shapes[seg.hf_index][1:]).numel()))
                        jobs += [
                            Job(t, layer, expert, seg.hf_index, lo, min(seg.hf_hi, lo + step),
                                seg.row + lo - seg.hf_lo)
                            for lo in range(seg.hf_lo, seg.hf_hi, step)
                        ]
    return jobs


def interleave_by_shard(jobs: list[Job], shard_of: Callable[[Job], int]) -> list[Job]:
    """`jobs` reordered round-robin over their output shards (file order kept within each shard), so that
    consecutive jobs, the ones running at once, write different files.

    One file takes one write at a time (`PositionalSafetensorsWriter`), so in file order `--threads` only
    overlaps within a shard's lock. At Qwen2.5-32B (65.5 GB, 14 shards of <= 5 GB) the 4 threads write 4
    shards at once; a model of one shard is written as before.
    """
    queues: dict[int, deque[Job]] = {}
    for job in jobs:
        queues.setdefault(shard_of(job), deque()).append(job)
    order: list[Job] = []
    while queues:
        for shard in list(queues):
            order.append(queues[shard].popleft())
            if not queues[shard]:
                del queues[shard]
    return order


def write_hf_tensors(
    reader: DistCheckpointReader, arch: ModelArch, writer: HFShardedWriter, dtype: torch.dtype, threads: int,
    chunk_bytes: int,
) -> None:
    """Convert and write every tensor as row blocks, `threads` at a time.

    Each block is one byte range of the checkpoint copied to one byte range of an HF file
    (`hf_row_segments`; qkv is de-interleaved as three ranges per query group). Where the range lies in
    one stored chunk and no --dtype cast is asked (converter output always; training checkpoints at
    TP=1, and at any TP but for blocks that cross a TP shard boundary) the kernel copies it
    (copy_file_range): no byte enters this process, RSS does not grow. Otherwise the block is mapped or
    assembled from its chunks, cast, and pwritten: `threads` blocks of at most chunk_bytes in memory
    (at Qwen2.5-32B, --threads 4 --chunk-mb 16: 64 MiB).
    """

    def run(job: Job) -> None:
        key, name = job.stored.key, job.hf_name
        rows = (job.row, job.row + job.hi - job.lo)
        out = entry_dtype(job.stored.entry, dtype)  # a buffer stays fp32 (weights.plan.BUFFER_DTYPE)
        src = reader.byte_range(key, job.index, rows) if reader.dtype(key) == out else None
        if src is not None:
            writer.copy_rows(name, job.lo, job.hi - job.lo, *src)
        else:
            writer.write_rows(name, job.lo, reader.read(key, job.index, rows).to(out))

    with ThreadPoolExecutor(max_workers=threads) as pool:
        window: deque[Future[None]] = deque()
        try:
            for job in interleave_by_shard(_jobs(reader, arch, chunk_bytes), lambda j: writer.shard_of(j.hf_name)):
                window.append(pool.submit(run, job))
                if len(window) >= 2 * threads:  # queued jobs hold no data; only running ones do
                    window.popleft().result()
            while window:
                window.popleft().result()
        except BaseException:
            for future in window:
                future.cancel()
            raise


def mcore_to_hf(cfg: McoreToHfConfig) -> list[str]:
    """Convert; returns the HF tensor names written, in file order."""
    with DistCheckpointReader(cfg.load) as reader:
        hf_config = _resolve_config(cfg, reader)
        arch = ModelArch.from_hf(hf_config)
        shapes = {k: reader.shape(k) for k in reader.tensors}
        check_global_shapes(shapes, arch, source=f"--load {cfg.load}", against="the HF config")
        dtype = DTYPES[cfg.dtype] if cfg.dtype else _model_dtype(reader, arch)
        specs = hf_tensor_specs(arch, dtype)
        with atomic_output_dir(cfg.save, overwrite=cfg.overwrite) as tmp:
            writer = HFShardedWriter(tmp, specs, cfg.max_shard_bytes)
            try:
                write_hf_tensors(reader, arch, writer, dtype, cfg.threads, cfg.chunk_bytes)
                writer.close()
            except BaseException:
                writer.abort()
                raise
            # transformers >= 5 writes "dtype", older versions "torch_dtype": update whichever is there.
            for key in [k for k in ("torch_dtype", "dtype") if k in hf_config] or ["torch_dtype"]:
                hf_config[key] = _DTYPE_NAMES[dtype]
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(hf_config, f, indent=2)
            copy_assets(cfg.tokenizer_path or os.path.join(cfg.load, ASSETS_DIR), tmp)
    return [s.name for s in specs]
