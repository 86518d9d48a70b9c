"""The real SmolLM2-135M-Instruct (GGUF Q4_1, de-quantized to fp32) through the system: conversion both ways,
Megatron log-probs vs HF on real chat text, and the embedded engine's greedy decoding vs HF generate.

Real activations, the real tokenizer (special tokens <|im_start|> 1 / <|im_end|> 2, pad = eos), its chat template
(a default system turn when none is given) and EOS stopping at <|im_end|>. Tolerance LOGPROB_ATOL = 1e-4 per token,
fp32 on CPU; measured max |difference|: Megatron (the hf-to-mcore checkpoint loaded as --load) vs HF teacher-forced
1.7e-5 over 47 answer tokens; the embedded engine's per-token log-probs vs HF's of the same tokens 3.7e-5.
Cost: ~26 s (two 540 MB conversions, one actor, 3 x 40 greedy tokens on two engines) after the one-time ~25 s
GGUF conversion of tests/real_model.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.real_model import CHATS, EOS, LOGPROB_ATOL, SMOLLM2_MARKS, chat_ids, hf_logprobs, smollm2_hf_dir
from tests.torchrun import REPO

pytestmark = SMOLLM2_MARKS

PROMPTS = ["What is 7 plus 5?", "Name three colors.", "Lucy has 3 apples and buys 4 more. How many apples?"]


@pytest.fixture(scope="module")
def hf_dir():
    return smollm2_hf_dir()


@pytest.fixture(scope="module")
def tokenizer(hf_dir):
    return AutoTokenizer.from_pretrained(hf_dir)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    return LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def round_trip(hf_dir, tmp_path_factory):
    """(torch_dist dir, exported HF dir): hf-to-mcore then mcore-to-hf through the CLI, TP1."""
    from checkpoint_convert.cli import main as convert

    tmp = tmp_path_factory.mktemp("smollm2")
    mc, back = tmp / "mcore", tmp / "hf"
    assert convert(["hf-to-mcore", "--hf-path", str(hf_dir), "--save", str(mc)]) == 0
    assert convert(["mcore-to-hf", "--load", str(mc), "--save", str(back)]) == 0
    return mc, back


def test_tokenizer_special_tokens(tokenizer):
    """What the rest of the system relies on: eos = pad = <|im_end|> (2), and the template brings its own tokens."""
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (EOS, EOS, 1)
    ids = chat_ids(tokenizer, "Hi")
    assert ids[0] == 1 and ids.count(1) == 3  # system, user, assistant turns; no extra BOS from encode
    assert tokenizer.decode(ids[-4:]) == "<|im_start|>assistant\n"  # "assistant" is two tokens


def test_prompt_set_renders_the_chat_template(tokenizer):
    """The run's prompts (data/arith-words-heldout.jsonl through load_prompt_set) are exactly what the tokenizer's
    own chat template gives, with one <|im_start|> per turn and no extra BOS."""
    from megatron_dapo.data import load_prompts
    from megatron_dapo.data.prompt_set import load_prompt_set

    path = REPO / "data" / "arith-words-heldout.jsonl"
    prompts = load_prompt_set(str(path), tokenizer, prompt_format="chat", max_prompt_length=128)
    records = load_prompts(path)
    assert len(prompts) == len(records) == 64
    for prompt, record in zip(prompts, records, strict=True):
        want = tokenizer.apply_chat_template(record.messages, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want  # transformers 5 returns a BatchEncoding
        assert prompt.prompt_ids == list(want)
        assert prompt.prompt_ids.count(1) == 3 and EOS not in prompt.prompt_ids[-4:]


@pytest.mark.parametrize("tp, pp", [pytest.param(3, 2, id="tp3-pp2"), pytest.param(2, 1, id="tp2")])
def test_layout_check(hf_dir, tp, pp, capsys):
    """9 heads / 3 KV heads: TP3 x PP2 fits; TP2 does not, and the converter says which flag to change."""
    from checkpoint_convert.cli import main as convert

    argv = ["hf-to-mcore", "--hf-path", str(hf_dir), "--save", "unused", "--tp", str(tp), "--pp", str(pp),
            "--dry-run"]
    rc = convert(argv)
    if tp == 2:
        assert rc != 0
        assert "num_attention_heads (9) is not divisible by --tensor-model-parallel-size (2)" in capsys.readouterr().err
    else:
        assert rc == 0


def test_round_trip_is_bit_exact_and_loads(hf_dir, round_trip, tokenizer):
    _, back = round_trip
    want = load_file(str(hf_dir / "model.safetensors"))
    got = {}
    for shard in sorted(back.glob("*.safetensors")):
        got.update(load_file(str(shard)))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    config = json.loads((back / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["tie_word_embeddings"]) == ("llama", 49152, True)
    again = AutoTokenizer.from_pretrained(back)
    assert chat_ids(again, *CHATS[0]) == chat_ids(tokenizer, *CHATS[0])
    assert (again.eos_token_id, again.pad_token_id) == (EOS, EOS)


def test_megatron_logprobs_equal_hf(round_trip, hf_dir, hf_model, tokenizer):
    """The torch_dist checkpoint loaded as `--load` (trainer.build_actor's path) scores real chat text like HF."""
    from megatron_dapo.actor import ActorConfig, MegatronActor, TrainSample, destroy_parallel, init_parallel
    from megatron_dapo.checkpoint.dist_load import load_model_weights
    from megatron_dapo.models.hf_config import ModelArch

    mc, _ = round_trip
    arch = ModelArch.from_hf(hf_dir)
    samples = []
    for user, answer in CHATS:
        prompt = chat_ids(tokenizer, user)
        samples.append(TrainSample(tokens=chat_ids(tokenizer, user, answer), prompt_len=len(prompt)))
    layout = init_parallel(seed=0)
    try:
        actor = MegatronActor(arch, ActorConfig(lr=1e-5, max_tokens_per_micro_batch=256), layout)
        load_model_weights(actor.module, mc, arch)
        got = actor.compute_log_probs(samples)
    finally:
        destroy_parallel()
    diffs = []
    for sample, lp in zip(samples, got, strict=True):
        want = hf_logprobs(hf_model, sample.tokens, sample.prompt_len)
        diffs.append(float((lp.float() - want).abs().max()))
        torch.testing.assert_close(lp.float(), want, atol=LOGPROB_ATOL, rtol=0)
    tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    print(f"max |logp_megatron - logp_hf| = {max(diffs):.2e} over {tokens} tokens")


def test_embedded_engine_greedy_equals_hf_generate(round_trip, hf_model, tokenizer):
    """From the exported directory: the same greedy tokens as HF generate, a stop at <|im_end|>, HF's log-probs."""
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.rollout.embedded import EmbeddedEngine
    from megatron_dapo.rollout.types import RolloutRequest, SamplingParams

    _, back = round_trip
    max_new = 40
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    engine = EmbeddedEngine(str(back), arch=ModelArch.from_hf(back), tokenizer=tokenizer, max_batch_size=8)
    assert EOS in engine.eos_ids
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    requests = [RolloutRequest(request_id=f"p{i}", prompt_ids=ids, n=1, sampling=sampling)
                for i, ids in enumerate(prompts)]
    samples = {s.request_id: s for group in engine.generate(requests) for s in group}
    engine.shutdown()
    stopped, diffs = 0, []
    for i, ids in enumerate(prompts):
        sample = samples[f"p{i}"]
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=max_new, do_sample=False, eos_token_id=EOS, pad_token_id=EOS)
        want = out[0, len(ids):].tolist()
        assert sample.response_ids == want, (tokenizer.decode(sample.response_ids), tokenizer.decode(want))
        if sample.finish_reason == "stop":
            stopped += 1
            assert sample.response_ids[-1] == EOS and EOS not in sample.response_ids[:-1]
        else:
            assert sample.finish_reason == "length" and len(sample.response_ids) == max_new
        ref = hf_logprobs(hf_model, ids + sample.response_ids, len(ids))
        diffs.append(float((torch.tensor(sample.logprobs) - ref).abs().max()))
        torch.testing.assert_close(torch.tensor(sample.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
    assert stopped >= 1  # at least one answer ends with <|im_end|> within max_new tokens
    print(f"max |logp_embedded - logp_hf| = {max(diffs):.2e}; {stopped} of {len(prompts)} stopped at <|im_end|>")
