"""Build the embedded demo's base policy: a tiny Qwen2 model warmed up on the arithmetic task format.

Writes an HF directory (config.json, model.safetensors, character tokenizer) plus train/eval prompt
files in the DAPO schema, so `python -m megatron_dapo.train --hf-checkpoint DIR/model --prompt-data
DIR/train.jsonl` treats it like any Qwen2.5 checkpoint and dataset.

The task: two-digit addition ("37+45=") answered by column addition, one digit per line, then
"Answer: 82" (the DAPO verifier reads the last Answer: line). `--task remainder` is the ablation's
(megatron_dapo/data/remainder.py), `--task tool` the tool demo's: products of 3-4 digit numbers, which the model
can only get right by calling the Python tool (megatron_dapo/data/tool_task.py, examples/run_tool_demo.sh).

Why a noisy warm-up: RL sharpens what a policy can already sample; it does not teach arithmetic from
a reward of -1 on nearly every sample. The warm-up is supervised training on the worked format with
the right column sums, but a final answer that is right only `--correct-fraction` of the time (the
rest are off by 1-3). The base model thus works the sum out and then often misreports it: its
sampled accuracy "starts low but above zero" and DAPO has something to find (report what it
computed). `--sft-steps` trades build time for how well the column sums are learned.

    python tools/make_tiny_base.py --out runs/tiny-base
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatron_dapo.data import PromptRecord, render_prompt  # noqa: E402
from megatron_dapo.data.remainder import (  # noqa: E402
    ABLATION_MAX_RESPONSE_LENGTH,
    RemainderTask,
    WarmupStyle,
    make_remainder_problems,
    warmup_response,
)
from megatron_dapo.data.synthetic import (  # noqa: E402
    TOOL_CHARACTERS,
    ArithmeticTask,
    build_char_tokenizer,
    make_arithmetic_problems,
)
from megatron_dapo.data.tool_task import (  # noqa: E402
    TOOL_MAX_RESPONSE_LENGTH,
    ToolTask,
    ToolWarmup,
    make_tool_problems,
    warmup_segments,
)
from megatron_dapo.reward import get_reward_fn  # noqa: E402


def worked_response(expression: str, answer: int) -> str:
    """Column addition of two non-negative integers, then the (possibly noisy) final answer line.

    "37+45" -> "7+5=12\n3+4+1=8\nAnswer: 82": one line per digit, carries written out, so every
    token is a one-digit fact a tiny model learns quickly and that generalises to unseen operands.
    """
    left, right = (int(x) for x in expression.split("+"))
    lines, carry, place = [], 0, 0
    while left or right or carry or place == 0:
        a, b = left % 10, right % 10
        total = a + b + carry
        lines.append(f"{a}+{b}{'+1' if carry else ''}={total}")
        carry, left, right, place = total // 10, left // 10, right // 10, place + 1
        if not (left or right):
            break
    return "\n" + "\n".join(lines) + f"\nAnswer: {answer}"


def write_prompts(path: Path, records: list[PromptRecord]) -> None:
    """DAPO-schema jsonl: prompt (chat list), reward_model.ground_truth, data_source."""
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps({"prompt": r.messages, "reward_model": {"ground_truth": r.ground_truth},
                                "data_source": r.data_source}) + "\n")


def tiny_qwen2_config(vocab_size: int, eos_id: int, *, hidden: int, layers: int, heads: int, kv_heads: int,
                      ffn: int, max_len: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=eos_id,
        eos_token_id=eos_id, pad_token_id=eos_id, torch_dtype="float32",
    )


Segments = list[tuple[str, bool]]
"""A warm-up response as (text, trained) segments, each tokenized on its own: a tool's output is not trained on."""


def addition_warmup(correct_fraction: float) -> Callable[[PromptRecord, random.Random], Segments]:
    """The addition task's warm-up response: worked column sums, a final answer right `correct_fraction`
    of the time (otherwise off by 1-3)."""
    def response(r: PromptRecord, rng: random.Random) -> Segments:
        answer = int(r.ground_truth)
        if rng.random() >= correct_fraction:
            answer += rng.choice((-3, -2, -1, 1, 2, 3))
        return [(worked_response(r.extra["expression"], answer), True)]
    return response


def remainder_warmup(style: WarmupStyle) -> Callable[[PromptRecord, random.Random], Segments]:
    """The remainder task's warm-up response (megatron_dapo/data/remainder.py: slips and repeats)."""
    return lambda r, rng: [(warmup_response(r.extra["a"], r.extra["b"], rng, style), True)]


def tool_warmup(style: ToolWarmup, tokenizer) -> Callable[[PromptRecord, random.Random], Segments]:
    """The tool task's warm-up (megatron_dapo/data/tool_task.py): a call, its output and the answer, or a guess."""
    from megatron_dapo.tool_use.templates import tool_template

    template = tool_template("code_fence", tokenizer)
    return lambda r, rng: warmup_segments(r, rng, style, template)


def sft_batch(records: list[PromptRecord], tokenizer, rng: random.Random,
              response_fn: Callable[[PromptRecord, random.Random], Segments],
              batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, S], attention [B, S], loss mask [B, S]) of prompt + warm-up response + eos, right-padded; the mask is
    1 on the trained segments' tokens and the eos."""
    seqs, masks = [], []
    for r in rng.sample(records, batch_size):
        prompt = render_prompt(r, tokenizer)
        segments = response_fn(r, rng)
        response, mask = [], []
        for text, trained in segments:
            ids = tokenizer.encode(text, add_special_tokens=False)
            response += ids
            mask += [int(trained)] * len(ids)
        if "Answer:" in segments[-1][0].rsplit("\n", 1)[-1]:  # one without its answer line was cut off: no end
            response.append(tokenizer.eos_token_id)
            mask.append(1)
        seqs.append(prompt + response)
        masks.append([0] * len(prompt) + mask)
    width = max(map(len, seqs))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    att = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return ids, att, mask


@torch.no_grad()
def sampled_accuracy(model, tokenizer, records: list[PromptRecord], *, temperature: float,
                     max_new_tokens: int, seed: int, tool: bool = False) -> dict[str, float]:
    """eval/avg@1 (fraction of records answered correctly by one sample each, greedy when temperature == 0) and,
    with `tool`, eval/tool_call_rate: the samples are conversations with the Python tool (--tool-template
    code_fence, two turns, the real sandbox).

    The same engine and metric as the trainer's eval (seeded avg@1), so the numbers compare."""
    from megatron_dapo.rollout.collect import Prompt
    from megatron_dapo.rollout.embedded import EmbeddedEngine
    from megatron_dapo.rollout.evaluation import evaluate
    from megatron_dapo.rollout.types import SamplingParams

    prompts = [Prompt(prompt_ids=render_prompt(r, tokenizer), ground_truth=r.ground_truth, index=r.index)
               for r in records]
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              stop_token_ids=(tokenizer.eos_token_id,))
    with EmbeddedEngine(model, tokenizer=tokenizer, seed=seed, max_batch_size=len(prompts)) as engine:
        if tool:
            from megatron_dapo.rollout.multi_turn import MultiTurnConfig, ToolRolloutEngine
            from megatron_dapo.tool_use.pool import SandboxPool
            from megatron_dapo.tool_use.sandbox import SandboxLimits
            from megatron_dapo.tool_use.templates import tool_template

            engine = ToolRolloutEngine(engine, template=tool_template("code_fence", tokenizer), tokenizer=tokenizer,
                                       tools=SandboxPool(2, SandboxLimits()), config=MultiTurnConfig(max_turns=2))
        try:
            result = evaluate(engine, prompts, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                              get_reward_fn("math_dapo"), n_samples=1, sampling=sampling, seed=seed)
        finally:
            engine.shutdown()
    return {k: v for k, v in result.items() if k in ("eval/avg@1", "eval/tool_call_rate")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The tool's flags, with the task-dependent defaults (--sft-steps, --max-response-length) filled in."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (model/, train.jsonl, eval.jsonl)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=20000, help="training prompts")
    ap.add_argument("--num-eval", type=int, default=200, help="held-out prompts (none shared with train)")
    ap.add_argument("--task", choices=("addition", "remainder", "tool"), default="addition",
                    help="addition: the demo's two-digit sums; remainder: the ablation's 'a mod b' by repeated "
                         "subtraction (megatron_dapo/data/remainder.py), whose warm-up slips and rambles; tool: "
                         "products of 3-4 digit numbers, solved by calling the Python tool "
                         "(megatron_dapo/data/tool_task.py)")
    ap.add_argument("--call-prob", type=float, default=0.5,
                    help="tool task: share of warm-up responses that call the tool (the rest guess)")
    ap.add_argument("--min-operand", type=int, default=10, help="addition task")
    ap.add_argument("--max-operand", type=int, default=99, help="addition task")
    ap.add_argument("--max-response-length", type=int, default=None,
                    help="tokens sampled when measuring (default: 40 for addition, "
                         f"{ABLATION_MAX_RESPONSE_LENGTH} for remainder)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--ffn-hidden-size", type=int, default=256)
    ap.add_argument("--sft-steps", type=int, default=None, help="default: 600 for addition, 500 for remainder")
    ap.add_argument("--sft-batch-size", type=int, default=64)
    ap.add_argument("--sft-lr", type=float, default=3e-3)
    ap.add_argument("--correct-fraction", type=float, default=0.3,
                    help="addition task: fraction of warm-up final answers that are right (the rest are off by 1-3)")
    args = ap.parse_args(argv)
    if not 0.0 < args.correct_fraction <= 1.0:
        raise SystemExit("--correct-fraction must be in (0, 1]")
    if args.sft_steps is None:
        args.sft_steps = {"addition": 600, "remainder": 500, "tool": 1500}[args.task]
    if args.max_response_length is None:
        args.max_response_length = {"addition": 40, "remainder": ABLATION_MAX_RESPONSE_LENGTH,
                                    "tool": TOOL_MAX_RESPONSE_LENGTH}[args.task]
    return args


@dataclass
class TaskData:
    """The base's prompts and warm-up: pure Python from --seed (no torch RNG, no float kernel), so the same on every
    machine."""

    task: ArithmeticTask | RemainderTask | ToolTask
    train: list[PromptRecord]
    eval: list[PromptRecord]
    """Held-out: expressions never in train."""
    response_fn: Callable[[PromptRecord, random.Random], Segments]
    max_positions: int


def task_data(args: argparse.Namespace, tokenizer) -> TaskData:
    """The task's problems for `args`, split into train and held-out prompts, with its warm-up response."""
    if args.task == "addition":
        task = ArithmeticTask(min_operand=args.min_operand, max_operand=args.max_operand, min_operations=1,
                              max_operations=1, operators=("+",), prompt_template="{expression}=")
        pool = make_arithmetic_problems(args.num_train + 4 * args.num_eval, seed=args.seed, difficulty=task)
        response_fn = addition_warmup(args.correct_fraction)
        max_positions = 128
    elif args.task == "tool":
        task = ToolTask()
        pool = make_tool_problems(args.num_train + 4 * args.num_eval, seed=args.seed, task=task)
        response_fn = tool_warmup(ToolWarmup(call_prob=args.call_prob), tokenizer)
        max_positions = 128
    else:
        task = RemainderTask()
        pool = make_remainder_problems(args.num_train + 4 * args.num_eval, seed=args.seed, task=task)
        response_fn = remainder_warmup(WarmupStyle())
        max_positions = 256
    # held-out = expressions never seen in training
    eval_records, seen = [], set()
    for r in pool[args.num_train:]:
        expr = r.extra["expression"]
        if expr not in seen and len(eval_records) < args.num_eval:
            seen.add(expr)
            eval_records.append(r)
    train_records = [r for r in pool[: args.num_train] if r.extra["expression"] not in seen]
    return TaskData(task, train_records, eval_records, response_fn, max_positions)


def sft(model, data: TaskData, tokenizer, args: argparse.Namespace) -> None:
    """The warm-up: --sft-steps AdamW steps on batches of train prompts + warm-up responses (token-mean NLL of the
    responses), linear LR warm-up over 50 steps, gradients clipped at 1. Batches come from random.Random(--seed)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    for step in range(1, args.sft_steps + 1):
        ids, att, mask = sft_batch(data.train, tokenizer, rng, data.response_fn, args.sft_batch_size)
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(logp * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.sft_steps:
            elapsed = time.perf_counter() - t0
            print(f"sft step {step}/{args.sft_steps} loss {loss.item():.3f} ({elapsed:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(str(out / "model"), extra_characters=TOOL_CHARACTERS if args.task == "tool"
                                     else "")
    data = task_data(args, tokenizer)
    task, train_records, eval_records = data.task, data.train, data.eval
    write_prompts(out / "train.jsonl", train_records)
    write_prompts(out / "eval.jsonl", eval_records)

    config = tiny_qwen2_config(len(tokenizer), tokenizer.eos_token_id, hidden=args.hidden_size,
                               layers=args.num_layers, heads=args.num_heads, kv_heads=args.num_kv_heads,
                               ffn=args.ffn_hidden_size, max_len=data.max_positions)
    model = Qwen2ForCausalLM(config)
    t0 = time.perf_counter()
    sft(model, data, tokenizer, args)
    model.eval()
    max_new = args.max_response_length
    report = {
        "eval_accuracy_sampled": sampled_accuracy(model, tokenizer, eval_records, temperature=1.0,
                                                  max_new_tokens=max_new, seed=args.seed)["eval/avg@1"],
        "eval_accuracy_greedy": sampled_accuracy(model, tokenizer, eval_records, temperature=0.0,
                                                 max_new_tokens=max_new, seed=args.seed)["eval/avg@1"],
        "sft_seconds": time.perf_counter() - t0,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "train_prompts": len(train_records),
        "eval_prompts": len(eval_records),
        "task": asdict(task),
        "args": vars(args),
    }
    if args.task == "tool":  # with the tool: the accuracy the RL run starts from, and how often it calls
        with_tool = sampled_accuracy(model, tokenizer, eval_records, temperature=1.0, max_new_tokens=max_new,
                                     seed=args.seed, tool=True)
        report["eval_accuracy_sampled_with_tool"] = with_tool["eval/avg@1"]
        report["eval_tool_call_rate"] = with_tool["eval/tool_call_rate"]
    if args.task == "remainder":
        from megatron_dapo.rollout.embedded import EmbeddedEngine
        from megatron_dapo.rollout.remainder_eval import remainder_sample_stats

        with EmbeddedEngine(model, tokenizer=tokenizer, seed=args.seed, max_batch_size=256) as engine:
            report["sampled"] = remainder_sample_stats(engine, tokenizer, eval_records, k=4,
                                                       max_new_tokens=max_new, seed=args.seed)
    model.save_pretrained(out / "model", safe_serialization=True)
    (out / "base_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("task", "args")}, indent=2))


if __name__ == "__main__":
    main()
