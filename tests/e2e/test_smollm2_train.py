"""The real SmolLM2-135M-Instruct trained by the whole system: two DAPO steps of `python -m megatron_dapo.train` on
its real weights (the packaged GGUF de-quantized to fp32, tests/real_model.py), real chat-template prompts
(data/arith-words-train.jsonl), the embedded engine, a checkpoint and the HF export at the end.

What must hold:
- each step trains (grad norm > 0) and the engine's sampling log-probs equal the actor's for the same tokens
  (`mismatch/logprob_abs_diff_max`, every response token of the step, < LOGPROB_ATOL): at step 1 from the same
  --hf-checkpoint, at step 2 after the trainer pushed step 1's weights into the engine;
- the exported HF directory loads in transformers and scores real chat text like the actor of the final checkpoint
  (log-probs and entropies, < LOGPROB_ATOL), and unlike the base model (> 20 x LOGPROB_ATOL: the weights moved).

Why step 2's equality shows the push: Adam's first update moves every weight with a gradient by lr x sign(g)
(bias-corrected m / sqrt(v) = g / |g|) and its second by at most about lr again, so step 1 alone moved the policy by
about half of what the export differs from the base; an engine left on the base weights at step 2 would be off by
~10 x LOGPROB_ATOL or more, not within it.

Cost: 74 s on 2 CPU cores shared with other jobs (load ~4), the run 61 s of it (printed by the test; up to 2.5 min
at load ~8); 2 prompts x 4 samples x 8 tokens a step, after the one-time GGUF conversion of tests/real_model.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from tests.conftest import REPO, train_env
from tests.real_model import CHATS, LOGPROB_ATOL, SMOLLM2_MARKS, chat_ids, hf_logprobs, smollm2_hf_dir
from tests.rewards import PARITY_REWARD

pytestmark = SMOLLM2_MARKS

MOVED = 20 * LOGPROB_ATOL
"""The least max |log p_export - log p_base| over CHATS that shows two steps changed the weights (module docstring)."""


def _train(hf_dir, run) -> float:
    """Two DAPO steps on SmolLM2; returns their wall time in seconds."""
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(hf_dir),
           "--prompt-data", str(REPO / "data" / "arith-words-train.jsonl"), "--max-prompt-length", "128",
           "--rollout-engine", "embedded", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
           "--no-dynamic-sampling", *PARITY_REWARD,  # the length parity differs inside a group: every step moves
           "--max-response-length", "8", "--overlong-buffer-length", "4", "--global-batch-size", "8",
           "--lr", "1e-5", "--weight-decay", "0.0", "--num-steps", "2", "--seed", "1",
           "--log-dir", str(run / "log"), "--save", str(run / "ckpt"), "--export-hf", str(run / "hf"),
           "--no-wandb", "--no-progress"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return time.monotonic() - t0


def _final_actor_scores(hf_dir, ckpt, samples) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probs and entropies of `samples`' response tokens from the Megatron actor holding the run's last
    checkpoint (the weights the export was written from)."""
    from megatron_dapo.actor import ActorConfig, MegatronActor, destroy_parallel, init_parallel
    from megatron_dapo.checkpoint.dist_load import load_model_weights
    from megatron_dapo.models.hf_config import ModelArch

    arch = ModelArch.from_hf(hf_dir)
    layout = init_parallel(seed=0)
    try:
        actor = MegatronActor(arch, ActorConfig(lr=1e-5, max_tokens_per_micro_batch=256), layout)
        load_model_weights(actor.module, ckpt, arch)
        return actor.compute_log_probs(samples, with_entropy=True)
    finally:
        destroy_parallel()


def test_two_dapo_steps_push_to_the_engine_and_export_the_actor(tmp_path):
    from megatron_dapo.actor import TrainSample

    hf_dir = smollm2_hf_dir()
    run = tmp_path / "run"
    wall = _train(hf_dir, run)
    records = [json.loads(line) for line in (run / "log" / "metrics.jsonl").read_text().splitlines() if line]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["train/grad_norm"] > 0 and r["mismatch/tokens"] > 0, r
        assert r["mismatch/logprob_abs_diff_max"] < LOGPROB_ATOL, r  # step 2: the engine holds step 1's weights

    tokenizer = AutoTokenizer.from_pretrained(run / "hf")
    samples = [TrainSample(tokens=chat_ids(tokenizer, user, answer), prompt_len=len(chat_ids(tokenizer, user)))
               for user, answer in CHATS]
    actor_logp, actor_entropy = _final_actor_scores(hf_dir, run / "ckpt", samples)
    exported = LlamaForCausalLM.from_pretrained(run / "hf", dtype=torch.float32).eval()
    base = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    worst, moved = 0.0, 0.0
    for s, logp, entropy in zip(samples, actor_logp, actor_entropy, strict=True):
        want_logp, want_entropy = hf_logprobs(exported, s.tokens, s.prompt_len, with_entropy=True)
        torch.testing.assert_close(logp, want_logp, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(entropy, want_entropy, atol=LOGPROB_ATOL, rtol=0)
        worst = max(worst, float((logp - want_logp).abs().max()), float((entropy - want_entropy).abs().max()))
        moved = max(moved, float((hf_logprobs(base, s.tokens, s.prompt_len) - want_logp).abs().max()))
    assert moved > MOVED, f"the exported weights score like the base model (max |diff| {moved:.2e})"
    mismatch = max(r["mismatch/logprob_abs_diff_max"] for r in records)
    print(f"SmolLM2 2 DAPO steps: {wall:.0f} s; engine vs actor max |dlogp| {mismatch:.2e}; export vs final actor "
          f"{worst:.2e}; export vs base {moved:.2e}")
