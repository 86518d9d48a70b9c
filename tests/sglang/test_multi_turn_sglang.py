"""Multi-turn conversations on a real CPU SGLang 0.5.23 server: token in, token out, turn by turn.

The server loads the tokenizer (stop strings are matched on its decoded text, so --skip-tokenizer-init is off) and
is fed `input_ids` only. Each /generate body sent is recorded where the engine builds it: every turn's `input_ids`
must be the prompt followed by every id of the conversation before it, the final sample's ids must be each turn's
output ids as the server returned them interleaved with the tool's ids exactly as the template tokenized them once,
and every generated token's log-prob must be the teacher-forced HF log-prob of the final sequence (the sequence the
actor trains on): a dropped separator, a re-tokenized turn or a shifted id fails it."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from megatron_dapo.data.synthetic import build_char_tokenizer
from megatron_dapo.rollout.multi_turn import MultiTurnConfig, ToolRolloutEngine
from megatron_dapo.rollout.sglang import engine as sglang_engine
from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.sglang.real_server import MARKS, cpu_server_config, free_port, max_logprob_error
from tests.unit.rollout.test_multi_turn import LengthRunner, ParenTemplate

pytestmark = MARKS
TOKENIZER = build_char_tokenizer()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_multi_turn")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(TOKENIZER), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=TOKENIZER.eos_token_id)).eval()
    model.save_pretrained(root / "model")
    TOKENIZER.save_pretrained(root / "model")
    cfg = cpu_server_config(root, skip_tokenizer_init=False)
    engine = SGLangEngine(cfg, client=ClientConfig(max_concurrency=16, control_timeout_s=120, sync_backend="gloo",
                                                   sync_master_port=free_port(), disk_dir=str(root / "weights")))
    yield engine, model
    engine.shutdown()


@pytest.mark.parametrize("schedule", ["continuous", "rounds"])
def test_every_turn_is_fed_and_kept_as_token_ids(served, monkeypatch, schedule):
    """Both schedules: continuous adds each conversation's next turn to the running stream as its tool returns."""
    engine, model = served
    sent: dict[str, list[int]] = {}
    build = sglang_engine.generate_payload

    def recording(req, index, **kw):
        body = build(req, index, **kw)
        sent[req.request_id] = list(body["input_ids"])
        return body

    monkeypatch.setattr(sglang_engine, "generate_payload", recording)
    runner = LengthRunner()
    tools = ToolRolloutEngine(engine, template=ParenTemplate(), tokenizer=TOKENIZER, tools=runner,
                              config=MultiTurnConfig(max_turns=5, schedule=schedule))
    requests = [RolloutRequest(prompt_ids=TOKENIZER.encode(f"{i}*{i}="), n=4, request_id=f"m{i}",
                               sampling=SamplingParams(max_new_tokens=48, seed=20 + i,
                                                       stop_token_ids=(TOKENIZER.eos_token_id,)))
               for i in range(4)]
    samples = [s for g in tools.generate(requests) for s in g]
    assert sum(s.tool_calls for s in samples) >= 2, [(s.finish_reason, s.tool_calls) for s in samples]
    for s in sorted(samples, key=lambda s: (s.request_id, s.index)):
        mask = s.generated()
        done = 0
        for t in range(s.tool_calls + 1):
            rid = f"{s.request_id}#{s.index}.t{t}"
            if rid not in sent:  # the budget ran out in the last tool output: no turn after it
                assert t == s.tool_calls and s.finish_reason == "length" and done == len(s.response_ids)
                break
            assert sent[rid] == s.prompt_ids + s.response_ids[:done], f"turn {t} of {s.request_id}[{s.index}]"
            end = done
            while end < len(mask) and mask[end] == 1:
                end += 1
            if t < s.tool_calls:  # the turn ended at the token completing the stop string, then the tool's ids
                turn_text = TOKENIZER.decode(s.response_ids[done:end])
                assert turn_text.endswith(")") and ")" not in TOKENIZER.decode(s.response_ids[done:end - 1])
                tool = ParenTemplate().output_ids(TOKENIZER, str(len(turn_text)))
                got = s.response_ids[end:end + len(tool)]
                assert got == tool[:len(got)] and all(m == 0 for m in mask[end:end + len(got)])
                end += len(got)
            done = end
        assert done == len(s.response_ids)
    generated = [s for s in samples if s.finish_reason != "abort"]
    for s in generated:  # the server's log-probs of its tokens, read in the final sequence
        keep = torch.tensor(s.generated(), dtype=torch.bool)
        with torch.no_grad():
            lp = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0].log_softmax(-1)
        ref = lp[len(s.prompt_ids) - 1:-1].gather(1, torch.tensor(s.response_ids).unsqueeze(1)).squeeze(1)
        assert (ref - torch.tensor(s.logprobs))[keep].abs().max() < 1e-4
    assert max_logprob_error(model, [s for s in generated if not s.tool_calls]) < 1e-4
