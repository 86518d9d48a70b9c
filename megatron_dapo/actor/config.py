"""Actor configuration and the unit of training data it consumes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_dapo.algorithm.kl import KLConfig, kl_agg_mode
from megatron_dapo.algorithm.loss import PolicyLossConfig

PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine", "inverse-square-root")
"""megatron-core OptimizerParamScheduler's decay styles (--lr-decay-style)."""

STEP_METRICS: tuple[str, ...] = ("num_tokens", "grad_norm", "lr", "update_successful")
"""What `MegatronActor.train_step` reports beside the loss's own metrics: names a loss may not declare."""


@dataclass(kw_only=True)
class ActorConfig:
    lr: float = 1e-6
    """Peak learning rate after warmup (--lr)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate (--min-lr)."""
    lr_warmup_steps: int = 0
    """Rollout steps of linear warmup from 0 to lr (--lr-warmup-steps): every optimizer step of rollout step
    k (1-based) trains at lr * k / lr_warmup_steps for k <= lr_warmup_steps (DAPO: 20)."""
    lr_decay_steps: int | None = None
    """Rollout step at which the decayed lr reaches min_lr (--lr-decay-steps, default --num-steps); None
    only with the 'constant' style."""
    lr_decay_style: str = "constant"
    """--lr-decay-style: constant (DAPO), linear, cosine or inverse-square-root, over rollout steps."""
    weight_decay: float = 0.1
    """Decoupled (AdamW) weight decay (--weight-decay)."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global grad-norm clip (--clip-grad); 0 disables clipping."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP ranks (--use-distributed-optimizer)."""
    max_tokens_per_micro_batch: int | None = None
    """Token budget of one padded micro-batch, rows x longest row (--max-tokens-per-micro-batch);
    None = fixed micro_batch_size rows."""
    micro_batch_size: int = 1
    """Rows per micro-batch when no token budget is set (no flag: the trainer always sets a token budget)."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    kl: KLConfig | None = None
    """The KL term to the reference model (--kl-coef, --kl-estimator; algorithm/kl.py): every sample then carries
    its ref_log_probs, and train/kl is logged; None: no reference model. With --kl-in-reward its coef is 0 (train/kl
    only): the KL is a reward penalty instead (the trainer's TrainerConfig.kl_reward)."""
    use_fused_logprob: bool = True
    """Use megatron_dapo.ops' fused vocab-parallel log-prob/entropy when importable (--use-fused-logprob)."""
    pack_sequences: bool = False
    """Pack each micro-batch's rows into one [1, T] row (--pack-sequences); the token budget then counts
    real tokens. TE: THD attention over cu_seqlens; local spec: a block-diagonal causal mask."""
    fused_linear_logprob: bool = False
    """Compute log-probs/entropy from the last stage's hidden states and the output weight chunk by chunk,
    never building [tokens x V/tp] logits (--fused-linear-logprob)."""
    params_dtype: str = "float32"
    """Parameter dtype (--params-dtype): float32 or bfloat16 (bf16 keeps fp32 main params)."""
    seed: int = 1234
    """Seed of torch and the model-parallel RNG (--seed)."""
    moe_aux_loss_coeff: float | None = None
    """MoE models: megatron-core's load-balancing loss coefficient per layer (--moe-aux-loss-coeff); None:
    config.json's router_aux_loss_coef; 0: off."""
    moe_expert_capacity_factor: float | None = None
    """MoE models: expert capacity as a multiple of the even share, excess tokens dropped
    (--moe-expert-capacity-factor); None: dropless."""
    moe_routing_replay: bool = False
    """MoE models: the training forward uses the rollout's routing where a sample carries it
    (--moe-routing-replay)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr (--lr) must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"min_lr (--min-lr) must be in [0, lr={self.lr}], got {self.min_lr}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps (--lr-warmup-steps) must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style (--lr-decay-style) must be one of {LR_DECAY_STYLES}, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_decay_steps is not None and self.lr_decay_steps <= self.lr_warmup_steps:
            raise ValueError(f"lr_decay_steps (--lr-decay-steps, default --num-steps; {self.lr_decay_steps}) "
                             f"must exceed lr_warmup_steps (--lr-warmup-steps, {self.lr_warmup_steps}) rollout "
                             f"steps with --lr-decay-style {self.lr_decay_style}")
        if self.lr_decay_steps is None and self.lr_decay_style != "constant":
            raise ValueError(f"--lr-decay-style {self.lr_decay_style} needs lr_decay_steps "
                             "(--lr-decay-steps)")
        if self.moe_aux_loss_coeff is not None and not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"moe_aux_loss_coeff (--moe-aux-loss-coeff) must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.moe_expert_capacity_factor is not None and not self.moe_expert_capacity_factor > 0:
            raise ValueError("moe_expert_capacity_factor (--moe-expert-capacity-factor) must be > 0, got "
                             f"{self.moe_expert_capacity_factor}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay (--weight-decay) must be >= 0, got {self.weight_decay}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name} ({flag}) must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise ValueError(f"adam_eps (--adam-eps) must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad (--clip-grad) must be >= 0, got {self.clip_grad}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch <= 0:
            raise ValueError("max_tokens_per_micro_batch (--max-tokens-per-micro-batch) must be positive or "
                             f"unset, got {self.max_tokens_per_micro_batch}")
        if self.micro_batch_size <= 0:
            raise ValueError(f"ActorConfig.micro_batch_size must be positive, got {self.micro_batch_size}")
        if self.params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype (--params-dtype) must be one of {list(PARAMS_DTYPES)}, "
                             f"got {self.params_dtype!r}")
        if not isinstance(self.loss, PolicyLossConfig):
            raise TypeError(f"loss must be a PolicyLossConfig, got {type(self.loss).__name__}")
        if self.kl is not None:
            if self.loss.counts_tokens is None:
                raise ValueError(f"--kl-coef: the KL term must share the denominator of --policy-loss "
                                 f"{self.loss.name!r}, whose trial denominator counts neither tokens nor responses")
            if "kl" in self.loss.metrics:
                raise ValueError(f"--policy-loss {self.loss.name!r} declares a metric 'kl', the KL term's own")
        if clash := sorted(set(self.loss.metrics) & set(STEP_METRICS)):
            raise ValueError(f"--policy-loss {self.loss.name!r} declares metrics {clash}, which the train step "
                             f"reports itself ({', '.join(STEP_METRICS)}); give them other names")

    @property
    def metric_keys(self) -> tuple[str, ...]:
        """The token sums a train step reduces: the loss's declared metrics, and 'kl' with a KL term."""
        return self.loss.metrics + (("kl",) if self.kl is not None else ())

    @property
    def kl_agg_mode(self) -> str:
        """How the KL term aggregates: to the loss's own denominator (algorithm/kl.py: kl_agg_mode)."""
        return kl_agg_mode(bool(self.loss.counts_tokens), self.loss.agg_mode)

    @property
    def torch_params_dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.params_dtype]

    def check_model(self, arch) -> None:
        """Raise ValueError naming the mixture-of-experts flags given for `arch` (a ModelArch) when it has no
        experts: they would be ignored (the expert-parallel flags are refused the same way by
        distributed.parallel.validate_layout)."""
        if arch.is_moe:
            return
        given = [flag for flag, on in (("--moe-aux-loss-coeff", self.moe_aux_loss_coeff is not None),
                                       ("--moe-expert-capacity-factor", self.moe_expert_capacity_factor is not None),
                                       ("--moe-routing-replay", self.moe_routing_replay)) if on]
        if given:
            raise ValueError(f"{' / '.join(given)} apply to mixture-of-experts models; {arch.model_type} has no "
                             f"experts (drop the flag{'s' if len(given) > 1 else ''})")


@dataclass(kw_only=True)
class TrainSample:
    """One rollout: prompt + response token ids and what the loss needs per response token."""

    tokens: list[int]
    """Prompt ids followed by response ids."""
    prompt_len: int
    advantage: float = 0.0
    old_log_probs: torch.Tensor | None = None
    """[response_len] log pi_old; None = on-policy (the current log-probs, detached)."""
    ref_log_probs: torch.Tensor | None = None
    """[response_len] log pi_ref of the frozen reference model (--ref-load), for the KL term; None: none."""
    token_advantages: torch.Tensor | None = None
    """[response_len] a per-token advantage added to `advantage` (the distillation teacher's, algorithm/distill.py);
    None: the response's advantage alone."""
    loss_mask: torch.Tensor | None = None
    """[response_len] 1 = token enters the loss; None = all ones."""
    is_weights: torch.Tensor | None = None
    """[response_len] detached rollout-correction weight per token (--use-tis: min(pi_old/pi_rollout, C),
    algorithm/mismatch.py), multiplied into the token's loss; None = all ones."""
    routed_experts: torch.Tensor | None = None
    """MoE models: [len(tokens) - 1, num_layers, top_k] integer expert ids the rollout engine routed input token i
    to in each layer (global layer index; dense layers' rows are ignored), best first, as SGLang's
    return_routed_experts gives them; the last token was never fed back, so it has no row. None: not recorded.
    At Qwen3-30B-A3B a token's row is 48 x 8 ids (384 B as uint8)."""

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_len < len(self.tokens):
            raise ValueError(f"TrainSample: need 1 <= prompt_len ({self.prompt_len}) < len(tokens) "
                             f"({len(self.tokens)}): at least one prompt and one response token")
        for name in ("old_log_probs", "ref_log_probs", "token_advantages", "loss_mask", "is_weights"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (self.response_len,):
                raise ValueError(f"TrainSample.{name} has shape {tuple(value.shape)}, expected "
                                 f"[response_len={self.response_len}]")
        routed = self.routed_experts
        if routed is not None and (routed.dim() != 3 or routed.shape[0] != len(self.tokens) - 1):
            raise ValueError(f"TrainSample.routed_experts has shape {tuple(routed.shape)}, expected "
                             f"[len(tokens) - 1 = {len(self.tokens) - 1}, num_layers, top_k]")
        weights = self.is_weights
        if weights is not None and not (torch.isfinite(weights).all() and (weights >= 0).all()):
            raise ValueError("TrainSample.is_weights must be finite and >= 0")

    @property
    def response_len(self) -> int:
        return len(self.tokens) - self.prompt_len
