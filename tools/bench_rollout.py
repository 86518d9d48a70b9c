"""Rollout throughput of the embedded CPU engine against HF `generate`, side by side in one run.

Both sample the same tiny random Qwen2 at temperature 1 (no top-p / top-k) from the same prompts for
the same number of new tokens (eos disabled, so every row runs to the end). The embedded engine also
returns per-token log-probs, which `generate` does here only with output_scores (costlier).

    python tools/bench_rollout.py --hidden 64 --layers 2 --batch 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64, help="prompts x samples generated together")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each (best is reported)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.rollout.embedded import EmbeddedEngine
    from megatron_dapo.rollout.types import RolloutRequest, SamplingParams

    config = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.prompt_len + args.new_tokens + 8, tie_word_embeddings=True,
                         eos_token_id=None, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt_len))
    engine = EmbeddedEngine(model, max_batch_size=args.batch, seed=0)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    requests = [RolloutRequest(prompt_ids=p.tolist(), n=1, sampling=sampling, request_id=f"r{i}")
                for i, p in enumerate(prompts)]
    attention = torch.ones_like(prompts)

    def run_engine() -> int:
        return sum(len(g[0].response_ids) for g in engine.generate(requests))

    @torch.no_grad()
    def run_generate(with_scores: bool) -> int:
        out = model.generate(input_ids=prompts, attention_mask=attention, do_sample=True, temperature=1.0,
                             top_k=0, top_p=1.0, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             pad_token_id=0, output_scores=with_scores, return_dict_in_generate=with_scores)
        seqs = out.sequences if with_scores else out
        return int(seqs[:, args.prompt_len:].numel())

    def best(fn) -> tuple[float, int]:
        fn()  # warm-up
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            tokens = fn()
            runs.append((time.perf_counter() - t0, tokens))
        return min(runs)

    results = {}
    for name, fn in (("embedded engine (+ log-probs)", run_engine),
                     ("HF generate", lambda: run_generate(False)),
                     ("HF generate + scores", lambda: run_generate(True))):
        seconds, tokens = best(fn)
        results[name] = tokens / seconds
    base = results["HF generate"]
    print(f"tiny Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}, batch {args.batch}, "
          f"{args.new_tokens} new tokens, {args.threads} thread(s), best of {args.repeats}")
    print(f"{'variant':34s} {'tokens/s':>10s} {'x HF generate':>14s}")
    for name, tps in results.items():
        print(f"{name:34s} {tps:10.0f} {tps / base:14.2f}")
    engine.shutdown()
    return results


if __name__ == "__main__":
    main()
