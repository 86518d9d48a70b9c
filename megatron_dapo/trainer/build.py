"""Builders of the run's components from its typed config (RunConfig, parsed once from the flags by
megatron_dapo/startup.py): rank 0's preparation (`prepare_rank0`), the inputs read before any model exists, the
actor with its initial weights, rank 0's metrics logger and report. The entry point (megatron_dapo/train.py) calls
them in start-up order."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_dapo.data.prompt_set import load_prompt_set
from megatron_dapo.data.tokenizer_check import check_same_tokenizer
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.errors import UserError
from megatron_dapo.models.hf_config import ModelArch, require_arch
from megatron_dapo.rollout import build as rollout_build
from megatron_dapo.rollout.types import Prompt
from megatron_dapo.trainer.run_config import InputsConfig, RunConfig
from megatron_dapo.trainer.validation import check_context, check_model_layout, check_vocab


@dataclass
class Inputs:
    """What the run reads before any model exists; the prompt lists are filled on global rank 0 only."""

    arch: ModelArch
    tokenizer: Any
    train_prompts: list[Prompt] = field(default_factory=list)
    eval_prompts: list[Prompt] = field(default_factory=list)
    teacher_model: str | None = None
    """--teacher-url: the model its servers serve, as they report it (rank 0, once the tokenizer check passed)."""


def load_inputs(cfg: InputsConfig, arch: ModelArch | None, layout: ParallelLayout, *, with_data: bool,
                export_hf: str | None = None) -> Inputs:
    """The tokenizer against the model's vocab, the context, the model against the layout; with_data: `export_hf`
    (--export-hf: the target holds nothing else) and every prompt."""
    from transformers import AutoTokenizer

    arch = require_arch(arch, cfg.hf_checkpoint)
    tokenizer_dir = cfg.tokenizer_dir
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"no tokenizer loads from {tokenizer_dir} (--tokenizer, default --hf-checkpoint): "
                        f"{first_line}") from err
    check_vocab(tokenizer_size=len(tokenizer), vocab_size=arch.vocab_size, tokenizer_dir=tokenizer_dir,
                hf_checkpoint=cfg.hf_checkpoint)
    check_context(max_prompt_length=cfg.max_prompt_length, max_response_length=cfg.max_response_length,
                  context=arch.max_position_embeddings, allow_exceed=cfg.allow_exceed_context)
    check_model_layout(arch, layout, hf_checkpoint=cfg.hf_checkpoint)
    inputs = Inputs(arch=arch, tokenizer=tokenizer)
    if not with_data:
        return inputs
    if export_hf:
        from megatron_dapo.checkpoint.hf_export import check_export_target

        check_export_target(export_hf)
    limits = dict(prompt_format=cfg.prompt_format, max_prompt_length=cfg.max_prompt_length,
                  max_prompt_chars=cfg.max_prompt_chars, on_long_prompt=cfg.on_long_prompt)
    inputs.train_prompts = load_prompt_set(cfg.prompt_data, tokenizer, **limits, flag="--prompt-data")
    if cfg.eval_prompt_data and cfg.eval_interval:
        inputs.eval_prompts = load_prompt_set(cfg.eval_prompt_data, tokenizer, **limits, flag="--eval-prompt-data",
                                              limit=cfg.eval_max_prompts or None)
    return inputs


def load_hf_into_actor(actor, hf_dir: str, *, flag: str = "--hf-checkpoint") -> None:
    """Copy HF safetensors weights into this rank's Megatron shards through the mapping table (errors name `flag`).

    The shards carry local-spec names; `MegatronActor.load_shards` matches them to the model's own
    parameter names (local or Transformer Engine spec) through `weights.mapping.canonical_mcore_name`.
    First every rank checks the checkpoint holds exactly the tensors config.json implies (as hf-to-mcore does):
    one it has no place for (a Qwen2 checkpoint's biases under a llama config.json, experts beyond num_experts)
    is an error naming it, not a weight dropped in silence. Headers only, parsed on open: milliseconds.
    """
    from megatron.core import parallel_state

    from megatron_dapo.weights import iter_rank_shards
    from megatron_dapo.weights.hf_format import HFCheckpointReader
    from megatron_dapo.weights.plan import dropped_hf_tensors, dropped_notice, hf_tensor_specs
    from megatron_dapo.weights.safetensors_io import CheckpointError

    ranks = dict(tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                 ep_rank=parallel_state.get_expert_model_parallel_rank(),
                 etp_rank=parallel_state.get_expert_tensor_parallel_rank())
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dtype = actor.config.torch_params_dtype
    arch = actor.arch
    try:
        reader = HFCheckpointReader(hf_dir)
    except CheckpointError as err:  # a damaged file: every rank parses the same headers, rank 0 prints
        raise UserError(f"{flag}: {err}", echo=os.environ.get("RANK", "0") == "0") from err
    with reader:
        try:  # the same verdict on every rank (the same headers), rank 0 prints it
            reader.check_unquantized()
            prefixes, why = dropped_hf_tensors(arch)
            skipped = reader.check_expected(hf_tensor_specs(arch, dtype), model=f"model_type {arch.model_type!r}",
                                            dropped=prefixes)
        except CheckpointError as err:
            raise UserError(f"{flag}: {err}", echo=os.environ.get("RANK", "0") == "0") from err
        if skipped and os.environ.get("RANK", "0") == "0":
            print(f"[megatron-dapo] {flag} {hf_dir}: {dropped_notice(skipped, prefixes, why)}", flush=True)
        for chunk in range(len(actor.chunks)):  # several under --num-layers-per-virtual-pipeline-stage
            try:
                # each shard is cast where it lands (load_shards' copy_): a buffer stays fp32 (plan.BUFFER_DTYPE)
                shards = {name: shard for name, shard in
                          iter_rank_shards(reader.get, arch, actor.layout, pp_rank=pp_rank, chunk=chunk, **ranks)}
            except CheckpointError as err:  # a tensor this rank reads is missing or unreadable
                raise UserError(f"{flag}: {err}") from err
            actor.load_shards(shards, chunk, reload=False)
    actor.reload_main_params()


def build_actor(hf_checkpoint: str, arch: ModelArch, actor_cfg, layout, init_ckpt: str | None):
    """The Megatron actor with its initial weights: a torch_dist checkpoint's model weights at any TP/PP
    (`init_ckpt`, converter output passed as --load: iteration 0, fresh optimizer), else --hf-checkpoint
    re-sharded."""
    from megatron_dapo.actor import MegatronActor
    from megatron_dapo.checkpoint.dist_load import load_model_weights

    actor = MegatronActor(arch, actor_cfg, layout)
    if init_ckpt is not None:
        for module in actor.modules:  # one chunk, or several under --num-layers-per-virtual-pipeline-stage
            load_model_weights(module, init_ckpt, arch)
        actor.reload_main_params()  # the weights changed outside the optimizer
    else:
        load_hf_into_actor(actor, hf_checkpoint)
    return actor


def build_frozen(source, arch: ModelArch, actor_cfg, layout, *, against: str = "--hf-checkpoint config.json"):
    """A frozen model of `arch` on the actor's layout (MegatronActor(frozen=True): weights only), loaded from
    `source` (a resolved ReferenceSource or TeacherSource, actor/reference.py): an HF checkpoint through the mapping
    table, or a torch_dist checkpoint (converter output) at any TP/PP. UserError naming the source's flag for a
    checkpoint of another architecture than `arch` (`against` says where `arch` came from), or a layout the
    architecture does not divide into."""
    from megatron_dapo.actor import MegatronActor
    from megatron_dapo.checkpoint.ckpt_config import check_same_arch
    from megatron_dapo.checkpoint.dist_load import check_checkpoint_config, load_model_weights
    from megatron_dapo.weights.safetensors_io import CheckpointError

    flag = type(source).FLAG
    try:  # a checkpoint of another architecture is refused, naming both
        if source.kind == "hf":
            check_same_arch(ModelArch.from_hf(source.path), arch, stored_from=f"{flag} {source.flag}",
                            requested_from=against)
        else:
            check_checkpoint_config(source.path, arch, flag=flag)
    except (CheckpointError, ValueError) as err:
        raise UserError(f"{flag} {source.flag}: {err}") from err
    try:
        model = MegatronActor(arch, actor_cfg, layout, frozen=True)
    except ValueError as err:  # the layout check (heads, layers, experts divisible by the parallel sizes)
        raise UserError(f"{flag} {source.flag}: its {arch.model_type} on the actor's layout: {err}") from err
    if source.kind == "hf":
        load_hf_into_actor(model, source.path, flag=flag)
    else:
        for module in model.modules:
            load_model_weights(module, source.path, arch, flag=flag)
    return model


def frozen_models(ckpt, run: RunConfig, inputs: Inputs, layout: ParallelLayout, init_ckpt: str | None):
    """((reference source, reference model), (teacher source, teacher model)) from --ref-load and --teacher-load or
    --teacher-url (`ckpt`, a CheckpointConfig; models None where the flag is unset): each resolved once
    (actor/reference.py; the sources go into the checkpoint) and built frozen on the actor's layout. The reference
    has the actor's architecture; the teacher its own (`teacher_arch`), with the student's tokenizer. A --teacher-url
    teacher is an SGLangTeacher (rollout/sglang/teacher.py), its source the model rank 0 found served (collective:
    rank 0 tells the others)."""
    from megatron_dapo.actor.reference import TeacherSource, resolve_reference

    hf = run.inputs.hf_checkpoint
    reference = resolve_reference(ckpt.ref_load, hf_checkpoint=hf, initial_checkpoint=init_ckpt)
    ref_model = build_frozen(reference, inputs.arch, run.actor, layout) if reference.kind else None
    if ckpt.teacher_server is not None:
        from megatron_dapo.rollout.sglang.teacher import SGLangTeacher
        from megatron_dapo.trainer.validation import share_from_rank0

        served = share_from_rank0(inputs.teacher_model)
        source = TeacherSource(kind="sglang", path=served, flag=" ".join(ckpt.teacher_server.urls))
        return (reference, ref_model), (source, SGLangTeacher(ckpt.teacher_server))
    teacher = resolve_reference(ckpt.teacher_load, hf_checkpoint=hf, initial_checkpoint=init_ckpt,
                                source=TeacherSource)
    teacher_model = build_frozen(teacher, teacher_arch(teacher, inputs.arch, inputs.tokenizer), run.actor, layout,
                                 against="its own config.json") if teacher.kind else None
    return (reference, ref_model), (teacher, teacher_model)


def teacher_arch(source, actor_arch: ModelArch, tokenizer) -> ModelArch:
    """The distillation teacher's architecture (--teacher-load): its own config.json for an HF directory (it may be
    larger than the student), the actor's for a torch_dist checkpoint; UserError naming both directories unless its
    tokenizer is the student's (the same vocabulary, token for token, and the same end-of-sequence id): the teacher
    scores the student's token ids, which must mean the same text to both."""
    if source.kind != "hf":
        return actor_arch
    try:
        arch = ModelArch.from_hf(source.path)
    except ValueError as err:
        raise UserError(f"--teacher-load {source.flag}: {err}") from err
    check_same_tokenizer(tokenizer, source.path, flag=f"--teacher-load {source.flag}")
    return arch


def make_logger(run: RunConfig):
    """Rank 0's metrics logger; the run record (run_config.json next to metrics.jsonl, and wandb's config) says
    what ran, secrets redacted."""
    from megatron_dapo.trainer.metrics_log import MetricsLogger

    log = run.log
    run.write(log.log_dir)
    return MetricsLogger(log.log_dir, total_steps=run.trainer.num_steps, wandb_project=log.wandb_project,
                         run_name=log.wandb_run_name, config=run.record(), use_wandb=log.use_wandb,
                         progress=log.progress, private_argv=log.private_argv)


def write_report(log_dir: str | Path) -> None:
    """report.png of metrics.jsonl in `log_dir` (rank 0, at the end of the run)."""
    from megatron_dapo.trainer.metrics_log import read_metrics
    from megatron_dapo.trainer.report import plot

    log_dir = Path(log_dir)
    records = read_metrics(log_dir / "metrics.jsonl")
    if records:
        plot(records, log_dir / "report.png", title=str(log_dir))
        print(f"[megatron-dapo] report: {log_dir / 'report.png'}")


def virtual_stage_layers(run: RunConfig, *, echo: bool) -> int | None:
    """--num-layers-per-virtual-pipeline-stage: the model's layer count, by which init_parallel sizes the virtual
    stages (a layout that does not cut is the same verdict on every rank, printed by the one with `echo`). None
    without it."""
    if run.layout.layers_per_virtual_stage is None:
        return None
    arch = require_arch(run.arch, run.inputs.hf_checkpoint)
    try:
        check_model_layout(arch, run.layout, hf_checkpoint=run.inputs.hf_checkpoint)
    except UserError as err:
        err.echo = echo
        raise
    return arch.num_layers


def export_hf(actor, export_dir: str, hf_checkpoint: str, step: int) -> None:
    """--export-hf: the trained policy as an HF checkpoint (megatron_dapo/checkpoint/hf_export.py)."""
    from megatron_dapo.checkpoint.hf_export import export_hf as export

    path = export(actor, export_dir, hf_checkpoint)
    if path is not None:
        print(f"[megatron-dapo] exported step {step} as an HF checkpoint: {path}")


def prepare_rank0(run: RunConfig):
    """Rank 0 before any process group: checks --load, --save and --log-dir (and locks --save for the run),
    raises the fd limit for the SGLang connections, starts an --async-rollout embedded engine early, reads every
    input, then (--overwrite-save) deletes the previous run's steps. Returns (engine or None, Inputs)."""
    from megatron_dapo.checkpoint.save_dir import clear_previous_steps, prepare_run_dirs
    from megatron_dapo.rollout.sglang.fd_limit import ensure_fd_limit

    engine = None
    # milliseconds, before anything is started or built (checkpoint/save_dir.py)
    ckpt = run.checkpoint
    _, overwritten = prepare_run_dirs(load=ckpt.load, save=ckpt.save, overwrite_save=ckpt.overwrite_save,
                                      log_dir=run.log.log_dir)
    if run.engine.kind == "sglang":  # rank 0 holds the HTTP connections to the servers
        ensure_fd_limit(run.engine.sglang_max_concurrency, int(os.environ.get("WORLD_SIZE", "1")))
    if (run.engine.async_rollout or run.engine.max_staleness) and run.engine.kind == "embedded":
        # its process boots (~25 s of imports on a busy 2-core machine) while this one reads the data and
        # builds the actor; it loads the tokenizer itself
        engine = rollout_build.make_rollout_engine(run.engine, None)
    inputs = load_inputs(run.inputs, run.arch, run.layout, with_data=True, export_hf=ckpt.export_hf)
    if ckpt.teacher_server is not None:  # its servers answer, serve one model, with the student's tokenizer
        from megatron_dapo.rollout.sglang.teacher import check_teacher

        inputs.teacher_model = check_teacher(ckpt.teacher_server, inputs.tokenizer)
    if overwritten:  # only once the inputs proved readable
        clear_previous_steps(Path(ckpt.save), overwritten)
    return engine, inputs
