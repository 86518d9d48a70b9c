"""An SGLang server as the on-policy distillation teacher (--teacher-url): the check that it shares the student's
tokenizer, the model it serves (what the checkpoint records), and its log-probs of every trained sample on every
rank of the actor.

Where it scores: once per data-parallel replica. Every rank of a replica (its TP x CP ranks on each PP stage) holds
the same samples (the data plane's share for its DP rank), so only the replica's first rank (TP 0, CP 0, PP 0)
sends them to the teacher (rollout/sglang/scoring.py: one prefill-only /generate a sample), and the log-probs reach
the others in two broadcasts of one flat fp32 tensor: over the TP x CP group of PP stage 0, then along each
pipeline from stage 0. The scoring is the trainer's section ("scoring ... with the SGLang teacher"): the other ranks
wait for it on the gloo wait group (--rollout-timeout), not inside an NCCL broadcast's watchdog, and a teacher error
on a scoring rank (a server down, a refused key) stops every rank with that rank's error instead of a hang.

Cost at the production setting (a Qwen3-8B student at TP2, 64 GPUs: 32 replicas; 512 prompts x 16 samples of ~10k
tokens a step): 8,192 requests a step, 256 from each replica's scorer, at most --teacher-max-concurrency (64) in
flight each; the broadcasts move 4 B per response token, 256 x 10k x 4 B = 10 MB per replica, milliseconds. The
teacher's own cost (a 235B-A22B's prefill of 82 M tokens, ~570 s on 16 H100s): scoring.py.

The tokenizer check (`check_teacher`, rank 0 at start-up): the teacher scores the student's token ids, which must
mean the same text to both. The server's tokenizer files may live on another node, so it is asked
(`check_served_tokenizer`):
/detokenize of every id of the student's vocabulary one by one (8,192 ids a request: 19 requests at Qwen2.5's 151,665,
~2 MB of JSON each way) must give the student's text of each id, and /tokenize of a probe text of mixed scripts,
digits and code the student's ids. UserError naming the server's model and tokenizer and the student's. A server
started with --skip-tokenizer-init (as the rollout's are) cannot answer those; its tokenizer directory is then read
here, where this node sees it, and compared whole (data/tokenizer_check.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from megatron_dapo.data.tokenizer_check import check_same_tokenizer
from megatron_dapo.errors import UserError
from megatron_dapo.rollout.sglang.protocol import read_reply
from megatron_dapo.rollout.sglang.scoring import SGLangScorer

FLAG = "--teacher-url"
DETOKENIZE_CHUNK = 8192
"""Ids per /detokenize request of the tokenizer check."""
PROBE_TEXT = ("The answer is 42.\nLet x = 3.14159; then 2x^2 - 7x + 1 = 0 has roots (7 +/- sqrt(41)) / 4.\n"
              "def f(n):\n    return [i ** 2 for i in range(n) if i % 3 == 0]  # ok\n"
              "Überprüfung: naïve café, 数学题的答案是 17。 Ответ: сорок два. 😀 \t\"quoted\" {braces} <tag/>")
"""Tokenized by the teacher and the student in the tokenizer check: merges the per-id check does not see."""


@dataclass(frozen=True, kw_only=True)
class TeacherServerConfig:
    """The teacher served apart (--teacher-url and its flags)."""

    urls: tuple[str, ...]
    """--teacher-url: the servers' (or a router's) base URLs."""
    api_key_file: str | None = None
    """--teacher-api-key-file: read where the servers are called (rank 0's check, each replica's scorer)."""
    max_concurrency: int = 64
    """--teacher-max-concurrency: requests in flight per data-parallel replica."""
    http_timeout_s: float = 600.0
    """How long one scoring request may take (a prefill of the longest sample on a busy server)."""

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"{FLAG} needs at least one URL")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{FLAG} {url}: not an http:// or https:// URL of an SGLang server")
        if self.max_concurrency < 1:
            raise ValueError(f"--teacher-max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.http_timeout_s > 0:
            raise ValueError(f"the teacher's HTTP timeout must be > 0 s, got {self.http_timeout_s}")

    def api_key(self) -> str | None:
        """The key in --teacher-api-key-file (ValueError naming the flag for a file readable by others, or empty);
        None without one."""
        from megatron_dapo.rollout.sglang.api_key import read_key_file

        return None if self.api_key_file is None else read_key_file(self.api_key_file, flag="--teacher-api-key-file")


def _call(http: httpx.Client, url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """The JSON reply of GET (no `body`) or POST {url}{path}; UserError naming the URL when it does not answer, refuses
    the key, or answers an error."""
    try:
        resp = http.get(f"{url}{path}") if body is None else http.post(f"{url}{path}", json=body)
    except httpx.HTTPError as err:
        raise UserError(f"{FLAG} {url}: {path} did not answer ({type(err).__name__}: {err}); is an SGLang server "
                        f"serving the teacher there?") from err
    if resp.status_code in (401, 403):
        raise UserError(f"{FLAG} {url}: {path} refused the call ({resp.status_code}): put the API key the teacher's "
                        f"servers were started with in --teacher-api-key-file")
    try:
        return read_reply(resp, url, path)
    except RuntimeError as err:  # an error status (ServerDied is one)
        raise UserError(f"{FLAG} {url}: {err}") from err


def served_model(http: httpx.Client, urls: Sequence[str]) -> tuple[str, str]:
    """(model_path, tokenizer_path) that every server in `urls` reports at /model_info; UserError naming two that
    differ (the teacher must be one model), or a URL that is not an SGLang server."""
    seen: dict[str, tuple[str, str]] = {}
    for url in urls:
        try:
            info = _call(http, url, "/model_info")
            seen[url] = (str(info["model_path"]), str(info.get("tokenizer_path") or info["model_path"]))
        except (KeyError, TypeError) as err:
            raise UserError(f"{FLAG} {url}: /model_info did not answer as an SGLang server does (no {err})") from err
    first, *_ = urls
    for url, model in seen.items():
        if model[0] != seen[first][0]:
            raise UserError(f"{FLAG}: {first} serves {seen[first][0]} and {url} serves {model[0]}: the teacher's "
                            f"servers must serve one model")
    return seen[first]


def check_served_tokenizer(http: httpx.Client, url: str, tokenizer: Any, *, served: tuple[str, str]) -> None:
    """UserError unless the server at `url` (serving `served` = (model, tokenizer path)) decodes every id of the
    student's `tokenizer` to the same text and tokenizes PROBE_TEXT to the same ids (module docstring)."""
    mine = getattr(tokenizer, "name_or_path", None) or "the student's tokenizer"
    theirs = f"{url}, serving {served[0]} with the tokenizer {served[1]}"
    size = len(tokenizer)
    for start in range(0, size, DETOKENIZE_CHUNK):
        ids = [[i] for i in range(start, min(start + DETOKENIZE_CHUNK, size))]
        reply = _call(http, url, "/detokenize", {"tokens": ids, "skip_special_tokens": False})
        texts = reply.get("text") if isinstance(reply, dict) else None
        if not isinstance(texts, list) or len(texts) != len(ids):
            raise UserError(f"{FLAG} {url}: /detokenize answered {str(reply)[:200]!r}, not one text per id; is it an "
                            f"SGLang server with its tokenizer loaded?")
        want = tokenizer.batch_decode(ids, skip_special_tokens=False)
        for (i,), a, b in zip(ids, want, texts, strict=True):
            if a != b:
                raise UserError(f"{FLAG}: the teacher's tokenizer ({theirs}) is not the student's ({mine}, {size} "
                                f"tokens): id {i} is {b!r} to the teacher and {a!r} to the student; the teacher "
                                f"would score other text than the student sampled")
    reply = _call(http, url, "/tokenize", {"prompt": PROBE_TEXT, "add_special_tokens": False})
    got = reply.get("tokens") if isinstance(reply, dict) else None
    want_ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    if got != want_ids:
        raise UserError(f"{FLAG}: the teacher's tokenizer ({theirs}) splits text differently from the student's "
                        f"({mine}): a probe text is {len(got) if isinstance(got, list) else got} tokens to the "
                        f"teacher and {len(want_ids)} to the student; the teacher would score other text")


def check_teacher(cfg: TeacherServerConfig, tokenizer: Any, *, transport: httpx.BaseTransport | None = None) -> str:
    """Rank 0 at start-up: the model the teacher's servers serve (checkpointed as the run's teacher), after
    `served_model` and `check_served_tokenizer` on the first server; UserError naming the problem."""
    try:
        api_key = cfg.api_key()
    except ValueError as err:
        raise UserError(str(err)) from err
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = cfg.urls[0]
    with httpx.Client(timeout=60.0, headers=headers, transport=transport) as http:
        served = served_model(http, cfg.urls)
        info = _call(http, url, "/server_info")
        if not (isinstance(info, dict) and info.get("skip_tokenizer_init")):
            check_served_tokenizer(http, url, tokenizer, served=served)
            return served[0]
    # a server started with --skip-tokenizer-init has no tokenizer to ask: its files, where this node reads them
    if not Path(served[1]).is_dir():
        raise UserError(f"{FLAG} {url}: the server was started with --skip-tokenizer-init, so it cannot show its "
                        f"tokenizer, and its tokenizer path {served[1]} is not a directory on this node: start the "
                        f"teacher without --skip-tokenizer-init (the check asks it to detokenize every id)")
    check_same_tokenizer(tokenizer, served[1], flag=f"{FLAG} {url} (serving {served[0]})")
    return served[0]


def scoring_rank() -> bool:
    """Whether this rank sends its replica's samples to the teacher: TP 0, CP 0 on PP stage 0 (every rank in a world
    of one)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        return True
    return (parallel_state.get_tensor_and_context_parallel_rank() == 0
            and parallel_state.get_pipeline_model_parallel_rank() == 0)


class SGLangTeacher:
    """The teacher as the trainer sees a frozen model: `compute_log_probs(samples)` -> per sample its [response_len]
    fp32 log-probs of the response tokens, on every rank of the actor (module docstring). `section(what)`: the
    trainer's (set after it is built, as PhaseSwitcher.section); None: no wait group."""

    def __init__(self, cfg: TeacherServerConfig, *, transport: httpx.BaseTransport | None = None) -> None:
        self.urls = list(cfg.urls)
        self.section: Callable[[str], AbstractContextManager[None]] | None = None
        self._scorer = (SGLangScorer(cfg.urls, api_key=cfg.api_key(), http_timeout_s=cfg.http_timeout_s,
                                     max_concurrency=cfg.max_concurrency, transport=transport)
                        if scoring_rank() else None)

    def compute_log_probs(self, samples: Sequence[Any]) -> list[torch.Tensor]:
        """Per sample (a TrainSample: .tokens, .prompt_len, .response_len) the teacher's log-probs of its response
        tokens; collective over this rank's replica (TP x CP x PP)."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        from megatron_dapo.distributed import comm

        lens = [s.response_len for s in samples]
        flat = torch.zeros(sum(lens), dtype=torch.float32)
        section = self.section or (lambda _what: nullcontext())
        with section(f"scoring the samples with the SGLang teacher ({', '.join(self.urls)})"):
            if self._scorer is not None and samples:
                flat = torch.cat(self._scorer.compute_log_probs(samples))
        if dist.is_initialized():
            if (parallel_state.get_pipeline_model_parallel_rank() == 0
                    and parallel_state.get_tensor_and_context_parallel_world_size() > 1):
                group = parallel_state.get_tensor_and_context_parallel_group()
                comm.broadcast(flat, src=dist.get_process_group_ranks(group)[0], group=group)
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                comm.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_first_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
        return list(flat.split(lens))

    def close(self) -> None:
        if self._scorer is not None:
            self._scorer.close()


__all__ = ["PROBE_TEXT", "SGLangTeacher", "TeacherServerConfig", "check_served_tokenizer", "check_teacher",
           "scoring_rank", "served_model"]
