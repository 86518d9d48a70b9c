"""ToolRolloutEngine over the embedded engine: conversations carried as token ids, turn by turn.

References: every turn's input is checked against the ids that came before it (recorded at the inner engine), the
tool's ids against the template's own tokenization of the runner's output, and every generated token's rollout
log-prob against a teacher-forced HF forward of the whole final sequence (what the actor will see): a single id
re-tokenized, dropped or shifted anywhere would move them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.data.synthetic import build_char_tokenizer
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.engine import OpenStream
from megatron_dapo.rollout.multi_turn import MultiTurnConfig, ToolRolloutEngine, turn_sampling
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams

TOKENIZER = build_char_tokenizer()
VOCAB = len(TOKENIZER)
EOS = TOKENIZER.eos_token_id


@dataclass(frozen=True)
class ParenTemplate:
    """A test chat format: a turn that ends with ')' is a call whose code is the turn's text; the tool's output comes
    back as '=<output>.'"""

    stop: tuple[str, ...] = (")",)
    stop_token_ids: tuple[int, ...] = ()

    def find_call(self, turn_text: str) -> str | None:
        return turn_text if turn_text.endswith(")") else None

    def output_ids(self, tokenizer, output: str) -> list[int]:
        return tokenizer.encode(f"={output}.", add_special_tokens=False)


@dataclass(frozen=True)
class Outcome:
    text: str
    error: str | None = None
    wall_s: float = 0.001

    def for_policy(self, max_chars: int) -> str:
        return self.text[:max_chars]


class LengthRunner:
    """A deterministic tool: the number of characters of the code (an error for codes longer than 20), returned after
    `delay_s` from a thread of its own (submit), as a pool's would."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.delay_s = delay_s

    @staticmethod
    def outcome(code: str) -> Outcome:
        return Outcome(str(len(code)), None if len(code) <= 20 else "too long")

    def run_many(self, codes):
        self.calls += codes
        return [self.outcome(c) for c in codes]

    def submit(self, code):
        import threading
        import time
        from concurrent.futures import Future

        self.calls.append(code)
        future = Future()

        def finish():
            time.sleep(self.delay_s)
            future.set_result(self.outcome(code))
        threading.Thread(target=finish, daemon=True).start()
        return future


class Recording:
    """Wraps an engine and records every turn request and the sample it gave, and how each request was submitted
    (("open" | "add", request id), in order)."""

    def __init__(self, engine) -> None:
        self.engine, self.turns, self.events = engine, {}, []

    def _record(self, groups, by_id):
        for group in groups:
            self.turns[group[0].request_id] = (by_id[group[0].request_id], group[0])
            yield group

    def stream(self, requests):
        self.events += [("open", r.request_id) for r in requests]
        yield from self._record(self.engine.stream(requests), {r.request_id: r for r in requests})

    def open_stream(self, requests):
        by_id = {r.request_id: r for r in requests}
        self.events += [("open", r.request_id) for r in requests]
        inner = self.engine.open_stream(requests)

        def add(more):
            by_id.update((r.request_id, r) for r in more)
            self.events.extend(("add", r.request_id) for r in more)
            inner.add(more)
        return OpenStream(self._record(inner, by_id), add if inner.accepts_additions else None)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _model(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=EOS, attn_implementation="eager")
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _model()


SCHEDULES = pytest.mark.parametrize("schedule", ["continuous", "rounds"])


def _engine(model, tools=None, **cfg):
    inner = Recording(EmbeddedEngine(model, tokenizer=TOKENIZER, seed=3))
    tools = tools or LengthRunner()
    return ToolRolloutEngine(inner, template=ParenTemplate(), tokenizer=TOKENIZER, tools=tools,
                             config=MultiTurnConfig(**cfg)), inner, tools


def _requests(count: int, n: int, max_new: int) -> list[RolloutRequest]:
    return [RolloutRequest(prompt_ids=TOKENIZER.encode(f"{i}+{i}="), n=n, request_id=f"q{i}",
                           sampling=SamplingParams(max_new_tokens=max_new, seed=11 + i, stop_token_ids=(EOS,)))
            for i in range(count)]


def _teacher_forced(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    return logits.log_softmax(-1)[len(prompt) - 1:-1].gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


@SCHEDULES
def test_conversations_are_the_ids_the_engine_saw_and_produced(model, schedule):
    engine, inner, tools = _engine(model, max_turns=6, schedule=schedule)
    groups = engine.generate(_requests(3, n=4, max_new=60))
    samples = [s for g in groups for s in g]
    assert sum(s.tool_calls for s in samples) >= 3, "the random model should end some turns with ')'"
    for s in samples:
        turns = sorted((k, v) for k, v in inner.turns.items() if k.startswith(f"{s.request_id}#{s.index}."))
        turns.sort(key=lambda kv: int(kv[0].rsplit(".t", 1)[1]))
        rebuilt: list[int] = []
        mask: list[int] = []
        for t, (_, (req, out)) in enumerate(turns):
            assert req.prompt_ids == s.prompt_ids + rebuilt, "a turn's input is not the conversation so far"
            assert req.resumed_tokens == len(rebuilt) and req.first_index == s.index
            assert req.sampling.max_new_tokens == 60 - len(rebuilt)
            rebuilt += out.response_ids
            mask += [1] * len(out.response_ids)
            if t < s.tool_calls:
                code = TOKENIZER.decode(out.response_ids)
                assert code.endswith(")")
                tool = ParenTemplate().output_ids(TOKENIZER, str(len(code)))[:60 - len(rebuilt)]
                rebuilt += tool
                mask += [0] * len(tool)
        assert s.response_ids == rebuilt
        assert s.generated() == mask
        assert len(s.response_ids) <= 60
        gen = torch.tensor(s.generated(), dtype=torch.bool)
        ref = _teacher_forced(model, s.prompt_ids, s.response_ids)
        got = torch.tensor(s.logprobs)
        torch.testing.assert_close(got[gen], ref[gen], rtol=0, atol=2e-5)
        assert (got[~gen] == 0).all()
    assert len(tools.calls) == sum(s.tool_calls for s in samples)


@SCHEDULES
def test_tool_tokens_are_masked_and_counted_against_the_budget(model, schedule):
    engine, _, _ = _engine(model, max_turns=8, schedule=schedule)
    samples = [s for g in engine.generate(_requests(4, n=4, max_new=24)) for s in g]
    for s in samples:
        assert len(s.response_ids) <= 24
        if s.finish_reason == "length":
            assert len(s.response_ids) == 24
        calls_seen = sum(1 for a, b in zip([1] + s.generated(), s.generated(), strict=False) if a == 1 and b == 0)
        assert calls_seen == s.tool_calls
    metrics = engine.take_metrics()
    assert metrics["multi_turn/tool_calls"] == sum(s.tool_calls for s in samples)
    assert metrics["multi_turn/tool_tokens"] == sum(s.generated().count(0) for s in samples)
    assert metrics["multi_turn/tool_exec_s"] == pytest.approx(0.001 * metrics["multi_turn/tool_calls"])


def test_without_calls_a_conversation_is_the_single_turn_sample(model):
    """max_turns=1: a call is never run; each sample is exactly what the inner engine gives for the same request."""
    engine, _, tools = _engine(model, max_turns=1)
    reqs = _requests(2, n=3, max_new=30)
    got = engine.generate(reqs)
    plain = EmbeddedEngine(model, tokenizer=TOKENIZER, seed=3)
    want = plain.generate([RolloutRequest(prompt_ids=r.prompt_ids, n=r.n, request_id=r.request_id,
                                          sampling=turn_sampling(r.sampling, ParenTemplate(), 30)) for r in reqs])
    assert not tools.calls
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g, w, strict=True):
            assert (a.response_ids, a.logprobs, a.finish_reason) == (b.response_ids, b.logprobs, b.finish_reason)
            assert a.loss_mask == [] and a.tool_calls == 0


@SCHEDULES
def test_abort_ends_every_conversation_and_loses_no_group(model, schedule):
    engine, _, _ = _engine(model, LengthRunner(delay_s=0.05), max_turns=6, schedule=schedule)
    reqs = _requests(4, n=2, max_new=200)
    seen = []
    for group in engine.stream(reqs):
        seen.append(group)
        if len(seen) == 1:
            engine.abort()
    assert sorted(g[0].request_id for g in seen) == sorted(r.request_id for r in reqs)
    assert all(len(g) == 2 for g in seen)
    assert any(s.finish_reason == "abort" for g in seen[1:] for s in g)


class AbortingRunner(LengthRunner):
    """LengthRunner that aborts every conversation of `engine` when its `at`-th call arrives (that call and the ones
    after it still run): cuts between a turn and its output, right after an output, and inside turns."""

    def __init__(self, at: int) -> None:
        super().__init__(delay_s=0.01)
        self.at, self.engine = at, None

    def _maybe_abort(self) -> None:
        if len(self.calls) >= self.at and self.engine is not None:
            self.engine.abort()

    def run_many(self, codes):
        out = super().run_many(codes)
        self._maybe_abort()
        return out

    def submit(self, code):
        future = super().submit(code)
        self._maybe_abort()
        return future


@SCHEDULES
@pytest.mark.parametrize("trigger", ["first-group", "at-a-call"])
def test_a_conversation_cut_anywhere_continues_to_the_uncut_one(model, schedule, trigger):
    """Partial rollout of conversations: abort everything (once the first group is back, or when the 3rd call
    arrives), continue each cut sample from its prefix (partial_rollout.continuation_request: the prefix's ids and
    tool mask) and join the two (partial_rollout.extend). Cut mid-turn, between a call and its output, or after an
    output, every continued conversation is the uninterrupted one: the same ids, tool mask and calls (each sample
    draws from its own seeded stream, a continuation skipping the draws of its prefix), the log-probs to float
    rounding."""
    from megatron_dapo.rollout.partial_rollout import continuation_request, extend

    reqs = _requests(6, n=3, max_new=90)
    whole, _, _ = _engine(model, LengthRunner(delay_s=0.01), max_turns=4, schedule=schedule)
    want = {(s.request_id, s.index): s for g in whole.generate(reqs) for s in g}
    runner = AbortingRunner(at=3 if trigger == "at-a-call" else 10**9)
    cut_engine, _, _ = _engine(model, runner, max_turns=4, schedule=schedule)
    runner.engine = cut_engine
    cut = []
    for group in cut_engine.stream(reqs):
        if not cut and trigger == "first-group":
            cut_engine.abort()
        cut += group
    prompts = {r.request_id: r for r in reqs}
    partial = [s for s in cut if s.finish_reason == "abort"]
    assert len(partial) >= 3, [s.finish_reason for s in cut]
    if trigger == "at-a-call":
        assert any(s.loss_mask for s in partial), "no cut conversation had a tool's output"
    runner.engine = None
    continued = cut_engine.generate([
        continuation_request(prompts[s.request_id].prompt_ids, s, prompts[s.request_id].sampling,
                             prompts[s.request_id].sampling.seed, f"{s.request_id}-c{s.index}") for s in partial])
    done = {(s.request_id, s.index): s for s in cut if s.finish_reason != "abort"}
    for s, (cont,) in zip(partial, continued, strict=True):
        done[(s.request_id, s.index)] = extend(s, cont, prompts[s.request_id].prompt_ids)
    assert done.keys() == want.keys()
    for key, w in want.items():
        got = done[key]
        assert (got.response_ids, got.generated(), got.tool_calls, got.finish_reason) == \
            (w.response_ids, w.generated(), w.tool_calls, w.finish_reason), key
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-5)


def test_bad_config_names_the_flag():
    with pytest.raises(ValueError, match="--max-turns"):
        MultiTurnConfig(max_turns=0)
    with pytest.raises(ValueError, match="--tool-output-max-chars"):
        MultiTurnConfig(max_output_chars=63)
    with pytest.raises(ValueError, match="--tool-schedule"):
        MultiTurnConfig(schedule="greedy")


def test_the_two_schedules_give_the_same_conversations(model):
    """Rounds and continuous differ only in when a turn is submitted: every conversation's ids are the same (the
    embedded engine samples each row from its own seeded stream; its batches differ, so log-probs agree to float
    rounding, and the ids unless a rounding flips a draw, which these few rows at fp32 do not)."""
    got = {}
    for schedule in ("rounds", "continuous"):
        engine, _, _ = _engine(model, LengthRunner(delay_s=0.01), max_turns=4, schedule=schedule)
        got[schedule] = {(s.request_id, s.index): s for g in engine.generate(_requests(3, n=3, max_new=50)) for s in g}
    assert sum(s.tool_calls for s in got["rounds"].values()) >= 2
    for key, a in got["rounds"].items():
        b = got["continuous"][key]
        assert (a.response_ids, a.loss_mask, a.finish_reason, a.tool_calls) == \
            (b.response_ids, b.loss_mask, b.finish_reason, b.tool_calls)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_continuous_turns_go_back_while_other_turns_generate(model):
    """A conversation whose tool returned is resubmitted into the running stream (OpenStream.add) instead of waiting
    for the round: with an instant tool, some second turn is added while first turns are still generating."""
    engine, inner, _ = _engine(model, max_turns=6, schedule="continuous")
    samples = [s for g in engine.generate(_requests(4, n=4, max_new=60)) for s in g]
    assert sum(s.tool_calls for s in samples) >= 1
    added = [rid for kind, rid in inner.events if kind == "add"]
    assert added and all(not rid.endswith(".t0") for rid in added), inner.events[:12]
    rounds, rinner, _ = _engine(model, max_turns=6, schedule="rounds")
    rounds.generate(_requests(4, n=4, max_new=60))
    assert all(kind == "open" for kind, _ in rinner.events)


def test_the_embedded_engine_stops_at_the_token_that_completes_a_stop_string(model):
    engine = EmbeddedEngine(model, tokenizer=TOKENIZER, seed=3)
    free = engine.generate([RolloutRequest(prompt_ids=TOKENIZER.encode("1+1="), n=4, request_id="f",
                                           sampling=SamplingParams(max_new_tokens=40, seed=5))])[0]
    text = TOKENIZER.decode(free[0].response_ids)
    target = text[3:5]  # a two-character string the unconstrained sample holds
    first = text.index(target) + len(target)
    stopped = engine.generate([RolloutRequest(prompt_ids=TOKENIZER.encode("1+1="), n=4, request_id="s",
                                              sampling=SamplingParams(max_new_tokens=40, seed=5,
                                                                      stop=(target,)))])[0]
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].response_ids == free[0].response_ids[:first]
    with pytest.raises(ValueError, match="no tokenizer"):
        EmbeddedEngine(model, seed=3).generate([RolloutRequest(
            prompt_ids=[5], n=1, request_id="x", sampling=SamplingParams(max_new_tokens=4, stop=("a",)))])
    with pytest.raises(ValueError, match="stop must be non-empty"):
        SamplingParams(max_new_tokens=4, stop=("",))
