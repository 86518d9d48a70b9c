"""Entry point: `python -m megatron_dapo.train --help` (or under torchrun for TP/PP/DP).

Builds the pieces from flags (see megatron_dapo/arguments.py), loads the HF policy into the Megatron
actor, starts the rollout engine on global rank 0, resumes from --load when a checkpoint exists, and
runs `Trainer.run` (megatron_dapo/trainer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig, PolicyLossConfig
from megatron_dapo.arguments import build_parser
from megatron_dapo.collect import CollectConfig, Prompt
from megatron_dapo.models.hf_config import Qwen2Arch
from megatron_dapo.rollout.types import SamplingParams


def build_configs(args: argparse.Namespace, eos_ids: tuple[int, ...] = ()):
    """Flags -> (ActorConfig, CollectConfig, TrainerConfig); each dataclass validates its fields."""
    from megatron_dapo.actor import ActorConfig
    from megatron_dapo.trainer import TrainerConfig

    actor = ActorConfig(
        lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=None if args.lr_decay_style == "constant" else args.num_steps + args.lr_warmup_steps,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, seed=args.seed,
        use_fused_logprob=args.use_fused_logprob,
        params_dtype=args.params_dtype or ("bfloat16" if torch.cuda.is_available() else "float32"),
        loss=PolicyLossConfig(eps_low=args.clip_ratio_low, eps_high=args.clip_ratio_high,
                              dual_clip_c=args.clip_ratio_c, agg_mode=args.loss_agg_mode),
    )
    sampling = SamplingParams(max_new_tokens=args.max_response_length, temperature=args.rollout_temperature,
                              top_p=args.rollout_top_p, top_k=args.rollout_top_k, stop_token_ids=eos_ids)
    collect = CollectConfig(
        n_samples_per_prompt=args.n_samples_per_prompt, sampling=sampling,
        over_sample_factor=args.over_sample_factor, seed=args.seed,
        dynamic_sampling=DynamicSamplingConfig(train_batch_size=args.rollout_batch_size,
                                               enabled=args.dynamic_sampling,
                                               max_num_gen_batches=args.max_num_gen_batches,
                                               on_exhausted=args.on_gen_exhausted),
        overlong=OverlongConfig(max_response_length=args.max_response_length,
                                buffer_length=min(args.overlong_buffer_length, args.max_response_length),
                                penalty_factor=args.overlong_penalty_factor,
                                filter_truncated=args.overlong_filter),
    )
    trainer = TrainerConfig(
        num_steps=args.num_steps, global_batch_size=args.global_batch_size, eval_interval=args.eval_interval,
        eval_n_samples=args.n_samples_per_eval_prompt, save_dir=args.save, save_interval=args.save_interval,
        eval_sampling=SamplingParams(max_new_tokens=args.max_response_length,
                                     temperature=args.eval_temperature, stop_token_ids=eos_ids),
    )
    return actor, collect, trainer


def load_prompt_set(path: str, tokenizer, *, prompt_format: str, max_prompt_length: int,
                    limit: int | None = None) -> list[Prompt]:
    """Dataset rows -> token-id prompts; prompts longer than max_prompt_length are skipped (counted)."""
    from megatron_dapo.data import load_prompts, render_prompt

    prompts, skipped = [], 0
    for record in load_prompts(path, limit=limit):
        if prompt_format == "chat":
            ids = render_prompt(record, tokenizer)
        else:
            ids = tokenizer.encode("\n".join(m["content"] for m in record.messages), add_special_tokens=False)
        if len(ids) > max_prompt_length:
            skipped += 1
            continue
        prompts.append(Prompt(prompt_ids=ids, ground_truth=record.ground_truth, index=record.index))
    if not prompts:
        raise ValueError(f"{path}: every prompt is longer than --max-prompt-length={max_prompt_length}")
    if skipped:
        print(f"[megatron-dapo] {path}: skipped {skipped} prompts longer than {max_prompt_length} tokens")
    return prompts


def load_hf_into_actor(actor, hf_dir: str) -> None:
    """Copy HF safetensors weights into this rank's Megatron shards through the mapping table."""
    from megatron.core import parallel_state

    from megatron_dapo.weights import iter_mcore_shards
    from megatron_dapo.weights.hf_format import HFCheckpointReader

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dtype = actor.config.torch_params_dtype
    with HFCheckpointReader(hf_dir) as reader:
        shards = {name: per_tp[tp_rank].to(dtype)
                  for name, per_tp in iter_mcore_shards(reader.get, actor.arch, actor.layout, pp_rank)}
    actor.load_shards(shards)


def make_rollout_engine(args: argparse.Namespace, tokenizer):
    """The engine of global rank 0: embedded on CPU, else SGLang servers (launched or attached)."""
    from megatron_dapo.rollout import make_engine

    kind = args.rollout_engine or ("sglang" if torch.cuda.is_available() else "embedded")
    if kind == "embedded":
        return make_engine("embedded", args.hf_checkpoint, tokenizer=tokenizer, seed=args.seed,
                           max_batch_size=args.rollout_batch_size * args.n_samples_per_prompt)
    from megatron_dapo.rollout.sglang_engine import ClientConfig
    from megatron_dapo.rollout.sglang_server import ServerConfig

    attach = bool(args.sglang_server_urls)
    client = ClientConfig(
        max_concurrency=args.sglang_max_concurrency,
        update_mode=args.weight_sync_mode or ("distributed" if attach else "tensor"),
        bucket_bytes=args.weight_sync_bucket_mb << 20,
        sync_backend="nccl" if torch.cuda.is_available() else "gloo",
        sync_master_address=args.weight_sync_master_addr, sync_master_port=args.weight_sync_master_port,
    )
    if attach:
        return make_engine("sglang", client=client, server_urls=args.sglang_server_urls)
    python = args.sglang_python or sys.executable
    if not torch.cuda.is_available() and args.sglang_python is None and Path(".venv-sglang/bin/python").exists():
        python = ".venv-sglang/bin/python"  # the CPU SGLang environment of `make sglang-env`
    server = ServerConfig(model_path=args.hf_checkpoint, num_servers=args.sglang_num_servers,
                          tp_per_server=args.sglang_tp_size, base_port=args.sglang_base_port,
                          host=args.sglang_host, extra_args=tuple(args.sglang_extra_args.split()),
                          device="cuda" if torch.cuda.is_available() else "cpu", python=python,
                          log_dir=str(Path(args.log_dir) / "sglang"),
                          env={"CUDA_VISIBLE_DEVICES": args.sglang_gpus} if args.sglang_gpus else {})
    return make_engine("sglang", server, client=client)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    from megatron_dapo.actor import MegatronActor, init_parallel
    from megatron_dapo.checkpoint import load_checkpoint, save_checkpoint
    from megatron_dapo.data import ResumableSampler
    from megatron_dapo.metrics_log import MetricsLogger
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.trainer import Trainer
    from megatron_dapo.weights.dist_load import initial_checkpoint, load_model_weights

    layout = init_parallel(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                           seed=args.seed)
    rank0 = dist.get_rank() == 0
    arch = Qwen2Arch.from_hf(args.hf_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.hf_checkpoint)
    eos = tuple(sorted({t for t in (tokenizer.eos_token_id,) if t is not None}))
    actor_cfg, collect_cfg, trainer_cfg = build_configs(args, eos)
    reward_fn = get_reward_fn(args.reward_fn)

    actor = MegatronActor(arch, actor_cfg, layout)
    init_ckpt = initial_checkpoint(args.load, args.mcore_checkpoint)  # hf-to-mcore output, if given
    if init_ckpt is None:
        load_hf_into_actor(actor, args.hf_checkpoint)

    train_prompts = load_prompt_set(args.prompt_data, tokenizer, prompt_format=args.prompt_format,
                                    max_prompt_length=args.max_prompt_length) if rank0 else []
    eval_prompts = []
    if rank0 and args.eval_prompt_data and args.eval_interval:
        eval_prompts = load_prompt_set(args.eval_prompt_data, tokenizer, prompt_format=args.prompt_format,
                                       max_prompt_length=args.max_prompt_length,
                                       limit=args.eval_max_prompts or None)
    sampler = ResumableSampler(max(len(train_prompts), 1), seed=args.seed)
    engine = make_rollout_engine(args, tokenizer) if rank0 else None

    def next_prompts(k: int) -> list[Prompt]:
        return [train_prompts[i] for i in sampler.next_batch(k)]

    def save(step: int) -> None:
        box = [sampler.state_dict()]
        dist.broadcast_object_list(box, src=0)  # identical common state on every rank
        save_checkpoint(args.save, step, actor, extra={"sampler": box[0]})

    logger = None
    if rank0:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / "args.json").write_text(json.dumps(vars(args), indent=2))
        logger = MetricsLogger(args.log_dir, total_steps=args.num_steps, wandb_project=args.wandb_project,
                               run_name=args.wandb_run_name, config=vars(args), use_wandb=not args.no_wandb,
                               progress=not args.no_progress)
    trainer = Trainer(config=trainer_cfg, collect=collect_cfg, actor=actor, engine=engine,
                      next_prompts=next_prompts if rank0 else None, eval_prompts=eval_prompts,
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      reward_fn=reward_fn, logger=logger, save_fn=save if args.save else None)
    if init_ckpt is not None:  # torch_dist model weights at any TP/PP: iteration 0, fresh optimizer
        load_model_weights(actor.module, init_ckpt, arch)
        actor.optimizer.reload_model_params()
        trainer.sync_weights(0)  # the engine was started from --hf-checkpoint
    elif args.load:
        extra = load_checkpoint(args.load, actor)
        if extra is not None:
            if rank0:  # only rank 0 draws prompts; the other ranks' samplers are placeholders
                sampler.load_state_dict(extra["sampler"])
            trainer.step = int(extra["step"])
            trainer.sync_weights(trainer.step)  # the engine still holds the initial weights
            if rank0:
                print(f"[megatron-dapo] resumed from {args.load} at step {trainer.step}")
    try:
        trainer.run()
        if args.export_hf:
            from megatron_dapo.hf_export import export_hf

            path = export_hf(actor, args.export_hf, args.hf_checkpoint)
            if path is not None:
                print(f"[megatron-dapo] exported step {trainer.step} as an HF checkpoint: {path}")
    finally:
        if logger is not None:
            logger.close()
            _write_report(Path(args.log_dir))
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def _write_report(log_dir: Path) -> None:
    from megatron_dapo.metrics_log import read_metrics
    from megatron_dapo.report import plot

    records = read_metrics(log_dir / "metrics.jsonl")
    if records:
        plot(records, log_dir / "report.png", title=str(log_dir))
        print(f"[megatron-dapo] report: {log_dir / 'report.png'}")


if __name__ == "__main__":  # the guard matters: dist_checkpointing's spawn Manager re-imports __main__
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main(sys.argv[1:])
