"""avg@k and pass@k of an HF checkpoint on an AIME-style dataset, with any rollout engine.

    python tools/eval.py --model runs/tiny-base/model --data runs/tiny-base/eval.jsonl --k 4
    python tools/eval.py --model Qwen2.5-32B-DAPO --data data/aime-2024-dapo-format.parquet --k 32 \\
        --engine sglang --eval-temperature 1.0 --eval-top-p 0.7 --eval-max-response-length 20480  # DAPO's AIME avg@32

The sampling flags have the trainer's names (--eval-temperature, --eval-top-p, --eval-max-response-length);
--temperature, --top-p and --max-new-tokens are the same flags under their older names.

Prints one json object (avg@k, pass@1..k, mean response length, prompts) and writes it to --output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF checkpoint directory (weights, config, tokenizer)")
    ap.add_argument("--data", required=True,
                    help="parquet / jsonl prompts (DAPO schema or problem/answer rows)")
    ap.add_argument("--k", type=int, default=32, help="samples per prompt (avg@k)")
    ap.add_argument("--pass-k", type=int, nargs="*", default=None, help="pass@k values (default: 1 and k)")
    ap.add_argument("--engine", choices=["embedded", "sglang"], default="embedded")
    ap.add_argument("--eval-temperature", "--temperature", dest="temperature", type=float, default=1.0,
                    help="DAPO's AIME avg@32: 1.0")
    ap.add_argument("--eval-top-p", "--top-p", dest="top_p", type=float, default=1.0, help="DAPO's AIME avg@32: 0.7")
    ap.add_argument("--eval-max-response-length", "--max-new-tokens", dest="max_new_tokens", type=int, default=1024,
                    help="new tokens per response (DAPO's AIME avg@32: 20480)")
    ap.add_argument("--max-prompt-length", type=int, default=4096)
    ap.add_argument("--prompt-format", choices=["chat", "raw"], default="chat")
    ap.add_argument("--reward-fn", default="math_dapo")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sglang-num-servers", type=int, default=1)
    ap.add_argument("--sglang-tp-size", type=int, default=1)
    ap.add_argument("--sglang-base-port", type=int, default=30000)
    ap.add_argument("--output", default=None, help="also write the json result here")
    return ap


def eval_sampling(args: argparse.Namespace, stop_token_ids: tuple[int, ...] = ()):
    """The SamplingParams of every evaluation request, from the sampling flags."""
    from megatron_dapo.rollout.types import SamplingParams

    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              stop_token_ids=stop_token_ids)
    except ValueError as e:
        raise SystemExit(f"{e} (set by --eval-max-response-length, --eval-temperature, --eval-top-p)") from None


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = build_parser().parse_args(argv)
    if args.k < 1:
        raise SystemExit("--k must be >= 1")
    pass_ks = sorted(set(args.pass_k if args.pass_k else (1, args.k)))
    if any(not 1 <= k <= args.k for k in pass_ks):
        raise SystemExit(f"--pass-k values must be in [1, --k={args.k}], got {pass_ks}")

    from transformers import AutoTokenizer

    from megatron_dapo.data.prompt_set import load_prompt_set
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.rollout import make_engine
    from megatron_dapo.rollout.evaluation import evaluate

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompt_set(args.data, tokenizer, prompt_format=args.prompt_format,
                              max_prompt_length=args.max_prompt_length, limit=args.limit)
    eos = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    sampling = eval_sampling(args, eos)
    if args.engine == "embedded":
        engine = make_engine("embedded", args.model, arch=ModelArch.from_hf(args.model), tokenizer=tokenizer,
                             seed=args.seed)
    else:
        from megatron_dapo.rollout.sglang.server import ServerConfig

        server = ServerConfig(model_path=args.model, num_servers=args.sglang_num_servers,
                              tp_per_server=args.sglang_tp_size, base_port=args.sglang_base_port)
        engine = make_engine("sglang", server)
    t0 = time.perf_counter()
    with engine:
        result = evaluate(engine, prompts, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                          get_reward_fn(args.reward_fn), n_samples=args.k, sampling=sampling,
                          pass_ks=pass_ks, seed=args.seed)
    result = {key.removeprefix("eval/"): value for key, value in result.items()}
    result.update(prompts=float(len(prompts)), seconds=time.perf_counter() - t0)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return result


if __name__ == "__main__":
    main()
