"""The rollout rows as tensors (megatron_dapo/trainer/dataplane.py): pack -> unpack gives back every field exactly,
--kl-in-reward's step table too, the --rollout-timeout flag reaches the trainer config, an abort carries what
failed, and a rank 0 whose engine fails mid-push still runs the weight export (a collective) to the end. The
multi-process failure paths are in tests/multiprocess/test_dataplane_dist.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_dapo.actor import TrainSample
from megatron_dapo.algorithm import DynamicSamplingConfig, OverlongConfig
from megatron_dapo.arguments import build_parser
from megatron_dapo.rollout.collect import CollectConfig
from megatron_dapo.rollout.types import SamplingParams
from megatron_dapo.startup import build_configs
from megatron_dapo.trainer.dataplane import ABORT, StepRewards, abort_reason, abort_share, pack, unpack
from megatron_dapo.trainer.loop import Rollout, Trainer, TrainerConfig
from megatron_dapo.weights import export as export_module

FLAGS = ["--hf-checkpoint", "unused", "--prompt-data", "unused", "--num-steps", "1",
         "--max-response-length", "16", "--overlong-buffer-length", "4"]


def _rows(n: int, seed: int) -> list[Rollout]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, r = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
        tokens = torch.randint(0, 152064, (p + r,), generator=gen).tolist()
        adv = float(torch.randn(1, dtype=torch.float64, generator=gen))  # float64: must survive exactly
        out.append(Rollout(TrainSample(tokens=tokens, prompt_len=p, advantage=adv,
                                       loss_mask=torch.full((r,), float(i % 3 != 0))),
                           torch.randn(r, generator=gen)))
    return out


def test_pack_unpack_roundtrip_is_exact():
    minibatches = [_rows(3, 0), [], _rows(4, 1)]  # an empty share of a mini-batch keeps its slot
    packed = pack(minibatches)
    n_tok = sum(len(r.sample.tokens) for mb in minibatches for r in mb)
    n_resp = sum(r.sample.response_len for mb in minibatches for r in mb)
    assert packed.ints.dtype == torch.int32 and packed.logp.dtype == torch.float32
    assert packed.nbytes == 48 + 7 * 28 + 4 * n_tok + 4 * n_resp  # header, per row, per token
    assert int(packed.header[5]) == 0 and packed.generated is None  # single-turn: no mask on the wire
    back = unpack(packed, Rollout)
    assert [len(mb) for mb in back] == [3, 0, 4]
    for want_mb, got_mb in zip(minibatches, back, strict=True):
        for want, got in zip(want_mb, got_mb, strict=True):
            assert got.sample.tokens == want.sample.tokens and got.sample.prompt_len == want.sample.prompt_len
            assert got.sample.advantage == want.sample.advantage
            assert torch.equal(got.sample.loss_mask, want.sample.loss_mask)
            assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)


def test_the_step_table_of_kl_in_reward_travels_exactly():
    """--kl-in-reward: each row's index in the step and the step's rewards and groups (N = 11, more than the rows:
    responses without tokens are in no share) come back exactly, one StepRewards shared by every row; 8 bytes a row
    and 16 a step response more on the wire. Rows with different tables, or a row without its index, are refused."""
    import dataclasses

    step = StepRewards(rewards=torch.randn(11, dtype=torch.float64), group_ids=torch.arange(11) // 3)
    minibatches = [[dataclasses.replace(r, index=i, step_rewards=step) for i, r in zip((7, 0, 4), _rows(3, 0),
                                                                                      strict=True)],
                   [dataclasses.replace(r, index=10, step_rewards=step) for r in _rows(1, 1)]]
    plain = pack([[dataclasses.replace(r, step_rewards=None) for r in mb] for mb in minibatches])
    packed = pack(minibatches)
    assert packed.nbytes == plain.nbytes + 8 * 4 + 16 * 11 and int(packed.header[4]) == 11
    back = unpack(packed, Rollout)
    assert [r.index for mb in back for r in mb] == [7, 0, 4, 10]
    got = back[0][0].step_rewards
    assert all(r.step_rewards is got for mb in back for r in mb)
    assert torch.equal(got.rewards, step.rewards) and torch.equal(got.group_ids, step.group_ids)
    assert all(r.step_rewards is None and r.index is None for mb in unpack(plain, Rollout) for r in mb)
    other = StepRewards(rewards=torch.zeros(11, dtype=torch.float64), group_ids=torch.zeros(11, dtype=torch.int64))
    for bad in (dataclasses.replace(minibatches[1][0], step_rewards=other),
                dataclasses.replace(minibatches[1][0], index=None)):
        with pytest.raises(ValueError, match="the same StepRewards and each its index"):
            pack([minibatches[0], [bad]])


def test_a_row_with_a_varying_loss_mask_is_refused():
    row = Rollout(TrainSample(tokens=[5, 6, 7, 8], prompt_len=1, loss_mask=torch.tensor([1.0, 0.0, 1.0])),
                  torch.zeros(3))
    with pytest.raises(ValueError, match="one loss-mask value per row"):
        pack([[row]])


def test_tool_tokens_travel_as_a_mask_and_stay_out_of_the_loss():
    """Multi-turn rows: `generated` (tool tokens 0) comes back exactly, 1 byte a response token more on the wire, and
    the unpacked loss mask is the row's filter value times it; a row without tool tokens in a share with some gets
    ones."""
    import dataclasses

    rows = _rows(4, 3)
    gen = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1][:rows[1].sample.response_len], dtype=torch.uint8)
    rows[1] = dataclasses.replace(rows[1], sample=dataclasses.replace(rows[1].sample,
                                                                      loss_mask=rows[1].sample.loss_mask * gen),
                                  generated=gen)
    assert gen.numel() > 2
    plain, packed = pack([_rows(4, 3)]), pack([rows])
    n_resp = sum(r.sample.response_len for r in rows)
    assert int(packed.header[5]) == 1 and packed.nbytes == plain.nbytes + n_resp
    (back,) = unpack(packed, Rollout)
    for want, got in zip(rows, back, strict=True):
        keep = float(want.sample.loss_mask.max())
        ones = torch.ones(want.sample.response_len, dtype=torch.uint8)
        assert torch.equal(got.generated, ones if want.generated is None else want.generated)
        assert torch.equal(got.sample.loss_mask, keep * got.generated.float())
    assert back[1].sample.loss_mask.tolist()[:3] == [1.0 * float(rows[1].sample.loss_mask[0]), 0.0, 0.0]


def test_rollout_timeout_flag_reaches_the_trainer_config():
    _, _, cfg = build_configs(build_parser().parse_args([*FLAGS, "--rollout-timeout", "6.5"]))
    assert cfg.rollout_timeout_h == 6.5
    assert build_configs(build_parser().parse_args(FLAGS))[2].rollout_timeout_h == 12.0
    with pytest.raises(ValueError, match="--rollout-timeout"):
        TrainerConfig(num_steps=1, rollout_timeout_h=0)


def test_an_abort_share_carries_what_failed_and_no_rows():
    share = abort_share("while logging the metrics of step 7 (disk full: é)")
    assert int(share.header[0]) == ABORT and share.header[1:3].tolist() == [0, 0]
    assert share.row_vals.numel() == share.logp.numel() == 0
    assert share.header[3] == share.ints.numel() == len("while logging the metrics of step 7 (disk full: é)".encode())
    assert abort_reason(share) == "while logging the metrics of step 7 (disk full: é)"
    assert unpack(share, Rollout) == []


def test_a_push_that_fails_still_runs_the_export_to_the_end(monkeypatch):
    """The export is a collective the other ranks iterate too: rank 0 must take every tensor even when its engine
    raised after the first, then re-raise the engine's error."""
    taken: list[int] = []

    def export(chunks, arch):
        for i in range(5):
            taken.append(i)
            yield f"w{i}", torch.zeros(2)

    class DiesMidPush:
        def update_weights(self, named, *, version):
            next(iter(named))
            raise RuntimeError("every server lost past --sglang-server-wait-s")

    monkeypatch.setattr(export_module, "iter_hf_weights", export)
    collect = CollectConfig(n_samples_per_prompt=2, sampling=SamplingParams(max_new_tokens=3),
                            dynamic_sampling=DynamicSamplingConfig(rollout_batch_size=1, enabled=False),
                            overlong=OverlongConfig(max_response_length=3))
    trainer = Trainer(config=TrainerConfig(num_steps=1), collect=collect, actor=SimpleNamespace(chunks=[], arch=None),
                      engine=DiesMidPush(), next_prompts=lambda k: [], eval_prompts=[], decode=str, reward_fn=None,
                      logger=None)
    with pytest.raises(RuntimeError, match="every server lost"):
        trainer.sync_weights(1)
    assert taken == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("overlong_filter", [True, False], ids=["filter", "no-filter"])
def test_build_samples_gives_each_row_once_with_its_group_advantage_and_mask(monkeypatch, overlong_filter):
    """Trainer.build_samples (rank 0) against the pieces written out: each response's advantage is Eq. 9 of its own
    prompt group (mean and unbiased std over the group, + 1e-6), a truncated response's loss mask is 0 under
    --overlong-filter and 1 without, a response without tokens counts in its group's statistics but is not trained
    on, the rows are cut into --global-batch-size mini-batches in order, and each mini-batch's rows go to exactly one
    of the 2 DP ranks (every rank gets some)."""
    import statistics

    from megatron_dapo.algorithm import grpo_advantages
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.models.registry import families
    from megatron_dapo.rollout.collect import Prompt, ScoredGroup
    from megatron_dapo.rollout.types import Sample
    from megatron_dapo.trainer import loop

    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_world_size", lambda: 2)
    lengths = [[3, 9, 1, 5], [7, 0, 2, 4]]  # group 1's second response is empty
    rewards = [[1.0, -1.0, -1.0, 0.5], [-1.0, 1.0, 1.0, -0.25]]
    groups = []
    for g, (lens, rews) in enumerate(zip(lengths, rewards, strict=True)):
        samples = [Sample(request_id=f"g{g}", index=i, prompt_ids=[2, 3, g], response_ids=[10 + 10 * g + i] * n,
                          logprobs=[-0.1 * (i + 1)] * n, finish_reason="length" if n == 9 else "stop",
                          weight_version=0) for i, n in enumerate(lens)]
        groups.append(ScoredGroup(prompt=Prompt(prompt_ids=[2, 3, g], ground_truth="", index=g), samples=samples,
                                  accs=[r > 0 for r in rews], rewards=rews))
    arch = ModelArch.from_hf(dict(families()["qwen2"].tiny_config, model_type="qwen2"))
    trainer = SimpleNamespace(actor=SimpleNamespace(arch=arch), routing=None,
                              config=SimpleNamespace(advantage_estimator=grpo_advantages, global_batch_size=4,
                                                     kl_reward=None),
                              collect=SimpleNamespace(overlong=OverlongConfig(max_response_length=9,
                                                                              filter_truncated=overlong_filter)))
    trainer.dp_split = lambda mb, dp: Trainer.dp_split(trainer, mb, dp)
    shares, metrics = Trainer.build_samples(trainer, groups)
    expected = {}  # response token -> (advantage, loss-mask value), in flat order
    for lens, rews, g in zip(lengths, rewards, range(2), strict=True):
        mean, std = statistics.fmean(rews), statistics.stdev(rews)
        for i, (n, r) in enumerate(zip(lens, rews, strict=True)):
            if n:
                expected[10 + 10 * g + i] = ((r - mean) / (std + 1e-6), 0.0 if overlong_filter and n == 9 else 1.0)
    order = list(expected)
    assert metrics["train/minibatches"] == 2 and metrics["train/responses"] == 7
    assert len(shares) == 2 and all(len(per_rank) == 2 for per_rank in shares)
    for m, want in enumerate((order[:4], order[4:])):
        got = [r.sample.tokens[3] for d in range(2) for r in shares[d][m]]
        assert sorted(got) == sorted(want) and all(shares[d][m] for d in range(2)), (m, got)
    for d in range(2):
        for mb in shares[d]:
            for row in mb:
                adv, keep = expected[row.sample.tokens[3]]
                assert row.sample.advantage == pytest.approx(adv, rel=1e-6)
                assert torch.equal(row.sample.loss_mask, torch.full((row.sample.response_len,), keep))
                assert row.sample.tokens[:3] == [2, 3, row.sample.tokens[3] // 10 - 1]


@pytest.mark.parametrize("overlong_filter", [True, False], ids=["filter", "no-filter"])
def test_build_samples_keeps_a_conversations_tool_tokens_out_of_the_loss(monkeypatch, overlong_filter):
    """A multi-turn Sample (rollout/multi_turn.py) becomes a row whose loss mask is 0 on the tool's tokens and the
    filter's value on the policy's (a truncated conversation under --overlong-filter: 0 everywhere), carrying its
    `generated` mask for the mismatch metrics; a single-turn row of the same step carries none."""
    from megatron_dapo.algorithm import grpo_advantages
    from megatron_dapo.rollout.collect import Prompt, ScoredGroup
    from megatron_dapo.rollout.types import Sample
    from megatron_dapo.trainer import loop

    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_world_size", lambda: 1)
    mask = [1, 1, 0, 0, 0, 1, 1, 1]
    samples = [Sample(request_id="g", index=0, prompt_ids=[2, 3], response_ids=list(range(10, 18)),
                      logprobs=[-0.5 if m else 0.0 for m in mask], finish_reason="length", weight_version=0,
                      loss_mask=mask, tool_calls=1),
               Sample(request_id="g", index=1, prompt_ids=[2, 3], response_ids=[20, 21, 22], logprobs=[-0.1] * 3,
                      finish_reason="stop", weight_version=0)]
    group = ScoredGroup(prompt=Prompt(prompt_ids=[2, 3], ground_truth="", index=0), samples=samples,
                        accs=[True, False], rewards=[1.0, -1.0])
    from megatron_dapo.models.hf_config import ModelArch
    from megatron_dapo.models.registry import families

    arch = ModelArch.from_hf(dict(families()["qwen2"].tiny_config, model_type="qwen2"))
    trainer = SimpleNamespace(actor=SimpleNamespace(arch=arch), routing=None,
                              config=SimpleNamespace(advantage_estimator=grpo_advantages,
                                                                   global_batch_size=0, kl_reward=None),
                              collect=SimpleNamespace(overlong=OverlongConfig(max_response_length=8,
                                                                              filter_truncated=overlong_filter)))
    trainer.dp_split = lambda mb, dp: Trainer.dp_split(trainer, mb, dp)
    ((rows,),), _ = Trainer.build_samples(trainer, [group])
    conv, plain = sorted(rows, key=lambda r: -r.sample.response_len)
    keep = 0.0 if overlong_filter else 1.0
    assert conv.sample.loss_mask.tolist() == [keep * m for m in mask]
    assert conv.generated.tolist() == mask and plain.generated is None
    assert plain.sample.loss_mask.tolist() == [1.0] * 3
    (back,) = unpack(pack([rows]), Rollout)
    assert [r.sample.loss_mask.tolist() for r in back] == [r.sample.loss_mask.tolist() for r in rows]


def test_a_step_that_kept_no_group_trains_nothing_and_says_so(monkeypatch):
    """--on-gen-exhausted partial with every group all right or all wrong: no mini-batch, no update (the actor is not
    called: every advantage would be 0), `train/empty_batch` logged, instead of the actor refusing an empty share."""
    from megatron_dapo.algorithm import grpo_advantages
    from megatron_dapo.trainer import loop

    monkeypatch.setattr(loop.parallel_state, "get_data_parallel_world_size", lambda: 1)
    trainer = SimpleNamespace(routing=None, config=SimpleNamespace(advantage_estimator=grpo_advantages,
                                                                   global_batch_size=0, kl_reward=None),
                              collect=SimpleNamespace(overlong=OverlongConfig(max_response_length=8)))
    trainer.dp_split = lambda mb, dp: Trainer.dp_split(trainer, mb, dp)
    shares, metrics = Trainer.build_samples(trainer, [])
    assert shares == [[]] and metrics["train/advantage_abs_mean"] == 0.0 and metrics["train/responses"] == 0
    trainer.actor = None  # any call into it would fail
    assert Trainer.train(trainer, shares[0], step=3) == {"train/empty_batch": 1.0}
