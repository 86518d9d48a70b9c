"""EmbeddedEngine against independent references: HF full-sequence forward and HF greedy generate (Qwen2, and
every registered family's tiny model for greedy generation)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.hf_params import hf_state_dict
from megatron_dapo.rollout import make_engine
from megatron_dapo.rollout.embedded import EmbeddedEngine
from megatron_dapo.rollout.engine import RolloutEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.dist.actor_common import FAMILIES, tiny_config

CFG = dict(
    model_type="qwen2",
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1,
    rope_theta=10000.0,
)
EOS = 1


def _hf_model(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**CFG, attn_implementation="eager")).eval()
    with torch.no_grad():  # bigger weights than the init's 0.02 std so samples differ between seeds
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return model


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their on-disk HF names (an MoE model's experts one per tensor), as the export
    sends them."""
    return {k: v.clone() for k, v in hf_state_dict(model).items()}


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 96, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(count)]


def _requests(prompts, n, sampling, prefix="r"):
    return [RolloutRequest(prompt_ids=p, n=n, sampling=sampling, request_id=f"{prefix}{i}")
            for i, p in enumerate(prompts)]


def _teacher_forced_logprobs(model, prompt, response) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(response).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="module")
def model0():
    return _hf_model(0)


@pytest.mark.parametrize(
    "sampling",
    [pytest.param(SamplingParams(max_new_tokens=12, temperature=1.0), id="t1"),
     pytest.param(SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.9, top_k=20), id="filtered"),
     pytest.param(SamplingParams(max_new_tokens=12, temperature=0.0), id="greedy")],
)
def test_logprobs_equal_teacher_forced_forward(model0, sampling):
    """The rollout/training mismatch is ~0 for the same weights: raw log-probs, whatever the sampler."""
    engine = EmbeddedEngine(CFG, state_dict=_state(model0), max_batch_size=7)
    groups = engine.generate(_requests(_prompts(5), 3, sampling))
    worst = 0.0
    for group in groups:
        assert [s.index for s in group] == [0, 1, 2]
        for s in group:
            assert len(s.response_ids) == len(s.logprobs) >= 1
            ref = _teacher_forced_logprobs(model0, s.prompt_ids, s.response_ids)
            worst = max(worst, (torch.tensor(s.logprobs) - ref).abs().max().item())
    assert worst < 2e-5, worst


def test_greedy_matches_hf_generate(model0):
    engine = EmbeddedEngine(model0, max_batch_size=4)
    prompts = _prompts(6, seed=3)
    groups = engine.generate(_requests(prompts, 1, SamplingParams(max_new_tokens=10, temperature=0.0)))
    for prompt, (s,) in zip(prompts, groups, strict=True):
        with torch.no_grad():
            ref = model0.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                  eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        assert s.response_ids == ref
        assert s.finish_reason == ("stop" if ref[-1] == EOS else "length")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_family_greedy_matches_hf_generate(model_type):
    """Built from a config dict and a state dict, the engine picks the family's HF class itself
    (`arch.family.hf_causal_lm()`); the reference is transformers' Auto classes on the same config."""
    fields = dict(tiny_config(model_type, vocab_size=96, num_hidden_layers=2), model_type=model_type,
                  tie_word_embeddings=False, eos_token_id=EOS)
    torch.manual_seed(4)
    config = AutoConfig.for_model(**fields, attn_implementation="eager")
    reference = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # weights big enough for varied greedy paths; norms (q/k norms too) off 1
        for name, p in reference.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.15)
    engine = EmbeddedEngine(fields, state_dict=_state(reference), max_batch_size=4)
    assert type(engine.model).__name__ == type(reference).__name__
    prompts = _prompts(5, seed=3)
    groups = engine.generate(_requests(prompts, 1, SamplingParams(max_new_tokens=10, temperature=0.0)))
    for prompt, (s,) in zip(prompts, groups, strict=True):
        with torch.no_grad():
            ref = reference.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                     eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        assert s.response_ids == ref
        torch.testing.assert_close(torch.tensor(s.logprobs), _teacher_forced_logprobs(reference, prompt, ref),
                                   atol=2e-5, rtol=0)


def test_stop_tokens_and_length():
    engine = EmbeddedEngine(CFG, state_dict=_state(_hf_model(1)))
    stops = tuple(range(2, 14))  # an eighth of the vocab: some samples stop, others hit the cap
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=stops)
    groups = engine.generate(_requests(_prompts(4), 4, sampling))
    reasons = set()
    for s in (s for g in groups for s in g):
        reasons.add(s.finish_reason)
        if s.finish_reason == "stop":
            assert s.response_ids[-1] in stops + (EOS,)
            assert not set(s.response_ids[:-1]) & set(stops + (EOS,))
        else:
            assert s.finish_reason == "length" and len(s.response_ids) == 6 and s.truncated
    assert reasons == {"stop", "length"}


def test_seeded_samples_do_not_depend_on_batching(model0):
    sp = SamplingParams(max_new_tokens=8, seed=42)
    prompts = _prompts(5)
    alone = EmbeddedEngine(model0, max_batch_size=1).generate(_requests(prompts[2:3], 3, sp))[0]
    together = EmbeddedEngine(model0, max_batch_size=64, seed=9).generate(_requests(prompts, 3, sp))[2]
    assert [s.response_ids for s in alone] == [s.response_ids for s in together]
    assert len({tuple(s.response_ids) for s in alone}) > 1  # the n samples differ from each other


def test_weight_sync_follows_new_weights(model0):
    model1 = _hf_model(1)
    engine = make_engine("embedded", CFG, state_dict=_state(model0))
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0)
    reqs = _requests(_prompts(4, seed=5), 1, greedy)
    before = [g[0].response_ids for g in engine.generate(reqs)]
    engine.update_weights(model1.named_parameters(), version=3)
    assert engine.weight_version == 3
    after = engine.generate(reqs)
    assert all(g[0].weight_version == 3 for g in after)
    ref = [g[0].response_ids for g in EmbeddedEngine(model1).generate(reqs)]
    assert [g[0].response_ids for g in after] == ref != before
    s = after[0][0]
    torch.testing.assert_close(torch.tensor(s.logprobs), _teacher_forced_logprobs(model1, s.prompt_ids,
                                                                                  s.response_ids))


def _moe_reference(seed: int) -> torch.nn.Module:
    fields = dict(tiny_config("qwen3_moe", vocab_size=96, num_hidden_layers=2), model_type="qwen3_moe",
                  tie_word_embeddings=False, eos_token_id=EOS)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0, 0.15)
    return model


def test_moe_weight_sync_writes_fused_experts_in_place():
    """A qwen3_moe sync arrives one tensor per expert (on-disk names, in any order): each lands in the fused
    [E, 2I, H] / [E, H, I] parameters in place, and the engine then generates what HF does with the new weights."""
    old, new = _moe_reference(5), _moe_reference(6)
    engine = EmbeddedEngine(old, max_batch_size=4)
    fused = {n: (p.data_ptr(), p.shape) for n, p in engine.model.named_parameters() if "experts" in n}
    assert len(fused) == 4  # gate_up_proj and down_proj of 2 layers
    named = list(_state(new).items())
    assert sum(".experts." in n for n, _ in named) == 2 * 8 * 3  # layers x experts x (gate, up, down)
    engine.update_weights(reversed(named), version=1)
    assert {n: (p.data_ptr(), p.shape) for n, p in engine.model.named_parameters() if "experts" in n} == fused
    for name, param in engine.model.state_dict().items():
        assert torch.equal(param, new.state_dict()[name]), name
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    for (s,) in engine.generate(_requests(_prompts(3, seed=8), 1, greedy)):
        torch.testing.assert_close(torch.tensor(s.logprobs), _teacher_forced_logprobs(new, s.prompt_ids,
                                                                                      s.response_ids),
                                   atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="not sent"):  # one expert's up_proj missing
        engine.update_weights([(n, t) for n, t in named if n != "model.layers.1.mlp.experts.3.up_proj.weight"],
                              version=2)


def test_weight_sync_rejects_bad_input(model0):
    engine = EmbeddedEngine(CFG, state_dict=_state(model0))
    named = list(_state(model0).items())
    with pytest.raises(ValueError, match="not sent"):
        engine.update_weights(named[:-1], version=1)
    with pytest.raises(KeyError, match="no parameter"):
        engine.update_weights([("decoder.layers.0.weight", named[0][1])], version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights([(named[0][0], named[0][1][:-1])], version=1)
    assert engine.weight_version == 0


def test_abort_mid_stream_returns_every_group(model0):
    """Dynamic sampling: stop after 2 groups; the other groups still come back, marked 'abort'."""
    engine = EmbeddedEngine(model0, max_batch_size=8)
    reqs = _requests(_prompts(10), 4, SamplingParams(max_new_tokens=30))
    seen, aborted = [], None
    for group in engine.stream(reqs):
        seen.append(group)
        if len(seen) == 2:
            aborted = engine.abort()
    ids = [g[0].request_id for g in seen]
    assert sorted(ids) == sorted(r.request_id for r in reqs)  # none lost, none twice
    assert all(len(g) == 4 for g in seen)
    assert sorted(aborted) == sorted(ids[2:])
    later = [s for g in seen[2:] for s in g]
    assert {s.finish_reason for s in later} == {"abort"}
    for s in (s for s in later if s.response_ids):  # partial responses keep exact log-probs
        torch.testing.assert_close(torch.tensor(s.logprobs),
                                   _teacher_forced_logprobs(model0, s.prompt_ids, s.response_ids))
    assert engine.generate(reqs[:1])[0][0].finish_reason == "length"  # ids are reusable afterwards


def test_abort_selected_ids(model0):
    engine = EmbeddedEngine(model0, max_batch_size=4)
    reqs = _requests(_prompts(6), 2, SamplingParams(max_new_tokens=20))
    stream = engine.stream(reqs)
    assert engine.abort(["r4", "nope"]) == ["r4"]
    groups = {g[0].request_id: g for g in stream}
    assert set(groups) == {f"r{i}" for i in range(6)}
    assert [s.finish_reason for s in groups["r4"]] == ["abort", "abort"]
    assert groups["r4"][0].response_ids == []
    assert all(s.finish_reason in ("stop", "length") for rid, g in groups.items() if rid != "r4" for s in g)


def test_pause_resume_and_shutdown(model0):
    engine = EmbeddedEngine(model0)
    req = _requests(_prompts(1), 1, SamplingParams(max_new_tokens=3))
    engine.pause()
    with pytest.raises(RuntimeError, match="resume"):
        engine.generate(req)
    engine.resume()
    assert len(engine.generate(req)[0][0].response_ids) == 3
    assert engine.health()
    engine.shutdown()
    assert not engine.health()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(req)


def test_bad_construction_and_requests():
    with pytest.raises(ValueError, match="max_batch_size"):
        EmbeddedEngine(CFG, max_batch_size=0)
    with pytest.raises(FileNotFoundError, match="config.json"):
        EmbeddedEngine("/nonexistent/model")
    with pytest.raises(ValueError, match="--rollout-engine"):
        make_engine("vllm")
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="n must be"):
        RolloutRequest(prompt_ids=[1], n=0, sampling=SamplingParams(max_new_tokens=1), request_id="a")
    engine = EmbeddedEngine(CFG)
    req = RolloutRequest(prompt_ids=[3], n=1, sampling=SamplingParams(max_new_tokens=1), request_id="a")
    with pytest.raises(ValueError, match="duplicate"):
        engine.generate([req, req])


def test_loads_hf_directory(tmp_path, model0):
    """A model directory comes with the ModelArch its caller parsed (start-up's RolloutEngineConfig.arch): the engine
    reads no config.json itself, and refuses a directory without it, or an arch beside a config or a model."""
    model0.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"needs arch=, its ModelArch: ModelArch\.from_hf"):
        EmbeddedEngine(str(tmp_path))
    arch = ModelArch.from_hf(tmp_path)
    with pytest.raises(ValueError, match="pass arch only with a model directory"):
        EmbeddedEngine(model0, arch=arch)
    engine = EmbeddedEngine(str(tmp_path), arch=arch)
    reqs = _requests(_prompts(2), 1, SamplingParams(max_new_tokens=5, temperature=0.0))
    ref = EmbeddedEngine(model0).generate(reqs)
    assert [g[0].response_ids for g in engine.generate(reqs)] == [g[0].response_ids for g in ref]


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["t1", "greedy"])
def test_an_update_mid_stream_recomputes_the_live_rows_cache_under_the_new_weights(model0, temperature):
    """A push lands while rows are generating (a fully async push; SGLang's retract pause): the rows go on with
    their KV recomputed under the new weights, so every token's log-prob is one model's teacher-forced log-prob
    (the old model's before the update, the new one's after) and token_versions says which. Keeping the old K/V
    (in place) would give the new model's tokens over the old model's prefix K/V: neither reference."""
    model1 = _hf_model(1)
    engine = make_engine("embedded", CFG, state_dict=_state(model0))  # its own copy: model0 stays the reference
    short = RolloutRequest(prompt_ids=[5, 6, 7], n=1, request_id="short",
                           sampling=SamplingParams(max_new_tokens=3, temperature=temperature, seed=11))
    long = RolloutRequest(prompt_ids=[8, 9, 10, 11], n=2, request_id="long",
                          sampling=SamplingParams(max_new_tokens=10, temperature=temperature, seed=12))
    groups = {}
    for group in engine.stream([short, long]):
        if not groups:  # 'short' ends after 3 tokens: the push lands between decode steps 3 and 4 of 'long'
            assert group[0].request_id == "short" and len(group[0].response_ids) == 3
            engine.update_weights(model1.named_parameters(), version=1)
        groups[group[0].request_id] = group
    for s in groups["long"]:
        assert len(s.response_ids) > 3, "the case needs tokens after the update"
        assert s.weight_version == 0 and s.token_versions == [0] * 3 + [1] * (len(s.response_ids) - 3)
        old = _teacher_forced_logprobs(model0, s.prompt_ids, s.response_ids)[:3]
        new = _teacher_forced_logprobs(model1, s.prompt_ids, s.response_ids)[3:]
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.cat([old, new]))
        if temperature == 0.0:  # greedy: each token after the update is the new model's argmax
            with torch.no_grad():
                logits = model1(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
            argmax = logits[len(s.prompt_ids) - 1:-1].argmax(-1).tolist()
            assert s.response_ids[3:] == argmax[3:]
    assert groups["short"][0].token_versions == []  # one version: the field stays empty


def _admission_case(engine, temperature: float = 1.0):
    """open_stream with a long request (4 rows, 20 tokens) and a short one (1 row, 2 tokens); added once the short one
    is back, a third (2 rows, 3 tokens), and once that one is back a fourth (1 row, 3 tokens). Returns the groups in
    the order they came out."""
    sampling = SamplingParams(max_new_tokens=20, temperature=temperature, seed=21, stop_token_ids=[])
    long = RolloutRequest(prompt_ids=[5, 6, 7, 8, 9, 10, 11], n=4, request_id="long", sampling=sampling)
    short = RolloutRequest(prompt_ids=[12, 13], n=1, request_id="short",
                           sampling=SamplingParams(max_new_tokens=2, temperature=temperature, seed=22))
    added = RolloutRequest(prompt_ids=[14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], n=2, request_id="added",
                           sampling=SamplingParams(max_new_tokens=3, temperature=temperature, seed=23))
    late = RolloutRequest(prompt_ids=[25, 26], n=1, request_id="late",
                          sampling=SamplingParams(max_new_tokens=3, temperature=temperature, seed=24))
    stream = engine.open_stream([long, short])
    out = []
    for group in stream:
        out.append(group)
        if group[0].request_id == "short":  # a prompt wider than the batch's cache so far
            stream.add([added])
        if group[0].request_id == "added":  # one narrower
            stream.add([late])
    return out


NO_EOS = dict(CFG, eos_token_id=None)
"""CFG without an end-of-sequence token: every row runs to its max_new_tokens."""


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["t1", "greedy"])
def test_continuous_batching_starts_an_added_request_in_the_slots_freed_mid_batch(model0, temperature):
    """Continuous batching (the fully async rollout's refill): the request added after 'short' finished joins the
    batch 'long' is still decoding in (its KV cache prefilled on its own, left-padded to a wider prompt and merged),
    so it is back before 'long'; every token's log-prob is still the teacher-forced one of the same weights, and
    with greedy decoding every token is the reference model's argmax after the tokens before it."""
    state = _state(model0)
    engine = EmbeddedEngine(NO_EOS, state_dict=state, max_batch_size=6, continuous_batching=True)
    groups = _admission_case(engine, temperature)
    assert [g[0].request_id for g in groups] == ["short", "added", "late", "long"]
    assert [len(s.response_ids) for g in groups for s in g] == [2, 3, 3, 3, 20, 20, 20, 20]
    for s in (s for g in groups for s in g):
        torch.testing.assert_close(torch.tensor(s.logprobs),
                                   _teacher_forced_logprobs(model0, s.prompt_ids, s.response_ids),
                                   rtol=0, atol=2e-5)  # fp32: padding and batch shape change summation order only
        if temperature == 0.0:
            with torch.no_grad():
                logits = model0(torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
            assert s.response_ids == logits[len(s.prompt_ids) - 1:-1].argmax(-1).tolist()
    # without continuous_batching (the default) the added rows wait for the batch in progress to end
    chunked = _admission_case(EmbeddedEngine(NO_EOS, state_dict=state, max_batch_size=6), temperature)
    assert [g[0].request_id for g in chunked] == ["short", "long", "added", "late"]
    # stream() runs a batch to its end before taking more rows: the same requests come out in that order
    plain = EmbeddedEngine(NO_EOS, state_dict=state, max_batch_size=6)
    order = [g[0].request_id for g in plain.stream([RolloutRequest(prompt_ids=[1, 2], n=6, request_id="fill",
                                                                   sampling=SamplingParams(max_new_tokens=4)),
                                                    RolloutRequest(prompt_ids=[3], n=1, request_id="next",
                                                                   sampling=SamplingParams(max_new_tokens=1))])]
    assert order == ["fill", "next"]
    # the interface's default (an engine that cannot admit requests into a running stream) says so
    default = RolloutEngine.open_stream(plain, [])
    assert not default.accepts_additions and list(default) == []
    with pytest.raises(RuntimeError, match="accepts_additions"):
        default.add(_requests([[4]], 1, SamplingParams(max_new_tokens=1)))


def test_open_stream_rejects_an_id_in_flight_and_an_abort_stops_added_rows(model0):
    engine = EmbeddedEngine(NO_EOS, state_dict=_state(model0), max_batch_size=6)
    sampling = SamplingParams(max_new_tokens=15, seed=3)
    stream = engine.open_stream(_requests([[5, 6], [7]], 2, sampling, prefix="a"))
    with pytest.raises(ValueError, match="already in flight"):
        stream.add(_requests([[8]], 1, sampling, prefix="a"))
    stream.add(_requests([[8, 9, 10]], 3, sampling, prefix="b"))  # 6 slots: b0's third row waits for one
    first = next(stream)  # a0: every row reaches 15 tokens at the same step, a0 comes out first
    assert first[0].request_id == "a0"
    assert engine.abort() == ["a1", "b0"]  # a1 finished but is not out yet
    groups = {g[0].request_id: g for g in stream}
    assert sorted(groups) == ["a1", "b0"]
    assert [s.finish_reason for s in groups["a1"]] == ["length"] * 2
    assert [(s.finish_reason, len(s.response_ids)) for s in groups["b0"]] == [("length", 15)] * 2 + [("abort", 0)]
