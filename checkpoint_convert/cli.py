"""`python -m checkpoint_convert {hf-to-mcore,mcore-to-hf} ...`: flags map 1:1 onto the config dataclasses."""

from __future__ import annotations

import argparse
import sys
import time

from checkpoint_convert.hf_to_mcore import HfToMcoreConfig, hf_to_mcore
from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf
from megatron_dapo.weights.mcore_format import DTYPES


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoint_convert",
        description="Convert Qwen2/Qwen2.5 checkpoints between HF safetensors and megatron-dapo's Megatron "
        "format (per-rank safetensors, any TP/PP), streaming one parameter at a time.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF directory -> Megatron checkpoint for a TP/PP layout")
    a.add_argument("--hf-path", required=True, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--save", required=True, help="output Megatron checkpoint directory")
    a.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    a.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    a.add_argument("--dtype", choices=sorted(DTYPES), help="cast to this dtype (default: keep the HF dtype)")
    a.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    a.add_argument(
        "--dry-run",
        action="store_true",
        help="print Megatron args and per-rank tensor shapes from config.json only; write nothing",
    )

    b = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> HF safetensors shards + index + config")
    b.add_argument("--load", required=True, help="Megatron checkpoint directory written by hf-to-mcore")
    b.add_argument("--save", required=True, help="output HF model directory")
    b.add_argument(
        "--hf-config", help="config.json (or its dir) to write; checked against the checkpoint args"
    )
    b.add_argument("--tokenizer-path", help="copy tokenizer files from here (default: <load>/hf_assets)")
    b.add_argument("--max-shard-size", default="5GB", help="largest HF shard, e.g. 5GB, 500MB (default 5GB)")
    b.add_argument("--dtype", choices=sorted(DTYPES), help="cast to this dtype (default: keep)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = vars(build_parser().parse_args(argv))
    command = ns.pop("command")
    start = time.perf_counter()
    try:
        if command == "hf-to-mcore":
            cfg = HfToMcoreConfig(**ns)
            hf_to_mcore(cfg)
            done = "dry run" if cfg.dry_run else f"wrote {cfg.save} (tp={cfg.tp}, pp={cfg.pp})"
        else:
            cfg2 = McoreToHfConfig(**ns)
            names = mcore_to_hf(cfg2)
            done = f"wrote {cfg2.save} ({len(names)} tensors)"
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # CheckpointError is a ValueError
        print(f"checkpoint_convert {command}: error: {e}", file=sys.stderr)
        return 1
    print(f"checkpoint_convert {command}: {done} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
