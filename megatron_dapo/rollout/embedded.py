"""EmbeddedEngine: an in-process rollout engine over a registered family's HF causal LM (the default on CPU).

The decode loop is our own (rather than `generate`) so that each sampled token's log-prob is read
from the raw fp32 logits of the very forward pass that produced it, the quantity SGLang's return_logprob
reports and the actor recomputes. Prompts are left-padded so every row's next token sits in the last
column; rows leave the batch (and the KV cache) as soon as they stop, so short answers cost nothing.

A weight update while rows are live (`update_weights` called between two yields of `stream`, as a fully async push
lands mid-generation) is applied as SGLang's retract pause does it (docs/ASYNC.md): before the next token, every
live row's KV cache is recomputed from its prompt and the tokens it has generated, under the new weights; so each
token's log-prob comes from one set of weights, and `Sample.token_versions` says which (the version of the forward
pass that produced the token's logits).

With `record_routing` (--moe-routing-replay on an MoE model) a forward hook on each MoE layer's router (HF's
`mlp.gate`, whose forward returns (logits, scores, top-k indices)) keeps the experts every fed-in token was routed
to, what SGLang's return_routed_experts gives: Sample.routed_experts, rows for prompt + response - 1 tokens.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from megatron_dapo.models.family import ModelFamily
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import family
from megatron_dapo.rollout.engine import OpenStream, RolloutEngine, check_unique_ids
from megatron_dapo.rollout.sampling import row_seed, sample_tokens, skip_draws
from megatron_dapo.rollout.types import FinishReason, RolloutRequest, RoutingShape, Sample
from megatron_dapo.rollout.weights_load import load_named_tensors


@dataclass
class _Row:
    """One sample being generated: request `req`, sample `index`."""

    req: RolloutRequest
    index: int
    generator: torch.Generator
    stop_ids: frozenset[int]
    weight_version: int = -1
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    routes: list[torch.Tensor] = field(default_factory=list)
    """record_routing: [tokens, num_layers, top_k] per forward pass this row took part in (prompt, then one a token;
    after a weight update, one for prompt + response re-prefilled, replacing the earlier ones)."""
    versions: list[int] = field(default_factory=list)
    """Per response token, the weight version of the forward pass that produced its logits."""


DEFAULT_MAX_BATCH_SIZE = 64
"""Rows per forward pass when the caller does not say (the trainer passes --rollout-batch-size x
--n-samples-per-prompt)."""
REFILL_SHARE = 4
"""continuous_batching: waiting rows join a running batch once 1/REFILL_SHARE of its max_batch_size slots are free
(or all they need). Each join is a prefill of the new rows and a copy of the batch's whole KV cache, which for a
small model costs about a decode step: joining a quarter at a time keeps the batch at least 3/4 full at one copy
per quarter turned over."""


def _left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """`t` with zeros prepended along `dim` up to `width` (left padding: masked out of attention)."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge_caches(a: DynamicCache, b: DynamicCache, width: int) -> None:
    """Rows of `b` appended to `a` (in place), both left-padded to `width` positions. Full-attention layers only:
    a sliding-window layer's cache is not positional, so it cannot be aligned by padding."""
    for la, lb in zip(a.layers, b.layers, strict=True):
        if type(la) is not DynamicLayer or type(lb) is not DynamicLayer:
            raise NotImplementedError(f"EmbeddedEngine.open_stream: continuous batching merges full-attention KV "
                                      f"caches only, this model has {type(la).__name__} layers; use stream()")
        la.keys = torch.cat([_left_pad(la.keys, width, -2), _left_pad(lb.keys, width, -2)], dim=0)
        la.values = torch.cat([_left_pad(la.values, width, -2), _left_pad(lb.values, width, -2)], dim=0)


@dataclass
class _Batch:
    """The rows decoding together and their state: the logits of each row's next token [b, V] (fp32), the KV cache,
    the attention mask [b, width] (left padding 0), each row's last position [b], its sampling parameters [b], the
    tokens sampled last [b] and the weight version of the forward pass that produced `logits`."""

    rows: list[_Row] = field(default_factory=list)
    logits: torch.Tensor | None = None
    cache: DynamicCache | None = None
    mask: torch.Tensor | None = None
    last_pos: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    version: int = -1

    def join(self, rows: list[_Row], logits: torch.Tensor, cache: DynamicCache, mask: torch.Tensor,
             last_pos: torch.Tensor, version: int) -> None:
        """Add freshly prefilled rows (their logits, cache, mask and positions) to the batch."""
        device = logits.device
        params = [r.req.sampling for r in rows]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if not self.rows:
            self.rows, self.logits, self.cache, self.mask, self.last_pos = list(rows), logits, cache, mask, last_pos
            self.temperature, self.top_k, self.top_p, self.version = temperature, top_k, top_p, version
            return
        if version != self.version:
            raise AssertionError(f"rows prefilled at weight version {version} join a batch at {self.version}")
        width = max(self.mask.shape[1], mask.shape[1])
        _merge_caches(self.cache, cache, width)
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
        self.rows = self.rows + list(rows)
        self.logits = torch.cat([self.logits, logits])
        self.last_pos = torch.cat([self.last_pos, last_pos])
        self.temperature = torch.cat([self.temperature, temperature])
        self.top_k = torch.cat([self.top_k, top_k])
        self.top_p = torch.cat([self.top_p, top_p])

    def select(self, keep: list[int], tokens: torch.Tensor) -> None:
        """Keep rows `keep` (indices into `rows`), with `tokens` [b] the ones just sampled for every row."""
        if not keep:
            self.rows, self.cache = [], None
            return
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, device=tokens.device)
            self.cache.batch_select_indices(index)
            self.rows = [self.rows[i] for i in keep]
            tokens, self.mask, self.last_pos = tokens[index], self.mask[index], self.last_pos[index]
            self.temperature, self.top_k, self.top_p = self.temperature[index], self.top_k[index], self.top_p[index]
        self.tokens = tokens

    def trim(self) -> None:
        """Drop the leading cache columns that are padding for every row. A continuously refilled batch never
        empties, so without this its width (and each step's attention) would grow by one column a step for as long
        as it runs; trimmed, it stays the longest row's prompt + response."""
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        if start == 0:
            return
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[..., start:, :], layer.values[..., start:, :]
        self.mask = self.mask[:, start:]

    def restart(self, logits: torch.Tensor, cache: DynamicCache, mask: torch.Tensor, last_pos: torch.Tensor,
                version: int) -> None:
        """The same rows re-prefilled (after a weight update)."""
        self.logits, self.cache, self.mask, self.last_pos, self.version = logits, cache, mask, last_pos, version


def _family(model_type: Any, where: str) -> ModelFamily:
    try:
        return family(model_type)
    except ValueError as err:
        raise ValueError(f"EmbeddedEngine: {where}: {err}") from None


def _build_model(source: Any, arch: ModelArch | None, state_dict: dict[str, torch.Tensor] | None,
                 dtype: torch.dtype, seed: int):
    """The HF causal LM of the family registered under the source's model_type: for a model directory, `arch`'s
    (its config.json as the caller parsed it, ModelArch.from_hf); else the config's or model's own."""
    if arch is not None and not isinstance(source, (str, Path)):
        raise ValueError("EmbeddedEngine: pass arch only with a model directory (a config or a model names its "
                         "model_type itself)")
    if isinstance(source, PreTrainedModel):
        _family(source.config.model_type, "the model's config")
        if state_dict is not None:
            raise ValueError("EmbeddedEngine: pass state_dict only with a config, not with a model instance")
        return source.to(dtype)
    if isinstance(source, (str, Path)):
        if state_dict is not None:
            raise ValueError("EmbeddedEngine: pass state_dict only with a config, not with a model directory")
        if not (Path(source) / "config.json").is_file():
            raise FileNotFoundError(f"EmbeddedEngine: {source} has no config.json (expected an HF model dir)")
        if arch is None:
            raise ValueError(f"EmbeddedEngine: the model directory {source} needs arch=, its ModelArch: "
                             f"ModelArch.from_hf({str(source)!r}), parsed once by the caller (start-up passes "
                             f"RolloutEngineConfig.arch)")
        cls = arch.family.hf_causal_lm()
        return cls.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    if isinstance(source, dict):
        source = _family(source.get("model_type"), "the config dict").hf_config(**source)
    if not isinstance(source, PretrainedConfig):
        raise TypeError(
            "EmbeddedEngine: model_dir_or_config must be an HF model dir, a config dict / PretrainedConfig, "
            f"or an HF causal LM of a registered family; got {type(source).__name__}"
        )
    source._attn_implementation = "sdpa"
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # random init only matters when no state_dict follows; keep it reproducible
        model = _family(source.model_type, "the config").hf_causal_lm()(source).to(dtype)
    if state_dict is not None:
        load_named_tensors(model, state_dict.items())
    return model


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for src in (model.config, getattr(model, "generation_config", None), tokenizer):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
    return frozenset(ids)


class EmbeddedEngine(RolloutEngine):
    """Batched sampling with KV cache on the local CPU (or any torch device) in this process.

    model_dir_or_config: HF model directory (with `arch`, its parsed config.json), config dict / PretrainedConfig
    (+ `state_dict` with HF names), or a ready HF causal LM; the model_type of `arch` or of the config picks the
    family (`models/registry.py`). The engine reads no config.json itself: start-up parsed it once.
    `max_batch_size` bounds rows (samples) per forward pass.
    `seed` drives samples whose request has no seed, and the random init when no weights are given.
    `record_routing`: MoE models, keep each sample's routed experts (Sample.routed_experts; --moe-routing-replay).
    `continuous_batching`: `open_stream` refills a running batch (`_decode`); off, rows added to an open stream wait
    for the batch in progress to end, as `stream`'s chunks do (the default: on CPU with HF attention a refilled
    batch decodes ~2.5x slower a token, measured below).
    """

    def __init__(
        self,
        model_dir_or_config: Any,
        *,
        arch: ModelArch | None = None,
        state_dict: dict[str, torch.Tensor] | None = None,
        tokenizer: Any = None,
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
        seed: int = 0,
        device: str | torch.device = "cpu",
        num_threads: int | None = None,
        record_routing: bool = False,
        continuous_batching: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(
                f"EmbeddedEngine: max_batch_size must be >= 1 (rows per forward pass), got {max_batch_size}"
            )
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device = torch.device(device)
        self.dtype = dtype
        self.model = _build_model(model_dir_or_config, arch, state_dict, dtype, seed).to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.continuous_batching = continuous_batching
        self.eos_ids = _eos_ids(self.model, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        # Pad positions are masked out of attention, so any valid id works as filler.
        self.pad_id = int(pad if pad is not None else getattr(self.model.config, "pad_token_id", None) or 0)
        self._rng = torch.Generator().manual_seed(seed)
        self._version = 0
        self._paused = False
        self._closed = False
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self.routing: RoutingShape | None = None
        if record_routing:
            self.routing = self._routing_shape()

    def _routing_shape(self) -> RoutingShape:
        config = self.model.config
        routers = self._routers()
        if not routers:
            raise ValueError("EmbeddedEngine: record_routing (--moe-routing-replay) needs a mixture-of-experts model; "
                             f"{config.model_type} has no router")
        return RoutingShape(config.num_hidden_layers, config.num_experts_per_tok, config.num_experts)

    def _routers(self) -> dict[int, torch.nn.Module]:
        """{global layer index: HF router module} of the MoE layers (dense layers have no `mlp.gate` module)."""
        layers = self.model.model.layers
        return {i: layer.mlp.gate for i, layer in enumerate(layers)
                if isinstance(getattr(layer.mlp, "gate", None), torch.nn.Module)}

    # ---- RolloutEngine -------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def capacity(self) -> int:
        return self.max_batch_size

    def health(self) -> bool:
        return not self._closed

    def shutdown(self) -> None:
        self._closed = True
        self._live.clear()
        self.model = None  # type: ignore[assignment]

    def pause(self) -> None:
        # In-process, generation only advances while the caller iterates `stream`, so in-flight rows are
        # already held between yields; the flag makes new streams wait for resume() (they raise instead).
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def abort(self, request_ids: Iterable[str] | None = None) -> list[str]:
        ids = set(self._live) if request_ids is None else set(request_ids) & self._live
        self._aborted |= ids
        return sorted(ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        self._check_open()
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"update_weights: version must be an int >= 0, got {version!r}")
        load_named_tensors(self.model, named_tensors)
        self._version = version

    def stream(self, requests: Sequence[RolloutRequest]) -> Iterator[list[Sample]]:
        return self._start(requests, refill=False)

    def open_stream(self, requests: Sequence[RolloutRequest]) -> OpenStream:
        """`stream` that takes requests while it runs (`OpenStream.add`). Their rows queue behind the others and, as
        `stream`'s, start in chunks of max_batch_size once the batch in progress has ended; with
        `continuous_batching` they join the running batch once a quarter of its slots are free (REFILL_SHARE),
        prefilled on their own, their KV cache merged into the batch's.

        Why chunks by default: rows that joined a batch at other times sit at other positions, so every forward
        pass has padding and HF's SDPA path takes an explicit mask (and repeats the KV heads for GQA) where equal-
        length chunks need none. Measured (AMD EPYC, 1 thread, the remainder task's base policy, 320 rows of up to
        160 tokens, max_batch_size 128): 31,213 tokens in 1.9 s chunked, 3.8 s refilled (362 forward passes of
        8.5 ms against 477 of 3.0 ms); the fully async remainder arm ran 82 s with waves, 125 s refilled
        (tools/bench_async.py, docs/BENCHMARKS.md). SGLang's paged attention has no such cost: its servers refill
        every slot at once."""
        return self._start(requests, refill=self.continuous_batching)

    def _start(self, requests: Sequence[RolloutRequest], *, refill: bool) -> OpenStream:
        self._check_open()
        if self._paused:
            raise RuntimeError("EmbeddedEngine is paused: call resume() before generating")
        check_unique_ids(requests)
        pending: collections.deque[_Row] = collections.deque()
        remaining: dict[str, int] = {}
        owned: list[str] = []

        def add(more: Sequence[RolloutRequest]) -> None:
            ids = {r.request_id for r in more}
            clash = ids & (self._live | set(remaining))
            if clash:
                raise ValueError(f"request ids already in flight: {sorted(clash)[:5]}")
            self._live |= ids
            owned.extend(ids)
            for r in more:
                remaining[r.request_id] = r.n
                pending.extend(self._rows(r))

        add(requests)
        return OpenStream(self._run(pending, remaining, owned, refill), add)

    # ---- decode loop ---------------------------------------------------------------------------

    def _rows(self, req: RolloutRequest) -> list[_Row]:
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError(f"request {req.request_id!r} has stop strings {req.sampling.stop!r} but the embedded "
                             "engine has no tokenizer to decode the response with: pass EmbeddedEngine(tokenizer=)")
        base = req.sampling.seed
        rows = []
        for i in range(req.first_index, req.first_index + req.n):
            if base is not None:
                seed = row_seed(base, i)
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
            gen = torch.Generator(device=self.device).manual_seed(seed)
            if not req.sampling.greedy:  # a continuation goes on with the draws after its prefix's
                skip_draws(gen, self.model.get_output_embeddings().out_features, req.resumed_tokens)
            rows.append(_Row(req, i, gen, self.eos_ids | frozenset(req.sampling.stop_token_ids)))
        return rows

    def _run(self, pending: collections.deque[_Row], remaining: dict[str, int], owned: list[str],
             refill: bool) -> Iterator[list[Sample]]:
        try:
            rows_of: dict[str, list[_Row]] = {}
            for row in self._decode(pending, refill):
                rid = row.req.request_id
                rows_of.setdefault(rid, []).append(row)
                remaining[rid] -= 1
                if remaining[rid] == 0:
                    self._live.discard(rid)
                    self._aborted.discard(rid)
                    yield [self._to_sample(r) for r in sorted(rows_of.pop(rid), key=lambda r: r.index)]
        finally:
            # The consumer stopped iterating (or an error): forget these ids so they can be reused.
            for rid in owned:
                self._live.discard(rid)
                self._aborted.discard(rid)

    def _stop_string_ends(self, row: _Row) -> bool:
        """True when the row's decoded response tail (SamplingParams.stop_window tokens) holds a stop string."""
        sampling = row.req.sampling
        if not sampling.stop:
            return False
        tail = self.tokenizer.decode(row.response[-sampling.stop_window:])
        return any(s in tail for s in sampling.stop)

    def _to_sample(self, row: _Row) -> Sample:
        return Sample(
            request_id=row.req.request_id,
            index=row.index,
            prompt_ids=list(row.req.prompt_ids),
            response_ids=row.response,
            logprobs=row.logprobs,
            finish_reason=row.finish or "abort",
            weight_version=row.weight_version if row.weight_version >= 0 else self._version,
            token_versions=list(row.versions) if len(set(row.versions)) > 1 else [],
            # every fed-in token's row: the prompt's, then each sampled token but the last (never fed back)
            routed_experts=torch.cat(row.routes)[: len(row.req.prompt_ids) + len(row.response) - 1]
            if row.routes else None,
        )

    def _admit(self, pending: collections.deque[_Row], room: int) -> tuple[list[_Row], list[_Row]]:
        """Up to `room` rows off `pending`: (those to generate, those whose request was aborted meanwhile)."""
        admitted: list[_Row] = []
        aborted: list[_Row] = []
        while pending and len(admitted) < room:
            row = pending.popleft()
            if row.req.request_id in self._aborted:
                row.finish = "abort"
                aborted.append(row)
            else:
                admitted.append(row)
        return admitted, aborted

    @torch.inference_mode()
    def _decode(self, pending: collections.deque[_Row], refill: bool) -> Iterator[_Row]:
        """Runs the rows of `pending` (which may grow between yields) to completion, at most max_batch_size at a
        time, yielding each row the moment it finishes. Without `refill` a batch is taken only when the previous
        one is done; with it, waiting rows join once a quarter of the slots are free (REFILL_SHARE)."""
        batch = _Batch()
        while True:
            room = self.max_batch_size - len(batch.rows)
            want = min(len(pending), max(1, self.max_batch_size // REFILL_SHARE))
            if pending and (not batch.rows or (refill and room >= want)):
                admitted, aborted = self._admit(pending, room)
                yield from aborted
                if admitted:
                    out, cache, mask, last_pos = self._prefill(admitted, [list(r.req.prompt_ids) for r in admitted])
                    for row in admitted:
                        row.weight_version = self._version
                    batch.join(admitted, out.logits[:, -1, :].float(), cache, mask, last_pos, self._version)
                    continue  # admit more while rows are waiting and aborted ones free room
            if not batch.rows:
                if pending:
                    continue
                return
            live = batch.rows
            tokens = sample_tokens(batch.logits, batch.temperature, batch.top_k, batch.top_p,
                                   [r.generator for r in live])
            # Raw (temperature-1, unfiltered) log-prob of the chosen token: see Sample.logprobs.
            chosen_lp = batch.logits.log_softmax(dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
            for i, row in enumerate(live):
                tok = int(tokens[i])
                row.response.append(tok)
                row.logprobs.append(float(chosen_lp[i]))
                row.versions.append(batch.version)
                if tok in row.stop_ids or self._stop_string_ends(row):
                    row.finish = "stop"
                elif len(row.response) >= row.req.sampling.max_new_tokens:
                    row.finish = "length"
            # Yield finished rows only after the step's bookkeeping, so an abort() called by the consumer
            # meanwhile is seen by every row at the next step.
            yield from (row for row in live if row.finish is not None)
            # abort() may have been called by the consumer during those yields: stop such rows now
            # rather than after one more (wasted) forward pass.
            for row in live:
                if row.finish is None and row.req.request_id in self._aborted:
                    row.finish = "abort"
                    yield row
            keep = [i for i, row in enumerate(live) if row.finish is None]
            batch.select(keep, tokens)
            if refill and batch.rows:  # stream() keeps its width: the numerics the golden curve pins
                batch.trim()
            if not batch.rows:
                continue
            if self._version != batch.version:  # weights updated during the yields: retract, re-prefill
                out, cache, mask, last_pos = self._prefill(
                    batch.rows, [list(r.req.prompt_ids) + r.response for r in batch.rows], replace_routes=True)
                batch.restart(out.logits[:, -1, :].float(), cache, mask, last_pos, self._version)
                continue
            mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.rows), 1))], dim=1)
            last_pos = batch.last_pos + 1
            with self._recording() as picked:
                out = self.model(
                    input_ids=batch.tokens.unsqueeze(1), attention_mask=mask, position_ids=last_pos.unsqueeze(1),
                    past_key_values=batch.cache, use_cache=True,
                )
            if picked:
                for i, row in enumerate(batch.rows):
                    row.routes.append(picked[0][i : i + 1])
            batch.mask, batch.last_pos, batch.logits = mask, last_pos, out.logits[:, -1, :].float()

    def _prefill(self, live: list[_Row], sequences: list[list[int]], replace_routes: bool = False):
        """One forward pass over `sequences` (a row's prompt, or prompt + response after a weight update), left
        padded into a fresh KV cache. Returns (output with the last position's logits, cache, attention mask
        [b, width], each row's last position [b]); records each row's routes for those tokens."""
        lengths = [len(seq) for seq in sequences]
        width = max(lengths)
        ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for i, seq in enumerate(sequences):
            ids[i, width - lengths[i]:] = torch.tensor(seq)
            mask[i, width - lengths[i]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        position = (mask.cumsum(dim=1) - 1).clamp_min(0)
        cache = DynamicCache(config=self.model.config)
        with self._recording() as picked:
            out = self.model(
                input_ids=ids, attention_mask=mask, position_ids=position, past_key_values=cache,
                use_cache=True, logits_to_keep=1,
            )
        if picked:  # [b * width, L, K] -> each row's own (unpadded) positions
            routes = picked[0].view(len(live), width, *picked[0].shape[1:])
            for i, row in enumerate(live):
                if replace_routes:
                    row.routes.clear()
                row.routes.append(routes[i, width - lengths[i]:])
        return out, cache, mask, position[:, -1]

    @contextlib.contextmanager
    def _recording(self) -> Iterator[list[torch.Tensor]]:
        """Around one forward pass: with record_routing, yields a list that afterwards holds one [tokens, L, K]
        tensor of routed ids (layers without a router: zeros, as SGLang's dense-layer columns); else stays empty."""
        if self.routing is None:
            yield []
            return
        picked: dict[int, torch.Tensor] = {}
        hooks = [router.register_forward_hook(lambda _m, _i, out, i=i: picked.__setitem__(i, out[2]))
                 for i, router in self._routers().items()]
        box: list[torch.Tensor] = []
        try:
            yield box
        finally:
            for h in hooks:
                h.remove()
        tokens = next(iter(picked.values())).shape[0]
        full = torch.zeros(tokens, self.routing.num_layers, self.routing.top_k, dtype=self.routing.dtype)
        for i, ids in picked.items():
            full[:, i] = ids.to(self.routing.dtype)
        box.append(full)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EmbeddedEngine was shut down; create a new one")
