"""DAPO maths on plain tensors: policy losses, advantages, dynamic sampling, overlong shaping, off-policy
correction. Losses and advantage estimators register by name beside their definition (`@register_policy_loss`,
`@register_advantage_estimator`); registry.py chooses one for the run (--policy-loss, --advantage-estimator).

No Megatron, no I/O: everything here is a pure function or a small stateful accumulator.
"""

from megatron_dapo.algorithm.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    group_advantages,
    grpo_advantages,
)
from megatron_dapo.algorithm.cispo import cispo_loss
from megatron_dapo.algorithm.dynamic_sampling import (
    KEEP_RATE_FLOOR,
    ON_EXHAUSTED,
    BatchFiller,
    DynamicSamplingConfig,
    GenerationBudgetExhausted,
    group_is_informative,
)
from megatron_dapo.algorithm.grpo_loss import dr_grpo_loss, grpo_loss
from megatron_dapo.algorithm.gspo import gspo_loss
from megatron_dapo.algorithm.loss import (
    AGG_MODES,
    PolicyLossConfig,
    PolicyLossOutput,
    aggregate,
    policy_loss,
    reduce_metrics,
)
from megatron_dapo.algorithm.mismatch import (
    MIS_MODES,
    OffPolicyConfig,
    mis_keep_mask,
    mismatch_sums,
    off_policy_correction,
    reduce_mismatch,
    tis_weights,
)
from megatron_dapo.algorithm.overlong import (
    OverlongConfig,
    overlong_keep_mask,
    overlong_penalties,
    overlong_penalty,
)

__all__ = [
    "AGG_MODES",
    "KEEP_RATE_FLOOR",
    "MIS_MODES",
    "ON_EXHAUSTED",
    "BatchFiller",
    "DynamicSamplingConfig",
    "GenerationBudgetExhausted",
    "OffPolicyConfig",
    "OverlongConfig",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "aggregate",
    "broadcast_to_tokens",
    "cispo_loss",
    "dr_grpo_advantages",
    "dr_grpo_loss",
    "group_advantages",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "group_is_informative",
    "mis_keep_mask",
    "mismatch_sums",
    "off_policy_correction",
    "overlong_keep_mask",
    "overlong_penalties",
    "overlong_penalty",
    "policy_loss",
    "reduce_metrics",
    "reduce_mismatch",
    "tis_weights",
]
