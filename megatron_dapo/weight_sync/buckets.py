"""Packing a stream of named tensors into flat buckets of about `bucket_bytes` for weight sync.

Sending one tensor per call costs one round trip per tensor (hundreds for a 7B model); one flat buffer per
bucket costs one allocation, one shared-memory segment or one broadcast per ~512 MB instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[Bucket]:
    """Groups tensors in arrival order into buckets of at most `bucket_bytes` (a larger tensor gets a bucket
    of its own); a change of dtype closes the bucket, since a flat buffer has one dtype.

    Holds at most one bucket's tensors at a time, so a generator input (e.g. TP-gathered layers) streams.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1 (--weight-sync-bucket-mb), got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0

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
        if pending and (size + nbytes > bucket_bytes or tensor.dtype != pending[0][1].dtype):
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield flush()
