"""Entry point: `python -m megatron_dapo.train --help` (or under torchrun for TP/PP/DP).

parse -> validate (startup.check_flags: the flags into typed configs, the model and the layout, the same verdict on
every rank) -> build (trainer/build.py: inputs, actor, logger; rollout/build.py: the rollout engine;
trainer/colocate.py with --colocate) -> resume (Checkpointer.load + one weight push) -> `Trainer.run`
(trainer/loop.py). The run config (trainer/run_config.py) is built once from the flags and written to --log-dir as
run_config.json, the record of what ran; nothing below reads the flags. SIGTERM or a first
SIGINT stops the run with the last finished step saved, exit status 128 + the signal (trainer/stop.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.arguments import build_parser
from megatron_dapo.errors import UserError
from megatron_dapo.rollout import build as rollout_build
from megatron_dapo.startup import check_flags, dry_run
from megatron_dapo.trainer import build, colocate
from megatron_dapo.trainer.stop import StopRequested, StopSignal, restored_signal_handlers
from megatron_dapo.trainer.validation import share_verdict
from megatron_dapo.weight_sync import nccl_env

QUIET_EXIT_DELAY_S = 2.0
"""How much later than the rank that prints an input error the ranks that stay quiet exit."""


def main(argv: list[str] | None = None) -> None:
    """Run; an input error prints one line `error: ...` on stderr and exits 2 (`--debug`: the traceback); a run
    stopped by SIGTERM / SIGINT exits with 128 + the signal once its last finished step is saved (trainer/stop.py)."""
    args = build_parser().parse_args(argv)
    if args.dry_run:  # memory plan only: no process group, no model (megatron_dapo/planner/)
        sys.exit(dry_run(args))
    try:
        train(args)
    except StopRequested as stop:
        sys.exit(stop.status)
    except UserError as err:
        if args.debug:
            raise
        if err.echo:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun names the first rank to exit as the root cause and SIGTERMs the rest: let the printer go first
            time.sleep(QUIET_EXIT_DELAY_S)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


def train(args: argparse.Namespace) -> None:
    """validate flags -> read inputs (rank 0) -> build -> resume -> generate/reward/filter/train/sync/eval/save.
    The SIGTERM / SIGINT handlers it installs are the caller's again when it returns or raises."""
    with restored_signal_handlers():
        _train(args)


def _train(args: argparse.Namespace) -> None:
    from megatron_dapo.actor import init_parallel
    from megatron_dapo.checkpoint.checkpointer import Checkpointer
    from megatron_dapo.checkpoint.dist_load import initial_checkpoint
    from megatron_dapo.data import ResumableSampler
    from megatron_dapo.rollout.sglang.teacher import SGLangTeacher
    from megatron_dapo.trainer.loop import Trainer

    rank0 = os.environ.get("RANK", "0") == "0"
    try:
        run, reward_fn = check_flags(args)
        # before any NCCL communicator: NCCL reads it once per process (weight_sync/nccl_env.py)
        cumem = nccl_env.match_sglang_cumem(run.engine, os.environ, cuda=torch.cuda.is_available())
    except UserError as err:
        err.echo = rank0  # every rank reaches the same verdict; one prints it
        raise
    if cumem and os.environ.get("LOCAL_RANK", "0") == "0":  # one line a node: nodes may decide differently
        print(cumem, flush=True)
    # from here on SIGTERM / SIGINT stop the run at its next safe point, within --exit-save-timeout-s
    ckpt = run.checkpoint
    stop = StopSignal(run.trainer.exit_save_timeout_s, save_dir=Path(ckpt.save) if rank0 and ckpt.save else None)
    stop.install()
    engine, inputs, verdict = None, None, None
    if rank0:
        try:
            engine, inputs = build.prepare_rank0(run)
        except UserError as err:
            verdict = err
    # process groups only: the verdict travels over them
    layout = init_parallel(run.layout, seed=run.seed, num_layers=build.virtual_stage_layers(run, echo=rank0))
    share_verdict(verdict)
    inputs = inputs or build.load_inputs(run.inputs, run.arch, layout, with_data=False)
    tokenizer, prompts = inputs.tokenizer, inputs.train_prompts
    run = run.with_stop_tokens(tuple(sorted({t for t in (tokenizer.eos_token_id,) if t is not None})))
    init_ckpt = initial_checkpoint(ckpt.load, ckpt.mcore_checkpoint)  # hf-to-mcore output, if given
    if run.engine.colocate:  # the engines free their GPU memory before the actor allocates any (colocate.py)
        engine = colocate.start_colocated_engines(run.engine, tokenizer, rank0)
    actor = build.build_actor(run.inputs.hf_checkpoint, inputs.arch, run.actor, layout, init_ckpt)
    (reference, ref), (teacher_source, teacher) = build.frozen_models(ckpt, run, inputs, layout, init_ckpt)
    sampler = ResumableSampler(max(len(prompts), 1), seed=run.seed)  # rank 0 draws; a placeholder elsewhere
    if rank0 and engine is None:
        engine = rollout_build.make_rollout_engine(run.engine, tokenizer)
    logger = build.make_logger(run) if rank0 else None
    served = isinstance(teacher, SGLangTeacher)  # --teacher-url: on its own servers, nothing here
    frozen = [m for m in (ref, None if served else teacher) if m is not None]  # offloaded while generating
    phases, weight_sync = (colocate.make_colocated(run.engine, actor, engine, frozen) if run.engine.colocate
                           else (None, None))
    if rank0:  # conversations with a code tool (--tool-template) wrap the engine the sync and phases drive
        engine = rollout_build.with_tools(engine, run.engine.tools, tokenizer)
    trainer = Trainer(config=run.trainer, collect=run.collect, actor=actor, engine=engine,
                      next_prompts=(lambda k: [prompts[i] for i in sampler.next_batch(k)]) if rank0 else None,
                      eval_prompts=inputs.eval_prompts, reward_fn=reward_fn, logger=logger,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      phases=phases, weight_sync=weight_sync, stop=stop, ref=ref, teacher=teacher,  # sync None: built
                      weight_sync_mode=rollout_build.weight_sync_mode(run.engine) if rank0 else None)  # its transport
    if phases is not None:
        phases.section = trainer.section  # the phase switches' status barrier: the trainer's wait group
    if served:  # the replica's other ranks wait for its scorer on the wait group
        teacher.section = trainer.section
    trainer.checkpointer = Checkpointer(
        {"actor": actor, "trainer": trainer, "sampler": sampler, "carried": trainer.carried, "ahead": trainer.ahead,
         "stream": trainer.stream, "record": trainer.record, "reference": reference,
         "teacher": teacher_source},
        save_dir=ckpt.save, load_dir=None if init_ckpt else ckpt.load, fully_parallel=ckpt.fully_parallel_save,
        async_save=ckpt.async_save, section=trainer.section, group=trainer.wait_group)
    try:
        resumed = trainer.checkpointer.load() is not None
        if (resumed or init_ckpt is not None) and trainer.phases is None:  # --colocate: Trainer.run pushes
            trainer.sync_weights(trainer.step)  # the engine was started from --hf-checkpoint
        trainer.run()
        trainer.checkpointer.close()  # an --async-save in flight is finished and renamed here
        if ckpt.export_hf:
            if trainer.phases is not None:  # the export's TP gathers need not sit next to SGLang's KV cache
                trainer.phases.end()
            build.export_hf(actor, ckpt.export_hf, run.inputs.hf_checkpoint, trainer.step)
    finally:
        if logger is not None:
            logger.close()
            build.write_report(run.log.log_dir)
        if engine is not None:
            engine.shutdown()
        if served:
            teacher.close()
        if dist.is_initialized():
            from megatron_dapo.distributed import comm

            comm.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":  # the guard matters: dist_checkpointing's spawn Manager re-imports __main__
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
