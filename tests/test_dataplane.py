"""The rollout rows as tensors (megatron_dapo/dataplane.py): pack -> unpack gives back every field exactly,
and the --rollout-timeout flag reaches the trainer config."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import TrainSample
from megatron_dapo.arguments import build_parser
from megatron_dapo.dataplane import pack, unpack
from megatron_dapo.train import build_configs
from megatron_dapo.trainer import Rollout, TrainerConfig

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
    assert packed.nbytes == 32 + 7 * 28 + 4 * n_tok + 4 * n_resp  # header, per row, per token
    back = unpack(packed, Rollout)
    assert [len(mb) for mb in back] == [3, 0, 4]
    for want_mb, got_mb in zip(minibatches, back):
        for want, got in zip(want_mb, got_mb):
            assert got.sample.tokens == want.sample.tokens and got.sample.prompt_len == want.sample.prompt_len
            assert got.sample.advantage == want.sample.advantage
            assert torch.equal(got.sample.loss_mask, want.sample.loss_mask)
            assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)


def test_a_row_with_a_varying_loss_mask_is_refused():
    row = Rollout(TrainSample(tokens=[5, 6, 7, 8], prompt_len=1, loss_mask=torch.tensor([1.0, 0.0, 1.0])),
                  torch.zeros(3))
    with pytest.raises(ValueError, match="one loss-mask value per row"):
        pack([[row]])


def test_rollout_timeout_flag_reaches_the_trainer_config():
    _, _, cfg = build_configs(build_parser().parse_args([*FLAGS, "--rollout-timeout", "6.5"]))
    assert cfg.rollout_timeout_h == 6.5
    assert build_configs(build_parser().parse_args(FLAGS))[2].rollout_timeout_h == 12.0
    with pytest.raises(ValueError, match="--rollout-timeout"):
        TrainerConfig(num_steps=1, rollout_timeout_h=0)
