"""Sequence packing and the fused linear log-prob path, single process (local spec, CPU).

Packed micro-batches ([1, T] rows, block-diagonal causal mask, per-row position ids) and the fused
linear head (hidden states x output weight, chunked) must give the log-probs, entropies, loss metrics
and gradients of the padded logits path to 1e-6. The TP2 / PP2 / SP versions run in
tests/multiprocess/test_packing_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.actor import ActorConfig, MegatronActor, TrainSample
from megatron_dapo.actor.batching import (
    block_causal_mask,
    build_micro_batch,
    build_packed_micro_batch,
    iter_micro_batches,
    packed_length,
    plan_micro_batches,
)
from megatron_dapo.distributed.parallel import padded_vocab_size
from megatron_dapo.models.hf_config import ModelArch
from tests.dist.actor_common import (
    load_hf_weights,
    make_samples,
    single_process_world,
    tiny_hf_model,
)

ATOL = 1e-6
METRICS = ("pg_loss", "clipfrac_high", "clipfrac_low", "approx_kl", "ratio", "entropy", "grad_norm", "num_tokens")


def _samples(lengths, prompt=2):
    return [TrainSample(tokens=[(7 * i + t) % 50 + 1 for t in range(n)], prompt_len=prompt)
            for i, n in enumerate(lengths)]


# ---- planning and layout -------------------------------------------------------------------------------
def test_packed_plan_counts_real_tokens():
    lengths = [17, 5, 3, 9, 12, 8, 2, 20]
    groups = plan_micro_batches(lengths, max_tokens=20, micro_batch_size=1, packed=True)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in g) <= 20 for g in groups)
    # first-fit decreasing reaches the lower bound ceil(76 / 20) = 4 here; padded needs more
    assert len(groups) == 4
    assert len(plan_micro_batches(lengths, max_tokens=20, micro_batch_size=1)) > 4
    with pytest.raises(ValueError, match="--max-tokens-per-micro-batch"):
        plan_micro_batches(lengths, max_tokens=19, micro_batch_size=1, packed=True)


def test_packed_plan_splits_to_the_dp_count_within_budget():
    lengths = [10, 9, 8, 7, 3, 2, 1]
    more = plan_micro_batches(lengths, max_tokens=40, micro_batch_size=1, num_micro_batches=4, packed=True)
    assert len(more) == 4 and sorted(i for g in more for i in g) == list(range(7))
    assert all(sum(lengths[i] for i in g) <= 40 for g in more)


def test_packed_micro_batch_layout():
    samples = _samples([5, 3, 4])
    mb = build_packed_micro_batch(samples, [0, 1, 2], pad_to=4)
    assert packed_length([5, 3, 4], 4) == 12 and mb.tokens.shape == (1, 12)
    assert mb.cu_seqlens.tolist() == [0, 5, 8, 12] and mb.max_seqlen == 5
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    padded = build_micro_batch(samples, [0, 1, 2])
    # unpack maps the packed row back onto the padded rows at every real position
    real = torch.arange(5)[None, :] < torch.tensor([5, 3, 4])[:, None]
    torch.testing.assert_close(mb.unpack(mb.tokens)[real], padded.tokens[real])
    torch.testing.assert_close(mb.unpack(mb.targets)[real], padded.targets[real])
    for key in ("response_mask", "loss_mask", "old_log_probs"):
        torch.testing.assert_close(getattr(mb, key), getattr(padded, key))
    # block-diagonal causal mask written out: j visible from i iff same row and j <= i
    seg = [0] * 5 + [1] * 3 + [2] * 4
    want = torch.tensor([[not (seg[i] == seg[j] and j <= i) for j in range(12)] for i in range(12)])
    assert torch.equal(mb.attention_mask[0, 0], want)
    assert torch.equal(block_causal_mask(torch.tensor([0, 3])), torch.ones(1, 1, 3, 3, dtype=torch.bool).triu(1))


def test_sp_padding_forms_its_own_segment():
    mb = build_packed_micro_batch(_samples([5, 2], prompt=1), [0, 1], pad_to=4, causal_mask=False)
    assert mb.tokens.shape == (1, 8) and mb.cu_seqlens.tolist() == [0, 5, 7, 8] and mb.attention_mask is None
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 0]


def test_packed_batches_are_built_lazily():
    it = iter_micro_batches(_samples([5, 7, 4]), [[1], [0, 2]], packed=True, causal_mask=False)
    assert next(it).tokens.shape == (1, 7) and next(it).tokens.shape == (1, 9)


# ---- the actor: packed == padded, fused linear == logits -----------------------------------------------
@pytest.fixture(scope="module")
def world():
    yield from single_process_world(hf_seed=4)


def _actor(world, hf=None, **overrides) -> MegatronActor:
    layout, default_hf, _ = world
    hf = hf or default_hf
    arch = ModelArch.from_hf(hf.config)
    actor = MegatronActor(arch, ActorConfig(**{"lr": 1e-3, "clip_grad": 0.0, **overrides}), layout)
    load_hf_weights(actor, hf)
    return actor


def _grads(actor: MegatronActor) -> dict[str, torch.Tensor]:
    """The gradient of the last train_step (megatron's main_grad buffers, scaled by 1 / tokens)."""
    return {n: p.main_grad.detach().clone() for n, p in actor.module.named_parameters()}


VARIANTS = {
    "packed": dict(pack_sequences=True),
    "fused_linear": dict(fused_linear_logprob=True),
    "packed_fused_linear": dict(pack_sequences=True, fused_linear_logprob=True),
    "packed_megatron_ce": dict(pack_sequences=True, use_fused_logprob=False),
}


@pytest.fixture(scope="module")
def reference(world):
    samples = make_samples(9, seed=11)
    return samples, _run(world, samples, {})


def _run(world, samples, overrides, hf=None):
    actor = _actor(world, hf, max_tokens_per_micro_batch=48, **overrides)
    logps, ents = actor.compute_log_probs(samples, with_entropy=True)
    metrics = actor.train_step(samples)
    return {"logps": logps, "ents": ents, "metrics": metrics, "grads": _grads(actor),
            "n_micro": len(actor._micro_batches(samples))}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_matches_padded_logits_path(world, reference, variant):
    samples, want = reference
    got = _run(world, samples, VARIANTS[variant])
    for key in ("logps", "ents"):
        for g, w in zip(got[key], want[key], strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    for key in METRICS:
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-6, abs=ATOL), key
    for name, w in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], w, atol=ATOL, rtol=1e-5, msg=name)
    if "packed" in variant:  # the budget counts real tokens: fewer micro-batches than padded
        assert got["n_micro"] < want["n_micro"]


def test_fused_linear_with_tied_embeddings(world):
    """Tied weights: the head reads the embedding matrix and its gradient lands on it, as the logits path's."""
    hf = tiny_hf_model(tie=True, seed=6)
    samples = make_samples(6, seed=13)
    want = _run(world, samples, {}, hf)
    got = _run(world, samples, {"fused_linear_logprob": True, "pack_sequences": True}, hf)
    assert "output_layer.weight" not in want["grads"]
    for key in ("logps", "ents"):
        for g, w in zip(got[key], want[key], strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    for name, w in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], w, atol=ATOL, rtol=1e-5, msg=name)


def test_fused_linear_builds_no_logits(world):
    """With --fused-linear-logprob the last stage hands the loss [b, s, h] hidden states, not [b, s, V]."""
    samples = make_samples(3, seed=2)
    arch = world[2]
    seen = []
    actor = _actor(world, fused_linear_logprob=True, max_tokens_per_micro_batch=48)
    original = actor._token_log_probs

    def spy(mb, output, **kw):
        seen.append(output.shape[-1])
        return original(mb, output, **kw)

    actor._token_log_probs = spy
    actor.compute_log_probs(samples)
    assert seen and set(seen) == {arch.hidden_size}


# ---- planner -------------------------------------------------------------------------------------------
def test_planner_logits_bytes_with_and_without_the_fused_linear_head():
    """32B at TP8, 24576 tokens, bf16: [T, V/tp] logits + grad (2 x 2 B per entry) vs one chunk block
    (bf16 + fp32 temporaries) plus the fp32 [V/tp, h] d weight accumulator, written out."""
    from megatron_dapo.distributed.parallel import ParallelLayout
    from megatron_dapo.ops.fused_linear import DEFAULT_CHUNK_LOGITS
    from megatron_dapo.planner import activations, stages
    from tests.torchrun import REPO

    arch = ModelArch.from_hf(REPO / "examples/models/qwen2.5-32B")
    layout = ParallelLayout(tp=8, pp=2, dp=4, sp=True)
    v_local = padded_vocab_size(arch.vocab_size, 8) // 8
    kw = dict(tokens=24576, bytes_per_element=2, fused_logprob=True)
    assert activations.logits_bytes(arch, layout, **kw) == 24576 * v_local * 4
    chunk = DEFAULT_CHUNK_LOGITS // v_local
    gathered_hidden = 24576 * arch.hidden_size * 2 * (1 - 1 / 8)  # SP: the head saves [T, h], not [T / 8, h]
    assert activations.logits_bytes(arch, layout, **kw, fused_linear=True) == pytest.approx(
        chunk * v_local * 6 + v_local * arch.hidden_size * 4 + gathered_hidden)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="transformer_engine", bytes_per_element=2)
    base = stages.PlanInputs(tokens_per_micro_batch=24576, max_seq_len=22528)
    plain, head = (stages.plan_stages(arch, layout, base, spec)[-1],
                   stages.plan_stages(arch, layout, stages.PlanInputs(
                       tokens_per_micro_batch=24576, max_seq_len=22528, fused_linear_logprob=True), spec)[-1])
    assert plain.total - head.total == pytest.approx(activations.logits_bytes(arch, layout, **kw)
                                                     - activations.logits_bytes(arch, layout, **kw, fused_linear=True))


def test_planner_packed_row_length_terms_use_the_whole_row():
    """Local spec: a packed micro-batch of T tokens is one row, so its mask is T^2 bytes (padded: s^2)."""
    from megatron_dapo.distributed.parallel import ParallelLayout
    from megatron_dapo.planner import activations, stages

    arch = ModelArch(model_type="qwen2",
                     vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16)
    spec = activations.ActivationSpec.for_arch(arch, transformer_impl="local", bytes_per_element=4)
    kw = dict(first=True, last=True, recompute=False)
    padded = activations.micro_batch_extra_bytes(spec, ParallelLayout(), tokens=96, seq_len=24, **kw)
    packed = activations.micro_batch_extra_bytes(spec, ParallelLayout(), tokens=96, seq_len=96, **kw)
    assert packed - padded == 96 ** 2 - 24 ** 2
    (p_pad,), (p_pack,) = (stages.plan_stages(arch, ParallelLayout(), stages.PlanInputs(
        tokens_per_micro_batch=96, max_seq_len=24, params_dtype="float32", packed=packed), spec)
        for packed in (False, True))
    assert p_pack.total > p_pad.total  # the local spec's [T, T] mask and scores: why CPU defaults to padding


def test_32b_dry_run_prints_the_fused_linear_saving(tmp_path):
    from tests.unit.planner.test_planner import LAUNCHERS, _dry_run, _launcher_train_args

    script, env, model = LAUNCHERS[1].values
    args = _launcher_train_args(tmp_path, script, env, model)
    assert "--pack-sequences" in args and "--fused-linear-logprob" in args
    rc, lines = _dry_run(args)
    assert rc == 0
    assert any(line.startswith("micro-batch: 24576 real tokens packed") for line in lines)
    (saving,) = [line for line in lines if line.startswith("last-stage logits per micro-batch")]
    assert "1.75 GiB as [tokens x V/tp] logits, 0.66 GiB with --fused-linear-logprob (saves 1.08 GiB; on)" in saving


def test_flags_reach_the_actor_config():
    from megatron_dapo.arguments import build_parser
    from megatron_dapo.startup import build_configs

    base = ["--hf-checkpoint", "unused", "--prompt-data", "unused", "--num-steps", "1",
            "--max-response-length", "64", "--overlong-buffer-length", "16"]
    actor, _, _ = build_configs(build_parser().parse_args(base))
    assert not actor.pack_sequences and not actor.fused_linear_logprob  # CPU default: padded logits path
    actor, _, _ = build_configs(build_parser().parse_args(base + ["--pack-sequences", "--fused-linear-logprob"]))
    assert actor.pack_sequences and actor.fused_linear_logprob
