"""Scoring token sequences on SGLang servers: the teacher's log-probs of the student's samples (on-policy
distillation with a teacher served apart, algorithm/distill.py) without generating anything.

One POST /generate per sample with the whole sequence (prompt + response) as `input_ids`, `max_new_tokens` 0 and
`return_logprob` from position prompt_len - 1: SGLang 0.5.23 prefills the sequence and returns
`meta_info.input_token_logprobs`, one [log-prob, token id, text] entry per input position from there, the first None
(the position it starts at), then log pi(token_t | tokens_<t) for t = prompt_len .. len - 1: exactly the response
tokens' log-probs (checked on a real CPU server against HF: tests/sglang/test_sglang_scoring.py). A prefill only,
no decode: the cost is the teacher's forward over every token, as the in-process teacher's.

Cost at the production setting (a Qwen3-235B-A22B teacher, a Qwen3-8B student, 512 prompts x 16 samples a step at
~10k tokens each, estimated, not measured): 8,192 requests and 82 M tokens a step; the request bodies carry the ids
as JSON (~6 B a token: 0.5 GB up), the replies ~25 B a token of JSON (2 GB down); the prefill is 2 x 22e9 active
parameters x 82e6 tokens = 3.6e18 FLOP, ~1,100 s at 40% of 8 H100s' bf16 peak (the teacher's 470 GB of bf16 weights
need 8 x 80 GB at least), ~570 s on 16: a teacher of that size costs more GPUs than the student's own rollout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import torch

from megatron_dapo.rollout.sglang.protocol import ServerDied, read_reply


def score_payload(tokens: Sequence[int], prompt_len: int) -> dict[str, Any]:
    """Body of POST /generate that returns the log-probs of tokens[prompt_len:] given what precedes each."""
    if not 1 <= prompt_len < len(tokens):
        raise ValueError(f"score_payload: need 1 <= prompt_len ({prompt_len}) < len(tokens) ({len(tokens)})")
    return {"input_ids": list(tokens), "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": prompt_len - 1, "stream": False}


def parse_scores(reply: Any, tokens: Sequence[int], prompt_len: int) -> list[float]:
    """The response tokens' log-probs from a /generate reply to `score_payload(tokens, prompt_len)`; ValueError when
    the reply does not hold one entry per position from prompt_len - 1 with the tokens sent.

    SGLang 0.5.23 reports the id of the model's last vocabulary entry (vocab_size - 1) as 0 (its logprob processor
    clips image-token hashes at `x < vocab_size - 1`, one too low); the log-prob is the sent token's (checked against
    HF on a real server: tests/sglang/test_trainer_sglang_teacher.py). So a reported 0 is accepted where the largest
    id of the request was sent: the model's last entry is the largest id it has, and a misaligned reply differs
    elsewhere too."""
    try:
        entries = reply["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError) as err:
        raise ValueError("SGLang scoring reply: no meta_info.input_token_logprobs (is it a /generate reply with "
                         "return_logprob?)") from err
    want = len(tokens) - prompt_len + 1
    if len(entries) != want:
        raise ValueError(f"SGLang scoring reply: {len(entries)} input log-probs, expected {want} (positions "
                         f"{prompt_len - 1}..{len(tokens) - 1})")
    ids, sent = [int(e[1]) for e in entries], list(tokens[prompt_len - 1:])
    top = max(sent)
    if any(a != b and not (a == 0 and b == top) for a, b in zip(ids, sent, strict=True)):
        at = next(i for i, (a, b) in enumerate(zip(ids, sent, strict=True)) if a != b)
        raise ValueError(f"SGLang scoring reply: its token ids are not the ones sent (another tokenization?): at "
                         f"position {prompt_len - 1 + at} of {len(tokens)} it has {ids[at]}, {sent[at]} was sent")
    values = [e[0] for e in entries[1:]]
    if any(v is None for v in values):
        raise ValueError("SGLang scoring reply: a response token has no log-prob")
    return [float(v) for v in values]


RETRY_DELAYS_S: tuple[float, ...] = (2.0, 8.0, 30.0)
"""A scoring request that found its server gone (connection refused or reset, a timeout, a 5xx) is sent again, to the
next server, after each of these waits: 40 s in all, what a restarting server or a router failing over takes; then
the step fails naming the server (the run resumes from its last checkpoint)."""


class SGLangScorer:
    """Scores samples on SGLang servers (round robin over `urls`, up to `max_concurrency` requests in flight):
    `compute_log_probs(samples)` -> per sample its [response_len] fp32 log-probs, the interface of a frozen model's
    (`transport`: httpx's, for tests; `retry_delays_s`: RETRY_DELAYS_S)."""

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, http_timeout_s: float = 600.0,
                 max_concurrency: int = 64, transport: httpx.BaseTransport | None = None,
                 retry_delays_s: Sequence[float] = RETRY_DELAYS_S) -> None:
        if not urls:
            raise ValueError("SGLangScorer needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.retry_delays_s = tuple(retry_delays_s)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=http_timeout_s, headers=headers,
                                  limits=httpx.Limits(max_connections=max_concurrency), transport=transport)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang-score")

    def _score_one(self, i: int, tokens: list[int], prompt_len: int) -> torch.Tensor:
        """One sample's log-probs from server i (mod the count); a lost server's request goes to the next one after
        each RETRY_DELAYS_S wait, then RuntimeError naming the last server."""
        body, attempt = score_payload(tokens, prompt_len), 0
        while True:
            url = self.urls[(i + attempt) % len(self.urls)]
            try:
                reply = read_reply(self._http.post(f"{url}/generate", json=body), url, "/generate")
                return torch.tensor(parse_scores(reply, tokens, prompt_len), dtype=torch.float32)
            except (httpx.TransportError, ServerDied) as err:
                if attempt == len(self.retry_delays_s):
                    raise RuntimeError(f"the SGLang teacher did not score a sample in {attempt + 1} tries over "
                                       f"{sum(self.retry_delays_s):.0f} s; the last, {url}/generate: "
                                       f"{type(err).__name__}: {err}") from err
                time.sleep(self.retry_delays_s[attempt])
                attempt += 1

    def compute_log_probs(self, samples: Sequence[Any]) -> list[torch.Tensor]:
        """Per sample (anything with .tokens and .prompt_len: a TrainSample) the log-probs of its response tokens."""
        futures = [self._pool.submit(self._score_one, i, list(s.tokens), s.prompt_len) for i, s in enumerate(samples)]
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()


__all__ = ["SGLangScorer", "parse_scores", "score_payload"]
