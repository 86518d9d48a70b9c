"""Megatron-style command-line flags of `python -m megatron_dapo.train`, grouped by component.

Flag names follow Megatron-LM where one exists (--tensor-model-parallel-size, --lr, --clip-grad,
--save-interval, ...) and slime / verl's DAPO recipe for the RL ones (--n-samples-per-prompt,
--rollout-batch-size, --clip-ratio-high, --overlong-buffer-length, ...). Values are validated by the
config dataclasses they fill, whose errors name the flag.
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m megatron_dapo.train",
        description="DAPO (arXiv 2503.14476) on a Megatron-core actor with SGLang or embedded rollouts. "
                    "Launch with torchrun for TP/PP/DP; a single process works for small models.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model and checkpoints")
    g.add_argument("--hf-checkpoint", required=True,
                   help="HF Qwen2/Qwen2.5 directory (config.json, safetensors, tokenizer): the initial "
                        "policy and the architecture")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --hf-checkpoint)")
    g.add_argument("--mcore-checkpoint", default=None,
                   help="deprecated: pass `checkpoint_convert hf-to-mcore` output as --load instead")
    g.add_argument("--load", default=None,
                   help="resume from this checkpoint directory (written by --save; the newest step is taken), "
                        "or start from `checkpoint_convert hf-to-mcore` output (torch_dist, any TP/PP; model "
                        "weights only, iteration 0)")
    g.add_argument("--save", default=None, help="checkpoint directory (model, optimizer, scheduler, RNG, "
                                                "sampler, step)")
    g.add_argument("--export-hf", default=None,
                   help="at the end, write the trained policy here as an HF checkpoint (safetensors, config, "
                        "tokenizer); with --load of a finished run and the same --num-steps it only exports")
    g.add_argument("--save-interval", type=int, default=0,
                   help="checkpoint every N steps (0 = only at the end)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard optimizer state over data-parallel ranks (megatron-core distributed "
                        "optimizer)")

    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-steps", type=int, default=0, help="linear warmup, in optimizer steps")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global grad-norm clip (0 = off)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("batching")
    g.add_argument("--num-steps", "--num-rollout", dest="num_steps", type=int, required=True,
                   help="training steps (one rollout batch each)")
    g.add_argument("--rollout-batch-size", type=int, default=512, help="prompt groups kept per step")
    g.add_argument("--n-samples-per-prompt", type=int, default=16, help="G, responses per prompt")
    g.add_argument("--global-batch-size", type=int, default=0,
                   help="responses per optimizer step (DAPO: 32 prompts x 16 = 512); 0 = the whole "
                        "rollout batch (one update per step)")
    g.add_argument("--max-tokens-per-micro-batch", type=int, default=8192,
                   help="token budget of one padded micro-batch, rows x longest row (dynamic batch size)")
    g.add_argument("--use-fused-logprob", action=argparse.BooleanOptionalAction, default=True,
                   help="fused vocab-parallel log-prob/entropy kernel (megatron_dapo.ops) in the loss")
    g.add_argument("--params-dtype", choices=["float32", "bfloat16"], default=None,
                   help="actor parameter dtype (bf16 keeps fp32 main params); default: bf16 on GPU, "
                        "fp32 on CPU")

    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-engine", choices=["embedded", "sglang"], default=None,
                   help="default: sglang when CUDA is available, else the embedded CPU engine")
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--rollout-top-p", type=float, default=1.0)
    g.add_argument("--rollout-top-k", type=int, default=-1)
    g.add_argument("--max-response-length", type=int, default=20480, help="L_max, new tokens per response")
    g.add_argument("--max-prompt-length", type=int, default=2048, help="longer prompts are skipped at load")
    g.add_argument("--over-sample-factor", type=float, default=1.0,
                   help="prompts asked per generation round = factor x groups still needed")
    g.add_argument("--sglang-num-servers", type=int, default=1)
    g.add_argument("--sglang-tp-size", type=int, default=1, help="tensor parallel size of each SGLang server")
    g.add_argument("--sglang-base-port", type=int, default=30000)
    g.add_argument("--sglang-host", default="127.0.0.1")
    g.add_argument("--sglang-extra-args", default="", help="extra flags passed to sglang.launch_server")
    g.add_argument("--sglang-python", default=None,
                   help="python that runs sglang.launch_server (default: this one; on CPU: .venv-sglang/bin/python "
                        "from `make sglang-env`)")
    g.add_argument("--sglang-gpus", default=None,
                   help="CUDA_VISIBLE_DEVICES of the launched servers, e.g. 4,5,6,7 (apart from the "
                        "actor's GPUs)")
    g.add_argument("--sglang-server-urls", nargs="+", default=None,
                   help="attach to running SGLang servers instead of launching them (multi-node rollouts)")
    g.add_argument("--sglang-max-concurrency", type=int, default=256, help="requests in flight")
    g.add_argument("--weight-sync-mode", choices=["tensor", "distributed", "disk"], default=None,
                   help="tensor: colocated (shared memory); distributed: separate GPUs (NCCL group with "
                        "the servers); disk: safetensors + update_weights_from_disk. Default: tensor for "
                        "launched servers, distributed for --sglang-server-urls")
    g.add_argument("--weight-sync-bucket-mb", type=int, default=512, help="flattened bucket size")
    g.add_argument("--weight-sync-master-addr", default="127.0.0.1",
                   help="address of global rank 0 as the servers see it (distributed mode)")
    g.add_argument("--weight-sync-master-port", type=int, default=29650)

    g = p.add_argument_group("DAPO")
    g.add_argument("--clip-ratio-low", type=float, default=0.2, help="eps_low")
    g.add_argument("--clip-ratio-high", type=float, default=0.28, help="eps_high (Clip-Higher)")
    g.add_argument("--clip-ratio-c", type=float, default=None, help="dual-clip constant (off by default)")
    g.add_argument("--loss-agg-mode", choices=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"],
                   default="token-mean")
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=True,
                   help="drop groups whose accuracy is all 0 or all 1 and keep sampling")
    g.add_argument("--max-num-gen-batches", type=int, default=0,
                   help="generation rounds per step (0 = unlimited)")
    g.add_argument("--on-gen-exhausted", choices=["error", "partial"], default="error")
    g.add_argument("--overlong-buffer-length", type=int, default=4096, help="L_cache of the soft penalty")
    g.add_argument("--overlong-penalty-factor", type=float, default=1.0)
    g.add_argument("--overlong-filter", action="store_true", help="mask truncated responses out of the loss")
    g.add_argument("--reward-fn", default="math_dapo",
                   help="math_dapo | math_dapo_boxed | dotted path 'pkg.mod:fn' with signature "
                        "fn(response: str, ground_truth: str) -> RewardResult(score, acc, pred)")

    g = p.add_argument_group("data")
    g.add_argument("--prompt-data", required=True, help="training prompts: DAPO-format parquet or jsonl")
    g.add_argument("--eval-prompt-data", default=None, help="held-out prompts for avg@k (parquet or jsonl)")
    g.add_argument("--prompt-format", choices=["chat", "raw"], default="chat",
                   help="chat: apply the tokenizer's chat template to the prompt messages; raw: use the text")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-interval", type=int, default=0, help="evaluate every N steps (0 = off)")
    g.add_argument("--n-samples-per-eval-prompt", type=int, default=4, help="k of avg@k")
    g.add_argument("--eval-temperature", type=float, default=1.0)
    g.add_argument("--eval-max-prompts", type=int, default=0,
                   help="evaluate on the first N prompts (0 = all)")

    g = p.add_argument_group("logging")
    g.add_argument("--log-dir", default="runs/dapo", help="metrics.jsonl, wandb files and the PNG report")
    g.add_argument("--wandb-project", default=None, help="online wandb when WANDB_API_KEY is set too")
    g.add_argument("--wandb-run-name", default=None)
    g.add_argument("--no-wandb", action="store_true")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p
