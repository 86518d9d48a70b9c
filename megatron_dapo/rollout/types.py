"""Plain data that crosses the rollout seam: sampling parameters, requests and finished samples.

Nothing here imports an engine, so the trainer, the rollout manager and the engines share one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class RoutingShape(NamedTuple):
    """What a rollout's routed expert ids look like for one MoE model (ModelArch: num_layers, num_experts_per_tok,
    num_experts): each token's row is [num_layers, top_k] ids below num_experts."""

    num_layers: int
    top_k: int
    num_experts: int

    @property
    def dtype(self) -> torch.dtype:
        return routing_dtype(self.num_experts)


def routing_of(arch: Any, replay: bool) -> RoutingShape | None:
    """The RoutingShape rollouts record for `arch` (a ModelArch) when `replay` (--moe-routing-replay), else None. Layers
    are global (a dense layer's column is never read). Raises ValueError for a model without experts."""
    if not replay:
        return None
    if not arch.is_moe:
        raise ValueError("--moe-routing-replay needs a mixture-of-experts model (config.json num_experts > 0)")
    return RoutingShape(arch.num_layers, arch.num_experts_per_tok, arch.num_experts)


def routing_dtype(num_experts: int) -> torch.dtype:
    """The integer dtype rollouts keep routed expert ids in: uint8 up to 256 experts (Qwen3-30B-A3B's and 235B's 128,
    DeepSeek-V3's 256), else int32 (gloo, which carries them to the DP ranks, has no int16)."""
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"routing_dtype: num_experts must be an int >= 1, got {num_experts!r}")
    return torch.uint8 if num_experts <= 256 else torch.int32


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """A prompt ready for the engine: token ids plus what the verifier needs."""

    prompt_ids: list[int]
    ground_truth: str
    index: int
    """Position in the dataset (stable across resumes)."""


@dataclass(kw_only=True, frozen=True)
class SamplingParams:
    """How one request's responses are sampled (the same meaning as SGLang's `sampling_params`)."""

    max_new_tokens: int
    """Response length cap in tokens (--max-response-length). A response cut here ends with 'length'."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax of the raw logits)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0 = off."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra tokens that end a response with 'stop' (the model's eos always does). The stop token is kept
    as the last response token, with its log-prob, as SGLang does."""
    stop: tuple[str, ...] = ()
    """Stop strings (SGLang's `stop`): the response ends with 'stop' at the first token after which the decoded
    tail of the response contains one of them; that token is kept as the last, with its log-prob (SGLang's
    output_ids and ours are the same ids). The tail is the last `stop_window` tokens, so a match is found at the
    token that completes it whatever the tokenization (a multi-turn tool call ends at its closing string:
    rollout/multi_turn.py). Needs the engine's tokenizer."""
    seed: int | None = None
    """Makes sampling reproducible; sample i of a request draws from a stream seeded by (seed, i), so the
    result does not depend on how requests were batched. None = drawn from the engine's generator."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_new_tokens must be an int >= 1 (--max-response-length), "
                f"got {self.max_new_tokens!r}"
            )
        if not self.temperature >= 0.0:
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or an int >= 1, got {self.top_k!r}")
        ids = tuple(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be non-negative ints, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        stop = tuple(self.stop)
        if any(not isinstance(t, str) or not t for t in stop):
            raise ValueError(f"SamplingParams.stop must be non-empty strings, got {stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_window(self) -> int:
        """Tokens of the response tail decoded to look for a stop string: the longest one's characters + 1. A token
        decodes to at least one character, so a string completed by the last token lies within it. (SGLang decodes
        the stop string's own token count + 1 and, past that, its whole decoded text: the same first match.)"""
        return max((len(t) for t in self.stop), default=0) + 1

    def to_sglang(self) -> dict[str, Any]:
        """The `sampling_params` object of SGLang's /generate for these parameters."""
        params: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.stop:
            params["stop"] = list(self.stop)
        if self.seed is not None:
            params["sampling_seed"] = self.seed
        return params


@dataclass(kw_only=True)
class RolloutRequest:
    """One prompt to be answered `n` times (a DAPO group of G responses)."""

    prompt_ids: list[int]
    n: int
    sampling: SamplingParams
    request_id: str
    """Unique among requests in flight: the handle for abort and for matching results to prompts."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Carried through untouched (ground truth, data index, ...); engines never read it."""
    first_index: int = 0
    """Index of the first sample: the samples are first_index .. first_index + n - 1, and sample i draws
    from the stream seeded by (seed, i). A partial-rollout continuation of sample i of a group is a request
    with n = 1 and first_index = i, so it keeps the sample's own random stream."""
    resumed_tokens: int = 0
    """Partial rollout: the last `resumed_tokens` ids of prompt_ids are this sample's response prefix,
    generated before an abort. The sample's random stream continues after that many tokens, so with
    unchanged weights prefix + continuation is what one uninterrupted generation draws (SGLang keys its
    seeded noise by (seed, absolute position) and needs nothing more; the embedded engine skips the
    draws). 0 = a fresh request; > 0 needs n == 1."""
    resumed_mask: tuple[int, ...] = ()
    """A multi-turn conversation's continuation: per token of the resumed prefix, 1 if the policy generated it, 0 if
    a tool's output put it there (the prefix's Sample.loss_mask); empty = every prefix token was generated. Only
    rollout/multi_turn.py reads it (to count the calls made and find one left unanswered)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"RolloutRequest {self.request_id!r}: prompt_ids is empty")
        if any(not isinstance(t, int) or t < 0 for t in self.prompt_ids):
            raise ValueError(f"RolloutRequest {self.request_id!r}: prompt_ids must be non-negative ints")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(
                f"RolloutRequest {self.request_id!r}: n must be an int >= 1 (--n-samples-per-prompt), "
                f"got {self.n!r}"
            )
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"RolloutRequest.request_id must be a non-empty str, got {self.request_id!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"RolloutRequest.sampling must be SamplingParams, got {type(self.sampling)}")
        if not isinstance(self.first_index, int) or self.first_index < 0:
            raise ValueError(f"RolloutRequest {self.request_id!r}: first_index must be an int >= 0, got "
                             f"{self.first_index!r}")
        if not isinstance(self.resumed_tokens, int) or not 0 <= self.resumed_tokens < len(self.prompt_ids):
            raise ValueError(f"RolloutRequest {self.request_id!r}: resumed_tokens must be an int in [0, "
                             f"{len(self.prompt_ids)}) (a response prefix inside prompt_ids), got "
                             f"{self.resumed_tokens!r}")
        mask = tuple(self.resumed_mask)
        if mask and (len(mask) != self.resumed_tokens or set(mask) - {0, 1}):
            raise ValueError(f"RolloutRequest {self.request_id!r}: resumed_mask must hold one 0 or 1 per resumed "
                             f"token ({self.resumed_tokens}), got {len(mask)} values")
        self.resumed_mask = mask
        if self.resumed_tokens and self.n != 1:
            raise ValueError(f"RolloutRequest {self.request_id!r}: a continuation (resumed_tokens > 0) is one "
                             f"sample's prefix, so n must be 1, got {self.n}")


@dataclass(kw_only=True)
class Sample:
    """One finished (or aborted) response.

    `logprobs[t]` is log softmax(raw logits)[response_ids[t]] at the position that produced token t: the
    model's temperature-1, untruncated distribution (what SGLang's return_logprob reports), not the
    temperature/top-p/top-k distribution the token was drawn from. The trainer compares it to the actor's
    log-prob of the same token (the rollout/training mismatch), so both must mean the same thing.
    """

    request_id: str
    index: int
    """Which sample of the group this is (request.first_index .. first_index + n - 1; 0..n-1 normally)."""
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    """'stop': eos or a stop token (kept as the last token); 'length': hit max_new_tokens (truncated, what
    overlong shaping looks at); 'abort': cut by abort(), response possibly partial or empty."""
    weight_version: int
    """engine.weight_version when this sample's first token was generated."""
    token_versions: list[int] = field(default_factory=list)
    """Per response token, the weight version that generated it; empty = every token came from
    `weight_version`. Set when tokens come from several versions (a partial-rollout prefix continued after a
    weight update); read it through `versions()`."""
    loss_mask: list[int] = field(default_factory=list)
    """Multi-turn rollouts (rollout/multi_turn.py): per response token 1 if the policy generated it, 0 if a tool's
    output put it there (its log-prob is 0.0 and never read); empty = every token was generated."""
    tool_calls: int = 0
    """Tool calls run in this response (multi-turn rollouts)."""
    routed_experts: torch.Tensor | None = None
    """MoE models with --moe-routing-replay: [len(prompt_ids) + len(response_ids) - 1, num_layers, top_k] expert
    ids (RoutingShape.dtype: uint8 up to 256 experts) the engine routed input token i to in each layer, best first;
    the last token was never fed back, so it has no row. A partial rollout's continuation re-routes the whole
    prompt + prefix, so its rows cover the whole sequence. None: not recorded. At Qwen3-30B-A3B 48 x 8 = 384 B a
    token (TrainSample.routed_experts takes it as is)."""

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(
                f"Sample {self.request_id!r}[{self.index}]: {len(self.logprobs)} logprobs for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"Sample {self.request_id!r}[{self.index}]: finish_reason must be one of {FINISH_REASONS}, "
                f"got {self.finish_reason!r}"
            )
        if self.token_versions and len(self.token_versions) != len(self.response_ids):
            raise ValueError(
                f"Sample {self.request_id!r}[{self.index}]: {len(self.token_versions)} token_versions for "
                f"{len(self.response_ids)} response tokens"
            )
        if self.loss_mask and (len(self.loss_mask) != len(self.response_ids) or set(self.loss_mask) - {0, 1}):
            raise ValueError(
                f"Sample {self.request_id!r}[{self.index}]: loss_mask must hold one 0 or 1 per response token "
                f"({len(self.response_ids)}), got {len(self.loss_mask)} values"
            )
        if not isinstance(self.tool_calls, int) or self.tool_calls < 0:
            raise ValueError(f"Sample {self.request_id!r}[{self.index}]: tool_calls must be an int >= 0, got "
                             f"{self.tool_calls!r}")
        routed = self.routed_experts
        rows = len(self.prompt_ids) + len(self.response_ids) - 1
        if routed is not None and (routed.dim() != 3 or routed.shape[0] != rows):
            raise ValueError(
                f"Sample {self.request_id!r}[{self.index}]: routed_experts has shape {tuple(routed.shape)}, expected "
                f"[len(prompt_ids) + len(response_ids) - 1 = {rows}, num_layers, top_k]"
            )

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def generated(self) -> list[int]:
        """1 per response token the policy generated, 0 per tool-output token (len == len(response_ids))."""
        return list(self.loss_mask) if self.loss_mask else [1] * len(self.response_ids)

    def versions(self) -> list[int]:
        """The weight version of each response token (len == len(response_ids))."""
        return list(self.token_versions) if self.token_versions else [self.weight_version] * len(self.response_ids)
