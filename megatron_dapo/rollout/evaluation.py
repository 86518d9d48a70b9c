"""avg@k and pass@k of a rollout engine on a verifiable prompt set.

avg@k (DAPO's AIME metric, "avg@32"): mean accuracy over k samples per prompt, averaged over prompts.
pass@k: the unbiased estimator of Chen et al. 2021 (Codex, Eq. 1) from n >= k samples with c correct:
    pass@k = 1 - C(n - c, k) / C(n, k)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from math import comb

from megatron_dapo.rollout.collect import Prompt, RewardFn, seeded, tool_stats
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def evaluate(
    engine: RolloutEngine,
    prompts: Sequence[Prompt],
    decode: Callable[[list[int]], str],
    reward_fn: RewardFn,
    *,
    n_samples: int,
    sampling: SamplingParams,
    pass_ks: Sequence[int] = (1,),
    prefix: str = "eval",
    seed: int | None = None,
) -> dict[str, float]:
    """Sample n_samples responses per prompt; return {prefix/avg@n, prefix/pass@k..., response length}.

    With `seed`, each prompt's samples are drawn from their own seeded stream, so an evaluation of
    the same weights gives the same numbers."""
    requests = [RolloutRequest(prompt_ids=p.prompt_ids, n=n_samples, request_id=f"{prefix}-{i}",
                               sampling=seeded(sampling, seed, f"{prefix}-{i}"))
                for i, p in enumerate(prompts)]
    groups = engine.generate(requests)
    per_prompt_acc, correct_counts, lengths = [], [], []
    for prompt, samples in zip(prompts, groups, strict=True):
        accs = [bool(reward_fn(decode(s.response_ids), prompt.ground_truth).acc) for s in samples]
        per_prompt_acc.append(sum(accs) / len(accs))
        correct_counts.append(sum(accs))
        lengths.extend(len(s.response_ids) for s in samples)
    out = {f"{prefix}/avg@{n_samples}": sum(per_prompt_acc) / len(per_prompt_acc),
           f"{prefix}/response_len_mean": sum(lengths) / len(lengths)}
    if engine.tool_use:  # the calls' share, and the engine's multi_turn/* counters of this evaluation
        out |= tool_stats([s for g in groups for s in g], prefix)
        out |= {f"{prefix}/{key.split('/', 1)[1]}": value for key, value in engine.take_metrics().items()}
    for k in pass_ks:
        if k <= n_samples:
            out[f"{prefix}/pass@{k}"] = sum(pass_at_k(n_samples, c, k) for c in correct_counts) / len(prompts)
    return out
