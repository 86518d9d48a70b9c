"""SGLang HTTP wire format: /generate payloads and responses, as plain dicts (no sglang import).

One HTTP request per sample (not `n` in sampling_params): each sample then has its own rid for
/abort_request, its own seed, and can be retried alone on another server when one dies.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import torch

from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sampling import row_seed
from megatron_dapo.rollout.types import FINISH_REASONS, FinishReason, RolloutRequest, RoutingShape, Sample

CALL_MARGIN_S = 30.0
"""A thread waiting for HTTP calls made on the engine's loop waits their timeout plus this, so that the calls' own
timeouts (which mark a server lost) fire first."""


class ServerDied(RuntimeError):
    """A server stopped answering (connection refused / reset, a timeout, or a 5xx)."""


class ServerTimeout(ServerDied):
    """A server that took the call but did not answer within its timeout (`timeout_s`)."""

    def __init__(self, message: str, *, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


class ServersUnavailable(UserError):
    """The rollout cannot go on: a sample's /generate failed on every try (1 + ClientConfig.max_retries), or an attached
    server that failed did not answer /health again within --sglang-server-wait-s. One line (`error: ...`, exit 2)
    naming the server, what it did not answer within how long, and the flags that set that wait."""


def read_reply(resp: httpx.Response, url: str, path: str) -> Any:
    """The JSON body of SGLang's answer to POST {url}{path} (None when empty). A 5xx raises ServerDied (the
    caller recovers the server); a missing API key (401/403) or any other non-200 raises RuntimeError."""
    if resp.status_code >= 500:
        raise ServerDied(f"{url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
    if resp.status_code in (401, 403):
        raise RuntimeError(f"SGLang {url}{path} refused the call ({resp.status_code}): the server needs the "
                           f"API key it was started with (--sglang-api-key / SGLANG_API_KEY)")
    if resp.status_code != 200:
        raise RuntimeError(f"SGLang {url}{path} answered {resp.status_code}: {resp.text[:500]}")
    return resp.json() if resp.content else None


def check_success(reply: Any, what: str) -> None:
    """Raises RuntimeError naming `what` when SGLang's JSON reply says {"success": false} (a refused weight call)."""
    if isinstance(reply, dict) and reply.get("success") is False:
        raise RuntimeError(f"SGLang {what} failed: {reply.get('message')}")


def sample_rid(request_id: str, index: int) -> str:
    """The SGLang rid of sample `index` of a request (unique per sample, for /abort_request)."""
    return f"{request_id}::{index}"


def generate_payload(req: RolloutRequest, index: int, *, routed_experts: bool = False) -> dict[str, Any]:
    """Body of POST /generate for sample `index` (0..n-1) of `req`: token ids in, raw token log-probs out;
    `routed_experts`: also the experts each token was routed to (--moe-routing-replay; the server needs
    --enable-return-routed-experts).

    The seed is that of group sample req.first_index + index. SGLang draws its seeded noise from (seed,
    absolute position), so a partial-rollout continuation (prompt + prefix as input_ids, the same seed) draws
    what the uninterrupted sample would have; req.resumed_tokens needs no field here."""
    params = req.sampling.to_sglang()
    if req.sampling.seed is not None:
        params["sampling_seed"] = row_seed(req.sampling.seed, req.first_index + index)
    return {
        "rid": sample_rid(req.request_id, index),
        "input_ids": list(req.prompt_ids),
        "sampling_params": params,
        "return_logprob": True,
        # Only response tokens: prompt log-probs are not needed (the actor recomputes those it needs).
        "logprob_start_len": -1,
        "stream": False,
    } | ({"return_routed_experts": True} if routed_experts else {})


@dataclass(kw_only=True)
class ParsedOutput:
    """What one /generate response says about its sample."""

    response_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: int | None
    routed_experts: torch.Tensor | None = None
    """[rows, num_layers, top_k] when asked for (see decode_routed_experts)."""
    served_version: str | None = None
    """meta_info.weight_version as the server reported it ('default' for a server no update reached since its
    launch); None when the response does not say."""
    token_versions: list[int] = field(default_factory=list)
    """Per response token, the weight version that generated it (from meta_info.weight_versions); empty when every
    token has the same version or the server does not say (Sample.token_versions)."""


def decode_routed_experts(text: Any, shape: RoutingShape) -> torch.Tensor:
    """SGLang 0.5.23's meta_info.routed_experts: base64 of the raw bytes of an int32 array [seqlen - 1, num_layers,
    top_k] (seqlen = prompt + output tokens; row i = input token i; per layer the top-k ids by descending router
    probability; the layer axis has every decoder layer, tokenizer_manager.py:2602), returned as shape.dtype
    (uint8 up to 256 experts). Cost at Qwen3-30B-A3B: 48 x 8 x 4 B = 1,536 B a token on the wire, 2,048 B as base64
    (a 20k-token sample: 41 MB of JSON), 384 B a token once kept as uint8."""
    if not isinstance(text, str):
        raise ValueError(f"SGLang response: meta_info.routed_experts is {type(text).__name__}, expected a base64 "
                         f"string (is the server started with --enable-return-routed-experts?)")
    flat = np.frombuffer(base64.b64decode(text), dtype=np.int32)
    row = shape.num_layers * shape.top_k
    if flat.size % row:
        raise ValueError(f"SGLang response: meta_info.routed_experts holds {flat.size} ids, not a multiple of the "
                         f"model's {shape.num_layers} layers x top-{shape.top_k}")
    if flat.size and not 0 <= int(flat.min()) <= int(flat.max()) < shape.num_experts:
        raise ValueError(f"SGLang response: meta_info.routed_experts has ids outside [0, {shape.num_experts})")
    return torch.from_numpy(flat.reshape(-1, shape.num_layers, shape.top_k).astype(np.int64)).to(shape.dtype)


def _span_int(span: dict[str, Any], key: str, i: int) -> int:
    """Field `key` (start / end) of span `i` of meta_info.weight_versions, an int or a ValueError naming it."""
    value = span.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"SGLang response: meta_info.weight_versions[{i}].{key} is {value!r}, expected an int")
    return value


def parse_weight_versions(spans: Any, num_tokens: int, served: Any) -> list[int]:
    """The weight version of each of the `num_tokens` response tokens from SGLang 0.5.23's meta_info.weight_versions
    (`srt/utils/weight_versions.py`: compute_weight_version_spans, add_weight_versions_to_meta_info): a list of
    {"version": str, "start": int, "end": int}, half-open [start, end) ranges of output-token indices, in order, the
    first starting at 0, each starting where the previous ended, the last ending at the number of output tokens;
    the last span's version is meta_info.weight_version (`served`). Empty when every span has the same version (the
    caller labels all tokens with meta_info.weight_version, as without the field). Raises ValueError naming the
    field when the spans do not cover exactly the response tokens, when versions differ and one is not an integer
    (the 'default' label a server reports until its first update), or when versions decrease."""
    where = "SGLang response: meta_info.weight_versions"
    if not isinstance(spans, list) or not spans or not all(isinstance(s, dict) for s in spans):
        raise ValueError(f"{where} is {spans!r}, expected a non-empty list of {{version, start, end}} objects")
    bounds = [(_span_int(s, "start", i), _span_int(s, "end", i)) for i, s in enumerate(spans)]
    if missing := [i for i, s in enumerate(spans) if s.get("version") is None]:
        raise ValueError(f"{where}[{missing[0]}] has no version")
    labels = [str(s["version"]) for s in spans]
    position = 0
    for i, (start, end) in enumerate(bounds):
        if start != position or not (end > start or (len(bounds) == 1 and num_tokens == end == 0)):
            raise ValueError(f"{where}[{i}] covers [{start}, {end}), expected a non-empty span starting at token "
                             f"{position} (spans {bounds} must cover the {num_tokens} response tokens in order)")
        position = end
    if position != num_tokens:
        raise ValueError(f"{where} covers {position} tokens, but the response has {num_tokens} (spans {bounds})")
    if served is not None and labels[-1] != str(served):
        raise ValueError(f"{where} ends with version {labels[-1]!r} but meta_info.weight_version is {served!r}")
    if len(set(labels)) == 1:
        return []
    try:
        versions = [int(label) for label in labels]
    except ValueError:
        raise ValueError(f"{where} has versions {labels}: a token's version is not an integer (a server reports "
                         f"'default' until its first update), so the tokens cannot be labelled") from None
    if any(b < a for a, b in zip(versions, versions[1:], strict=False)):
        raise ValueError(f"{where} has versions {labels}, decreasing within one response")
    return [v for v, (start, end) in zip(versions, bounds, strict=True) for _ in range(start, end)]


def parse_generate_response(body: dict[str, Any], *, routing: RoutingShape | None = None) -> ParsedOutput:
    """Reads output_ids, meta_info.output_token_logprobs ([[logprob, token_id, text], ...]) and
    meta_info.finish_reason.type ('length' = truncated, 'stop', 'abort'); meta_info.weight_versions when the server
    sends it (parse_weight_versions: the version then is that of the first token); with `routing` (routed experts
    were asked for) meta_info.routed_experts too. Raises ValueError on a body that does not follow that shape,
    naming the field."""
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise ValueError(f"SGLang /generate response has no meta_info: keys {sorted(body)}")
    entries = meta.get("output_token_logprobs") or []
    ids = [int(e[1]) for e in entries]
    logprobs = [float(e[0]) for e in entries]
    output_ids = body.get("output_ids")
    if output_ids is not None and list(output_ids) != ids:
        raise ValueError(
            f"SGLang response: output_ids ({len(output_ids)}) and output_token_logprobs ({len(ids)}) disagree"
        )
    reason = meta.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in FINISH_REASONS:
        raise ValueError(f"SGLang response: unknown meta_info.finish_reason {reason!r}")
    version = meta.get("weight_version")
    try:
        version = int(version) if version is not None else None
    except (TypeError, ValueError):
        version = None  # a server started without --weight-version reports 'default'
    token_versions: list[int] = []
    if "weight_versions" in meta:
        token_versions = parse_weight_versions(meta["weight_versions"], len(ids), meta.get("weight_version"))
        if token_versions:
            version = token_versions[0]
    routes = None
    if routing is not None:
        if "routed_experts" not in meta:
            raise ValueError("SGLang response has no meta_info.routed_experts although the request asked for it: "
                             "start the servers with --enable-return-routed-experts (launched ones get it with "
                             "--moe-routing-replay)")
        routes = decode_routed_experts(meta["routed_experts"], routing)
    served = meta.get("weight_version")
    return ParsedOutput(response_ids=ids, logprobs=logprobs, finish_reason=kind, weight_version=version,
                        routed_experts=routes, served_version=None if served is None else str(served),
                        token_versions=token_versions)


def to_sample(req: RolloutRequest, index: int, out: ParsedOutput, fallback_version: int) -> Sample:
    return Sample(
        request_id=req.request_id,
        index=req.first_index + index,
        prompt_ids=list(req.prompt_ids),
        response_ids=out.response_ids,
        logprobs=out.logprobs,
        finish_reason=out.finish_reason,
        weight_version=out.weight_version if out.weight_version is not None else fallback_version,
        token_versions=list(out.token_versions),
        routed_experts=out.routed_experts,
    )


def aborted_sample(req: RolloutRequest, index: int, version: int) -> Sample:
    """A sample that was never generated (aborted before it was sent)."""
    return Sample(
        request_id=req.request_id, index=req.first_index + index, prompt_ids=list(req.prompt_ids), response_ids=[],
        logprobs=[], finish_reason="abort", weight_version=version,
    )
