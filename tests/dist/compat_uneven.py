"""torchrun worker (2 gloo ranks) of tests/unit/compat/test_compat_cpu.py: megatron's first-dim all-gather and
reduce-scatter with uneven split sizes (what the alltoall dispatcher does over the expert-TP group): the gather
through the CPU shim and without it (gloo refuses), the reduce-scatter as megatron has it (no shim: gloo's list
reduce_scatter takes uneven blocks); rank 0 writes argv[1] (json).

Rank r's input rows are `torch.arange` values offset by 1000 r, so every expected output is written out here: the
gather is the ranks' rows concatenated; rank r's reduce-scatter output is the sum over ranks of their r-th block.
The forward + backward of gather_from_sequence_parallel_region (the dispatcher's call) checks the backward's
reduce-scatter: d(sum(w * gathered))/d(input) on rank r = the sum over ranks of w's r-th block (w = 1 + rank).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from megatron_dapo.compat import cpu

SIZES = [3, 5]
H = 4


def rows(rank: int, n: int, offset: int = 0) -> torch.Tensor:
    return (torch.arange(n * H, dtype=torch.float32).reshape(n, H) + 1000 * rank + offset)


def main() -> None:
    dist.init_process_group("gloo")
    cpu.install()
    from megatron.core.tensor_parallel import mappings

    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    out = {}
    x = rows(rank, SIZES[rank])
    gathered = mappings._gather_along_first_dim(x, group, SIZES)
    out["gather_exact"] = torch.equal(gathered, torch.cat([rows(r, n) for r, n in enumerate(SIZES)]))
    full = torch.cat([rows(rank, n, offset=100 * i) for i, n in enumerate(SIZES)])  # block i of this rank
    scattered = mappings._reduce_scatter_along_first_dim(full, group, SIZES)
    out["reduce_scatter_exact"] = torch.equal(scattered, sum(rows(r, SIZES[rank], offset=100 * rank)
                                                             for r in range(world)))
    out["reduce_scatter_unshimmed"] = mappings._reduce_scatter_along_first_dim.__module__ == mappings.__name__
    x = rows(rank, SIZES[rank]).requires_grad_()
    y = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=SIZES)
    (y * (1.0 + rank)).sum().backward()
    out["backward_exact"] = torch.equal(x.grad, torch.full_like(x, float(sum(1.0 + r for r in range(world)))))
    try:
        cpu._original["gather_first_dim"](rows(rank, SIZES[rank]), group, SIZES)
        out["unshimmed_gather_error"] = None
    except RuntimeError as err:  # gloo: "allgather: invalid tensor size"
        out["unshimmed_gather_error"] = str(err).strip().splitlines()[0][:200]
    out["gather_shimmed"] = mappings._gather_along_first_dim is not cpu._original["gather_first_dim"]
    flags = [None] * world
    dist.all_gather_object(flags, out)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(flags, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
