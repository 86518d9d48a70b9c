"""Partial rollout (--partial-rollout): groups cut when a step's batch is full resume at the next step.

Without it, dynamic sampling (collect.py) aborts the requests still in flight once the batch is full and
throws away what they generated, together with the groups that finished behind the cut. With it, every
such group is *carried*: its finished samples are kept as they are, each unfinished sample keeps its
response prefix (token ids, the rollout log-probs, the weight version of every token), and the next step
submits the carried groups first, before any new prompt, each unfinished sample as a continuation request
(prompt + prefix as input ids, max_new_tokens minus the prefix length, RolloutRequest.resumed_tokens). The
final Sample is prefix + continuation with per-token versions (`Sample.token_versions`). Nothing
generated is dropped: tokens generated = kept + filtered + carried (collect.py's `rollout/*_tokens`).

Sampler and keep rate: a carried group's prompt was drawn at the step that first submitted it and is never
drawn again; carried groups fill the first round's request (round 1 asks the sampler for
round_size - carried prompts, `fresh_prompt_count`; none, and the sampler is not called, when the carried groups
alone reach round_size: that round is the carried groups only, and the next round, sized by the keep rate they
measured, asks for new prompts). Once decided they count in the step's keep rate like any group. Overlong
shaping and the overlong filter see the full response (prefix + continuation), and the continuation stops at
the same max_new_tokens as one generation would.

The loss: the actor recomputes the old log-probs of every token (Trainer.train -> compute_log_probs), so
the PPO ratio is against the policy that trains; the prefix's *rollout* log-probs come from an older
policy, which is the rollout-vs-actor mismatch that --use-tis / --mis-mode correct (algorithm/mismatch.py).
`rollout/max_staleness` (current version minus the oldest token version among the kept groups) and
`rollout/stale_token_frac` say how far off-policy the batch is. A group is carried again when it is still
cut at the next step (only when the carried groups ahead of it fill the batch), so staleness is usually 1.

The staleness cap (--partial-rollout-max-staleness N, default DEFAULT_MAX_STALENESS = 1): nothing else bounds
how many steps a group can be carried again (a low keep rate or a small batch lets the carried groups fill
the batch step after step), and the TIS / MIS correction of the prefix degrades with the version gap. At the
start of each step, before any request is sent, a carried group whose oldest token is more than N versions
older than the engine's weights (`staleness_of`, the definition of `rollout/max_staleness`) is dropped
(`drop_stale`): it is not resubmitted, its tokens count in `rollout/discarded_tokens` (they were counted in
`rollout/resumed_tokens` as carried in, so the token identity still holds), and `rollout/stale_dropped_groups`
counts it. Every token a step generates has the engine's version, so a kept group's staleness is that of its
carried prefix: `rollout/max_staleness` never exceeds N. The dropped group's prompt is not drawn again: the
sampler never rewinds (it has moved on since the step that drew it), so that prompt is skipped for the rest of
its epoch like a prompt whose group dynamic sampling filters out, and comes back in the next epoch's order.
The decision uses the engine's version at that step and the carried state in the checkpoint, both restored
on a resume (the engine is pushed the resumed step's version), so a resumed run drops the same groups.
Why 1: in the regime partial rollout is for (carried groups are a fraction of the batch) every carried group
is resumed, and decided, at the very next step, so staleness is 1 and the cap drops nothing; only a group cut
twice (the carried groups alone filled the batch) would reach 2. N = 1 keeps every trained token within one
weight update of the engine's (two of the actor's with --async-rollout 1). The cost of the cap is the
tokens of the dropped groups, generated and never trained on (simulated: docs/BENCHMARKS.md, "Partial rollout").

Reproducibility: a continuation keeps its sample's random stream (same seed, same sample index;
RolloutRequest.first_index / resumed_tokens), and the carried groups are in the checkpoint (`state()`), so
a resumed run regenerates exactly what the uninterrupted one did. With the embedded engine the cut itself is
deterministic: decisions are in submission order, and the engine stops every unfinished row at the decode
step during which the batch filled, so which tokens each prefix holds depends only on the seeds and weights.
On SGLang the abort point is timing-dependent: how many tokens each in-flight sample has when
/abort_request reaches the scheduler (and which queued samples had started) changes from run to run, so the
prefixes, and everything after them, are not reproducible across runs; given a checkpoint, a resumed run
continues the carried prefixes with the same seeds (SGLang keys seeded noise by seed and absolute position, so
a continuation draws the noise the uninterrupted sample would have), bit-exact only under deterministic
inference, and its own later cuts are timing-dependent again.

Cost: the carried state is 12 bytes per token (int32 ids, fp32 log-probs, int32 versions) in the checkpoint's
common state, written by rank 0 and broadcast to every rank twice per save (ours in train.py, megatron's
common-state consistency check); on rank 0 the carried Samples are Python lists (3 values per token). How much
is carried, discarded and dropped at the production setting, and what that state then weighs
(tools/bench_partial_rollout.py, simulated): docs/BENCHMARKS.md, "Partial rollout".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from megatron_dapo.checkpoint.state import CommonState, Holder
from megatron_dapo.rollout.types import Prompt, RolloutRequest, Sample, SamplingParams

STATE_VERSION = 2
"""Layout version of `state()` (checked by `from_state`; 2 added a conversation's tool-token mask and calls, a
version-1 checkpoint still reads: its samples had none)."""

DEFAULT_MAX_STALENESS = 1
"""--partial-rollout-max-staleness when --partial-rollout is given without it (see the module docstring)."""


@dataclass(kw_only=True)
class CarriedGroup:
    """A group cut at the end of a step: G samples by index, finished ones ('stop' / 'length') kept as they are,
    'abort' ones holding the response prefix to continue from (possibly empty)."""

    prompt: Prompt
    samples: list[Sample]
    seed: int | None
    """Sampling seed of the group's first request (None in an unseeded run): continuations draw from it."""
    first_step: int
    """Step that first submitted the group."""

    def __post_init__(self) -> None:
        if not self.samples or [s.index for s in self.samples] != list(range(len(self.samples))):
            raise ValueError(f"carried group of prompt {self.prompt.index}: samples must be ordered by index "
                             f"0..{len(self.samples) - 1}, got {[s.index for s in self.samples]}")

    @property
    def tokens(self) -> int:
        """Response tokens already generated (finished samples and prefixes)."""
        return sum(len(s.response_ids) for s in self.samples)

    @property
    def unfinished(self) -> list[int]:
        return [s.index for s in self.samples if s.finish_reason == "abort"]


def fresh_prompt_count(round_size: int, carried: int) -> int:
    """New prompts a round asks the sampler for when `carried` groups of the previous step already fill part of
    it: round_size - carried, and 0 (the sampler is not called) when the carried groups alone reach round_size.
    The carried groups are all resubmitted whatever their number: they cannot wait, their staleness grows."""
    if round_size < 1 or carried < 0:
        raise ValueError(f"round of {round_size} prompts with {carried} carried groups: need round_size >= 1, "
                         "carried >= 0")
    return max(0, round_size - carried)


def settle(sample: Sample, sampling: SamplingParams) -> Sample:
    """An aborted sample whose prefix already ends the response, relabelled as finished: SGLang applies an
    abort on the decode pass after which it lands, so that pass's token can be a stop token or the
    max_new_tokens-th one. Any other sample is returned unchanged."""
    if sample.finish_reason != "abort" or not sample.response_ids:
        return sample
    if sample.response_ids[-1] in sampling.stop_token_ids:
        return dataclasses.replace(sample, finish_reason="stop")
    if len(sample.response_ids) >= sampling.max_new_tokens:
        return dataclasses.replace(sample, finish_reason="length")
    return sample


def continuation_request(prompt_ids: Sequence[int], prefix: Sample, sampling: SamplingParams, seed: int | None,
                         request_id: str) -> RolloutRequest:
    """The request that continues sample `prefix.index` of a group from its response prefix: input ids
    prompt + prefix, the remaining token budget, the sample's own seed and random-stream position."""
    k = len(prefix.response_ids)
    if k >= sampling.max_new_tokens:
        raise ValueError(f"sample {prefix.index} of {request_id!r} already holds {k} tokens of the "
                         f"{sampling.max_new_tokens} allowed (--max-response-length): nothing to continue")
    return RolloutRequest(
        prompt_ids=list(prompt_ids) + list(prefix.response_ids), n=1, request_id=request_id,
        sampling=dataclasses.replace(sampling, seed=seed, max_new_tokens=sampling.max_new_tokens - k),
        first_index=prefix.index, resumed_tokens=k, resumed_mask=tuple(prefix.loss_mask),
    )


def extend(prefix: Sample | None, continuation: Sample, prompt_ids: Sequence[int]) -> Sample:
    """prefix + continuation as one sample of `prompt_ids` (the original prompt), with per-token versions; a
    conversation's (rollout/multi_turn.py) tool-token masks joined and its calls added up.

    `prefix` None (or empty): the continuation is the whole response, returned with its own fields."""
    if prefix is None or not prefix.response_ids:
        return dataclasses.replace(continuation, prompt_ids=list(prompt_ids))
    if prefix.index != continuation.index:
        raise ValueError(f"continuation of sample {continuation.index} offered to sample {prefix.index}")
    return Sample(
        request_id=prefix.request_id, index=prefix.index, prompt_ids=list(prompt_ids),
        response_ids=list(prefix.response_ids) + list(continuation.response_ids),
        logprobs=list(prefix.logprobs) + list(continuation.logprobs),
        finish_reason=continuation.finish_reason, weight_version=prefix.weight_version,
        token_versions=prefix.versions() + continuation.versions(),
        loss_mask=prefix.generated() + continuation.generated() if prefix.loss_mask or continuation.loss_mask
        else [],
        tool_calls=prefix.tool_calls + continuation.tool_calls,
        # the continuation re-routed prompt + prefix in its prefill: its rows already cover the whole sequence
        routed_experts=continuation.routed_experts,
    )


def staleness_metrics(samples: Sequence[Sample], current_version: int) -> dict[str, float]:
    """rollout/max_staleness (current_version minus the oldest token version) and rollout/stale_token_frac
    (share of tokens generated by an older version) over `samples` (the kept groups' responses)."""
    versions = [v for s in samples for v in s.versions()]
    if not versions:
        return {"rollout/max_staleness": 0.0, "rollout/stale_token_frac": 0.0}
    return {"rollout/max_staleness": float(current_version - min(versions)),
            "rollout/stale_token_frac": sum(v < current_version for v in versions) / len(versions)}


def staleness_of(group: CarriedGroup, current_version: int) -> int:
    """current_version minus the oldest token version of the group's responses so far (0 without tokens): the
    group's `rollout/max_staleness` if it is decided on weights `current_version`."""
    versions = [v for s in group.samples for v in s.versions()]
    return current_version - min(versions) if versions else 0


def drop_stale(groups: Sequence[CarriedGroup], current_version: int,
               max_staleness: int | None) -> tuple[list[CarriedGroup], list[CarriedGroup]]:
    """(resubmitted, dropped): `groups` split by staleness_of(group, current_version) <= max_staleness, each
    in the given order (max_staleness None: no cap, nothing dropped)."""
    if max_staleness is None:
        return list(groups), []
    keep, drop = [], []
    for g in groups:
        (keep if staleness_of(g, current_version) <= max_staleness else drop).append(g)
    return keep, drop


# ---- checkpoint state: plain types and tensors, no pickled classes ---------------------------------------

def state(groups: Sequence[CarriedGroup]) -> dict[str, Any]:
    """The carried groups as the checkpoint's `extra["carried"]`: 12 bytes per token (int32 ids, fp32 log-probs,
    int32 versions), plus with --moe-routing-replay the routed experts (L x K uint8 per prompt + response token:
    384 B at 30B-A3B); the rollout log-probs are fp32 values (the engines' and the trainer's precision)."""
    return {"version": STATE_VERSION, "groups": [{
        "prompt_ids": torch.tensor(g.prompt.prompt_ids, dtype=torch.int32),
        "ground_truth": g.prompt.ground_truth, "index": g.prompt.index, "seed": g.seed,
        "first_step": g.first_step,
        "samples": [{"response_ids": torch.tensor(s.response_ids, dtype=torch.int32),
                     "logprobs": torch.tensor(s.logprobs, dtype=torch.float32),
                     "versions": torch.tensor(s.versions(), dtype=torch.int32),
                     "finish_reason": s.finish_reason, "weight_version": s.weight_version,
                     "request_id": s.request_id}
                    # a multi-turn conversation: which tokens were a tool's (1 B a token) and the calls made
                    | ({"loss_mask": torch.tensor(s.loss_mask, dtype=torch.uint8), "tool_calls": s.tool_calls}
                       if s.loss_mask else {})
                    # --moe-routing-replay: a finished sample of a carried group keeps its routes (384 B a token
                    # at 30B-A3B); a continued one gets new rows for its whole sequence anyway
                    | ({"routed_experts": s.routed_experts} if s.routed_experts is not None else {})
                    for s in g.samples],
    } for g in groups]}


def from_state(data: dict[str, Any] | None) -> list[CarriedGroup]:
    """Inverse of `state` (None: a checkpoint written without --partial-rollout, nothing carried)."""
    if data is None:
        return []
    if data.get("version") not in (1, STATE_VERSION):
        raise ValueError(f"checkpoint's carried groups have layout version {data.get('version')!r}, this code "
                         f"reads {STATE_VERSION}")
    groups = []
    for g in data["groups"]:
        prompt_ids = [int(t) for t in g["prompt_ids"].tolist()]
        prompt = Prompt(prompt_ids=prompt_ids, ground_truth=g["ground_truth"], index=int(g["index"]))
        samples = []
        for i, s in enumerate(g["samples"]):
            versions = [int(v) for v in s["versions"].tolist()]
            uniform = all(v == s["weight_version"] for v in versions)
            samples.append(Sample(request_id=s["request_id"], index=i, prompt_ids=prompt_ids,
                                  response_ids=[int(t) for t in s["response_ids"].tolist()],
                                  logprobs=[float(x) for x in s["logprobs"].tolist()],
                                  finish_reason=s["finish_reason"], weight_version=int(s["weight_version"]),
                                  token_versions=[] if uniform else versions,
                                  loss_mask=[int(m) for m in s["loss_mask"].tolist()] if "loss_mask" in s else [],
                                  tool_calls=int(s.get("tool_calls", 0)),
                                  routed_experts=s.get("routed_experts")))
        groups.append(CarriedGroup(prompt=prompt, samples=samples, seed=g["seed"], first_step=int(g["first_step"])))
    return groups


@dataclass
class CarriedGroups:
    """Rank 0's groups cut at the end of the last step, resumed first by the next one: a checkpointed component
    (megatron_dapo/checkpoint/checkpointer.py, name "carried"; 12 B per carried token, see `state`).

    `enabled` is --partial-rollout: without it nothing is carried, nothing is saved, and a checkpoint's groups are
    dropped with a warning."""

    checkpoint_state: ClassVar[CommonState] = CommonState(key="carried", holder=Holder.RANK0_SHARED, optional=True)
    """extra["carried"], rank 0's, broadcast before a save; absent from a checkpoint written without
    --partial-rollout."""

    enabled: bool = False
    groups: list[CarriedGroup] = dataclasses.field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """`state(groups)`; {} without --partial-rollout (the checkpoint then holds no "carried")."""
        return state(self.groups) if self.enabled else {}

    def load_state_dict(self, data: dict[str, Any]) -> None:
        if self.enabled:
            self.groups = from_state(data)
        elif data.get("groups"):
            import sys

            print(f"[megatron-dapo] warning: the checkpoint carries {len(data['groups'])} partial-rollout groups; "
                  f"without --partial-rollout they are dropped", file=sys.stderr)
