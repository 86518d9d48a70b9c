"""What a policy's samples look like on the remainder task (megatron_dapo/data/remainder.py).

One seeded sampling pass over held-out problems at the run's max response length and temperature 1 gives the
numbers the ablation reads each technique by: avg@k, accuracy by problem length, the response length and its
tail, the truncated share and how much of it was sound reasoning cut off (the reward noise of DAPO Sec. 3.4),
the share of responses that repeat a line, and the token entropy (estimated as the mean -log p of the sampled
tokens, which at temperature 1 is an unbiased estimate of the policy's entropy per token, in nats).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from megatron_dapo.data import render_prompt
from megatron_dapo.data.records import PromptRecord
from megatron_dapo.data.remainder import sound_so_far
from megatron_dapo.reward import get_reward_fn
from megatron_dapo.rollout.collect import seeded
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams

LENGTH_BUCKETS = ((1, 6), (7, 13), (14, 24))
"""Lines of work (a // b) the accuracy is split by: short, middle and long problems."""


def _percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def has_repeat(response: str) -> bool:
    """Whether a line of `response` repeats the line before it (the rambling the warm-up planted)."""
    lines = [line for line in response.strip("\n").split("\n")]
    return any(a == b and a for a, b in zip(lines, lines[1:], strict=False))  # pairs: lines[1:] is one shorter


def remainder_sample_stats(engine: Any, tokenizer: Any, records: Sequence[PromptRecord], *, k: int,
                       max_new_tokens: int, seed: int) -> dict[str, float]:
    """Sample `k` responses per record from `engine` (any RolloutEngine) and summarise them.

    Keys: avg@k; acc_<lo>_<hi> (accuracy over problems of lo..hi lines); len_mean, len_p90, len_max
    (tokens); truncated (share of responses cut at `max_new_tokens`); sound_truncated (share of responses that
    were cut off while every line so far was right); repeat (share that repeat a line); entropy (nats/token)."""
    reward = get_reward_fn("math_dapo")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                              stop_token_ids=(tokenizer.eos_token_id,))
    requests = [RolloutRequest(prompt_ids=render_prompt(r, tokenizer), n=k, request_id=f"remainder-eval-{i}",
                               sampling=seeded(sampling, seed, f"remainder-eval-{i}"))
                for i, r in enumerate(records)]
    groups = engine.generate(requests)
    lengths, nll, tokens = [], 0.0, 0
    accs, truncated, sound_cut, repeats = [], [], [], []
    by_bucket: dict[tuple[int, int], list[float]] = {b: [] for b in LENGTH_BUCKETS}
    for record, samples in zip(records, groups, strict=True):
        a, b = record.extra["a"], record.extra["b"]
        for s in samples:
            text = tokenizer.decode(s.response_ids, skip_special_tokens=True)
            acc = float(bool(reward(text, record.ground_truth).acc))
            accs.append(acc)
            for lo, hi in LENGTH_BUCKETS:
                if lo <= a // b <= hi:
                    by_bucket[(lo, hi)].append(acc)
            lengths.append(len(s.response_ids))
            truncated.append(float(s.truncated))
            sound_cut.append(float(s.truncated and sound_so_far(text, a, b)))
            repeats.append(float(has_repeat(text)))
            nll -= sum(s.logprobs)
            tokens += len(s.logprobs)
    out = {
        f"avg@{k}": statistics.fmean(accs),
        "len_mean": statistics.fmean(lengths),
        "len_p90": _percentile(lengths, 0.9),
        "len_max": float(max(lengths)),
        "truncated": statistics.fmean(truncated),
        "sound_truncated": statistics.fmean(sound_cut),
        "repeat": statistics.fmean(repeats),
        "entropy": nll / max(tokens, 1),
    }
    for (lo, hi), values in by_bucket.items():
        if values:
            out[f"acc_{lo}_{hi}"] = statistics.fmean(values)
    return out
