"""Resumable training checkpoints through megatron-core dist_checkpointing (torch_dist format).

One checkpoint = `<save>/step_<N>/` holding the model and optimizer as sharded tensors (reshardable
across TP/PP on load for the model), plus common state written by rank 0: LR scheduler, data
sampler position, step and the trainer's extra state; each rank's RNG states go in a ShardedObject.
`<save>/latest` names the newest complete step.

Crash safety: a step is written to `step_<N>.tmp/`; when every rank's files are complete, a
`manifest.json` (each file's size and CRC-32, checkpoint_manifest.py) is added, the directory is
renamed, then `latest` is replaced atomically. With --async-save the same finalisation runs only
after the background write finished on every rank. A run killed with SIGKILL mid-save leaves a
`.tmp` directory that loading ignores; `--load` verifies the newest step against its manifest and
falls back to the previous usable step, with a warning naming what was wrong.

Save cost at the production setting (Qwen2.5-32B, 32.8e9 params; TP8 x PP2 x DP8 = 128 ranks on 16
nodes, a TP group per node; 14 bytes/param: bf16 weights 2 + fp32 main params 4 + Adam m, v 8 = 459 GB
per checkpoint). Each of the 16 model-parallel shards holds 2.05e9 params (28.7 GB of state); bytes
each rank writes, and seconds at 2 GB/s of storage bandwidth per node:

- regular optimizer, default save: only DP rank 0 of each shard writes (replica_id 0): 28.7 GB on
  each of 16 ranks (2 nodes, 8 per node: 229 GB per node, ~115 s), 0 on the other 112 ranks.
- regular optimizer, --ckpt-fully-parallel-save: the 8 DP replicas split each shard's tensors
  (FullyParallelSaveStrategyWrapper over the DP group): 3.6 GB on every rank, 28.7 GB per node, ~14 s.
- --use-distributed-optimizer, default: the 12 B/param optimizer state is already split over DP
  (3.1 GB per rank), the bf16 weights (4.1 GB per shard) are written by DP rank 0 alone: 7.2 GB on
  those ranks (57 GB per node, ~29 s), 3.1 GB elsewhere; with --ckpt-fully-parallel-save 3.6 GB on
  every rank, ~14 s.

--async-save moves that write off the training loop: the trainer forks a writer (a copy-on-write
snapshot on CPU; on GPU megatron first copies the tensors to host memory, up to 7.2 GB per rank) and only
waits for the previous save to finish when it starts the next one, or at the end of the run. That
finalisation is collective: every rank waits for the slowest rank's write (AsyncCallsQueue's
all-reduce), then each rank CRCs its own files (~1.4 s for 3.6 GB) and rank 0 renames.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.base import StrategyAction, register_default_strategy
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonSaveStrategy
from torch.distributed.checkpoint.api import CheckpointException

from megatron_dapo.checkpoint import manifest as checkpoint_manifest
from megatron_dapo.checkpoint import procs as checkpoint_procs
from megatron_dapo.checkpoint import safe_read
from megatron_dapo.checkpoint.ckpt_config import request_stored_keys
from megatron_dapo.distributed import comm
from megatron_dapo.errors import UserError, disk_full_error, is_disk_full
from megatron_dapo.weights.extra_state import load_tolerating_absent_extra_state, stored_keys

LATEST = "latest"
# Resharding of the distributed optimizer across DP is supported; fully_reshardable fails on CPU.
OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def _without_rank0_extra(common: dict[str, Any], *, keys: tuple[str, ...]) -> dict[str, Any]:
    """The common state megatron compares across ranks: `common` without the `extra` keys only global rank 0 holds
    (CheckpointSaver's `rank0_extra`; not modified)."""
    extra = {k: v for k, v in common.get("extra", {}).items() if k not in keys}
    return {**common, "extra": extra}


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rank0_step(what: str) -> AbstractContextManager[None]:
    """Rank 0's own filesystem steps (removing a stale `.tmp` and making it; the manifest, rename and `latest`),
    then every rank meets on the default group (NCCL at production: one int64 all-reduce on each rank's GPU,
    comm.section). The other 127 ranks wait on rank 0 for metadata operations, seconds at most, far inside the
    30-minute watchdog; if rank 0's step fails (disk full, permissions) they raise "global rank 0 failed <what>"
    at once instead of waiting in a barrier rank 0 never reaches."""
    return comm.section(what) if dist.is_initialized() else nullcontext()


def step_dir(save_dir: str | os.PathLike, step: int) -> Path:
    return Path(save_dir) / f"step_{step:07d}"


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _model_keys(actor) -> list[str]:
    """The state keys of the model chunks: "model", or Megatron-LM's "model0", "model1", ... under
    --num-layers-per-virtual-pipeline-stage. The sharded tensors inside carry global layer numbers, so a
    checkpoint loads at any VPP (or none), like any TP/PP."""
    return ["model"] if len(actor.modules) == 1 else [f"model{c}" for c in range(len(actor.modules))]


def _sharded_state(actor, *, is_loading: bool, rng: dict[str, Any] | None,
                   stored: set[str] | None = None) -> dict[str, Any]:
    """The model chunks', optimizer's and RNG's sharded state; loading (`stored`: the checkpoint's keys), the model
    tensors ask for the keys the checkpoint holds them under before the optimizer's keys are made from theirs, so
    a local-spec save resumes under TE and the reverse (an MoE layer's pre-MLP norm: `request_stored_keys`)."""
    models = {key: module.sharded_state_dict() for key, module in zip(_model_keys(actor), actor.modules, strict=True)}
    model_sd = models["model"] if len(models) == 1 else models
    if stored is not None:
        request_stored_keys(model_sd, actor.arch, stored)
    rank, world = _rank_world()
    return {
        **models,
        "optimizer": actor.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                        metadata=OPTIM_METADATA),
        "rng": ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0),
    }


def optimizer_layout(actor) -> dict[str, Any]:
    """What the optimizer state's structure in a checkpoint depends on, beyond the model (saved in the common state
    as "optimizer_layout" and checked by `check_optimizer_layout` on load).

    Under --expert-model-parallel-size > 1 megatron-core builds two optimizers (dense, and the experts' over the
    expert-DP group) chained, whose state keys carry `chained_0.` / `chained_1.`; at EP 1 the experts are ordinary
    params of one optimizer. The distributed optimizer's dp_reshardable state is one flat buffer per model-parallel
    rank: the experts' follows the EP x expert-TP split. At Qwen3-30B-A3B the experts are 29.0e9 of the 30.5e9
    parameters (48 layers x 128 x 3 x 768 x 2048): their optimizer state (fp32 main params + Adam m, v: 12 B/param)
    is 348 GB of the checkpoint's 366 GB, what an EP change would have to reshard."""
    return {"expert_parallel": actor.layout.ep, "expert_tensor_parallel": actor.layout.expert_tp,
            "distributed_optimizer": bool(actor.config.use_distributed_optimizer)}


class CheckpointLayoutError(UserError):
    """The checkpoint's optimizer state cannot be resharded to this run's layout (megatron-core 0.16.1 refuses)."""


def check_optimizer_layout(saved: dict[str, Any] | None, actor, path: Path, *,
                           cause: BaseException | None = None) -> None:
    """Raise CheckpointLayoutError when `saved` (a checkpoint's `optimizer_layout`; None: an older checkpoint, not
    checked) cannot resume under `actor`'s layout. Measured on megatron-core 0.16.1
    (tests/multiprocess/test_checkpoint_ep.py, a tiny Qwen3-MoE saved at EP 2 x expert-DP 2 on 4 ranks):

    - the same EP: resumes exactly (regular and distributed optimizer);
    - regular optimizer, EP 2 -> EP 4 (both > 1): resumes (the expert state is stored with a global expert axis);
    - distributed optimizer, another EP or expert-TP: refused (the experts' flat dp_reshardable buffer has another
      global size: CheckpointingException "Global shape mismatch");
    - EP > 1 <-> EP 1, either optimizer: refused (chained vs single-optimizer state keys: KeyError).
    The model weights alone load at any EP (a layout-independent [E, ...] tensor per layer): an HF export of the
    checkpoint (checkpoint/hf_export.py) starts a run at another expert layout, with a fresh optimizer.
    `cause`: the load error this explains (chained to the raised error)."""
    if saved is None:
        return
    now = optimizer_layout(actor)
    ep, etp = saved["expert_parallel"], saved["expert_tensor_parallel"]
    chained_changed = (ep > 1) != (now["expert_parallel"] > 1)
    sharding_changed = now["distributed_optimizer"] and saved["distributed_optimizer"] and (
        (ep, etp) != (now["expert_parallel"], now["expert_tensor_parallel"]))
    if chained_changed or sharding_changed:
        why = ("megatron-core keeps the experts' optimizer state in a separate chained optimizer only when EP > 1"
               if chained_changed else
               "the distributed optimizer's expert state is flat per EP x expert-TP rank and cannot be resharded")
        raise CheckpointLayoutError(
            f"{path} was saved at --expert-model-parallel-size {ep} --expert-tensor-parallel-size {etp} "
            f"(distributed optimizer {saved['distributed_optimizer']}); this run has "
            f"--expert-model-parallel-size {now['expert_parallel']} --expert-tensor-parallel-size "
            f"{now['expert_tensor_parallel']}: {why}; resume with the saved expert sizes"
            + ("" if chained_changed else " or without --use-distributed-optimizer in both runs")) from cause


LAYER_IMPL_KEY = "layer_impl"
"""A checkpoint's layer implementation travels in the key of a one-element ShardedObject, `layer_impl.<impl>`, so a
load reads it from the stored keys it reads anyway (`stored_keys`: the `.metadata` index), not from the common state
(rank 0's, up to ~0.7 GB with an --async-rollout batch)."""


def layer_impl_of(modules) -> str:
    """'transformer_engine' or 'local': the layer implementation the model chunks were built with
    (`models.gpt.build_gpt_model` records it on their TransformerConfig), which is what the distributed optimizer's
    flat buffer follows, not the flag that asked for it. (A parameter name does not tell: a multi-head latent
    attention layer fuses its latent norms into its up projections on both.)"""
    from megatron_dapo.weights.load import unwrap

    return unwrap(modules[0]).config.transformer_impl


def saved_layer_impl(stored: set[str]) -> str | None:
    """The layer implementation a checkpoint (`stored`: its stored keys) was saved from; None for a checkpoint
    written before it was recorded."""
    prefix = f"{LAYER_IMPL_KEY}."
    for key in stored:
        if key.startswith(prefix):
            return key[len(prefix):].split("/", 1)[0]
    return None


def check_layer_impl(saved: str | None, actor, path: Path) -> None:
    """CheckpointLayoutError when a --use-distributed-optimizer checkpoint saved from one layer implementation is
    resumed under the other. Its optimizer state (dp_reshardable) is one flat fp32 buffer per model-parallel rank in
    the order the model registers its parameters, and the two specs register them in different orders (TE fuses the
    norms into the linears) with the same total size: megatron-core loads it without complaint and every Adam
    moment and main param lands on another parameter (measured on a tiny Qwen2: grad norm 7.72 instead of 2.46 the
    step after resume). The regular optimizer keys its state by parameter and resumes exactly across the two."""
    now = layer_impl_of(actor.modules)
    if saved is None or saved == now or not actor.config.use_distributed_optimizer:
        return
    raise CheckpointLayoutError(
        f"{path} was saved with --transformer-impl {saved} and --use-distributed-optimizer; this run builds "
        f"--transformer-impl {now}: the distributed optimizer's flat state follows the layer implementation's "
        f"parameter order and would land on the wrong parameters; resume with --transformer-impl {saved}, or start "
        f"from the checkpoint's weights with a fresh optimizer (checkpoint_convert mcore-to-hf, then "
        f"--hf-checkpoint)")


class CheckpointSaver:
    """Writes checkpoints of one run: `save(step, actor, extra)` on every rank, `close()` at the end.

    fully_parallel (--ckpt-fully-parallel-save): replicated tensors are split among the data-parallel
    replicas instead of all written by DP rank 0 (megatron-core's FullyParallelSaveStrategyWrapper over
    the DP group; the distribution is computed once and cached, the state dict's structure is fixed).
    async_save (--async-save): the sharded tensors are written by a forked process (megatron-core's
    AsyncCallsQueue, non-persistent caller); rename / `latest` happen when that write finished on all
    ranks, checked at the next save (which waits for it) and in `close()`. One save is in flight at most.
    rank0_extra: the keys of `extra` that only global rank 0 holds (the --async-rollout batch: up to ~0.7 GB at 32B;
    Holder.RANK0_ONLY in checkpoint/state.py): rank 0's copy is written, and they are left out of megatron's
    cross-rank common-state check, which would broadcast them to every rank.
    """

    def __init__(self, save_dir: str | os.PathLike, *, fully_parallel: bool = False, async_save: bool = False,
                 rank0_extra: tuple[str, ...] = ()) -> None:
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

        self.save_dir, self.fully_parallel, self.async_save = Path(save_dir), fully_parallel, async_save
        self.rank0_extra = rank0_extra
        self.strategy = get_default_save_sharded_strategy()
        if fully_parallel and _rank_world()[1] > 1:
            from megatron.core import parallel_state
            from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

            self.strategy = FullyParallelSaveStrategyWrapper(
                self.strategy, parallel_state.get_data_parallel_group(with_context_parallel=True),
                do_cache_distribution=True)
        self._queue = None
        self._in_flight: Path | None = None  # the step_N.tmp of the --async-save in flight
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._queue = AsyncCallsQueue(persistent=False)  # a forked writer per save; see checkpoint_procs

    def save(self, step: int, actor, extra: dict[str, Any]) -> Path:
        """Write step `step` (all ranks call this); `extra` (rank 0's copy is kept) must be picklable.

        Returns the final step directory; with async_save it exists only once `finalize` has run. A full
        disk (ENOSPC / EDQUOT, on any rank) raises UserError naming the directory and its free space, once global
        rank 0 has removed the unfinished `step_N.tmp`.
        """
        self.finalize(blocking=True)  # the previous --async-save: its own failure names its own step
        tmp = Path(f"{step_dir(self.save_dir, step)}.tmp")
        with _disk_full_is_user_error(self.save_dir, "a checkpoint (--save)", unfinished=tmp):
            return self._save(step, actor, extra)

    def _save(self, step: int, actor, extra: dict[str, Any]) -> Path:
        checkpoint_procs.install_results_queue(async_save=self.async_save)
        checkpoint_procs.install_write_errors()
        # megatron-core 0.16.1's save takes no common strategy of the caller's ("The only supported common strategy is
        # torch"): ours becomes the registered default for ('torch', 1), the backend its metadata.json names
        register_default_strategy(StrategyAction.SAVE_COMMON, "torch", 1, _CommonSave("torch", 1))
        rank, _ = _rank_world()
        final, tmp = step_dir(self.save_dir, step), Path(f"{step_dir(self.save_dir, step)}.tmp")
        with _rank0_step(f"while preparing {tmp}"):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        state = _sharded_state(actor, is_loading=False, rng=rng_state())
        state["scheduler"] = actor.scheduler.state_dict()
        state["extra"] = {"step": step, **extra}
        state["optimizer_layout"] = optimizer_layout(actor)
        impl = layer_impl_of(actor.modules)  # written by rank 0 (replica 0), read back from the stored keys
        state[LAYER_IMPL_KEY] = ShardedObject(f"{LAYER_IMPL_KEY}.{impl}", impl, (1,), (0,), replica_id=rank)
        check_common = partial(_without_rank0_extra, keys=self.rank0_extra)
        request = dist_checkpointing.save(state, str(tmp), sharded_strategy=self.strategy,
                                          async_sharded_save=self.async_save, content_metadata=OPTIM_METADATA,
                                          preprocess_common_before_consistancy_check=check_common)
        if request is None:
            self._finish(tmp, final)
        else:
            request.add_finalize_fn(partial(self._finish, tmp, final))
            self._queue.schedule_async_request(request)
            self._in_flight = tmp
        return final

    def finalize(self, *, blocking: bool) -> None:
        """Rename the async saves whose writes finished on every rank (all ranks call this)."""
        if self._queue is not None:
            with _disk_full_is_user_error(self.save_dir, "a checkpoint (--save, --async-save)",
                                          unfinished=self._in_flight):
                self._queue.maybe_finalize_async_calls(blocking=blocking)
            if not self._queue.get_num_unfinalized_calls():
                self._in_flight = None

    def close(self) -> None:
        """Wait for an async save in flight and finalise it; stop the async results Manager."""
        self.finalize(blocking=True)
        if self._queue is not None:
            self._queue.close()
            checkpoint_procs.shutdown()

    def _finish(self, tmp: Path, final: Path) -> None:
        """Manifest (each rank checksums its own files), rename, `latest`: after every rank's write."""
        rank, world = _rank_world()
        mine = checkpoint_manifest.describe_files(tmp, checkpoint_manifest.files_written_by(tmp, rank, world))
        tables = [mine]
        if dist.is_initialized() and world > 1:
            # Default group (NCCL at production: CUDA tensors on this rank's GPU). Every rank waits for the
            # slowest rank's CRC of its own files: 28.7 GB on the DP-rank-0 writers of a default save (~11 s
            # at 2.5 GB/s hot; up to ~115 s reading a node's 229 GB back at 2 GB/s), 3.6 GB per rank
            # (~1.4 s) with --ckpt-fully-parallel-save: inside the 30-minute NCCL watchdog. Bytes: each
            # rank's table is ~100 B per file, a few files per rank; every rank receives 128 x the longest.
            tables = comm.all_gather_object(mine)
        with _rank0_step(f"while finishing {final}"):
            if rank == 0:
                checkpoint_manifest.write_manifest(tmp, {k: v for t in tables for k, v in t.items()})
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                latest_tmp = self.save_dir / f".{LATEST}.tmp"
                latest_tmp.write_text(final.name)
                os.replace(latest_tmp, self.save_dir / LATEST)


def _rank_failures(err: BaseException) -> list[BaseException]:
    """A torch CheckpointException's per-rank errors (megatron's "Worker failure: [Errno 28] ..." among them)."""
    return [failure[0] for failure in err.failures.values()] if isinstance(err, CheckpointException) else []


@contextmanager
def _disk_full_is_user_error(path: Path, what: str, *, unfinished: Path | None = None) -> Iterator[None]:
    """Re-raise a full-disk error of the body as errors.disk_full_error (printed by global rank 0 only), after
    global rank 0 removed the `unfinished` step directory (every rank's write has ended by then: torch gathers the
    write errors of all ranks, or rank 0's own step failed inside a section the others wait in), so the free space
    named is what is left without it."""
    try:
        yield
    except UserError:
        raise
    except (Exception, CheckpointException) as err:  # torch's CheckpointException is a BaseException
        if not _disk_full_anywhere(err):
            raise
        rank0 = _rank_world()[0] == 0
        removed = ""
        if rank0 and unfinished is not None and unfinished.exists():
            shutil.rmtree(unfinished, ignore_errors=True)
            removed = f"; the unfinished {unfinished.name} was removed"
        error = disk_full_error(path, what)
        raise UserError(f"{error}{removed}", echo=rank0) from err


def _disk_full_anywhere(err: BaseException) -> bool:
    """Whether `err` reports a full disk, on this rank or, for torch's CheckpointException, on any rank.

    A CheckpointException is raised on every rank together (torch gathers each rank's write errors; megatron-core's
    finalisation broadcasts that one happened), but megatron-core 0.16.1 hands the errors themselves to the
    coordinator (global rank 0) alone: the others get an empty one. So for it every rank contributes its own verdict
    to one MAX all-reduce (an int64 on the default group, NCCL at production), and all decide alike: rank 0 prints the
    one line, the others exit quietly instead of printing "CheckpointException ranks:dict_keys([])"."""
    full = is_disk_full(err, _rank_failures)
    if isinstance(err, CheckpointException) and dist.is_initialized() and dist.get_world_size() > 1:
        full = bool(comm.all_reduce(torch.tensor([int(full)], dtype=torch.int64), op=dist.ReduceOp.MAX))
    return full


class _CommonSave(TorchCommonSaveStrategy):
    """megatron-core's common.pt save (rank 0), written through a Python file object inside a rank-0 section.
    torch.save to a path writes from C++ and reports a full disk as a bare RuntimeError ("file write failed" /
    "unexpected pos") with no errno; through a file the OSError(ENOSPC) is raised, or is that error's __context__,
    which errors.is_disk_full finds. The section (one int64 all-reduce) makes the other ranks raise at once instead of
    waiting in the tensor write's first collective. common.pt: ~3 KB, up to ~0.7 GB with an --async-rollout batch
    at 32B."""

    def save_common(self, common_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike) -> None:
        path = Path(checkpoint_dir) / COMMON_STATE_FNAME
        with _rank0_step(f"while writing {path}"):
            if _rank_world()[0] == 0:
                with open(path, "wb") as f:
                    torch.save(common_state_dict, f)


def save_checkpoint(save_dir: str | os.PathLike, step: int, actor, extra: dict[str, Any], *,
                    fully_parallel: bool = False) -> Path:
    """One synchronous save (all ranks call this); see CheckpointSaver."""
    saver = CheckpointSaver(save_dir, fully_parallel=fully_parallel)
    path = saver.save(step, actor, extra)
    saver.close()
    return path


def _materialise_distributed_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state before a dp_reshardable load.

    Without TE/Apex (the CPU path) megatron-core 0.16.1's DistributedOptimizer.state_dict() reads each
    param's torch-Adam 'step' and asserts there is exactly one value, which fails on a never-stepped
    optimizer (no state at all). Megatron fills dummy state the same way before its fsdp_dtensor loads;
    the dummy values (main params included) are overwritten in place by the checkpoint's.
    """
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:  # the fused-Adam path keeps 'step' elsewhere; nothing to do
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        init = getattr(opt, "_init_optimizer_states_with_dummy_values", None)
        if init is not None and not opt.optimizer.state:
            init()


def _distributed_adam_steps(optimizer, optimizer_state) -> list[float | None]:
    """Per chained optimizer: the checkpoint's torch-Adam step of a distributed optimizer (no TE/Apex), else None."""
    from megatron.core.optimizer import distrib_optimizer

    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [optimizer_state] if len(opts) == 1 else [v for _, v in sorted(optimizer_state.items())]
    steps: list[float | None] = []
    for opt, state in zip(opts, states, strict=True):
        if distrib_optimizer.HAVE_APEX_OR_TE or not isinstance(opt, distrib_optimizer.DistributedOptimizer):
            steps.append(None)
            continue
        values = {group["step"] for group in state["optimizer"]["param_groups"]}
        if len(values) != 1:
            raise ValueError(f"checkpoint's optimizer param groups disagree on the Adam step: {sorted(values)}")
        steps.append(float(values.pop()))
    return steps


def _restore_distributed_adam_steps(optimizer, steps: list[float | None]) -> None:
    """Give every param of a resumed distributed optimizer its own torch-Adam 'step' = the saved one.

    megatron-core 0.16.1's DistributedOptimizer.load_state_dict without TE/Apex (torch Adam, the CPU
    path) gets 'step' wrong twice: it puts one shared tensor into every param's state, then
    `load_parameter_state_from_dp_reshardable` copies the *fresh* optimizer's step (1, from the dummy
    step) into it. torch Adam then bias-corrects with step 2, 3, ... instead of N+1, N+2, ... and,
    incrementing the shared tensor in place once per param, advances it by the number of params per
    update: the ~3e-4 relative drift of the next updates after a resume. The regular optimizer
    deep-copies the saved step per param (`_restore_common_per_param_step`), as this does.
    """
    for opt, step in zip(getattr(optimizer, "chained_optimizers", [optimizer]), steps, strict=True):
        if step is None:
            continue
        for state in opt.optimizer.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)


class CheckpointCorruptError(RuntimeError):
    """No step under --load passes verification; the message names each step and its problem."""


class CheckpointFallbackWarning(UserWarning):
    """The newest step under --load is unusable and an older one is loaded instead."""


class StepLinkError(UserError):
    """A `step_N` or `latest` under --load is a symbolic link that leads outside the directory."""


def check_step_links(root: Path) -> None:
    """StepLinkError naming the first `step_*` or `latest` entry of `root` that is a symbolic link resolving outside
    `root` (a link between steps of `root` is fine). A checkpoint is read, and unusable steps are skipped, inside
    --load only: such a link is never followed, whatever it points at. Cost: one lstat per entry."""
    if not root.is_dir():
        return
    base = os.path.realpath(root)
    for entry in sorted(root.iterdir()):
        if not (entry.name.startswith("step_") or entry.name == LATEST) or not entry.is_symlink():
            continue
        target = os.path.realpath(entry)
        if os.path.commonpath([base, target]) != base:
            rank0 = _rank_world()[0] == 0
            raise StepLinkError(f"--load {root}: {entry.name} is a symbolic link to {os.readlink(entry)}, outside "
                                f"{root}; a checkpoint is read from its own directory only: replace the link by the "
                                f"step directory itself, or give --load the directory that holds it", echo=rank0)


def candidate_step_dirs(load_dir: str | os.PathLike) -> list[Path]:
    """Complete-looking step directories, newest first (`latest`'s target leads; `.tmp` never counts); a step or
    `latest` linking outside `load_dir` is a StepLinkError (`check_step_links`)."""
    root = Path(load_dir)
    check_step_links(root)
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)
    marker = root / LATEST
    if marker.is_file():
        named = root / marker.read_text().strip()
        if named in steps:
            steps.remove(named)
            steps.insert(0, named)
    return steps


def step_problems(path: Path) -> list[str]:
    """What makes a step directory unloadable (empty list: usable); collective when distributed.

    Needs metadata.json and a manifest whose files are all present with the recorded size and CRC-32;
    the files are checked round-robin over the ranks and the problems gathered on every rank. A step
    without a manifest (written before manifests existed, or the manifest lost) is checked against its own
    `.metadata` instead (checkpoint_manifest.check_unverified) and is loaded unverified.
    """
    rank, world = _rank_world()
    problems: list[str] = []
    if not (path / "metadata.json").is_file():
        problems.append(f"{path} has no metadata.json (not written by --save, or damaged)")
    try:
        files = checkpoint_manifest.read_manifest(path)
    except (ValueError, OSError) as e:  # json errors are ValueErrors
        files, problems = {}, [*problems, f"{path}/{checkpoint_manifest.MANIFEST} is unreadable: {e}"]
    if files:
        problems += checkpoint_manifest.check_files(path, files, sorted(files)[rank::world])
    elif files is None:
        problems += checkpoint_manifest.check_unverified(path, rank, world)
    if dist.is_initialized() and world > 1:
        # Default group (NCCL at production: CUDA tensors on this rank's GPU). Every rank waits for the rank
        # with the most bytes to read back and CRC: files are dealt out by count, not size, so after a default
        # save (16 writers of 28.7 GB) a rank may get one writer's whole share: ~15 s at 2 GB/s, about a
        # minute when several land on one node; ~2 s per rank after --ckpt-fully-parallel-save. Inside the
        # 30-minute NCCL watchdog. Bytes: the problem strings, an empty list's pickle for a good step.
        problems = [p for g in comm.all_gather_object(problems) for p in g]
    return sorted(set(problems))


def load_checkpoint(load_dir: str | os.PathLike, actor) -> dict[str, Any] | None:
    """Restore model, optimizer, scheduler and this rank's RNG; return the extra state (with 'step').

    Takes the newest step that passes verification (`step_problems`); an unverified step (no manifest) whose
    read fails anyway is skipped too. Skipped steps are named in a CheckpointFallbackWarning; when no step is
    usable, CheckpointCorruptError names them all. Returns None when load_dir holds no step at all.
    The read of an unverified step fails on every rank together (torch.distributed.checkpoint gathers each
    rank's read error and raises CheckpointException everywhere), so every rank moves on to the same step.
    """
    rejected: list[str] = []
    for path in candidate_step_dirs(load_dir):
        problems = step_problems(path)
        if not problems:
            verified = checkpoint_manifest.read_manifest(path) is not None
            try:
                loaded = _read_step(path, actor)
            except (Exception, CheckpointException) as err:  # torch's CheckpointException is a BaseException
                if verified or isinstance(err, (CheckpointLayoutError, safe_read.UnsafeCheckpointError)):
                    raise  # a crafted file is not damage to fall back from
                problems = [f"{path} has no {checkpoint_manifest.MANIFEST} and fails to load: {_first_error(err)}"]
            else:
                _warn_loaded(load_dir, path, rejected, verified)
                return _apply_step(loaded, actor)
        rejected.append("; ".join(problems))
    if rejected:
        raise CheckpointCorruptError(f"--load {load_dir}: no usable checkpoint: {' | '.join(rejected)}; "
                                     f"remove the damaged step directories or point --load elsewhere")
    return None


def _warn_loaded(load_dir: str | os.PathLike, path: Path, rejected: list[str], verified: bool) -> None:
    """Rank 0's CheckpointFallbackWarnings for the step taken: the newer steps skipped, no manifest."""
    if _rank_world()[0] != 0:
        return
    if rejected:
        warnings.warn(f"--load {load_dir}: skipped unusable checkpoint(s): {'; '.join(rejected)}; "
                      f"resuming from {path.name}", CheckpointFallbackWarning, stacklevel=3)
    if not verified:
        warnings.warn(f"{path} has no {checkpoint_manifest.MANIFEST} (an older checkpoint): loaded "
                      f"unverified", CheckpointFallbackWarning, stacklevel=3)


def _first_error(err: BaseException) -> str:
    """`Type: first line` of a load error; for torch's CheckpointException, of the first failed rank's error."""
    if isinstance(err, CheckpointException) and err.failures:
        err = err.failures[min(err.failures)][0]  # (exception, traceback) of the lowest failed rank
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def load_training_state(path: Path, actor) -> dict[str, Any]:
    """Load one verified step directory written by --save into `actor`; return its extra state."""
    return _apply_step(_read_step(path, actor), actor)


def _read_step(path: Path, actor) -> dict[str, Any]:
    """Read a step directory's tensors and objects into a state dict shaped by `actor` (nothing applied yet)."""
    _materialise_distributed_optimizer_state(actor.optimizer)
    stored = stored_keys(path)
    check_layer_impl(saved_layer_impl(stored), actor, path)
    state = _sharded_state(actor, is_loading=True, rng=None, stored=stored)
    try:
        return load_tolerating_absent_extra_state(state, path, stored)  # a local-spec checkpoint resumed under TE
    except (Exception, CheckpointException) as err:
        # diagnosed only on failure: the common state (rank 0's, up to ~0.7 GB with an --async-rollout batch) is
        # read once more here, by every rank; all ranks fail such a load together (the read errors are gathered)
        saved = safe_read.load_common(path).get("optimizer_layout")
        check_optimizer_layout(saved, actor, path, cause=err)
        raise


def _apply_step(loaded: dict[str, Any], actor) -> dict[str, Any]:
    """Put a read step into `actor` (model, optimizer, scheduler), this rank's RNG; return the extra state."""
    for key, module in zip(_model_keys(actor), actor.modules, strict=True):
        module.load_state_dict(loaded[key])
    with torch.no_grad():
        # The optimizer state holds the fp32 main params: they are loaded as saved, never re-derived
        # from the (bf16) model params, which would round every update below bf16 resolution away.
        adam_steps = _distributed_adam_steps(actor.optimizer, loaded["optimizer"])
        actor.optimizer.load_state_dict(loaded["optimizer"])
        _restore_distributed_adam_steps(actor.optimizer, adam_steps)
    actor.scheduler.load_state_dict(loaded["scheduler"])
    set_rng_state(loaded["rng"])
    extra = dict(loaded["extra"])
    actor.steps = int(extra["step"])
    return extra
