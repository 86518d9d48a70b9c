"""Natural-language arithmetic word problems for the SmolLM2 DAPO run (examples/run_smollm2_cpu.sh).

    python tools/make_arith_task.py   # rewrites data/arith-words-train.jsonl and data/arith-words-heldout.jsonl

Deterministic (seeded): the same files on every run. Each row is one user turn in the DAPO/verl schema (a chat
`prompt` list, so no math template is wrapped around it; the model's own chat template is applied when the run
loads it), `reward_model.ground_truth` an integer string, `data_source`="arith_words". The problems are
"NAME has A ITEMS. NAME gets B more. How many ITEMS does NAME have now? Answer in one short sentence."
and the like, with A and B in [2, --max-operand]; the held-out problems share no (template, A, B) with the
training ones. Verified with `--reward-fn last_number` (megatron_dapo/reward/last_number.py).

Difficulty was tuned on SmolLM2-135M-Instruct (its chat template, greedy, 48 new tokens, `last_number`) on the
held-out file: 0.31 with the "Answer in one short sentence." suffix (mean response 23 tokens), 0.17 without it
(it often keeps writing past the result and is cut at 48 tokens). On 40-problem probes of one template: sums of
two-digit numbers scored 0.05, differences 0.08, one-digit products 0.28.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ("Tom", "Anna", "Ben", "Lucy", "Sam", "Mia", "Leo", "Emma", "Max", "Zoe")
ITEMS = ("apples", "books", "marbles", "coins", "cookies", "stickers", "pencils", "cards", "shells", "stamps")
INSTRUCTION = " Answer in one short sentence."
"""Appended to every question: without it the model rambles past its result (see above)."""
TEMPLATES = (
    "{n} has {a} {it}. {n} gets {b} more. How many {it} does {n} have now?",
    "{n} had {a} {it} and found {b} more. How many {it} does {n} have in total?",
    "There are {a} {it} in a box and {b} {it} on the table. How many {it} are there altogether?",
)
DATA_SOURCE = "arith_words"


def problems(rng: random.Random, max_operand: int) -> list[tuple[str, int, int]]:
    """Every (template, a, b) of the task, shuffled by `rng`."""
    cases = [(t, a, b) for t in TEMPLATES for a in range(2, max_operand + 1) for b in range(2, max_operand + 1)]
    rng.shuffle(cases)
    return cases


def row(rng: random.Random, template: str, a: int, b: int) -> dict:
    text = (template + INSTRUCTION).format(n=rng.choice(NAMES), it=rng.choice(ITEMS), a=a, b=b)
    return {"prompt": [{"role": "user", "content": text}], "reward_model": {"ground_truth": str(a + b)},
            "data_source": DATA_SOURCE}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parent.parent / "data"))
    ap.add_argument("--train", type=int, default=320, help="training problems")
    ap.add_argument("--heldout", type=int, default=64, help="held-out problems")
    ap.add_argument("--max-operand", type=int, default=20, help="operands are in [2, this]")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    cases = problems(rng, args.max_operand)
    if args.train + args.heldout > len(cases):
        raise SystemExit(f"--train + --heldout > {len(cases)} distinct problems; raise --max-operand")
    out = Path(args.out_dir)
    for name, chunk in (("train", cases[: args.train]), ("heldout", cases[args.train : args.train + args.heldout])):
        path = out / f"arith-words-{name}.jsonl"
        path.write_text("".join(json.dumps(row(rng, *case)) + "\n" for case in chunk), encoding="utf-8")
        print(f"{path}: {len(chunk)} rows")


if __name__ == "__main__":
    main()
