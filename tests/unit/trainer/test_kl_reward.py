"""--kl-in-reward through the trainer's own pieces (trainer/loop.py `Trainer.build_samples`, the data plane's
pack/unpack, `Trainer._kl_reward`) on two simulated DP ranks (threads; the DP all-reduce a sum at a barrier): every
row of every mini-batch gets the advantage of its penalised reward, r - beta sum_t m_t k3(log pi_old - log pi_ref),
normalised over its whole group as GRPO's Eq. 9 written out says, though the group is split over the ranks, a
response without tokens counts in its group, and an overlong-filtered one is not penalised. The real collective:
tests/e2e/test_trainer_kl.py (DP2 equals DP1)."""

from __future__ import annotations

import math
import statistics
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.algorithm import OverlongConfig, grpo_advantages
from megatron_dapo.algorithm.kl import KLConfig
from megatron_dapo.models.hf_config import ModelArch
from megatron_dapo.models.registry import families
from megatron_dapo.rollout.collect import Prompt, ScoredGroup
from megatron_dapo.rollout.types import Sample
from megatron_dapo.trainer import loop
from megatron_dapo.trainer.dataplane import pack, unpack
from megatron_dapo.trainer.loop import Rollout, Trainer

BETA = 0.5
LENGTHS = [[3, 9, 1, 5], [7, 0, 2, 4]]
"""Response lengths of two groups: group 1's second response is empty, group 0's second (9 = L_max) truncated."""
REWARDS = [[1.0, -1.0, -1.0, 0.5], [-1.0, 1.0, 1.0, -0.25]]


def _logps(token: int, n: int) -> tuple[list[float], list[float]]:
    """(log pi_old, log pi_ref) of a response's n tokens, from its token id: d = old - ref in [-0.5, 0.75]."""
    old = [-0.1 * (j + 1) - 0.01 * token for j in range(n)]
    return old, [o - 0.25 * ((token + j) % 6 - 2) for j, o in enumerate(old)]


def _groups() -> list[ScoredGroup]:
    groups = []
    for g, (lens, rews) in enumerate(zip(LENGTHS, REWARDS, strict=True)):
        samples = [Sample(request_id=f"g{g}", index=i, prompt_ids=[2, 3, g], response_ids=[10 + 10 * g + i] * n,
                          logprobs=[-0.1] * n, finish_reason="length" if n == 9 else "stop", weight_version=0)
                   for i, n in enumerate(lens)]
        groups.append(ScoredGroup(prompt=Prompt(prompt_ids=[2, 3, g], ground_truth="", index=g), samples=samples,
                                  accs=[r > 0 for r in rews], rewards=rews))
    return groups


def _expected() -> tuple[dict[int, float], list[float], list[float]]:
    """Written out: {response token id: advantage}, every response's KL sum and advantage (flat order)."""
    kl_sums, advantages, by_token = [], [], {}
    for g, (lens, rews) in enumerate(zip(LENGTHS, REWARDS, strict=True)):
        sums = []
        for i, n in enumerate(lens):
            old, ref = _logps(10 + 10 * g + i, n)
            masked = n == 9  # --overlong-filter
            sums.append(0.0 if masked else sum(math.exp(-(o - r)) + (o - r) - 1 for o, r in zip(old, ref,
                                                                                                  strict=True)))
        penalised = [r - BETA * s for r, s in zip(rews, sums, strict=True)]
        mean, std = statistics.fmean(penalised), statistics.stdev(penalised)
        for i, p in enumerate(penalised):
            advantages.append((p - mean) / (std + 1e-6))
            if LENGTHS[g][i]:
                by_token[10 + 10 * g + i] = advantages[-1]
        kl_sums += sums
    return by_token, kl_sums, advantages


class _DPGroup:
    """A DP group of two threads: all_reduce sums both ranks' tensors."""

    def __init__(self) -> None:
        self.barrier, self.parts = threading.Barrier(2, timeout=30), {}

    def all_reduce(self, tensor, op=None, group=None):
        self.parts[threading.current_thread().name] = tensor.clone()
        self.barrier.wait()
        total = sum(self.parts.values())
        self.barrier.wait()
        return tensor.copy_(total)


def test_every_row_gets_the_advantage_of_its_penalised_reward_over_its_whole_group(monkeypatch):
    dp = _DPGroup()
    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_world_size", lambda: 2)
    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_group", lambda: None)
    monkeypatch.setattr(loop.comm, "all_reduce", dp.all_reduce)
    arch = ModelArch.from_hf(dict(families()["qwen2"].tiny_config, model_type="qwen2"))
    trainer = SimpleNamespace(actor=SimpleNamespace(arch=arch), routing=None,
                              config=SimpleNamespace(advantage_estimator=grpo_advantages, global_batch_size=4,
                                                     kl_reward=KLConfig(coef=BETA, estimator="k3")),
                              collect=SimpleNamespace(overlong=OverlongConfig(max_response_length=9,
                                                                              filter_truncated=True)))
    trainer.dp_split = lambda mb, n: Trainer.dp_split(trainer, mb, n)
    shares, _ = Trainer.build_samples(trainer, _groups())
    # each DP rank's rows as the data plane delivers them: two mini-batches, the step's table and each row's index
    ranks = [[r for mb in unpack(pack(share), Rollout) for r in mb] for share in shares]
    assert [len(local) for local in ranks] and sum(len(local) for local in ranks) == 7
    groups_of = [{r.sample.tokens[2] for r in local} for local in ranks]
    assert groups_of[0] & groups_of[1], "a group split over the two ranks is what the all-reduce is for"
    for local in ranks:
        assert all(r.step_rewards is local[0].step_rewards and len(r.step_rewards) == 8 for r in local)
    olds = []
    for local in ranks:
        olds.append([])
        for r in local:
            old, ref = _logps(r.sample.tokens[3], r.sample.response_len)
            r.sample.ref_log_probs = torch.tensor(ref)
            olds[-1].append(torch.tensor(old))
    metrics, errors = [None, None], []

    def rank(d: int) -> None:
        try:
            metrics[d] = Trainer._kl_reward(trainer, ranks[d], olds[d])
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)
            dp.barrier.abort()

    threads = [threading.Thread(target=rank, args=(d,), name=f"dp{d}") for d in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    by_token, kl_sums, advantages = _expected()
    for local in ranks:
        for r in local:
            assert r.sample.advantage == pytest.approx(by_token[r.sample.tokens[3]], rel=1e-6, abs=1e-6)
    assert metrics[0] == metrics[1]  # every rank computed the same
    assert metrics[0]["kl/reward_penalty"] == pytest.approx(BETA * statistics.fmean(kl_sums), rel=1e-6)
    assert metrics[0]["train/advantage_abs_mean"] == pytest.approx(statistics.fmean(map(abs, advantages)), rel=1e-6)
    unpenalised = grpo_advantages(torch.tensor([r for rews in REWARDS for r in rews]), [0] * 4 + [1] * 4)
    assert max(abs(a - u) for a, u in zip(advantages, unpenalised.tolist(), strict=True)) > 0.05  # it moved
