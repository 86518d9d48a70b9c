"""Packing a stream of named tensors into flat buckets of about `bucket_bytes` for weight sync.

Sending one tensor per call costs one round trip per tensor (hundreds for a 7B model); one flat buffer per
bucket costs one allocation, one shared-memory segment or one broadcast per ~512 MB instead.

The request count of a sync is a function of its bytes, not of its tensor count (`plan_buckets`): greedy packing in
arrival order closes a bucket only when the next tensor would overflow it (or its dtype differs), so any two
consecutive buckets hold more than `bucket_bytes` together and a sync of B bytes in one dtype is at most
2 x ceil(B / bucket_bytes) requests, whatever the tensor count. At Qwen3-30B-A3B (bf16, 18,432 expert tensors of
3 MiB among 18,867 tensors, 61.1 GB) the default 512 MiB buckets give 114 requests per server (`plan_buckets` on its
tensor list; tools/bench_weight_sync.py prints it next to the dense model); the dense Qwen2.5-32B (771 tensors,
65.5 GB) 194, since its 270 MiB MLP matrices fit one to a bucket. Each bucket is one request per server whatever it
holds; in tensor mode the body carries a ~129 B handle per tensor (2.3 MiB per sync at 30B-A3B).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """Where one tensor lives in its bucket's flat buffer (offset and numel in elements)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int


@dataclass(kw_only=True)
class Bucket:
    """One flat 1-D buffer (a single dtype) and the metadata to cut it back into named tensors."""

    flat: torch.Tensor
    metas: list[TensorMeta]

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Views into `flat` (no copy): [(name, tensor of meta.shape)]."""
        return [(m.name, self.flat[m.offset : m.offset + m.numel].view(m.shape)) for m in self.metas]


def closes_bucket(size: int, count: int, bucket_dtype: torch.dtype | None, nbytes: int, dtype: torch.dtype,
                  bucket_bytes: int) -> bool:
    """Whether a tensor of `nbytes` / `dtype` starts a new bucket after one holding `count` tensors of `size` bytes of
    `bucket_dtype`: it would overflow it, or its dtype differs (a flat buffer has one dtype). The one rule of
    iter_buckets and plan_buckets."""
    return count > 0 and (size + nbytes > bucket_bytes or dtype != bucket_dtype)


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """What a sync of a tensor list costs in buckets (= requests / broadcasts per server): see plan_buckets."""

    tensors: int
    nbytes: int
    buckets: int
    largest_bucket: int
    """Bytes of the largest bucket (a tensor above bucket_bytes gets one of its own: the embedding at 30B-A3B)."""


def plan_buckets(sizes: Iterable[tuple[int, torch.dtype]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketPlan:
    """The buckets iter_buckets makes of tensors of these (bytes, dtype), in order, without any tensor: for sizing a
    sync at the production setting from a config (weights.plan.hf_tensor_specs)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (--weight-sync-bucket-mb), got {bucket_bytes}")
    tensors = total = buckets = largest = size = count = 0
    dtype: torch.dtype | None = None
    for nbytes, dt in sizes:
        if closes_bucket(size, count, dtype, nbytes, dt, bucket_bytes):
            largest, size, count = max(largest, size), 0, 0
        if count == 0:
            buckets, dtype = buckets + 1, dt
        size, count, tensors, total = size + nbytes, count + 1, tensors + 1, total + nbytes
    return BucketPlan(tensors=tensors, nbytes=total, buckets=buckets, largest_bucket=max(largest, size))


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    keep_together: Mapping[str, str] | None = None,
) -> Iterator[Bucket]:
    """Groups tensors in arrival order into buckets of at most `bucket_bytes` (a larger tensor gets a bucket
    of its own); a change of dtype closes the bucket, since a flat buffer has one dtype. `keep_together` maps a
    tensor's name to its partner's (`weights.mapping.keep_together`: a pair the server fuses only within one
    request): from the first of a pair until its partner, the bucket stays open even past `bucket_bytes` (by the
    tensors in between); a partner that never comes is a ValueError.

    Holds at most one bucket's tensors at a time, so a generator input (e.g. TP-gathered layers) streams.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (--weight-sync-bucket-mb), got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    pairs, awaiting = dict(keep_together or {}), set()

    def flush() -> Bucket:
        flat = torch.cat([t.detach().reshape(-1) for _, t in pending])
        metas, offset = [], 0
        for name, t in pending:
            metas.append(TensorMeta(name=name, shape=tuple(t.shape), dtype=t.dtype, offset=offset,
                                    numel=t.numel()))
            offset += t.numel()
        return Bucket(flat=flat, metas=metas)

    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if awaiting and pending and tensor.dtype != pending[0][1].dtype:
            raise ValueError(f"{sorted(awaiting)[0]} must travel in one bucket with its pair, but {name} of another "
                             f"dtype ({tensor.dtype}, not {pending[0][1].dtype}) comes in between")
        if not awaiting and closes_bucket(size, len(pending), pending[0][1].dtype if pending else None, nbytes,
                                          tensor.dtype, bucket_bytes):
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
        awaiting.discard(name)  # the partner is in: the bucket may close after it
        if name in pairs:
            awaiting.add(pairs[name])
    if awaiting:
        raise ValueError(f"{sorted(awaiting)} never came: each must travel in one bucket with its pair")
    if pending:
        yield flush()
