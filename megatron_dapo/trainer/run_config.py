"""The run config: every setting of one run, built once from the flags, and its record (run_config.json).

`RunConfig` is a small tree of the components' own configs (ActorConfig, CollectConfig, TrainerConfig; each
validates its fields and names the flag to fix) plus the flags as parsed. Its `record()` is the one record of what
ran: written to --log-dir as run_config.json and given to wandb as the run's config, every secret redacted
(megatron_dapo/trainer/run_record.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from megatron_dapo.actor.config import ActorConfig
from megatron_dapo.algorithm import DynamicSamplingConfig, OffPolicyConfig, OverlongConfig
from megatron_dapo.algorithm.registry import get_advantage_estimator, policy_loss_config
from megatron_dapo.rollout.collect import CollectConfig
from megatron_dapo.rollout.partial_rollout import DEFAULT_MAX_STALENESS
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.trainer.loop import TrainerConfig
from megatron_dapo.trainer.run_record import redact, run_record, secrets_of

RECORD_FILE = "run_config.json"
"""The run record's name in --log-dir."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What one run is: the components' configs and the flags they came from."""

    actor: ActorConfig
    collect: CollectConfig
    trainer: TrainerConfig
    flags: argparse.Namespace
    """The parsed flags (with the API key resolved by trainer/build.check_flags); in the record only redacted."""

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> RunConfig:
        """Build (and so validate) every config from the flags; ValueError names the flag."""
        actor, collect, trainer = build_configs(args)
        return cls(actor=actor, collect=collect, trainer=trainer, flags=args)

    def with_stop_tokens(self, eos_ids: tuple[int, ...]) -> RunConfig:
        """The same run with the tokenizer's end-of-sequence ids as the stop tokens of training and eval sampling
        (known once the tokenizer is loaded, after the flags are checked)."""
        collect = dataclasses.replace(self.collect,
                                      sampling=dataclasses.replace(self.collect.sampling, stop_token_ids=eos_ids))
        trainer = self.trainer
        if trainer.eval_sampling is not None:
            trainer = dataclasses.replace(
                trainer, eval_sampling=dataclasses.replace(trainer.eval_sampling, stop_token_ids=eos_ids))
        return dataclasses.replace(self, collect=collect, trainer=trainer)

    def record(self) -> dict[str, Any]:
        """The record of the run, JSON-safe: every flag as parsed (top level, as in the args.json it replaces) and
        "config", the configs built from them, with every secret redacted."""
        flags = run_record(self.flags)
        configs = {name: dataclasses.asdict(getattr(self, name)) for name in ("actor", "collect", "trainer")}
        configs = redact(json.loads(json.dumps(configs, default=_json_value)), secrets_of(self.flags))
        return flags | {"config": configs}

    def write(self, log_dir: str | Path) -> Path:
        """run_config.json in `log_dir` (made if missing)."""
        path = Path(log_dir) / RECORD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.record(), indent=2))
        return path


def _json_value(value: Any) -> str:
    """A config value JSON has no type for: a function (the policy loss, the advantage estimator) as the
    `module:qualname` path that --policy-loss / --advantage-estimator would accept, anything else as str()."""
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{value.__module__}:{value.__qualname__}"
    return str(value)


def build_configs(args: argparse.Namespace, eos_ids: tuple[int, ...] = ()):
    """Flags -> (ActorConfig, CollectConfig, TrainerConfig); each dataclass validates its fields.

    The LR schedule counts rollout steps: warmup over --lr-warmup-steps of them, decay (when not
    constant) reaching --min-lr at --lr-decay-steps (default --num-steps)."""
    decay_steps = None
    if args.lr_decay_style != "constant":
        decay_steps = args.num_steps if args.lr_decay_steps is None else args.lr_decay_steps
    actor = ActorConfig(
        lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style=args.lr_decay_style, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        use_distributed_optimizer=args.use_distributed_optimizer,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch, seed=args.seed,
        use_fused_logprob=args.use_fused_logprob, pack_sequences=args.pack_sequences,
        fused_linear_logprob=args.fused_linear_logprob, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor, moe_routing_replay=args.moe_routing_replay,
        params_dtype=args.params_dtype or ("bfloat16" if torch.cuda.is_available() else "float32"),
        loss=policy_loss_config(args.policy_loss, eps_low=args.clip_ratio_low, eps_high=args.clip_ratio_high,
                                dual_clip_c=args.clip_ratio_c, agg_mode=args.loss_agg_mode,
                                max_response_length=args.max_response_length),
    )
    sampling = _sampling("--max-response-length, --rollout-temperature, --rollout-top-p, --rollout-top-k",
                         max_new_tokens=args.max_response_length, temperature=args.rollout_temperature,
                         top_p=args.rollout_top_p, top_k=args.rollout_top_k, stop_token_ids=eos_ids)
    collect = CollectConfig(
        n_samples_per_prompt=args.n_samples_per_prompt, sampling=sampling,
        over_sample_factor=args.over_sample_factor, seed=args.seed, partial_rollout=args.partial_rollout,
        partial_rollout_max_staleness=max_staleness(args),
        dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=args.rollout_batch_size,
                                               enabled=args.dynamic_sampling,
                                               max_num_gen_batches=args.max_num_gen_batches,
                                               on_exhausted=args.on_gen_exhausted),
        overlong=OverlongConfig(max_response_length=args.max_response_length,
                                buffer_length=args.overlong_buffer_length,
                                penalty_factor=args.overlong_penalty_factor,
                                filter_truncated=args.overlong_filter),
    )
    eval_length = args.max_response_length if args.eval_max_response_length is None \
        else args.eval_max_response_length
    eval_sampling = _sampling("--eval-max-response-length, --eval-temperature, --eval-top-p",
                              max_new_tokens=eval_length,
                              temperature=args.eval_temperature, top_p=args.eval_top_p, stop_token_ids=eos_ids)
    trainer = TrainerConfig(
        num_steps=args.num_steps, global_batch_size=args.global_batch_size, eval_interval=args.eval_interval,
        eval_n_samples=args.n_samples_per_eval_prompt, save_dir=args.save, save_interval=args.save_interval,
        eval_sampling=eval_sampling, rollout_timeout_h=args.rollout_timeout,
        async_rollout=args.async_rollout, exit_save_timeout_s=args.exit_save_timeout_s,
        off_policy=OffPolicyConfig(use_tis=use_tis(args), tis_cap=args.tis_cap, mis_mode=args.mis_mode,
                                   mis_threshold=args.mis_threshold),
        advantage_estimator=get_advantage_estimator(args.advantage_estimator),
    )
    return actor, collect, trainer


def use_tis(args: argparse.Namespace) -> bool:
    """--use-tis / --no-use-tis as given; unset: on exactly when --async-rollout 1 (the batch was generated
    by the weights one update behind the actor, the gap TIS corrects)."""
    return args.use_tis if args.use_tis is not None else args.async_rollout > 0


def max_staleness(args: argparse.Namespace) -> int | None:
    """--partial-rollout-max-staleness as given; unset: partial_rollout.DEFAULT_MAX_STALENESS with
    --partial-rollout, None without it (nothing is carried)."""
    given = args.partial_rollout_max_staleness
    return given if given is not None or not args.partial_rollout else DEFAULT_MAX_STALENESS


def _sampling(flags: str, **params) -> SamplingParams:
    """SamplingParams whose validation error names the flags the values came from."""
    try:
        return SamplingParams(**params)
    except ValueError as e:
        raise ValueError(f"{e} (set by {flags})") from None
