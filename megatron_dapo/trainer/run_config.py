"""The run config: every setting of one run, parsed once from the flags (megatron_dapo/startup.py), and its record
(run_config.json).

`RunConfig` is a small tree of the components' own configs (ActorConfig, CollectConfig, TrainerConfig, the rollout
engine's, the inputs', the checkpoints', the logger's; each validates its fields and names the flag to fix), the
model architecture and the parallel layout, plus a redacted snapshot of the flags as parsed. Its `record()` is the
one record of what ran: written to --log-dir as run_config.json and given to wandb as the run's config, every
secret redacted (megatron_dapo/trainer/run_record.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from megatron_dapo.actor.config import ActorConfig
from megatron_dapo.distributed.parallel import ParallelLayout
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.rollout.build import RolloutEngineConfig
from megatron_dapo.rollout.collect import CollectConfig
from megatron_dapo.trainer.loop import TrainerConfig
from megatron_dapo.trainer.run_record import redact

RECORD_FILE = "run_config.json"
"""The run record's name in --log-dir."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputsConfig:
    """What the run reads before any model exists (trainer/build.load_inputs): the tokenizer and the prompts."""

    hf_checkpoint: str
    """--hf-checkpoint"""
    tokenizer: str | None
    """--tokenizer (None: --hf-checkpoint)"""
    prompt_data: str
    """--prompt-data"""
    eval_prompt_data: str | None
    """--eval-prompt-data (read only with --eval-interval)"""
    eval_interval: int
    """--eval-interval"""
    eval_max_prompts: int
    """--eval-max-prompts (0: all)"""
    prompt_format: str
    """--prompt-format"""
    max_prompt_length: int
    """--max-prompt-length"""
    max_prompt_chars: int | None
    """--max-prompt-chars"""
    on_long_prompt: str
    """--on-long-prompt"""
    max_response_length: int
    """--max-response-length (the context check)"""
    allow_exceed_context: bool
    """--allow-exceed-context"""

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.hf_checkpoint


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where the run starts from and saves to (checkpoint/save_dir.py, checkpoint/checkpointer.py)."""

    load: str | None
    """--load"""
    save: str | None
    """--save"""
    overwrite_save: bool
    """--overwrite-save"""
    mcore_checkpoint: str | None
    """--mcore-checkpoint (deprecated spelling of --load of converter output)"""
    fully_parallel_save: bool
    """--ckpt-fully-parallel-save"""
    async_save: bool
    """--async-save"""
    export_hf: str | None
    """--export-hf"""
    ref_load: str | None = None
    """--ref-load: the frozen reference model's weights ('initial', an HF or a torch_dist directory), None: none"""
    teacher_load: str | None = None
    """--teacher-load: the distillation teacher's weights (as --ref-load; its own architecture), None: none"""
    teacher_server: Any = None
    """--teacher-url: the distillation teacher served apart (rollout/sglang/teacher.py TeacherServerConfig), None:
    none"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Rank 0's metrics logger (trainer/metrics_log.py)."""

    log_dir: str
    """--log-dir"""
    wandb_project: str | None
    """--wandb-project"""
    wandb_run_name: str | None
    """--wandb-run-name"""
    use_wandb: bool
    """not --no-wandb"""
    progress: bool
    """not --no-progress"""
    private_argv: bool
    """a secret is on the command line (--sglang-api-key): tools that record it must not (run_record.py)"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """What one run is: the components' configs, the model and the layout, parsed once from the flags."""

    actor: ActorConfig
    collect: CollectConfig
    trainer: TrainerConfig
    engine: RolloutEngineConfig
    inputs: InputsConfig
    checkpoint: CheckpointConfig
    log: LogConfig
    arch: ModelArch | None
    """--hf-checkpoint's config.json, parsed once; None: it has none (load_inputs' error, after --save is checked)."""
    layout: ParallelLayout
    """The parallel flags over $WORLD_SIZE ranks."""
    seed: int
    """--seed"""
    flags: dict[str, Any]
    """The flags as parsed (the API key resolved), secrets redacted (run_record.run_record); top level of the record."""
    secrets: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    """The secret values the configs' record is redacted of (run_record.secrets_of)."""

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
        configs = {name: dataclasses.asdict(getattr(self, name)) for name in ("actor", "collect", "trainer")}
        configs = redact(json.loads(json.dumps(configs, default=_json_value)), list(self.secrets))
        return dict(self.flags) | {"config": configs}

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
