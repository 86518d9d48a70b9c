"""The first run on a GPU machine, one part at a time (tools/gpu_smoke.sh runs every part under its own
time limit, then `report`). Each part writes OUT/<part>.json; `report` merges them into OUT/gpu_smoke.json
and OUT/gpu_smoke.md.

    python tools/gpu_smoke.py hf_logits --out runs/gpu_smoke   # tiny Qwen2 from HF weights vs HF logits
    python tools/gpu_smoke.py trainer --out runs/gpu_smoke     # 3 demo DAPO steps on CUDA/NCCL vs the CPU run
    python tools/gpu_smoke.py kernels --out runs/gpu_smoke     # log-prob/entropy kernels at V=152064 vs fp64
    python tools/gpu_smoke.py scale --out runs/gpu_smoke       # ~1.5B Qwen2: memory, tokens/s, MFU
    python tools/gpu_smoke.py colocate --out runs/gpu_smoke    # ~1.5B actor's phase switch: resident memory
    python tools/gpu_smoke.py ipc --out runs/gpu_smoke         # a tensor-mode bucket opened by a 2nd process
    python tools/gpu_smoke.py report --out runs/gpu_smoke

--dry runs the same plumbing with tiny sizes on CPU (gloo, the torch kernel backend): the test of this
script, not a measurement. The actor's layers are megatron-core's local spec unless transformer_engine
imports: TE's wheels are far over the 64 MiB that travels with the working tree to the GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

PARTS = ("hf_logits", "trainer", "kernels", "scale", "colocate", "ipc")
# bf16 dense tensor-core peak per GPU (FLOP/s), by a substring of torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12}
QWEN2_5_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                    num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                    tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, model_type="qwen2")
SIZES = {  # full: one H200 (141 GB), a few minutes per part; dry: a few seconds on 2 CPU cores
    False: dict(hf=dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2), hf_tokens=(2, 64),
                base=["--sft-steps", "60", "--num-train", "2000", "--num-eval", "16"],
                demo=["--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--max-response-length", "40",
                      "--global-batch-size", "64"],
                vocab=152064, check_rows=128, time_rows=4096,
                scale=QWEN2_5_1_5B, budgets=(8192, 16384), row_len=2048, steps=3),
    True: dict(hf=dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2), hf_tokens=(2, 9),
               base=["--sft-steps", "3", "--num-train", "200", "--num-eval", "4", "--hidden-size", "32",
                     "--ffn-hidden-size", "64", "--sft-batch-size", "8", "--max-response-length", "8"],
               demo=["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--max-response-length", "8",
                     "--global-batch-size", "8"],
               vocab=1000, check_rows=8, time_rows=16,
               scale=dict(QWEN2_5_1_5B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2),
               budgets=(64, 128), row_len=32, steps=3),
}


def _device_info() -> dict:
    """The device and the versions that ran (the lent machine's Python, torch and transformers are its own, not
    the pins of requirements.txt; megatron-core comes from the carried wheels)."""
    import platform
    from importlib import metadata

    import torch

    cuda = torch.cuda.is_available()

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "python": platform.python_version(),
            "packages": {d: version(d) for d in ("megatron-core", "transformers", "triton")}}


def _write(out: Path, part: str, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{part}.json").write_text(json.dumps({"part": part, **result}, indent=2, default=str))


def _fusions(config) -> dict:
    from megatron_dapo.models.config import FUSIONS

    return {f: bool(getattr(config, f)) for f in FUSIONS}


def choose_transformer_impl(*, cuda: bool, te: bool) -> dict:
    """The --transformer-impl every part builds its models with, and why: TransformerEngine where CUDA and TE
    both are, else megatron-core's local layers. The trainer's own default on CUDA is TE *required* (no silent
    fallback, models/spec.py), so on the lent GPU machine, which has no TE (its wheels do not travel), a part
    that left the flag out would die at model build: every part passes this choice explicitly."""
    if cuda and te:
        return {"transformer_impl": "transformer_engine", "cuda": cuda, "te": te,
                "why": "CUDA and transformer_engine are both here"}
    why = ("transformer_engine is not installed on this CUDA machine (its wheels do not travel with the tree): "
           "megatron-core's local layers, [b, heads, s, s] attention scores, no fused RoPE") if cuda else \
        "no CUDA: megatron-core's local layers"
    return {"transformer_impl": "local", "cuda": cuda, "te": te, "why": why}


def layer_choice() -> dict:
    """choose_transformer_impl for this machine, as the layer-spec code sees it (models.spec.cuda_available:
    under --dry it answers True, so the CPU run takes the GPU machine's branch)."""
    from megatron_dapo.models import spec

    return choose_transformer_impl(cuda=spec.cuda_available(), te=spec.te_available())


@contextlib.contextmanager
def device_path(dry: bool):
    """--dry: models.spec.cuda_available() answers True for the part's whole run, so the layer-spec choice of a
    CUDA machine is exercised on CPU (a builder left to its default would ask for TransformerEngine and raise,
    as it would on the lent GPU machine). Only that choice: tensors, fusions and process groups still follow
    the real device."""
    if not dry:
        yield
        return
    from unittest import mock

    from megatron_dapo.models import spec

    with mock.patch.object(spec, "cuda_available", return_value=True):
        yield


def _impl_flags() -> list[str]:
    return ["--transformer-impl", layer_choice()["transformer_impl"]]


# ---- part 1: HF weights -> Megatron model, logits vs transformers ----------------------------------------

def part_hf_logits(dry: bool) -> dict:
    """A random tiny Qwen2 saved as safetensors, loaded through the project's HF -> Megatron mapping, and its
    logits / log-probs compared with transformers' on the same device, in fp32 and bf16."""
    import tempfile

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from megatron_dapo.actor import destroy_parallel, init_parallel
    from megatron_dapo.models import ModelArch, build_gpt_model
    from megatron_dapo.weights import iter_mcore_shards
    from megatron_dapo.weights.hf_format import HFCheckpointReader

    size = SIZES[dry]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    choice = layer_choice()
    use_te = choice["transformer_impl"] == "transformer_engine"
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(**size["hf"], max_position_embeddings=256, tie_word_embeddings=False))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        arch = ModelArch.from_hf(tmp)
        layout = init_parallel(seed=0)
        b, s = size["hf_tokens"]
        ids = torch.randint(0, arch.vocab_size, (b, s), generator=torch.Generator().manual_seed(1)).to(dev)
        pos = torch.arange(s, device=dev).expand(b, s)
        mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=dev).triu(1)
        for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 0.25)):
            row = {"dtype": str(dtype).removeprefix("torch."), "tolerance": tol}
            try:
                model = build_gpt_model(arch, params_dtype=dtype, use_te=use_te)
                with HFCheckpointReader(tmp) as reader, torch.no_grad():
                    params = dict(model.named_parameters())
                    for name, shards in iter_mcore_shards(reader.get, arch, layout, 0):
                        params[name].copy_(shards[0].to(dtype))
                    got = model(ids, pos, mask)[..., :arch.vocab_size].float()
                    want = hf.to(dev, dtype)(ids).logits.float()
                lp_err = (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
                row |= {"max_abs_logit_err": (got - want).abs().max().item(), "max_abs_logprob_err": lp_err,
                        "ok": lp_err <= tol, "fusions": _fusions(model.config)}
                del model
            except Exception as e:  # one dtype failing keeps the other's numbers
                row |= {"ok": False, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
        destroy_parallel()
    return {"status": "ok" if all(r["ok"] for r in rows) else "fail", "layers": choice, "rows": rows,
            "shape": [b, s], "vocab": arch.vocab_size}


# ---- part 2: the demo's DAPO loop on CUDA vs the same seed on CPU ----------------------------------------

class _Recorder:
    """Stands in for MetricsLogger: keeps every step's metrics."""

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def log(self, step: int, metrics: dict) -> None:
        self.steps.append({"step": step, **{k: float(v) for k, v in metrics.items()}})

    def log_record(self, name: str, record: dict) -> None:
        pass


def demo_args(base: Path, dry: bool, log_dir: Path) -> list[str]:
    """The embedded demo's flags (examples/run_embedded_demo.sh) for 3 steps, fp32 on every device, with a frozen
    reference of the base and a KL term (--ref-load initial --kl-coef 0.01: the second model's forward on the device
    too). The base is barely warmed up, so the reward is the response length's parity (tests/rewards.py): every step
    has groups with non-zero advantages, as the math verifier would not give them yet."""
    return ["--hf-checkpoint", str(base / "model"), "--prompt-data", str(base / "train.jsonl"),
            "--rollout-engine", "embedded", "--over-sample-factor", "1.5", "--rollout-temperature", "1.0",
            "--max-num-gen-batches", "16", "--on-gen-exhausted", "partial", "--clip-ratio-low", "0.2",
            "--clip-ratio-high", "0.28", "--loss-agg-mode", "token-mean", "--dynamic-sampling",
            "--overlong-buffer-length", "8", "--reward-fn", "tests.rewards:length_parity", "--lr", "5e-4",
            "--lr-warmup-steps", "5", "--weight-decay", "0.0", "--clip-grad", "1.0", "--seed", "1234",
            "--num-steps", "3", "--ref-load", "initial", "--kl-coef", "0.01",
            "--params-dtype", "float32", "--use-fused-logprob", "--log-dir", str(log_dir), "--no-wandb",
            "--no-progress", *_impl_flags(), *SIZES[dry]["demo"]]


def part_trainer_run(base: Path, dry: bool, out: Path, label: str) -> dict:
    """One 3-step run of the demo loop on this process's device; log-probs of fixed probe sequences first."""
    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.actor import MegatronActor, TrainSample
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.data import ResumableSampler
    from megatron_dapo.data.prompt_set import load_prompt_set
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.reward import get_reward_fn
    from megatron_dapo.rollout.build import make_rollout_engine
    from megatron_dapo.startup import build_configs, engine_config
    from megatron_dapo.trainer.build import load_hf_into_actor
    from megatron_dapo.trainer.loop import Trainer

    args = build_parser().parse_args(demo_args(base, dry, out / f"trainer_{label}_log"))
    layout = _init_layout(args)  # the flags' layout, --transformer-impl included
    arch = ModelArch.from_hf(args.hf_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(args.hf_checkpoint)
    eos = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    actor_cfg, collect_cfg, trainer_cfg = build_configs(args, eos)
    actor = MegatronActor(arch, actor_cfg, layout)
    load_hf_into_actor(actor, args.hf_checkpoint)
    ref = MegatronActor(arch, actor_cfg, layout, frozen=True)  # --ref-load initial
    load_hf_into_actor(ref, args.hf_checkpoint, flag="--ref-load")
    prompts = load_prompt_set(args.prompt_data, tokenizer, prompt_format=args.prompt_format,
                              max_prompt_length=args.max_prompt_length)
    response = tokenizer.encode("\n7+5=12\n3+4+1=8\nAnswer: 82", add_special_tokens=False)
    probe = [TrainSample(tokens=list(p.prompt_ids) + response, prompt_len=len(p.prompt_ids)) for p in prompts[:4]]
    logp, entropy = actor.compute_log_probs(probe, with_entropy=True)
    sampler = ResumableSampler(len(prompts), seed=args.seed)
    engine = make_rollout_engine(engine_config(args, arch, api_key=args.sglang_api_key), tokenizer)
    recorder = _Recorder()
    trainer = Trainer(config=trainer_cfg, collect=collect_cfg, actor=actor, engine=engine,
                      next_prompts=lambda k: [prompts[i] for i in sampler.next_batch(k)], eval_prompts=[],
                      decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                      reward_fn=get_reward_fn(args.reward_fn), logger=recorder, ref=ref)
    t0 = time.perf_counter()
    trainer.run()
    engine.shutdown()
    return {"label": label, **_device_info(), "layers": layer_choice(), "backend": torch.distributed.get_backend(),
            "fusions": _fusions(actor.module.config), "seconds": time.perf_counter() - t0,
            "probe_logp": [t.tolist() for t in logp], "probe_entropy": [t.tolist() for t in entropy],
            "steps": recorder.steps}


STEP_KEYS = ("rollout/accuracy", "train/pg_loss", "train/entropy", "train/grad_norm", "train/clipfrac_high", "train/kl",
             "mismatch/logprob_abs_diff_mean", "mismatch/logprob_abs_diff_max", "time/step_s")


def part_trainer(dry: bool, out: Path) -> dict:
    """Builds the demo's base policy, runs the loop on the device and on CPU (same seed) side by side."""
    import shutil

    base = out / "trainer_base"
    shutil.rmtree(base, ignore_errors=True)
    cpu_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "4"))
    subprocess.run([sys.executable, str(REPO / "tools" / "make_tiny_base.py"), "--out", str(base),
                    *SIZES[dry]["base"]], check=True, env=cpu_env, stdout=subprocess.DEVNULL)
    runs = {}
    procs = {label: subprocess.Popen([sys.executable, __file__, "trainer_run", "--out", str(out), "--base", str(base),
                                      "--label", label, *(["--dry"] if dry else [])],
                                     env=cpu_env if label == "cpu" else dict(os.environ))
             for label in ("device", "cpu")}
    for label, proc in procs.items():
        rc = proc.wait()
        path = out / f"trainer_run_{label}.json"
        runs[label] = json.loads(path.read_text()) if rc == 0 and path.exists() else {"error": f"exit {rc}"}
    dev, cpu = runs["device"], runs["cpu"]
    result = {"runs": {k: {kk: v for kk, v in r.items() if not kk.startswith("probe")} for k, r in runs.items()}}
    if "error" in dev or "error" in cpu:
        return {"status": "fail", **result}
    import torch

    diff = max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
               for a, b in zip(dev["probe_logp"], cpu["probe_logp"], strict=True))
    ent = max((torch.tensor(a) - torch.tensor(b)).abs().max().item()
              for a, b in zip(dev["probe_entropy"], cpu["probe_entropy"], strict=True))
    rows = [{"step": d["step"], **{f"{k} device": d.get(k) for k in STEP_KEYS},
             **{f"{k} cpu": c.get(k) for k in STEP_KEYS}}
            # not strict: a run with fewer steps is a "fail" of `ok` below, reported with the rows both runs have
            for d, c in zip(dev["steps"], cpu["steps"], strict=False)]
    ok = diff < 1e-3 and len(dev["steps"]) == len(cpu["steps"]) == 3 and all(
        d["mismatch/logprob_abs_diff_mean"] < 1e-3 for d in dev["steps"])
    for label, run in runs.items():
        result[f"{label}_run"] = f"{run['device']}, {run['backend']}, {run['seconds']:.1f} s for 3 steps"
    result["device_run_fusions"] = dev["fusions"]
    result["layers"] = dev["layers"]
    return {"status": "ok" if ok else "fail", "probe_logp_max_abs_diff_device_vs_cpu": diff,
            "probe_entropy_max_abs_diff_device_vs_cpu": ent, "rows": rows, **result}


# ---- part 3: the log-prob / entropy kernels at Qwen2.5's vocabulary --------------------------------------

def part_kernels(dry: bool) -> dict:
    """Triton (torch backend under --dry) log-prob/entropy at V=152064 vs fp64, and fwd+bwd time and peak
    memory against the naive log_softmax + gather (tools/gpu_check_ops.py's helpers)."""
    import gpu_check_ops as ops
    import torch

    from megatron_dapo.ops import token_logprob_entropy
    from megatron_dapo.ops.reference import naive_logprob_entropy

    size = SIZES[dry]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "triton" if dev == "cuda" else "torch"
    v, g = size["vocab"], torch.Generator(device=dev).manual_seed(0)
    rows = []
    for dtype, tol in ((torch.bfloat16, 2e-5), (torch.float32, 2e-5)):
        n = size["check_rows"]
        x = (torch.randn(n, v, device=dev, generator=g, dtype=torch.float64) * 3).to(dtype)
        t = torch.randint(0, v, (n,), device=dev, generator=g)
        coef = torch.randn(2, n, device=dev, generator=g, dtype=torch.float64)
        got = ops._grads(lambda a, b: token_logprob_entropy(a, b, backend=backend), x, t, coef)
        ref = ops._grads(naive_logprob_entropy, x.double(), t, coef)
        tag = f"{backend} [{n}x{v}] {str(dtype).removeprefix('torch.')}"
        errs = [ops.check(f"{tag} {what}", a, b, tol if what != "d logits" else 2e-2)
                for what, a, b in zip(("logp", "entropy", "d logits"), got, ref, strict=True)]
        n = size["time_rows"]
        (fused_ms, fused_gib), (naive_ms, naive_gib) = _time_kernels(n, v, dtype, dev, backend, g)
        rows.append({"dtype": str(dtype).removeprefix("torch."), "backend": backend, "vocab": v,
                     "check_rows": size["check_rows"], "max_err_logp": errs[0], "max_err_entropy": errs[1],
                     "max_err_dlogits": errs[2], "tolerance": tol, "ok": errs[0] <= tol and errs[1] <= tol,
                     "time_rows": n, "fused_ms": fused_ms, "naive_ms": naive_ms,
                     "fused_peak_gib": None if fused_gib != fused_gib else fused_gib,
                     "naive_peak_gib": None if naive_gib != naive_gib else naive_gib})
    return {"status": "ok" if all(r["ok"] for r in rows) else "fail", **_device_info(), "rows": rows}


def _time_kernels(n: int, v: int, dtype, dev: str, backend: str, g) -> tuple[tuple, tuple]:
    """((ms, peak GiB) of the fused kernel, the same of naive log_softmax + gather): forward + backward of
    log p and entropy of [n, v] logits (tools/gpu_check_ops.measure: median of 5, NaN GiB without CUDA)."""
    import gpu_check_ops as ops
    import torch

    from megatron_dapo.ops import token_logprob_entropy
    from megatron_dapo.ops.reference import naive_logprob_entropy

    x = (torch.randn(n, v, device=dev, generator=g) * 3).to(dtype).requires_grad_()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    c = torch.randn(n, device=dev, generator=g)

    def step(f):
        def run():
            x.grad = None
            lp, h = f(x, t)
            (lp * c + h * c).sum().backward()
        return run

    fused = ops.measure(step(lambda a, b: token_logprob_entropy(a, b, backend=backend)))
    naive = ops.measure(step(naive_logprob_entropy))
    return fused, naive


# ---- part 4: a ~1.5B Qwen2 at 8k / 16k tokens per micro-batch ----------------------------------------------

def train_flops_per_token(arch, seq_len: int) -> float:
    """Model FLOPs of one trained token (forward + backward = 3 x forward, recompute not counted):
    6 x the matmul parameters (q/k/v/o, SwiGLU, LM head) + 12 x layers x seq_len x (heads x head_dim) for
    QK^T and AV over the full s x s square (Megatron-LM's convention)."""
    h, f = arch.hidden_size, arch.intermediate_size
    per_layer = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 3 * h * f
    matmul = arch.num_layers * per_layer + arch.vocab_size * h
    return 6 * matmul + 12 * arch.num_layers * seq_len * arch.q_size


def _recompute_flags() -> list[str] | None:
    """The full-recompute flags of this build's parser, or None when it has no recompute-granularity option."""
    from megatron_dapo.arguments import build_parser

    known = {s for a in build_parser()._actions for s in a.option_strings}
    if "--recompute-granularity" not in known:
        return None
    flags = ["--recompute-granularity", "full"]
    if "--recompute-method" in known:
        flags += ["--recompute-method", "uniform"]
    if "--recompute-num-layers" in known:
        flags += ["--recompute-num-layers", "1"]
    return flags


def _init_layout(args):
    """init_parallel from the flags, as train.main does (recompute options and --transformer-impl included)."""
    from megatron_dapo.actor import init_parallel
    from megatron_dapo.startup import layout_options

    return init_parallel(seed=args.seed, **layout_options(args))


def _config_only_model(model_dir: Path, config: dict):
    """A model directory holding only config.json (the actor initialises its weights) and its ModelArch."""
    from megatron_dapo.models.hf_config import ModelArch

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir, ModelArch.from_hf(model_dir)


def part_scale(dry: bool, out: Path) -> dict:
    """Random-init Qwen2 (Qwen2.5-1.5B shapes) in bf16, 3 train steps per micro-batch token budget, with and
    without full recompute: peak memory, tokens/s (mean of steps 2..3) and MFU."""
    import dataclasses
    import gc

    import torch

    from megatron_dapo.actor import MegatronActor, TrainSample, destroy_parallel
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.startup import build_configs

    size = SIZES[dry]
    cuda = torch.cuda.is_available()
    model_dir, arch = _config_only_model(out / "scale_model", size["scale"])
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = next((f for key, f in PEAK_BF16_FLOPS.items() if key in name), None) if cuda else None
    recompute = _recompute_flags()
    notes = [] if recompute is not None else [
        "recompute is not available in this build (no --recompute-granularity flag): measured without it only"]
    variants = [("none", [])] + ([("full", recompute)] if recompute is not None else [])
    rows = []
    base_flags = ["--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl", "--num-steps", "1",
                  "--lr", "1e-6", "--params-dtype", "bfloat16" if cuda else "float32", "--use-fused-logprob",
                  *_impl_flags()]
    for label, flags in variants:
        try:
            args = build_parser().parse_args(base_flags + flags)
            layout = _init_layout(args)
            actor_cfg, _, _ = build_configs(args)
            t0 = time.perf_counter()
            actor = MegatronActor(arch, actor_cfg, layout)
            build_s = time.perf_counter() - t0
            static_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None
        except Exception as e:
            rows.append({"recompute": label, "error": f"{type(e).__name__}: {e}"})
            destroy_parallel(keep_process_group=True)
            continue
        for budget in size["budgets"]:
            row = {"recompute": label, "tokens_per_micro_batch": budget, "row_len": size["row_len"],
                   "build_s": build_s, "static_gib": static_gib}
            try:
                actor.config = dataclasses.replace(actor.config, max_tokens_per_micro_batch=budget)
                gen = torch.Generator().manual_seed(budget)
                n_rows, length = budget // size["row_len"], size["row_len"]
                samples = [TrainSample(tokens=torch.randint(0, arch.vocab_size, (length,), generator=gen).tolist(),
                                       prompt_len=length // 4, advantage=1.0 if i % 2 else -1.0)
                           for i in range(n_rows)]
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(size["steps"]):
                    t0 = time.perf_counter()
                    metrics = actor.train_step(samples)
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t0)
                step_s = sum(times[1:]) / len(times[1:])  # the first step compiles and warms up
                tps = n_rows * length / step_s
                row |= {"step_s": times, "tokens_per_s": tps, "grad_norm": metrics["grad_norm"],
                        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                        "mfu": tps * train_flops_per_token(arch, length) / peak if peak else None}
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        del actor
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        destroy_parallel(keep_process_group=True)
    ok = all("error" not in r for r in rows)
    return {"status": "ok" if ok else "fail", **_device_info(), "layers": layer_choice(),
            "parameters": arch.num_parameters(), "peak_flops": peak, "notes": notes, "rows": rows}


class _BlockEngine:
    """Stands in for a colocated SGLang engine on this machine (SGLang's CUDA build is not carried to it):
    release frees, resume re-allocates, a block of `nbytes` on the GPU, the size the engine's weights and KV
    cache would take. It measures the allocator's side of the switch, not SGLang's own release."""

    def __init__(self, nbytes: int, device) -> None:
        import torch

        self.nbytes, self.device = nbytes, device
        self.block = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def release_memory_occupation(self, tags) -> None:
        import torch

        if "weights" in tags:
            self.block = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def resume_memory_occupation(self, tags) -> None:
        import torch

        if "weights" in tags:
            self.block = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)


def part_colocate(dry: bool, out: Path) -> dict:
    """--colocate's phase switch with the ~1.5B actor (bf16) and a stand-in SGLang block of twice the weights
    (weights + as much KV cache): memory allocated by the actor in each phase, seconds per switch, and whether
    training after an offload/onload equals training without one (a second actor, same steps)."""
    import torch

    from megatron_dapo.actor import MegatronActor, TrainSample, destroy_parallel
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.startup import build_configs
    from megatron_dapo.trainer.colocate import ActorOffloader, PhaseSwitcher, device_resident_bytes

    size = SIZES[dry]
    cuda = torch.cuda.is_available()
    model_dir, arch = _config_only_model(out / "colocate_model", size["scale"])
    args = build_parser().parse_args(["--hf-checkpoint", str(model_dir), "--prompt-data", "unused.jsonl",
                                      "--num-steps", "1", "--lr", "1e-5", "--params-dtype",
                                      "bfloat16" if cuda else "float32",
                                      "--max-tokens-per-micro-batch", str(size["budgets"][0]), *_impl_flags()])
    layout = _init_layout(args)
    actor_cfg, _, _ = build_configs(args)
    gen = torch.Generator().manual_seed(5)
    length = size["row_len"]
    batches = [[TrainSample(tokens=torch.randint(0, arch.vocab_size, (length,), generator=gen).tolist(),
                            prompt_len=length // 4, advantage=1.0 if i % 2 else -1.0)
                for i in range(size["budgets"][0] // length)] for _ in range(2)]
    rows, notes = [], ["SGLang is a stand-in block here (its CUDA build is not on this machine): the actor's side "
                       "and the allocator are measured, not SGLang's own release"]
    try:
        ref = MegatronActor(arch, actor_cfg, layout)
        actor = MegatronActor(arch, actor_cfg, layout)
        actor.load_shards({k: v.to(actor_cfg.torch_params_dtype) for k, v in ref.state_dict_for_export().items()},
                          reload=True)
        for i, batch in enumerate(batches, start=1):
            ref.train_step(batch, rollout_step=i)
        weights_bytes = sum(p.numel() * p.element_size() for c in actor.chunks for p in c.parameters())
        device = next(actor.chunks[0].parameters()).device
        engine = _BlockEngine(2 * weights_bytes, device)
        switch = PhaseSwitcher(offloader=ActorOffloader(actor.chunks, actor.optimizer), engine=engine)
        switch.start()  # the run begins generating: the actor offloads first
        for i, batch in enumerate(batches, start=1):
            m = switch.to_training()
            actor.train_step(batch, rollout_step=i)
            if cuda:
                torch.cuda.synchronize()
            training = device_resident_bytes() / 2**30
            g = switch.to_generation()
            generation = device_resident_bytes() / 2**30
            rows.append({"step": i, "to_training_s": m["colocate/to_training_s"],
                         "to_generation_s": g["colocate/to_generation_s"],
                         "offloaded_gib": g["colocate/actor_offloaded_gib"],
                         "resident_gib_training (actor)": training,
                         "resident_gib_generation (actor + stand-in)": generation,
                         "stand_in_gib": engine.nbytes / 2**30})
        switch.to_training()
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(
            [p for c in actor.chunks for p in c.parameters()], [p for c in ref.chunks for p in c.parameters()],
            strict=True))
        result = {"status": "ok" if diff == 0.0 or cuda else "fail", "weights_max_abs_diff_vs_no_offload": diff,
                  "memory": "torch.cuda.memory_allocated" if cuda else "process RSS (CPU)"}
        if cuda and diff != 0.0:
            notes.append("not bit-exact on this GPU: nondeterministic kernels differ between the two actors too")
    except Exception as e:
        result = {"status": "fail", "error": f"{type(e).__name__}: {e}"}
    destroy_parallel(keep_process_group=True)
    return {**result, **_device_info(), "layers": layer_choice(), "parameters": arch.num_parameters(),
            "notes": notes, "rows": rows}


IPC_RECEIVER = """
import base64, hashlib, sys
import torch, torch.multiprocessing
from multiprocessing.reduction import ForkingPickler
torch.multiprocessing.set_sharing_strategy("file_system")
for line in sys.stdin:
    try:
        [(name, t)] = ForkingPickler.loads(base64.b64decode(line.strip()))
        data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
        print(name, hashlib.sha256(data).hexdigest(), flush=True)
    except Exception as e:
        print(name if "name" in dir() else "?", "error", type(e).__name__, str(e).splitlines()[0][:200], flush=True)
"""


def part_ipc(dry: bool, out: Path) -> dict:
    """Tensor-mode weight sync's CUDA IPC (megatron_dapo/weight_sync/tensor_ipc.py) between two processes on one GPU,
    this one running with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (gpu_smoke.sh exports it, as the
    launchers do): a bucket staged in the IpcBucketPool must open in a second process (its sha256 equal), its
    segment must not be expandable. The same bytes in the trainer's own allocator (an expandable segment) are
    tried too, for the record only: that import needs pidfd_getfd, i.e. ptrace permission, which this machine
    may or may not grant; so is a bucket in a private MemPool made without switching expandable segments off
    (whether this torch's pools follow the global setting). Dry: CPU buckets through /dev/shm (the protocol,
    not the allocator)."""
    import hashlib

    import torch

    from megatron_dapo.weight_sync.tensor_ipc import (
        IpcBucketPool,
        segment_is_expandable,
        serialize_named_tensors,
        stage_bucket,
    )

    cuda = torch.cuda.is_available()
    alloc_conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    notes = [f"PYTORCH_CUDA_ALLOC_CONF={alloc_conf!r}"]
    if not cuda:
        torch.multiprocessing.set_sharing_strategy("file_system")
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(1 << (10 if dry else 26), generator=gen).to(torch.bfloat16)  # 128 MiB on the GPU
    flat = src.cuda() if cuda else src
    pool = IpcBucketPool()
    staged = stage_bucket(flat, cuda=cuda, pool=pool, shm_dir=str(out))
    buckets = {"ipc_pool": staged}
    if cuda:
        buckets["default_allocator"] = flat  # the old path: the trainer's own (expandable) block
        # For the record: a private MemPool *without* the switch, the code before issue 37 defect 3. Expandable
        # here means this torch's pools follow the global setting, i.e. the switch is what keeps ipc_pool plain.
        bare = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(bare):
            buckets["mempool_without_switch"] = flat.clone()
    want = hashlib.sha256(src.view(torch.uint8).numpy().tobytes()).hexdigest()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", IPC_RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    rows = []
    try:
        for name, t in buckets.items():
            handle = serialize_named_tensors([(name, t)], uuid_of=lambda index: index)  # plain torch handle
            try:
                proc.stdin.write(handle + "\n")
                proc.stdin.flush()
                reply = proc.stdout.readline().split(maxsplit=1)
                got = reply[1].strip() if len(reply) == 2 else "no reply"
            except BrokenPipeError:  # the receiver died on an earlier handle: this row says so
                got = f"receiver exited ({proc.poll()})"
            rows.append({"bucket": name, "bytes": t.numel() * t.element_size(),
                         "expandable_segment": segment_is_expandable(t.data_ptr()) if cuda else None,
                         "opened_in_receiver": got == want, "receiver": "sha256 equal" if got == want else got})
    finally:
        with contextlib.suppress(BrokenPipeError):  # the receiver died on a handle: its row says so
            proc.stdin.close()
        proc.wait(timeout=60)
        del staged
        pool.release()
    pooled = rows[0]
    ok = pooled["opened_in_receiver"] and (not cuda or pooled["expandable_segment"] is False)
    if cuda and "expandable_segments:True" not in alloc_conf.replace(" ", ""):
        notes.append("expandable segments were off in this run: the pool's advantage is not exercised")
    return {"status": "ok" if ok else "fail", **_device_info(), "notes": notes, "rows": rows}


# ---- report -----------------------------------------------------------------------------------------------

def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return "" if v is None else str(v)


def _table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)).replace("|", "/") for c in cols) + " |" for r in rows]
    return lines


def report(out: Path, dry: bool) -> dict:
    """Merges OUT/<part>.json (and OUT/<part>.rc from gpu_smoke.sh) into gpu_smoke.json and gpu_smoke.md."""
    merged = {"dry": dry, "parts": {}}
    md = [f"# GPU smoke{' (dry run on CPU: plumbing only, not a measurement)' if dry else ''}", ""]
    for part in PARTS:
        path, rc_path = out / f"{part}.json", out / f"{part}.rc"
        rc = int(rc_path.read_text().strip()) if rc_path.exists() else None
        if path.exists():
            result = json.loads(path.read_text())
        else:
            why = "timed out" if rc in (124, 137) else f"exited with {rc}" if rc is not None else "did not run"
            result = {"part": part, "status": "fail", "error": f"{why}: no result (see {part}.log)"}
        result["exit_code"] = rc
        merged["parts"][part] = result
        md += [f"## {part}: {result.get('status')}", ""]
        scalars = {k: v for k, v in result.items() if k not in ("rows", "runs", "part") and not isinstance(v, list)}
        md += [f"- {k}: {_fmt(v)}" for k, v in scalars.items()]
        md += [f"- note: {n}" for n in result.get("notes", [])]
        md += [""] + _table(result.get("rows", [])) + [""]
    (out / "gpu_smoke.json").write_text(json.dumps(merged, indent=2, default=str))
    (out / "gpu_smoke.md").write_text("\n".join(md))
    return merged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=[*PARTS, "report", "trainer_run"])
    p.add_argument("--out", required=True, type=Path, help="where <part>.json goes")
    p.add_argument("--dry", action="store_true", help="tiny sizes on CPU: the script's own test")
    p.add_argument("--base", type=Path, help="trainer_run: the tiny base policy directory")
    p.add_argument("--label", choices=["device", "cpu"], help="trainer_run: which run this is")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "report":
        merged = report(a.out, a.dry)
        print((a.out / "gpu_smoke.md").read_text())
        return 0 if all(r.get("status") == "ok" for r in merged["parts"].values()) else 1
    if a.part == "trainer_run":
        with device_path(a.dry):
            result = part_trainer_run(a.base, a.dry, a.out, a.label)
        (a.out / f"trainer_run_{a.label}.json").write_text(json.dumps(result))
        return 0
    t0 = time.perf_counter()
    with device_path(a.dry):
        if a.part == "hf_logits":
            result = part_hf_logits(a.dry)
        elif a.part == "trainer":
            result = part_trainer(a.dry, a.out)
        elif a.part == "kernels":
            result = part_kernels(a.dry)
        elif a.part == "scale":
            result = part_scale(a.dry, a.out)
        elif a.part == "colocate":
            result = part_colocate(a.dry, a.out)
        else:
            result = part_ipc(a.dry, a.out)
    result["seconds"] = time.perf_counter() - t0
    _write(a.out, a.part, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "runs")}, default=str))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
