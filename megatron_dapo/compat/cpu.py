"""Device shims that let megatron-core train on a CPU-only torch (gloo), and a no-op under CUDA.

megatron-core assumes a GPU in ~200 places: `torch.cuda.current_device()` as a device,
`torch.cuda.synchronize()` after p2p, hard-coded `device="cuda"` tensors, `.cuda()` moves and
`Tensor.type() == "torch.cuda.FloatTensor"` checks. Patching each site would be brittle, so the
shims are three process-wide redirections:

1. `torch.cuda.current_device()` returns ``"cpu"`` (every site passes it as a ``device=``).
2. `torch.cuda.synchronize()` is a no-op (there is no asynchronous device stream on CPU).
3. A `TorchFunctionMode` on the installing thread maps any ``cuda`` device argument to ``cpu``,
   makes `Tensor.cuda()` return the tensor itself and reports `Tensor.type()` with the ``cuda``
   prefix, so megatron's dtype checks accept fp32 CPU tensors.

`SHIMS` lists the megatron-core files each shim serves (audited for `CHECKED_MEGATRON_CORE_VERSION`);
`scan_cuda_sites()` recounts the sites so a test fails loudly when an upgrade adds one.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

CHECKED_MEGATRON_CORE_VERSION = "0.16.1"


@dataclass(frozen=True, kw_only=True)
class Shim:
    name: str
    """What is redirected."""
    files: tuple[str, ...]
    """megatron/core files (relative) on the CPU training path that need it (audited line numbers)."""


SHIMS: tuple[Shim, ...] = (
    Shim(name="torch.cuda.current_device() -> 'cpu'", files=(
        "distributed/param_and_grad_buffer.py:800,806",
        "models/common/embeddings/rotary_pos_embedding.py:162",
        "pipeline_parallel/p2p_communication.py:313,321",
        "utils.py:631",
        "optimizer/distrib_optimizer.py:791",
        "dist_checkpointing/strategies/state_dict_saver.py:252",
    )),
    Shim(name="torch.cuda.synchronize() -> no-op", files=(
        "pipeline_parallel/p2p_communication.py:398",
        "dist_checkpointing/strategies/filesystem_async.py:230",
    )),
    Shim(name="device='cuda' / Tensor.cuda() -> cpu (TorchFunctionMode)", files=(
        "optimizer/optimizer.py:481,485,907",
        "optimizer/clip_grads.py:103,174",
        "utils.py:1207",
        "pipeline_parallel/schedules.py:596,2138",
    )),
    Shim(name="CUDA RNG state get/set -> empty state / no-op (activation recomputation's checkpoint)", files=(
        "tensor_parallel/random.py:55,84-111",
    )),
    Shim(name="Tensor.type() -> 'torch.cuda.<T>Tensor' (TorchFunctionMode)", files=(
        "optimizer/clip_grads.py:167",
        "optimizer/distrib_optimizer.py:361,420,582",
    )),
    Shim(name="MoE alltoall dispatcher: no DtoH side stream; split sizes as numpy (gloo's all_to_all_single)", files=(
        "transformer/moe/token_dispatcher.py:444-445,862-901",
        "transformer/moe/moe_utils.py:1093",
    )),
    Shim(name="uneven first-dim all-gather on gloo -> padded to the largest split, then cut", files=(
        "tensor_parallel/mappings.py:148-150",
        "transformer/moe/token_dispatcher.py:693-701",
    )),
)

MOE_ROUTER_TE_FIX = "transformer/moe/moe_utils.py:22-39,1192,1225"
"""megatron-core 0.16.1 reads the module global `te_general_gemm` in the router's linear, bound only when
TransformerEngine imports: without TE (CPU, or --transformer-impl local on GPU) every router forward raises
NameError. `install_moe_fixes` binds it to None (the torch.mm path), on any device."""

# Site counts of megatron-core 0.16.1 per pattern, in the files the shims serve and in the whole
# package; `scan_cuda_sites` must reproduce them, otherwise the audit above is stale.
SITE_PATTERNS: dict[str, str] = {
    "current_device": r"torch\.cuda\.current_device\(\)",
    "synchronize": r"torch\.cuda\.synchronize\(\)",
    "device_cuda": r"device=['\"]cuda['\"]",
    "dot_cuda": r"\.cuda\(",
    "type_string": r"'torch\.cuda\.[A-Za-z0-9]+Tensor'",
}
# file (or "<all>"): (current_device, synchronize, device_cuda, dot_cuda, type_string)
PINNED_SITE_COUNTS: dict[str, tuple[int, int, int, int, int]] = {
    "dist_checkpointing/strategies/filesystem_async.py": (0, 1, 0, 0, 0),
    "dist_checkpointing/strategies/state_dict_saver.py": (1, 0, 1, 0, 0),
    "distributed/param_and_grad_buffer.py": (3, 0, 1, 0, 0),
    "models/common/embeddings/rotary_pos_embedding.py": (3, 0, 0, 0, 0),
    "optimizer/clip_grads.py": (0, 0, 5, 0, 1),
    "optimizer/distrib_optimizer.py": (2, 0, 0, 1, 5),
    "optimizer/optimizer.py": (1, 0, 4, 2, 3),
    "pipeline_parallel/p2p_communication.py": (6, 2, 0, 0, 0),
    "pipeline_parallel/schedules.py": (0, 0, 3, 0, 0),
    "utils.py": (2, 1, 6, 1, 0),
    "<all>": (175, 31, 59, 21, 9),
}

_lock = threading.Lock()
_installed_mode: TorchFunctionMode | None = None
_original: dict[str, Callable[..., Any]] = {}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int device means cuda:<int> to torch; it can only come from GPU-assuming code here.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirect cuda devices to cpu for every torch call made on this thread."""

    def __torch_function__(self, func, types, args: tuple = (), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            # 'torch.FloatTensor' -> 'torch.cuda.FloatTensor' so megatron's fp32 checks pass.
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if i > 0 and _is_cuda_device(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def check_megatron_version() -> None:
    """Raise when the installed megatron-core is not the version the shims were audited against."""
    version = megatron_core_version()
    if version != CHECKED_MEGATRON_CORE_VERSION:
        raise RuntimeError(
            f"megatron_dapo.compat.cpu was audited against megatron-core {CHECKED_MEGATRON_CORE_VERSION}, "
            f"found {version}: re-run tests/unit/compat/test_compat_cpu.py, update SHIMS/PINNED_SITE_COUNTS in "
            f"megatron_dapo/compat/cpu.py, or install megatron-core=={CHECKED_MEGATRON_CORE_VERSION}"
        )


def install() -> bool:
    """Install the CPU shims once per process (the mode on the calling thread).

    Returns True when shims are active, False on a CUDA machine (where nothing is changed).
    """
    global _installed_mode
    if torch.cuda.is_available():
        install_moe_fixes()
        return False
    with _lock:
        if _installed_mode is not None:
            return True
        check_megatron_version()
        _original["current_device"] = torch.cuda.current_device
        _original["synchronize"] = torch.cuda.synchronize
        torch.cuda.current_device = lambda: "cpu"
        torch.cuda.synchronize = lambda device=None: None
        # --recompute-granularity: CheckpointFunction saves and restores the CUDA RNG around the
        # recomputed forward; there is no CUDA generator (and no registered family has dropout), so nothing to keep.
        from megatron.core.tensor_parallel import random as mcore_random

        _original["get_rng_state"] = torch.cuda.random.get_rng_state
        _original["set_cuda_rng_state"] = mcore_random._set_cuda_rng_state
        torch.cuda.random.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
        mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: None
        install_moe_fixes()
        mode = _CudaToCpuMode()
        mode.__enter__()
        _installed_mode = mode
    return True


def install_moe_fixes() -> None:
    """What megatron-core 0.16.1's MoE layer needs off its TransformerEngine + CUDA path (idempotent).

    Any device: `te_general_gemm` bound to None when TE did not import (MOE_ROUTER_TE_FIX). Without CUDA: the
    alltoall dispatcher's DtoH side stream (a torch.cuda.Stream made in its constructor) is never created, and
    its `_maybe_dtoh_and_synchronize` only turns the all-to-all split sizes into numpy arrays, which is what
    the CUDA path hands torch's all_to_all_single (CPU tensors stay tensors there and gloo's binding rejects them);
    the dispatcher's uneven all-gather over the expert-TP group works on gloo (`_install_uneven_collectives`).
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        return
    dispatcher = token_dispatcher.MoEAlltoAllTokenDispatcher
    if "dtoh" in _original:
        return
    _original["dtoh"] = dispatcher._maybe_dtoh_and_synchronize
    dispatcher.cuda_dtoh_stream = "cpu: no side stream"  # the constructor makes one only while this is None

    def _maybe_dtoh_and_synchronize(self, point: str, tokens_per_expert: torch.Tensor | None = None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for attr in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, attr, None)
                if torch.is_tensor(value):
                    setattr(self, attr, value.numpy())
        return tokens_per_expert

    dispatcher._maybe_dtoh_and_synchronize = _maybe_dtoh_and_synchronize
    _install_uneven_collectives()


def _gloo_group(group) -> bool:
    import torch.distributed as dist

    return dist.get_backend(group) == "gloo"


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t.contiguous()


def gather_uneven_first_dim(input_: torch.Tensor, group, output_split_sizes) -> torch.Tensor:
    """All-gather along dim 0 where rank i contributes `output_split_sizes[i]` rows, over gloo: every rank pads
    its rows to the largest split, one even all-gather, then each rank's padding is cut (exact: only copies).
    Costs one extra (max split x world) buffer; this path exists on CPU only."""
    from megatron_dapo.distributed import comm

    sizes = [int(n) for n in output_split_sizes]
    rows = max(sizes)
    if input_.shape[0] != sizes[group.rank()]:
        raise ValueError(f"gather_uneven_first_dim: this rank has {input_.shape[0]} rows, its split says "
                         f"{sizes[group.rank()]}")
    parts = comm.all_gather(_padded_rows(input_, rows), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def _install_uneven_collectives() -> None:
    """megatron's alltoall dispatcher with expert-TP > 1 all-gathers the routed tokens over the expert-TP group with
    uneven `output_split_sizes` (token_dispatcher.py:693-701 -> mappings.py:148-150, a list all_gather), which gloo
    rejects ("allgather: invalid tensor size"): route the uneven gloo case through `gather_uneven_first_dim`. The
    backward's list reduce_scatter with the same uneven sizes (mappings.py:182-190) works on gloo as it is (torch
    2.13; tests/dist/compat_uneven.py checks both)."""
    from megatron.core.tensor_parallel import mappings

    if "gather_first_dim" in _original:
        return
    gather = _original["gather_first_dim"] = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1 or not _gloo_group(group):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return gather_uneven_first_dim(input_, group, output_split_sizes)

    mappings._gather_along_first_dim = _gather_along_first_dim


def is_installed() -> bool:
    return _installed_mode is not None


def megatron_core_root() -> Path:
    import megatron.core

    return Path(megatron.core.__file__).resolve().parent


def scan_cuda_sites(root: Path | None = None) -> dict[str, tuple[int, ...]]:
    """Count each SITE_PATTERNS match, per audited file and over all of megatron/core.

    Returns {"<relative file>" | "<all>": counts in SITE_PATTERNS order}, comparable with
    PINNED_SITE_COUNTS.
    """
    root = root or megatron_core_root()
    compiled = {name: re.compile(p) for name, p in SITE_PATTERNS.items()}
    audited = {site.split(":")[0] for shim in SHIMS for site in shim.files}
    counts: dict[str, dict[str, int]] = {rel: dict.fromkeys(compiled, 0) for rel in sorted(audited)}
    total = dict.fromkeys(compiled, 0)
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(errors="replace")
        rel = path.relative_to(root).as_posix()
        for name, regex in compiled.items():
            n = len(regex.findall(text))
            total[name] += n
            if rel in counts:
                counts[rel][name] += n
    counts["<all>"] = total
    return {rel: tuple(c.values()) for rel, c in counts.items()}

