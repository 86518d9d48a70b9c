"""Bytes each rank receives for one rollout batch: pickled groups broadcast to every rank (before) vs
each DP rank's rows as tensors (after, megatron_dapo/trainer/dataplane.py), and the Python heap each holds.

Synthetic 32B setting: 512 prompts x 16 responses, response lengths lognormal (median --median-len,
sigma --sigma) capped at 20480, prompt lengths lognormal around 200, token ids uniform over Qwen2.5's
152064 ids, DP=8 (16 nodes x 8 GPUs, TP8 x PP2). Per-token costs are measured on a sub-sample of
--measure-prompts real `ScoredGroup`s (pickle.dumps as broadcast_object_list does; tracemalloc around
pickle.loads / dataplane.unpack) and scaled by the full batch's token counts; the tensor bytes are
exact (checked against `dataplane.pack` on the sub-sample).

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tools/bench_dataplane.py

Output (defaults: seed 0, median 4000, sigma 0.8, 16 measured groups; 2026-12-03, CPU host, 27 s):

    tokens: 44.8 M (prompt 1.7 M, response 43.1 M), 8192 responses; DP=8; largest share 6.01 M tokens
    per rank                           before (pickle bcast)  after (DP share tensors)  after/before
    bytes received                                  0.566 GB                  0.047 GB         0.084
    bytes per token received                           12.63                      7.86
    Python heap once received                        3.15 GB                   0.29 GB         0.091
    rank 0 sends 0.309 GB in all (was a 0.566 GB broadcast)

"Before" is what every one of the 128 ranks received and unpickled (70 bytes of heap per token); "after"
is the largest DP share (1/8 of the rows), 7.86 bytes per token of the share (int32 id + fp32 log-prob
per response token, int32 id per prompt token, 28 bytes per row), and its host memory as TrainSamples
(token ids as a Python list, loss mask and log-probs as fp32 tensors). Rank 0 sends each other DP
leader its share (0.31 GB in all); each leader broadcasts it to its 15 TP/PP peers over gloo.
"""

from __future__ import annotations

import argparse
import math
import pickle
import tracemalloc

import torch

from megatron_dapo.actor import TrainSample
from megatron_dapo.rollout.collect import Prompt, ScoredGroup
from megatron_dapo.rollout.types import Sample
from megatron_dapo.trainer.dataplane import pack, unpack
from megatron_dapo.trainer.loop import Rollout

VOCAB = 152064


def lengths(n: int, median: float, sigma: float, cap: int, gen: torch.Generator) -> torch.Tensor:
    """n lognormal lengths (median, sigma), rounded, in [1, cap]."""
    x = torch.randn(n, generator=gen, dtype=torch.float64) * sigma + math.log(median)
    return x.exp().round().clamp(1, cap).long()


def make_groups(prompt_lens, resp_lens, n: int, gen: torch.Generator) -> list[ScoredGroup]:
    """Real ScoredGroups (what rank 0 broadcast before): ids uniform over the vocab, log-probs in (-5, 0)."""
    groups = []
    for p, (pl, rls) in enumerate(zip(prompt_lens.tolist(), resp_lens.view(-1, n).tolist(), strict=True)):
        prompt = torch.randint(0, VOCAB, (pl,), generator=gen).tolist()
        samples = [Sample(request_id=f"r{p}", index=i, prompt_ids=prompt,
                          response_ids=torch.randint(0, VOCAB, (rl,), generator=gen).tolist(),
                          logprobs=(-5 * torch.rand(rl, generator=gen, dtype=torch.float64)).tolist(),
                          finish_reason="length" if rl >= 20480 else "stop", weight_version=0)
                   for i, rl in enumerate(rls)]
        groups.append(ScoredGroup(Prompt(prompt_ids=prompt, ground_truth="42", index=p), samples,
                                  [i % 2 == 0 for i in range(n)], [float(i % 2) for i in range(n)]))
    return groups


def heap_of(fn) -> tuple[int, object]:
    """Peak traced Python heap bytes while `fn()` builds its result (the result kept alive)."""
    tracemalloc.start()
    out = fn()
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--n", type=int, default=16, help="responses per prompt")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--median-len", type=float, default=4000.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--cap", type=int, default=20480)
    ap.add_argument("--measure-prompts", type=int, default=16, help="groups actually built and pickled")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(a.seed)
    resp = lengths(a.prompts * a.n, a.median_len, a.sigma, a.cap, gen)
    prompt = lengths(a.prompts, 200, 0.3, 2048, gen)
    rows = a.prompts * a.n
    n_resp, n_prompt = int(resp.sum()), int(prompt.sum()) * a.n  # the prompt goes with every response
    n_tok = n_resp + n_prompt

    # before: measured per token on a sub-sample, scaled to the full batch
    k = a.measure_prompts
    sub = make_groups(prompt[:k], resp[:k * a.n], a.n, gen)
    sub_resp = int(resp[:k * a.n].sum())
    sub_tok = sub_resp + int(prompt[:k].sum()) * a.n
    wire = pickle.dumps([(sub, {"rollout/reward": 0.5})])
    heap_before_sub, _ = heap_of(lambda: pickle.loads(wire))
    scale = n_tok / sub_tok
    before_bytes, before_heap = len(wire) * scale, heap_before_sub * scale

    # after: exact tensor bytes of the largest DP share (strided split of one mini-batch)
    shares = [torch.arange(d, rows, a.dp) for d in range(a.dp)]
    pl_row = prompt.repeat_interleave(a.n)
    share_bytes = [40 + 28 * len(s) + 8 * int(resp[s].sum()) + 4 * int(pl_row[s].sum()) for s in shares]
    after_bytes = max(share_bytes)
    worst = shares[share_bytes.index(after_bytes)]
    share_tok = int(resp[worst].sum() + pl_row[worst].sum())

    # check the formula against pack() and measure the unpacked heap on the sub-sample
    flat = [Rollout(TrainSample(tokens=g.prompt.prompt_ids + s.response_ids, prompt_len=len(g.prompt.prompt_ids),
                                advantage=0.5, loss_mask=torch.ones(len(s.response_ids))),
                    torch.tensor(s.logprobs, dtype=torch.float32)) for g in sub for s in g.samples]
    packed = pack([flat])
    formula = 40 + 28 * len(flat) + 8 * sub_resp + 4 * (sub_tok - sub_resp)
    assert packed.nbytes == formula, (packed.nbytes, formula)
    heap_after_sub, _ = heap_of(lambda: unpack(packed, Rollout))
    tensors = 8 * sub_resp  # per response token: fp32 loss mask + fp32 rollout log-prob (torch, not traced)
    after_heap = (heap_after_sub + tensors) * share_tok / sub_tok

    gb = 1e9
    print(f"tokens: {n_tok / 1e6:.1f} M (prompt {n_prompt / 1e6:.1f} M, response {n_resp / 1e6:.1f} M), "
          f"{rows} responses; DP={a.dp}; largest share {share_tok / 1e6:.2f} M tokens")
    print(f"{'per rank':<34}{'before (pickle bcast)':>22}{'after (DP share tensors)':>26}{'after/before':>14}")
    print(f"{'bytes received':<34}{before_bytes / gb:>19.3f} GB{after_bytes / gb:>23.3f} GB"
          f"{after_bytes / before_bytes:>14.3f}")
    print(f"{'bytes per token received':<34}{before_bytes / n_tok:>22.2f}{after_bytes / share_tok:>26.2f}")
    print(f"{'Python heap once received':<34}{before_heap / gb:>19.2f} GB{after_heap / gb:>23.2f} GB"
          f"{after_heap / before_heap:>14.3f}")
    print(f"rank 0 sends {(sum(share_bytes) - share_bytes[0]) / gb:.3f} GB in all (was a "
          f"{before_bytes / gb:.3f} GB broadcast)")


if __name__ == "__main__":
    main()
